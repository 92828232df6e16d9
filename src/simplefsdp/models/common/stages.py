"""Splitting a decoder into pipeline stages by layer ranges.

This lives beside the model, not in it (as torchtitan's ``pipeline_llama``
does). A stage is a copy of the :class:`~.decoder.Decoder` that keeps a
contiguous range of its layers under their original names (``layers`` is an
``nn.ModuleDict`` keyed by layer index), the token embedding only on the
first stage and the final norm and output head only on the last; the model's
``forward`` skips what a stage lacks. Because names are kept, the union of the
stages' state dicts is the whole model's, so distributed checkpoints move
between pipeline layouts.

Stages are numbered ``0 .. num_stages - 1`` in model order. With more stages
than pipeline ranks (interleaved schedules), rank ``r`` of ``pp`` holds stages
``r, r + pp, r + 2 pp, ...`` (:func:`stage_ids_for_rank`, torch's "loop"
placement).

Example::

    with torch.device("meta"):
        model = Transformer(args)
    stages = pipeline_split(model, stage_ids_for_rank(pp_rank, pp=2, stages_per_rank=2), 4)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch.nn as nn


def layer_ranges(
    n_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """The layer indices of each stage.

    Without ``layers_per_stage`` the layers are split as evenly as possible,
    the first ``n_layers % num_stages`` stages taking one more (the last stage
    also runs the output head, the most expensive single layer).

    Raises:
        ValueError: ``num_stages`` not in ``1..n_layers``, or
            ``layers_per_stage`` of the wrong length, with a negative entry
            or not summing to ``n_layers``.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if layers_per_stage is None:
        if num_stages > n_layers:
            raise ValueError(
                f"cannot split {n_layers} layers into {num_stages} stages; "
                f"valid stage counts: 1..{n_layers} (or give layers_per_stage)"
            )
        base, extra = divmod(n_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != n_layers:
            raise ValueError(
                f"layers_per_stage {list(layers_per_stage)} must be {num_stages} non-negative "
                f"counts summing to the model's {n_layers} layers"
            )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stages of pipeline rank ``pp_rank``: ``pp_rank + k * pp`` ("loop" placement).

    Raises:
        ValueError: ``pp_rank`` not in ``0..pp-1`` or ``stages_per_rank < 1``.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp={pp}; valid: 0..{pp - 1}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def pipeline_split(
    model: nn.Module,
    stage_ids: Sequence[int],
    num_stages: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
) -> list[nn.Module]:
    """Copies of ``model``, one per stage in ``stage_ids``, each keeping its layers.

    ``model`` is left unchanged; build it on the meta device so the copies
    cost no memory, then materialise each stage (``to_empty`` and
    ``init_weights``, which initialises only what the stage holds).

    Args:
        model: a :class:`~.decoder.Decoder` (``tok_embeddings``, ``layers``
            as an ``nn.ModuleDict``, ``norm``, ``output``).
        stage_ids: the stages to build (e.g. :func:`stage_ids_for_rank`).
        num_stages: the total number of stages.
        layers_per_stage: layers per stage (default: as even as possible).

    Raises:
        ValueError: a stage id out of range, a model without ``layers`` as a
            ``ModuleDict``, or a bad split (see :func:`layer_ranges`).
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(
            f"pipeline_split expects a decoder whose layers are an nn.ModuleDict, "
            f"got {type(model).__name__} with layers {type(layers).__name__}"
        )
    ranges = layer_ranges(len(layers), num_stages, layers_per_stage)
    stages = []
    for stage_id in stage_ids:
        if not 0 <= stage_id < num_stages:
            raise ValueError(
                f"stage id {stage_id} out of range for {num_stages} stages; "
                f"valid: 0..{num_stages - 1}"
            )
        keep = {str(i) for i in ranges[stage_id]}
        stage = copy.deepcopy(model)
        for key in list(stage.layers.keys()):
            if key not in keep:
                del stage.layers[key]
        if stage_id != 0:
            stage.tok_embeddings = None
        if stage_id != num_stages - 1:
            stage.norm = None
            stage.output = None
        stages.append(stage)
    return stages
