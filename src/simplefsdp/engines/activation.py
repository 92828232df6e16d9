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

# Note: [Selective activation checkpointing]
#     ``selective`` is torchtitan's op-level policy: per block forward, the
#     outputs of attention, matmuls, grouped matmuls, amax reductions
#     (``max``, for float8 scales), top-k routing and the collectives whose
#     recomputation would communicate again (reduce-scatter, all-to-all) are
#     saved, except every second matmul (``mm``/``addmm``/``linear``,
#     counted per block, forward and recomputation alike), which is
#     recomputed with everything else (norms, activations, rotary, casts).
#     Copies to the host (token counts) are saved, so the recomputation
#     does not sync again. A Llama block saves its ``wq``, ``wv``, ``w1``
#     and ``w2`` outputs and recomputes ``wk``, ``wo`` and ``w3``. Grouped
#     matmuls (the experts) are saved, all of them: torchtitan's default
#     list does not name them, but they are a mixture-of-experts block's
#     costliest ops. ``recompute_experts`` recomputes them too, as
#     torchtitan does: less memory (the experts' hidden and output rows of
#     every routed token) for one more forward of the experts per MoE layer.
#     ``save_attention=False`` leaves the attention kernels out of the list,
#     as an op list that names only some of torch's SDPA kernels does where
#     torch picks another (the planner's model of such a run): every block's
#     attention is then recomputed in backward.

_EXPERT_MATMULS = ("_grouped_mm", "_scaled_grouped_mm")


def _sac_save_ops(
    recompute_experts: bool = False, save_attention: bool = True
) -> tuple[frozenset[Any], frozenset[Any]]:
    """``(save, matmuls)``: the ops whose outputs selective AC keeps, those of
    this torch build, and among them the matmuls, of which every second one
    per block is recomputed (Note: [Selective activation checkpointing]);
    the experts' grouped matmuls not kept with ``recompute_experts``, the
    attention kernels not kept without ``save_attention``."""
    attention = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.linear.default}
    save = set(matmuls) | {aten.bmm.default, aten.baddbmm.default, aten.max.default}
    save.add(aten.topk.default)
    for name in (
        *(attention if save_attention else ()),
        *(() if recompute_experts else _EXPERT_MATMULS),
        "_scaled_mm",
    ):
        packet = getattr(aten, name, None)
        if packet is not None:
            save.add(packet.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("reduce_scatter_tensor", "all_to_all_single"):
        packet = getattr(functional, name, None) if functional is not None else None
        if packet is not None:
            save.add(packet.default)
    return frozenset(save), frozenset(matmuls)


def _to_host(op: Any, args: tuple, kwargs: dict) -> bool:
    """``op`` copies an accelerator tensor to the host (a token-count sync)."""
    if op is not torch.ops.aten._to_copy.default or not args:
        return False
    device = kwargs.get("device")
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and (isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu")
    )


# Note: [FSDP2 hooks inside a selective checkpoint]
#     Under expert parallelism the fsdp2 engine gives a block's experts an
#     FSDP2 group of their own, inside the block's checkpointed region: its
#     hooks run in forward and again in the recomputation, where they find
#     the experts gathered or not and so mark a different number of
#     ``record_function`` ranges. torch's selective checkpoint (2.13) counts
#     every op of the region and takes a count that differs for
#     nondeterminism. Those ranges are profiler markers, no tensor comes
#     out of them: they are ignored as SAC ignores ``detach``.


def _ignore_profiler_ranges_in_sac() -> None:
    """Leave the profiler's range ops out of selective checkpointing's op
    counts (Note: [FSDP2 hooks inside a selective checkpoint])."""
    import torch.utils.checkpoint as checkpoint

    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", None)
    if ignored is None:
        return
    profiler = torch.ops.profiler
    for name, overload in (
        ("_record_function_enter", "default"),
        ("_record_function_enter_new", "default"),
        ("_record_function_exit", "_RecordFunction"),
    ):
        packet = getattr(profiler, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            ignored.add(op)


def _sac_context_fn(save_ops: frozenset[Any], matmuls: frozenset[Any]) -> tuple[Any, Any]:
    """Selective-checkpoint contexts of one block's forward (Note: [Selective
    activation checkpointing])."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if _to_host(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def check_recompute_experts(mode: str, recompute_experts: bool, flag: str) -> None:
    """One-line ``ValueError`` where ``recompute_experts`` (spelled ``flag``)
    is asked for with an AC ``mode`` other than ``selective`` (full AC
    recomputes every op already; no AC recomputes none)."""
    if recompute_experts and mode != "selective":
        raise ValueError(
            f"{flag} applies to selective activation checkpointing; the mode is {mode!r} "
            "(use selective, or leave it out)"
        )


def apply_activation_checkpointing(
    model: nn.Module, mode: str, recompute_experts: bool = False, *, save_attention: bool = True
) -> int:
    """Wrap every repeated block (``simplefsdp.bucket_plan.repeated_blocks``) for AC.

    Must run before sharding, so the sharded parameters live inside the
    wrapped blocks. ``"full"`` recomputes the whole block in backward;
    ``"selective"`` is torchtitan's op-level policy (Note: [Selective
    activation checkpointing]), the experts' grouped matmuls recomputed
    too with ``recompute_experts``, the attention without
    ``save_attention``. Checkpoint keys are
    unchanged: DCP and the wrapper's state-dict hooks strip its prefix.

    Returns:
        The number of wrapped blocks.

    Raises:
        ValueError: unknown ``mode``; ``recompute_experts`` without
            selective AC.
    """
    if mode not in AC_MODES:
        raise ValueError(
            f"unknown activation checkpointing mode {mode!r}; valid: {', '.join(AC_MODES)}"
        )
    check_recompute_experts(mode, recompute_experts, "recompute_experts")
    if mode == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if mode == "selective":
        _ignore_profiler_ranges_in_sac()
        kwargs["context_fn"] = partial(
            _sac_context_fn, *_sac_save_ops(recompute_experts, save_attention)
        )
    blocks = repeated_blocks(model)
    for fqn, block in blocks:
        parent_fqn, _, name = fqn.rpartition(".")
        model.get_submodule(parent_fqn).register_module(name, checkpoint_wrapper(block, **kwargs))
    logger.info("activation checkpointing (%s) on %d blocks", mode, len(blocks))
    return len(blocks)
