"""The host's side of an eager step (``simplefsdp plan``, analytic families):
the step's kernels as the host issues them against the device.

Note: [Host-bound steps]
    An eager step (FSDP2, the eager executor) launches its kernels one at a
    time from Python: per kernel the host runs Python, the dispatcher,
    autograd's bookkeeping and the driver's launch. The GPU runs what the
    host has queued; the host runs ahead of it until it must read a value
    the GPU computes (a device-to-host sync), where the queue drains and
    the GPU idles until the host has launched the next kernel.

    Where the syncs are: an expert-parallel MoE layer reads its token
    counts to the host before its all-to-all (the split sizes), in forward
    and again in full activation checkpointing's recomputation (selective
    AC saves the copy, as torchtitan's policy does: Note: [Selective
    activation checkpointing]); backward's all-to-all reuses the saved
    splits (no sync). Without expert parallelism the counts stay
    on the GPU (``torch._grouped_mm`` takes them as a tensor) and the host
    runs ahead across the whole step.

    The timeline (:func:`timeline_step`): the family's own model is built
    at the layout's shapes on the meta device (bfloat16, the experts as
    ``torch._grouped_mm``, the engines' AC applied) and one training step
    run under a dispatch mode that records, in issue order, every ATen op
    that launches a kernel (``METADATA_OPS`` and views launch none), its
    pass (forward, backward, or AC's recomputation) and its device seconds
    from the kernel model at its real shapes (Note: [Kernel model]:
    matmuls by shape, the grouped GEMMs as the rank's local experts'
    equal GEMMs, attention as one fused kernel each way, any other op by
    the bytes it reads and writes: eager fuses nothing). With ``ep > 1`` a
    sync precedes every experts call but selective AC's recomputation.
    :func:`simulate` then issues the ops from one host thread at the
    profile's host cost per op of their pass and runs them in order on one
    stream: a kernel starts when it is issued and its predecessor is done;
    at a sync the host waits for the device.
    FSDP's groups (the blocks, the experts of each MoE block under expert
    parallelism, the root, and with FSDP2's split root the embedding and
    the final norm with the output) cost the host their hooks (FSDP2's: the
    profile's ``host_fsdp2_group_s`` per group and step, half as the
    group's forward starts, after the token sync for the experts, half as
    its backward starts), kernel-less ops in the timeline. Each block's
    all-gather in forward is issued on one communication stream when the
    host reaches the block and waited for at once: hidden behind the
    kernels already queued, exposed where a sync left the queue short;
    under expert parallelism the engines prefetch explicitly (as
    torchtitan does), issuing the next block's and its experts' gathers
    as a block starts. Models of one and of two MoE blocks are simulated and the MoE blocks
    extrapolated, as the traced plans do. The step's compute is the
    simulated end; what it adds to the kernels' own time is the host's.

Note: [FSDP2's collective buffers]
    Eager FSDP2 allocates its collectives' buffers on streams of their own,
    and the caching allocator keeps each stream's freed blocks for that
    stream: what the compute stream frees the collectives cannot reuse and
    the other way round. For the allocator's simulation of an eager MoE
    step the recording adds them as the ``fsdp2`` engine's groups allocate
    them (:class:`Fsdp2Buffers`: one group per block, the experts of an
    MoE block a group of their own, as torchtitan wraps them too, the
    embedding and the final norm with the output, or with ``fsdp2_root``
    ``whole`` one root group of all three): a group's all-gather output
    (its bf16 parameters whole) on the all-gather stream (1), issued as
    the block's forward starts (under expert parallelism one block ahead,
    the engine's explicit prefetch; in backward one block ahead, FSDP2's
    backward prefetch) and freed when copied out to the gathered
    parameters on the compute stream; those freed after the block's
    forward (resharded) and its backward, the embedding's after its
    forward and gathered again for its backward (the step's last), the
    final norm's and output's kept from their forward to the last block's
    backward (one root group: from the forward's start to the end of
    backward); in backward the unsharded
    gradients on the compute stream;
    at each group's post-backward (the next block's backward starts) its
    gradients copied into the reduce-scatter's fp32 input on the
    reduce-scatter stream (2), held until the next group's, and the
    gradient shard allocated there, which the next step's ``zero_grad``
    frees (:class:`~simplefsdp.plan.allocator.Previous`): the step's
    forward cannot reuse those blocks.

    Host cost per op (:class:`~simplefsdp.plan.hardware.HardwareProfile`):
    ``host_forward_op_s`` for forward and recomputed ops (Python with
    autograd recording), ``host_backward_op_s`` for backward ops (issued by
    autograd's C++ engine), plus ``host_selective_ac_op_s`` per forward and
    recomputed op under selective AC (its dispatch mode calls a Python
    policy per op; measured). Not counted: FSDP2's hooks per group and
    Python around the modules beyond what the per-op costs hold. Compiled
    engines (Inductor) launch fused kernels, far fewer than eager: they
    are taken as device bound, only the syncs' latency counted (the
    compiled plan's own device model applies). ``aot_eager`` (no engine of
    the plan) would run the same kernels from the FX graph's Python code
    without autograd recording: less host time than eager, not more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simplefsdp.bucket_plan import outer_modules, repeated_blocks
from simplefsdp.plan.allocator import Alloc, Free, Previous

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

    @attention.register_fake
    def _(q, k, v, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @attention_backward.register_fake
    def _(grad, q, k, v, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

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


@dataclass(frozen=True)
class HostStep:
    """The step's compute as the host issues it against the device (seconds).

    Attributes:
        host_s: the host's time issuing the step's kernels.
        device_s: the device's kernels' time.
        step_s: the compute's end, the host's waits and the syncs'
            latency included (Note: [Host-bound steps]).
        sync_s: what the syncs add (device-to-host copy and the first
            launch after each).
        host_bound: the host adds more than 5% to the device's time.
    """

    host_s: float
    device_s: float
    step_s: float
    sync_s: float
    host_bound: bool

    @property
    def wait_s(self) -> float:
        """What the step waits for the host (and the syncs) beyond the
        device's time."""
        return self.step_s - self.device_s


def _recomputation_syncs(ac: str) -> bool:
    """AC mode ``ac``'s recomputation copies the token counts to the host
    again: full AC's; selective AC saves the copy (Note: [Host-bound
    steps])."""
    return ac == "full"


def token_syncs(n_moe: int, ac: str, ep: int) -> int:
    """The token counts' copies to the host in a step of ``n_moe`` MoE
    layers (Note: [Host-bound steps]): one per layer with expert
    parallelism, and one more where AC's recomputation copies them again."""
    return n_moe * (2 if _recomputation_syncs(ac) else 1) if ep > 1 else 0


def device_bound(device_s: float, *, syncs: int, sync_s: float) -> HostStep:
    """A step taken as device bound (compiled kernels, or host and device
    one CPU): the device's time plus ``syncs`` each costing ``sync_s``."""
    assert math.isfinite(device_s), device_s
    return HostStep(0.0, device_s, device_s + syncs * sync_s, syncs * sync_s, False)


# ------------------------------------------------------------ the timeline


class KernelOp(NamedTuple):
    """One recorded op (Note: [Host-bound steps]): its pass (``forward``,
    ``backward`` or ``recompute`` for a kernel; ``hook`` for an FSDP
    group's hooks, ``prefetch`` where they issue the next block's gather,
    both without a kernel), its device seconds, whether a device-to-host
    read precedes it, the kind of block (``dense``, ``moe``) whose forward
    all-gather it issues, if any, and whether it waits for the last
    all-gather issued."""

    phase: str
    device_s: float
    sync: bool = False
    gather: str | None = None
    wait: bool = False


class _KernelRecorder(TorchDispatchMode):
    """A dispatch mode recording, in issue order, each ATen op that launches a
    kernel: its pass (``forward``; in backward ``recompute`` where grad mode
    is on, as AC's recomputation runs, else ``backward``), its device seconds
    (``price``) and whether a device-to-host read precedes it
    (``pending_sync``, set by the experts' pre-hook with expert parallelism)."""

    def __init__(self, price, saves_attention: bool) -> None:
        super().__init__()
        self.price = price
        self.saves_attention = saves_attention
        self.backward = False
        self.pending_sync = False
        self.ops: list[KernelOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in METADATA_OPS or getattr(func, "is_view", False):
            return out
        phase = "forward"
        if self.backward:
            # (the attention stand-in runs its forward below autograd)
            forward_attention = func._schema.name == f"{_LIB}::host_count_attention"
            if forward_attention and self.saves_attention:
                return out  # selective AC saves the fused kernel's output
            recomputed = torch.is_grad_enabled() or forward_attention
            phase = "recompute" if recomputed else "backward"
        seconds = self.price(func, args, out)
        self.ops.append(KernelOp(phase, seconds, self.pending_sync))
        self.pending_sync = False
        return out


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def kernel_pricer(kernels: Any, local_experts: int, imbalance: float = 1.0, cp: int = 1):
    """Device seconds of one recorded op at its real shapes (Note: [Kernel
    model]): matmuls by shape, ``torch._grouped_mm`` as ``local_experts``
    equal GEMMs (the rows a rank's experts receive, balanced; times
    ``imbalance``, the most loaded rank's share over the mean), the
    attention stand-in by its FLOPs (times ``cp``: under context
    parallelism a rank's queries meet every rank's keys), anything else by
    the bytes it reads and writes."""
    matmuls = {"aten::mm", "aten::addmm", "aten::bmm"}
    attention = f"{_LIB}::host_count_attention"

    def price(func, args, out) -> float:
        name = func._schema.name
        tensors = _tensors(args)
        if name in matmuls:
            a, b = (tensors[-2], tensors[-1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            return kernels.gemm_seconds(m, n, k, "bfloat16", batch)
        if name == "aten::_grouped_mm":
            a, b = tensors[0], tensors[1]
            e = max(local_experts, 1)
            if a.dim() == 2 and b.dim() == 3:  # (R, K) x (E, K, N)
                seconds = kernels.gemm_seconds(max(a.shape[0] // e, 1), b.shape[-1], a.shape[1],
                                               "bfloat16", e)  # fmt: skip
            else:  # weight gradient: (K, R) x (R, N) -> (E, K, N)
                seconds = kernels.gemm_seconds(a.shape[0], b.shape[-1], max(a.shape[1] // e, 1),
                                               "bfloat16", e)  # fmt: skip
            return seconds * imbalance
        if name.startswith(attention):
            q, k = tensors[1], tensors[2]  # (grad,) q, k, v
            if name == attention:
                q, k = tensors[0], tensors[1]
            v = tensors[-1] if name == attention else tensors[3]
            b, h, sq, d = q.shape
            flops = 2.0 * b * h * sq * k.shape[-2] * (d + v.shape[-1])
            backward = name != attention
            moved = sum(t.numel() * t.element_size() for t in tensors)
            flash = d == v.shape[-1]
            return cp * kernels.attention_seconds(
                flops * (2.5 if backward else 1.0), moved, backward, flash
            )
        moved = sum(t.numel() * t.element_size() for t in tensors + _tensors(out))
        return moved / kernels.bytes_per_s + kernels.kernel_overhead_s

    return price


class _MemoryRecorder(_KernelRecorder):
    """A :class:`_KernelRecorder` that also records the allocation and the
    free of every storage the step's ops create, as the caching allocator
    would see them (:class:`~simplefsdp.plan.allocator.Alloc`,
    :class:`~simplefsdp.plan.allocator.Free`, in order): a storage is freed
    when nothing holds it any more (autograd's saved tensors included),
    checked before each op. ``external``: storages that exist before the
    step (parameters, buffers); views of them allocate nothing."""

    def __init__(self, price, saves_attention: bool) -> None:
        super().__init__(price, saves_attention)
        self.external: set[int] = set()
        self.live: dict[int, tuple[int, Any]] = {}  # storage -> (event key, weak ref)
        self.events: list = []
        self.forward_end = 0  # the events' index where backward starts
        self._keys = itertools.count()

    def sweep(self) -> None:
        """Free events for the storages no longer held."""
        for storage, (key, ref) in list(self.live.items()):
            if ref.expired():
                del self.live[storage]
                self.events.append(Free(key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.sweep()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            address = storage._cdata
            if address in self.live or address in self.external:
                continue
            key = next(self._keys)
            self.live[address] = (key, StorageWeakRef(storage))
            self.events.append(Alloc(key, storage.nbytes()))
        return out


@dataclass(frozen=True)
class Fsdp2Buffers:
    """Eager FSDP2's FSDP groups as its collective buffers see them (Note:
    [FSDP2's collective buffers]): for a dense block, an MoE block (its
    experts a group of their own) and the root (the final norm and output;
    with ``embedding`` given, the embedding a group apart, else in the
    root's), each group's ``(gathered, shard)`` bytes: its bf16 parameters
    gathered whole, and this rank's fp32 gradient shard; whether the blocks
    are resharded after forward (else kept gathered to their backward)."""

    dense: tuple[tuple[int, int], ...]
    moe: tuple[tuple[int, int], ...]
    root: tuple[tuple[int, int], ...]
    reshard_after_forward: bool = True
    # With a split root (``fsdp2_root``): the embedding's group, gathered
    # for its forward and again for its backward; ``root`` is then the final
    # norm and output, kept from their forward to the end of their backward.
    embedding: tuple[tuple[int, int], ...] = ()


class _Fsdp2Events:
    """Appends eager FSDP2's collective buffers to a :class:`_MemoryRecorder`'s
    events as its hooks would allocate them (Note: [FSDP2's collective
    buffers]): all-gather outputs on stream 1, reduce-scatter inputs and
    gradient shards on stream 2, the gathered parameters and their
    unsharded gradients on the compute stream (0). A block is its index in
    ``kinds`` (``dense`` or ``moe``), or ``root``."""

    def __init__(self, recorder: Any, buffers: Fsdp2Buffers, kinds: list[str]) -> None:
        self.recorder, self.buffers, self.kinds = recorder, buffers, kinds
        self.issued: set[Any] = set()  # all-gathers issued, not yet copied out
        self.gathered: dict[Any, str] = {}  # block -> the pass that gathered it
        self.reducing: list[Any] = []  # the reduce-scatter input held to the next one
        self.split = False  # the embedding a group of its own (Fsdp2Buffers.embedding)
        self.shards: list[Any] = []

    def _groups(self, block: Any) -> tuple[tuple[int, int], ...]:
        kind = block if isinstance(block, str) else self.kinds[block]
        return getattr(self.buffers, kind)

    def _emit(self, event: Any) -> None:
        self.recorder.events.append(event)

    def _issue(self, block: Any, phase: str) -> None:
        if block is None or (block, phase) in self.issued or block in self.gathered:
            return
        self.issued.add((block, phase))
        for g, (gathered, _) in enumerate(self._groups(block)):
            self._emit(Alloc(("fsdp2-ag", phase, block, g), gathered, 1))

    def unshard(self, block: Any, phase: str, prefetch: Any = None) -> None:
        """``block``'s all-gathers waited for and copied out to its
        parameters (in backward, its gradients allocated beside them), then
        ``prefetch``'s issued (FSDP2's backward prefetch of the previous
        block)."""
        if block not in self.gathered:
            self._issue(block, phase)
            self.issued.discard((block, phase))
            self.gathered[block] = phase
            for g, (gathered, _) in enumerate(self._groups(block)):
                self._emit(Alloc(("fsdp2-param", phase, block, g), gathered))
                self._emit(Free(("fsdp2-ag", phase, block, g)))
        if phase == "backward":
            self.gradients(block)
        self._issue(prefetch, phase)

    def gradients(self, block: Any) -> None:
        """The unsharded gradients autograd accumulates for ``block``."""
        for g, (gathered, _) in enumerate(self._groups(block)):
            self._emit(Alloc(("fsdp2-grad", block, g), gathered))

    def reshard(self, block: Any) -> None:
        phase = self.gathered.pop(block, None)
        if phase is not None:
            for g in range(len(self._groups(block))):
                self._emit(Free(("fsdp2-param", phase, block, g)))

    def reduce(self, block: Any) -> None:
        """``block``'s post-backward: per group its gradients copied into
        the reduce-scatter's fp32 input, the previous group's input
        released, the gradient shard allocated; then resharded."""
        for g, (gathered, shard) in enumerate(self._groups(block)):
            self._emit(Alloc(("fsdp2-rs", block, g), 2 * gathered, 2))
            self._emit(Free(("fsdp2-grad", block, g)))
            for held in self.reducing:
                self._emit(Free(held))
            self.reducing = [("fsdp2-rs", block, g)]
            self._emit(Alloc(("fsdp2-shard", block, g), shard, 2))
            self.shards.append(("fsdp2-shard", block, g))
        self.reshard(block)

    def finish(self) -> None:
        """The first block's and the root's post-backward (the last; with a
        split root the embedding's, the others reduced as backward reached
        them); the last reduce-scatter's input released; the gradient
        shards of the step before freed as the step starts (``zero_grad``)."""
        if self.split:
            self.reduce("embedding")
        else:
            if self.kinds:
                self.reduce(0)  # the first block's post-backward
            self.reduce("root")
        for held in self.reducing:
            self._emit(Free(held))
        self.reducing = []
        previous = [Free(Previous(key)) for key in self.shards]
        self.recorder.events[:0] = previous
        self.recorder.forward_end += len(previous)


def _on_output_grad(output: Any, fn: Any) -> None:
    """Calls ``fn()`` when the gradient of ``output``'s first tensor that
    requires one is computed: as a module's backward starts (FSDP2's
    pre-backward hook)."""
    out = next((t for t in _tensors(output) if t.requires_grad), None)
    if out is not None:
        out.register_hook(lambda _grad: fn())


def _hook_fsdp2(
    model: Any, recorder: Any, buffers: Fsdp2Buffers, kinds: list[str], prefetch: bool
) -> _Fsdp2Events:
    """Registers eager FSDP2's collective buffers on ``model``'s blocks (as
    wrapped for AC) and root, as the ``fsdp2`` engine groups them (Note:
    [FSDP2's collective buffers]): the root gathered as the forward starts
    and kept to the end of backward, each block gathered as its forward
    starts (one block ahead with ``prefetch``, the engine's explicit
    prefetch under expert parallelism) and its backward starts (the
    previous block's prefetched), or kept from its forward to its backward
    where ``buffers`` does not reshard after forward."""
    blocks = list(getattr(model, "layers", {}).values())
    fsdp = _Fsdp2Events(recorder, buffers, kinds)
    last = len(blocks) - 1
    first = 0 if prefetch and blocks else None
    outer = outer_modules(model, repeated_blocks(model)) if buffers.embedding else None
    if outer is not None and outer[0] and outer[1]:
        # Split root: the embedding gathered as the forward starts, resharded
        # after it, gathered again as its backward (the step's last) starts,
        # once the first block's has ended; the final norm and output
        # gathered as their forward starts, reduced as the last block's
        # backward starts.
        embedding, head = outer[0][0][1], outer[1][0][1]
        model.register_forward_pre_hook(lambda *_: fsdp.unshard("embedding", "forward", first))
        head.register_forward_pre_hook(lambda *_: fsdp.unshard("root", "forward"))

        def embedding_backward() -> None:
            if blocks:
                fsdp.reduce(0)
            fsdp.unshard("embedding", "backward")

        def embedding_forward(output: Any) -> None:
            if recorder.backward:
                return
            if buffers.reshard_after_forward:
                fsdp.reshard("embedding")
            _on_output_grad(output, embedding_backward)

        embedding.register_forward_hook(lambda _m, _a, out: embedding_forward(out))
        fsdp.split = True
    else:
        model.register_forward_pre_hook(lambda *_: fsdp.unshard("root", "forward", first))

    def post_forward(i: int, output: Any) -> None:
        if buffers.reshard_after_forward:
            fsdp.reshard(i)
        _on_output_grad(output, lambda: pre_backward(i))

    def pre_backward(i: int) -> None:
        if i < last:
            fsdp.reduce(i + 1)  # the block after it has finished its backward
        elif fsdp.split:
            fsdp.reduce("root")  # the final norm's and output's have ended
        fsdp.unshard(i, "backward", i - 1 if i else None)

    for i, block in enumerate(blocks):
        ahead = i + 1 if prefetch and i < last else None
        block.register_forward_pre_hook(lambda *_, i=i, a=ahead: fsdp.unshard(i, "forward", a))
        block.register_forward_hook(lambda _m, _a, out, i=i: post_forward(i, out))
    return fsdp


def _record_step(
    spec: Any,
    config: Any,
    ac: str,
    ep: int,
    batch: int,
    seq: int,
    price,
    memory: bool = False,
    buffers: Fsdp2Buffers | None = None,
    recompute_experts: bool = False,
    fused_loss: bool = False,
    split_root: bool = False,
) -> Any:
    """The kernels of one training step of ``config``'s model at its real
    shapes (meta tensors, bfloat16, the experts' grouped GEMMs), in issue
    order (:class:`_KernelRecorder`); with ``ep > 1`` each experts call
    (forward and recomputation) first reads the token counts to the host.
    With ``memory`` the recorder (:class:`_MemoryRecorder`) is returned,
    its ``events`` without the parameters' gradients (FSDP reduces and
    frees each block's as its backward ends; the plan counts the sharded
    ones); with ``buffers`` eager FSDP2's collective buffers are added to
    them (:func:`_hook_fsdp2`). The loss is a log-sum-exp over the
    vocabulary: of fp32 logits (eager: their fp32 copy and its gradient
    allocated), or with ``fused_loss`` of the bf16 logits (a compiled loss
    holds no fp32 tensor of the vocabulary's width). ``split_root``: the
    embedding and the final norm with the output are FSDP2 groups of their
    own beside the root (``fsdp2_root`` ``split``), each hooked."""
    import inspect

    from simplefsdp.engines.activation import apply_activation_checkpointing

    kind = _MemoryRecorder if memory else _KernelRecorder
    recorder = kind(price, saves_attention=ac == "selective")
    with torch.device("meta"):
        model = spec.build(config)
    model.to(torch.bfloat16)
    n_dense = getattr(config, "n_dense_layers", 0)

    # FSDP's groups and their hooks (Note: [Host-bound steps]): each a
    # kernel-less op at the group's pre-forward (after the token sync where
    # one is pending) and pre-backward. A block's forward all-gather: issued
    # as its forward starts and waited for at once, or, under expert
    # parallelism, issued one block ahead with its experts' (the engines'
    # explicit prefetch: the syncs stop the host running ahead).
    prefetch = ep > 1
    blocks = list(getattr(model, "layers", {}).values())
    kinds = ["dense" if index < n_dense else "moe" for index in range(len(blocks))]

    def hook(*_, gather: str | None = None, wait: bool = False) -> None:
        recorder.ops.append(KernelOp("hook", 0.0, recorder.pending_sync, gather, wait))
        recorder.pending_sync = False

    def pre_forward(index: int | None) -> None:
        if recorder.backward:
            return  # AC's recomputation: the block is gathered for backward
        if index is None:  # the root, which prefetches the first block
            hook(gather=kinds[0] if prefetch and kinds else None)
        elif prefetch:
            hook(wait=True)
            if index + 1 < len(kinds):
                recorder.ops.append(KernelOp("prefetch", 0.0, False, kinds[index + 1]))
        else:
            hook(gather=kinds[index], wait=True)

    def hook_backward(output: Any) -> None:
        if not recorder.backward:
            _on_output_grad(output, hook)

    model.register_forward_pre_hook(lambda *_: pre_forward(None))
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, index=index: pre_forward(index))
        block.register_forward_hook(lambda _m, _a, out: hook_backward(out))
    outer = outer_modules(model, repeated_blocks(model)) if split_root else None
    if outer is not None and outer[0] and outer[1]:
        # the embedding's group and the final norm's with the output: hooked
        # as their forward starts and as their backward starts
        for side in outer:
            side[0][1].register_forward_pre_hook(lambda *_: None if recorder.backward else hook())
            side[-1][1].register_forward_hook(lambda _m, _a, out: hook_backward(out))

    def token_sync() -> None:
        # the token counts' copy to the host: in forward, and again where
        # AC's recomputation copies them
        if not recorder.backward or _recomputation_syncs(ac):
            recorder.pending_sync = True

    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = True
        forward = getattr(type(module), "forward", None)
        if ep > 1 and forward and "num_tokens_per_expert" in inspect.signature(forward).parameters:
            # the token counts read, then the experts' own group's hooks
            module.register_forward_pre_hook(lambda *_: token_sync())
            module.register_forward_pre_hook(lambda *_: None if recorder.backward else hook())
            module.register_forward_hook(lambda _m, _a, out: hook_backward(out))
    apply_activation_checkpointing(model, ac, recompute_experts)
    fsdp = _hook_fsdp2(model, recorder, buffers, kinds, prefetch) if memory and buffers else None
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    held = [*model.parameters(), *model.buffers(), tokens]
    if memory:
        recorder.external = {t.untyped_storage()._cdata for t in held}
    with _one_kernel_attention(), recorder:
        logits = model(tokens)
        if not fused_loss:
            logits = logits.float()  # the eager loss computes in fp32
        loss = logits.logsumexp(-1).float().mean()
        del logits
        if memory:
            recorder.sweep()
            recorder.forward_end = len(recorder.events)  # what backward will read is live
        recorder.backward = True
        hook()  # the root's pre-backward, as the loss's backward starts
        if fsdp:
            fsdp.gradients("root")  # from the output layer's backward, the first
        loss.backward()
    if fsdp:
        fsdp.finish()
    if not memory:
        return recorder.ops
    del loss
    recorder.sweep()
    grads = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
    drop = {recorder.live[g][0] for g in grads if g in recorder.live}
    recorder.events = [e for e in recorder.events if e.key not in drop]
    return recorder


@dataclass(frozen=True)
class EagerStep:
    """An eager training step to record (Note: [Host-bound steps]): the
    family's ``spec`` and ``config``, its AC mode, EP degree and batch,
    ``seq`` this rank's tokens of each sequence (a ``cp``-th), the
    ``kernels`` that price its ops (``None``: unpriced), the most loaded EP
    rank's routed tokens over the mean (``imbalance``), the CP degree,
    eager FSDP2's collective ``buffers`` (``None``: none recorded),
    whether selective AC recomputes the experts, whether the loss is
    compiled (``fused_loss``) and whether FSDP2 groups the embedding and
    the final norm with the output apart from its root (``split_root``)."""

    spec: Any
    config: Any
    ac: str
    ep: int
    batch: int
    seq: int
    kernels: Any = None
    imbalance: float = 1.0
    cp: int = 1
    buffers: Fsdp2Buffers | None = None
    recompute_experts: bool = False
    fused_loss: bool = False
    split_root: bool = False

    def key(self) -> tuple:
        """What the recording depends on, hashable (the kernel model by its
        repr: it holds dicts)."""
        return (self.spec.family, self.config, self.ac, self.ep, self.batch, self.seq,
                repr(self.kernels), self.imbalance, self.cp, self.buffers,
                self.recompute_experts, self.fused_loss, self.split_root)  # fmt: skip


def eager_step_events(step: EagerStep) -> tuple:
    """Allocation and free events of ``step`` with two MoE blocks (past the
    dense ones) (Note: [Host-bound steps]; :class:`_MemoryRecorder`), eager
    FSDP2's collective buffers added where ``step.buffers`` has them, for
    the caching allocator's simulation; the recording
    :func:`timeline_step` simulates."""
    return _recorded(step)[2]


def simulate(
    ops: list, host_s: dict[str, float], sync_s: float, gather_s: dict[str, float] | None = None
) -> tuple[float, float, float]:
    """``(step, device, host)`` seconds of ``ops`` (:class:`KernelOp`, in
    issue order) issued by one host thread at
    ``host_s[pass]`` each and run in order on one device stream: a kernel
    starts when it is issued and the one before it is done; before a sync
    the host waits for the device to drain, and the read costs ``sync_s``.
    An op with a ``gather`` issues a block's all-gather as the host has
    issued it, ``gather_s[gather]`` seconds on one communication stream;
    an op with ``wait`` starts no earlier than the last gather issued
    (Note: [Host-bound steps])."""
    host = device = busy = issued = link = pending = 0.0
    for phase, seconds, sync, gather, wait in ops:
        if sync:
            host = device = max(host, device) + sync_s
        host += host_s[phase]
        issued += host_s[phase]
        if gather and gather_s:
            link = pending = max(host, link) + gather_s.get(gather, 0.0)
        ready = pending if wait else 0.0
        device = max(device, host, ready) + seconds
        busy += seconds
    return max(host, device), busy, issued


_RECORDED: dict[tuple, tuple] = {}


def _recorded(step: EagerStep) -> tuple:
    """The kernels of models of ``step`` with one and with two MoE blocks
    (past the dense ones), priced by ``step.kernels`` (0 without), and the
    allocation events of the second, cached per :meth:`EagerStep.key`:
    ``(ops of one, ops of two, events of two)``."""
    key = step.key()
    if key not in _RECORDED:
        config = step.config
        local = max(config.num_experts // step.ep, 1)
        price = (
            kernel_pricer(step.kernels, local, step.imbalance, step.cp)
            if step.kernels
            else (lambda *_: 0.0)
        )
        shape = (step.ac, step.ep, step.batch, step.seq, price)
        recompute = {
            "recompute_experts": step.recompute_experts,
            "fused_loss": step.fused_loss,
            "split_root": step.split_root,
        }

        def model(extra: int) -> Any:
            return dataclasses.replace(config, n_layers=config.n_dense_layers + extra)

        one = _record_step(step.spec, model(1), *shape, **recompute)
        two = _record_step(step.spec, model(2), *shape, True, step.buffers, **recompute)
        _RECORDED[key] = (tuple(one), tuple(two.ops), tuple(two.events))
    return _RECORDED[key]


def timeline_step(
    step: EagerStep,
    hw: Any,
    gather_s: dict[str, float] | None = None,
    fsdp2: bool = False,
) -> HostStep:
    """``step`` on ``hw`` as the host issues it against the device (Note:
    [Host-bound steps]): the kernels of models of one and of two MoE blocks
    recorded at its shapes, priced by ``step.kernels``, and simulated, with
    each block's forward all-gather (``gather_s`` by block kind, ``dense``
    or ``moe``), the MoE blocks extrapolated. ``device_s`` is the kernel
    model's; ``wait_s`` what the host and the gathers add to it.
    ``fsdp2``: FSDP2's hooks cost the host ``hw.host_fsdp2_group_s`` per
    group. ``step.buffers`` leaves the kernels alone: it selects the
    recording :func:`eager_step_events` shares."""
    selective = hw.host_selective_ac_op_s if step.ac == "selective" else 0.0
    host_s = {
        "forward": hw.host_forward_op_s + selective,
        "recompute": hw.host_forward_op_s + selective,
        "backward": hw.host_backward_op_s,
        # an FSDP2 group's hooks per step, half before its forward, half
        # before its backward
        "hook": hw.host_fsdp2_group_s / 2 if fsdp2 else 0.0,
        "prefetch": 0.0,
    }
    sync_s = hw.kernel_overhead_s + hw.host_forward_op_s
    one, two, _ = _recorded(step)
    (t1, d1, h1), (t2, d2, h2) = (simulate(ops, host_s, sync_s, gather_s) for ops in (one, two))
    n_moe = step.config.n_moe_layers
    end = t1 + (n_moe - 1) * (t2 - t1)
    device = d1 + (n_moe - 1) * (d2 - d1)
    host = h1 + (n_moe - 1) * (h2 - h1)
    syncs = token_syncs(n_moe, step.ac, step.ep)
    # host bound: the host's issue adds more than 5% to the kernels' time
    return HostStep(host, device, max(end, device), syncs * sync_s, end > device * 1.05)
