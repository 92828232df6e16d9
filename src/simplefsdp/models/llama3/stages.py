"""Splitting a Llama 3 model into pipeline stages: the shared decoder split
(:mod:`simplefsdp.models.common.stages`), under the family's name."""

from simplefsdp.models.common.stages import layer_ranges, pipeline_split, stage_ids_for_rank  # noqa: F401 (re-exported for the llama3 package)
