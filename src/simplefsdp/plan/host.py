"""The host's side of an eager step (``simplefsdp plan``, analytic families):
how many kernels a block launches, and what launching them costs the CPU.

Note: [Host-bound steps]
    An eager step (FSDP2, the eager executor) launches its kernels one at a
    time from Python: per kernel the host runs Python, the dispatcher,
    autograd's bookkeeping and the driver's launch. The GPU runs what the
    host has queued; the host runs ahead of it until it must read a value
    the GPU computes (a device-to-host sync). Between two syncs (a
    *segment*) the work takes ``max(host time of the segment's ops, device
    time of its kernels)``; at the sync the queue drains, so a segment's
    spare host or device time never hides another segment's.

    Where the syncs are: an expert-parallel MoE layer reads its token
    counts to the host before its all-to-all (the split sizes), in forward
    and again in activation checkpointing's recomputation (the engines'
    selective policy recomputes the copy; torchtitan's saves it, and its
    backward then has no sync); backward's all-to-all reuses the saved
    splits (no sync). So with ``ep > 1`` the
    forward is one run of equal segments (one per MoE layer) and backward
    another (each MoE block's recomputation syncs once): the step is
    ``max(host_fw, device_fw) + max(host_bw, device_bw)``, and each sync
    adds a device-to-host copy and the launch of the first kernel after it
    (the GPU is idle meanwhile). Without expert parallelism the counts stay
    on the GPU (``torch._grouped_mm`` takes them as a tensor) and the host
    runs ahead across the whole step: ``max(host, device)``.

    Kernel counts come from the family's own model (:func:`block_ops`):
    a tiny model of the flavor's structure (the family's smallest flavor
    with the flavor's switches: every string, bool and 0/1 field copied,
    e.g. no query compression, one expert group, softmax routing) is run in
    bfloat16 on the CPU under a dispatch mode that counts ATen ops, forward,
    backward and (selective or full AC, as the engines apply it)
    recomputation (the kernels that run again; selective AC's saved ops
    are not). One MoE block's count is the difference between models
    of ``n_dense + 2`` and ``n_dense + 1`` blocks; the rest of the model
    (embedding, dense blocks, output, loss) is the smaller model less one
    MoE block. What is not a kernel is not counted (``METADATA_OPS``: views,
    aliases, ``detach``, ``empty``). The GPU path is what is counted: the
    routed experts run as ``torch._grouped_mm`` (one kernel per matmul,
    the path bfloat16 takes on CUDA), attention through SDPA as one fused
    kernel each way (as the flash/efficient kernels run on a GPU; a model
    whose attention is written out, as with sinks, counts its ops), and
    with ``ep > 1``
    the expert-parallel dispatch and combine of
    :mod:`simplefsdp.frontend.expert_parallel` on a one-rank mesh, its
    collectives counted as one kernel each.

    Host cost per kernel (:class:`~simplefsdp.plan.hardware.HardwareProfile`
    fields ``host_forward_op_s``, ``host_backward_op_s``): forward ops and
    their recomputation are Python-issued with autograd recording; backward
    ops are issued by autograd's C++ engine. Not counted: the host time of
    views and of Python around the ops (module calls, hooks, selective AC's
    dispatch mode), so the host times are lower bounds. Compiled engines
    (Inductor) launch fused kernels, far fewer than eager: they are taken
    as device bound, only the syncs' latency counted. ``aot_eager`` (no
    engine of the plan) would run the same kernels from the FX graph's
    Python code without autograd recording, about 2 us each plus the
    launch (pytorch/pytorch#41383): less host time than eager, not more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen ops that launch no kernel: views and aliases (metadata only),
#: ``detach``, uninitialised allocations, and the metadata queries a
#: dispatch mode sees. Any op whose schema declares it a view counts as one
#: too (``OpOverload.is_view``).
METADATA_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::_reshape_alias",
        "aten::reshape",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::expand",
        "aten::squeeze",
        "aten::unsqueeze",
        "aten::slice",
        "aten::select",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::unbind",
        "aten::narrow",
        "aten::as_strided",
        "aten::alias",
        "aten::detach",
        "aten::lift_fresh",
        "aten::view_as_real",
        "aten::view_as_complex",
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::is_same_size",
    }
)

_LIB = "simplefsdp_plan"


@dataclass(frozen=True)
class BlockOps:
    """Kernels one step launches, counted on the family's model (Note:
    [Host-bound steps]).

    Attributes:
        forward, backward: one MoE block's kernels in forward and in
            backward (the recomputation not included).
        recompute: one MoE block's kernels recomputed in backward under the
            AC mode counted with.
        rest_forward, rest_backward, rest_recompute: the same for the rest
            of the tiny model (embedding, its ``dense_blocks`` dense blocks,
            output, loss).
        dense_forward, dense_backward, dense_recompute: one dense block's
            (0 for a family without dense blocks).
        dense_blocks: the tiny model's dense blocks (in the rest's count).
        syncs_per_pass: device-to-host syncs per MoE block forward (and per
            recomputation): 1 with expert parallelism, else 0 (the
            dispatch's own kernels are counted only where torch.distributed
            is not initialised: the count runs on a fake one-rank group).
    """

    forward: int
    backward: int
    recompute: int
    rest_forward: int
    rest_backward: int
    rest_recompute: int
    dense_forward: int = 0
    dense_backward: int = 0
    dense_recompute: int = 0
    dense_blocks: int = 0
    syncs_per_pass: int = 0

    def step_counts(self, n_moe: int, n_dense: int) -> tuple[int, int, int]:
        """``(forward, backward, recompute)`` kernels of a model of ``n_moe``
        MoE and ``n_dense`` dense blocks."""
        extra = n_dense - self.dense_blocks
        return (
            self.rest_forward + n_moe * self.forward + extra * self.dense_forward,
            self.rest_backward + n_moe * self.backward + extra * self.dense_backward,
            self.rest_recompute + n_moe * self.recompute + extra * self.dense_recompute,
        )


class _KernelCounter(TorchDispatchMode):
    """A dispatch mode counting the ATen ops that launch a kernel (by schema
    name in ``counts``); a one-rank group's all-to-all is the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name == "_c10d_functional::all_to_all_single":
            self.counts[name] += 1
            return args[0].clone()
        if name == "_c10d_functional::wait_tensor":
            return args[0]
        out = func(*args, **(kwargs or {}))
        if name not in METADATA_OPS and not getattr(func, "is_view", False):
            self.counts[name] += 1
        return out


@functools.cache
def _attention_op() -> Any:
    """Attention as one op each way (a planning-only custom op over the math
    path, which takes any head dims), as the fused kernels run on a GPU."""

    @torch.library.custom_op(f"{_LIB}::host_count_attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return _math_attention(q, k, v, scale)

    @torch.library.custom_op(f"{_LIB}::host_count_attention_backward", mutates_args=())
    def attention_backward(
        grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (autograd is off inside an op's kernel: the causal softmax's
        # gradient written out)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, T)
        t = scores.shape[-1]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        dv = probs.transpose(-2, -1) @ grad.float()
        dprobs = grad.float() @ v.float().transpose(-2, -1)
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
        dq, dk = dscores @ k.float(), dscores.transpose(-2, -1) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _math_attention(q, k, v, scale):
        # the builtin itself: F.scaled_dot_product_attention is patched meanwhile
        return torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def setup_context(ctx, inputs, output):
        q, k, v, scale = inputs
        ctx.scale = scale
        ctx.save_for_backward(q, k, v)

    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad.contiguous(), q, k, v, ctx.scale)
        return dq, dk, dv, None

    attention.register_autograd(backward, setup_context=setup_context)
    return attention


@contextlib.contextmanager
def _one_kernel_attention() -> Iterator[Any]:
    """``F.scaled_dot_product_attention`` replaced by :func:`_attention_op`
    (its ``OpOverload`` is yielded)."""
    import torch.nn.functional as F

    op = _attention_op()
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_kwargs):
        assert attn_mask is None and is_causal, "attend() calls causal SDPA without a mask"
        return op(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)

    F.scaled_dot_product_attention = sdpa
    try:
        yield op._opoverload
    finally:
        F.scaled_dot_product_attention = original


def tiny_config(spec: Any, config: Any) -> Any:
    """A small configuration of ``config``'s structure: the family's smallest
    flavor with every string, bool and 0/1 field of ``config`` (Note:
    [Host-bound steps])."""
    smallest = min(spec.flavors.values(), key=lambda c: spec.num_params(c))
    switches = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, (bool, str)) or (type(value) is int and value in (0, 1)):
            switches[f.name] = value
    return dataclasses.replace(smallest, **switches)


@contextlib.contextmanager
def _one_rank_group() -> Iterator[bool]:
    """A fake one-rank process group for the expert-parallel wrapper; yields
    ``False`` (no wrapper) where torch.distributed is already initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield False
        return
    from simplefsdp.plan.trace import fake_process_group

    with fake_process_group(1):
        yield True


def _build(spec: Any, config: Any, ac: str, ep: bool) -> Any:
    """The tiny model in bfloat16 on the CPU, its experts expert-parallel on
    a one-rank mesh (``ep``), AC applied by the engines' own function."""
    from simplefsdp import apply_expert_parallel
    from simplefsdp.engines.activation import apply_activation_checkpointing
    from simplefsdp.layout import Layout

    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(config)
    model.to_empty(device="cpu")
    spec.init_weights(model, "cpu")
    model.to(torch.bfloat16)
    if ep:
        # the layout's one-rank mesh stands in for the expert-parallel one
        apply_expert_parallel(model, Layout(dp_shard=1).build("cpu", 1).world)
    apply_activation_checkpointing(model, ac)
    return model


def _count_step(spec: Any, config: Any, ac: str, ep: bool) -> tuple[int, int, int]:
    """Kernels of one training step of ``config``'s model: ``(forward,
    backward, recompute)``, the recomputation being what AC adds to backward.

    Selective AC saves the fused attention kernels' outputs; the counting
    stand-in for them (:func:`_attention_op`) is not in its list, so its
    recomputations are taken off."""
    seq = 32
    counts = []
    # the global RNG untouched; gradients on whatever the caller's mode
    with (
        torch.random.fork_rng(devices=[]),
        torch.enable_grad(),
        _one_kernel_attention() as attention,
    ):
        for mode in dict.fromkeys(("none", ac)):
            model = _build(spec, config, mode, ep)
            tokens = torch.randint(0, config.vocab_size, (1, seq))
            counter = _KernelCounter()
            with counter:
                loss = model(tokens).float().logsumexp(-1).mean()
            forward = sum(counter.counts.values())
            counter = _KernelCounter()
            with counter:
                loss.backward()
            backward = sum(counter.counts.values())
            if mode == "selective":
                backward -= counter.counts[attention._schema.name]
            counts.append((forward, backward))
    (forward, backward), (_, backward_ac) = counts[0], counts[-1]
    return forward, backward, backward_ac - backward


@functools.cache
def _block_ops(family: str, config: Any, ac: str, ep: bool) -> BlockOps:
    from simplefsdp.models.registry import get_spec

    spec = get_spec(family)
    n_dense = getattr(config, "n_dense_layers", 0)
    group = _one_rank_group() if ep else contextlib.nullcontext(False)
    with group as wrapped:
        one = _count_step(spec, dataclasses.replace(config, n_layers=n_dense + 1), ac, wrapped)
        two = _count_step(spec, dataclasses.replace(config, n_layers=n_dense + 2), ac, wrapped)
        dense = one
        if n_dense:  # one more dense block before the MoE one
            more = dataclasses.replace(config, n_layers=n_dense + 2, n_dense_layers=n_dense + 1)
            dense = _count_step(spec, more, ac, wrapped)
    block = [b - a for a, b in zip(one, two, strict=True)]
    rest = [a - b for a, b in zip(one, block, strict=True)]
    dense = [b - a for a, b in zip(one, dense, strict=True)]
    return BlockOps(
        forward=block[0],
        backward=block[1],
        recompute=block[2],
        rest_forward=rest[0],
        rest_backward=rest[1],
        rest_recompute=rest[2],
        dense_forward=dense[0],
        dense_backward=dense[1],
        dense_recompute=dense[2],
        dense_blocks=n_dense,
        syncs_per_pass=1 if ep else 0,
    )


def block_ops(spec: Any, config: Any, ac: str, ep: int) -> BlockOps:
    """The kernels one training step of ``config`` (a flavor of ``spec``)
    launches per MoE block and in the rest of the model, counted on a tiny
    model of its structure (Note: [Host-bound steps]); cached per family,
    structure, AC mode and whether experts are parallel (``ep > 1``)."""
    return _block_ops(spec.family, tiny_config(spec, config), ac, ep > 1)


@dataclass(frozen=True)
class HostStep:
    """The step's compute as host and device per run of segments (seconds).

    Attributes:
        host_s: the host's time issuing the step's kernels.
        device_s: the device's compute (and exposed all-to-all) time.
        step_s: the two combined segment by segment, plus the syncs'
            latency (Note: [Host-bound steps]).
        sync_s: what the syncs add (device-to-host copy and the first
            launch after each).
        host_bound: the host's time decides at least one run of segments.
    """

    host_s: float
    device_s: float
    step_s: float
    sync_s: float
    host_bound: bool

    @property
    def wait_s(self) -> float:
        """What the step waits for the host beyond the device's time."""
        return self.step_s - self.device_s


def host_step(
    runs: list[tuple[float, float]], *, syncs: int, sync_s: float, overlap: bool
) -> HostStep:
    """Combine host and device time: each of ``runs`` is ``(host_s,
    device_s)`` of a run of segments separated by syncs (Note: [Host-bound
    steps]); ``overlap``: no sync separates the runs, so the host runs ahead
    across all of them. ``syncs`` each cost ``sync_s``."""
    host = sum(h for h, _ in runs)
    device = sum(d for _, d in runs)
    if overlap:
        combined = max(host, device)
        bound = host > device
    else:
        combined = sum(max(h, d) for h, d in runs)
        bound = any(h > d for h, d in runs)
    extra = syncs * sync_s
    assert math.isfinite(combined), runs
    return HostStep(host, device, combined + extra, extra, bound)
