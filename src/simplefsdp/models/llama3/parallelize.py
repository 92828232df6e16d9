"""The Llama 3 entry to the one parallelize recipe (:func:`simplefsdp.engines.parallelize_model`).

``parallelize_llama`` is that recipe with the Llama 3 family's spec
(``spec.py``: the tensor-parallel plan, the stage split, ``init_weights`` and
:func:`cross_entropy`). The model package itself stays plain modules:
``import simplefsdp.models.llama3`` does not load this file.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import EngineSpec, ParallelModel, PipelinedModel, PipelineSpec
from simplefsdp.engines.recipe import RecipeOptions, parallelize_model
from simplefsdp.models.llama3.spec import SPEC, cross_entropy  # noqa: F401 (re-exported for the tests)


def parallelize_llama(
    model: nn.Module,
    spec: EngineSpec,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    pipeline: PipelineSpec | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    measure_times: bool = False,
) -> ParallelModel | PipelinedModel:
    """:func:`simplefsdp.engines.parallelize_model` with the Llama 3 spec.

    Args:
        model: a Llama 3 ``Transformer``, on the meta device or with real weights.
        spec: the engine and its settings.
        mesh: the job's meshes (``Layout(...).build()``) or world mesh.
        device: the training device.
        pipeline / sequence_parallel / loss_parallel / measure_times: the
            recipe's :class:`~simplefsdp.engines.RecipeOptions`.
    """
    options = RecipeOptions(pipeline, sequence_parallel, loss_parallel, measure_times)
    return parallelize_model(model, SPEC, mesh, spec, device, options)
