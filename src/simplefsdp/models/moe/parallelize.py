"""The mixture-of-experts parallelisation recipe that ``simplefsdp train`` calls.

Expert parallelism (``spec.ep > 1``) and data parallelism come from the engine
layer (:func:`simplefsdp.engines.parallelize`): each ``experts`` module gets
:class:`~simplefsdp.frontend.expert_parallel.ExpertParallel` on the mesh's
``"ep"`` dim and its parameters are sharded over ``"dp_shard_mod_ep"``, the
dense ones over all data-parallel ranks. What is the model's: its
initialisation (``init_weights``) and the loss (Llama's
:func:`~simplefsdp.models.llama3.parallelize.cross_entropy`). The graph of a
MoE layer is never whole (its per-expert token counts are read to the host),
so a compiled model is compiled with graph breaks (``fullgraph=False``).
The package itself stays plain modules: ``import simplefsdp.models.moe`` does
not load this file.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import EngineSpec, ParallelModel, parallelize
from simplefsdp.models.llama3.parallelize import cross_entropy

__all__ = ["parallelize_moe"]


def parallelize_moe(
    model: nn.Module, spec: EngineSpec, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    """Parallelise a :class:`~simplefsdp.models.moe.Transformer`.

    Args:
        model: the model, on the meta device (initialised with its
            ``init_weights`` after sharding, under the current RNG state) or
            with real weights (kept).
        spec: the engine and its settings; ``spec.ep > 1`` for expert
            parallelism (``spec.tp`` must be 1).
        mesh: the data-parallel mesh: with ``spec.ep > 1`` the flattened
            ``"dp"`` mesh of
            :func:`~simplefsdp.frontend.expert_parallel.build_expert_parallel_mesh`,
            else :func:`simplefsdp.engines.build_mesh`'s.
        device: the training device.

    Returns:
        A :class:`~simplefsdp.engines.ParallelModel` stepping with the mean
        token cross-entropy.

    Raises:
        ValueError: ``spec.tp > 1`` (no tensor-parallel plan for MoE models
            here), or the engine layer's errors.
    """
    if spec.tp > 1:
        raise ValueError(
            f"spec.tp={spec.tp}: mixture-of-experts models train with data and expert "
            "parallelism only; use tp=1"
        )
    spec = dataclasses.replace(spec, fullgraph=False)
    return parallelize(
        model,
        spec,
        mesh,
        device,
        init_fn=lambda m: m.init_weights(buffer_device=device),
        loss_fn=cross_entropy,
    )
