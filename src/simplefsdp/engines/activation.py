"""Activation checkpointing of each repeated block, applied before sharding."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from simplefsdp.bucket_plan import repeated_blocks
from simplefsdp.parallel_dims import AC_MODES

logger = logging.getLogger(__name__)


def _sac_save_ops() -> set[Any]:
    """Ops whose outputs selective AC keeps: matmuls and attention (expensive to
    recompute), those that exist in this torch build; everything else (norms,
    activations, rotary, casts) is recomputed."""
    ops = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _sac_context_fn(save_ops: frozenset[Any]) -> tuple[Any, Any]:
    """Selective-checkpoint contexts that save the outputs of ``save_ops`` only."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap every repeated block (``simplefsdp.bucket_plan.repeated_blocks``) for AC.

    Must run before sharding, so the sharded parameters live inside the
    wrapped blocks. ``"full"`` recomputes the whole block in backward;
    ``"selective"`` saves matmul and attention outputs and recomputes the rest
    (an op-level policy, as torchtitan's selective AC). Checkpoint keys are
    unchanged: DCP and the wrapper's state-dict hooks strip its prefix.

    Returns:
        The number of wrapped blocks.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in AC_MODES:
        raise ValueError(
            f"unknown activation checkpointing mode {mode!r}; valid: {', '.join(AC_MODES)}"
        )
    if mode == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(_sac_context_fn, frozenset(_sac_save_ops()))
    blocks = repeated_blocks(model)
    for fqn, block in blocks:
        parent_fqn, _, name = fqn.rpartition(".")
        model.get_submodule(parent_fqn).register_module(name, checkpoint_wrapper(block, **kwargs))
    logger.info("activation checkpointing (%s) on %d blocks", mode, len(blocks))
    return len(blocks)
