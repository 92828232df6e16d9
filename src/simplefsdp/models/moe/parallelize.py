"""The mixture-of-experts entry to the one parallelize recipe.

``parallelize_moe`` is :func:`simplefsdp.engines.parallelize_model` with the
MoE family's spec (its ``init_weights``, the loss, and ``fullgraph=False``:
a MoE layer's per-expert token counts are read to the host). Expert
parallelism comes from the layout's ``ep``. The package itself stays plain
modules: ``import simplefsdp.models.moe`` does not load this file.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import EngineSpec, ParallelModel
from simplefsdp.engines.recipe import parallelize_model
from simplefsdp.models.moe.spec import SPEC


def parallelize_moe(
    model: nn.Module, spec: EngineSpec, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    """:func:`simplefsdp.engines.parallelize_model` with the mixture-of-experts spec.

    Args:
        model: a MoE ``Transformer``, on the meta device or with real weights.
        spec: the engine and its settings (``spec.ep > 1``: expert parallelism).
        mesh: the job's meshes (``Layout(ep=...).build()``) or world mesh.
        device: the training device.
    """
    return parallelize_model(model, SPEC, mesh, spec, device)
