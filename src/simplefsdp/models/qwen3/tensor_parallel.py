"""Qwen3's tensor-parallel plan: the shared decoder plan plus the QK-norms.

:func:`simplefsdp.models.common.tensor_parallel.apply_decoder_tp` splits the
heads (``wq``/``wk``/``wv`` colwise, ``wo`` rowwise), the dense
feed-forward networks, and keeps a MoE layer's router and routed experts
replicated. Each rank then normalises its own heads with ``q_norm`` and
``k_norm``, whose ``(head_dim,)`` weights every head shares: their gradients
are partial sums over a rank's heads. The norms are therefore
:class:`SequenceParallel` over the heads dim (``sequence_dim=2`` of the
``(B, T, H, head_dim)`` input): the weight becomes a replicated DTensor whose
gradient is summed over the TP ranks (torchtitan's Qwen3 plan does the same).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from simplefsdp.models.common.tensor_parallel import apply_decoder_tp


def qk_norm_plan(model: nn.Module) -> dict[str, Any]:
    """FQN -> style for every block's ``q_norm`` and ``k_norm`` (local heads in
    and out)."""
    plan: dict[str, Any] = {}
    for key in model.layers:
        for norm in ("q_norm", "k_norm"):
            plan[f"layers.{key}.attention.{norm}"] = SequenceParallel(
                sequence_dim=2, use_local_output=True
            )
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard a Qwen3 model (or pipeline stage) over ``tp_mesh`` in place.

    Args:
        model: the model, plain tensors, before any data parallelism.
        tp_mesh: a 1-D ``DeviceMesh``.
        sequence_parallel: shard the residual stream on the sequence dim.
        loss_parallel: leave the logits sharded on the vocabulary.

    Raises:
        ValueError: see :func:`~simplefsdp.models.common.tensor_parallel.apply_decoder_tp`.
    """
    apply_decoder_tp(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    parallelize_module(model, tp_mesh, qk_norm_plan(model))
    return model
