"""The eager executor's scheduling: when each bucket is gathered, freed and reduced.

Note: [Eager schedule]
    Hooks (installed by ``simplefsdp.eager``; see ``hooks.py``) drive a small
    state machine per bucket: ``SHARDED -> GATHERING`` (all-gather issued,
    asynchronously) ``-> UNSHARDED`` (waited, copied out into the flat buffer)
    ``-> SHARDED`` (freed).

    Forward. The root's pre-forward hook starts an iteration. The first
    pre-forward of any of a bucket's owner modules *begins* the bucket: it is
    gathered if needed (or its prefetched gather is waited on), its parameter
    views are published to the owners, and (``forward_prefetch``) the next
    buckets in the recorded forward order are gathered early. When every owner
    has run, the bucket *ends*: it registers nothing more and is freed if the
    model reshards after forward, except the root bucket (the last to end in
    forward, which backward needs first). Each owner's post-forward hook puts
    a hook on its outputs that fires when their first gradient is computed:
    the bucket's *pre-backward*, which regathers the bucket and
    (``backward_prefetch``) issues the gather of the next bucket in backward
    order, so that gather is queued before this bucket's reduce-scatter.

    Orders. The first iteration records the order in which buckets begin
    (forward order, used for forward prefetch from the second iteration) and
    the order in which they end; backward order is the reverse of the latter
    (a tied embedding ends last in forward and is needed first in backward).
    The first iteration therefore runs without forward prefetch and reshards
    every bucket.

    Backward. Autograd accumulates the views' gradients into the bucket's flat
    leaf; its post-accumulate-grad hook fires once, when the last gradient is
    in. It reduce-scatters the flat gradient (all-reduce for replicated slots;
    then across replicas for hybrid, when the reduction is finished) and frees
    the bucket. Reductions are waited on lazily: when a newer one is issued,
    the older one is finished (gradients written), and the rest at the end of
    backward (an autograd engine callback), which also frees every bucket.

    Rate limiter. A prefetch is issued only while fewer than
    ``limit_all_gathers`` buckets are gathered (or gathering) and not yet used;
    a bucket needed now is always gathered. This bounds the unsharded memory
    that prefetching can hold at once, as the FSDP paper's limiter does.

    Gradient accumulation. With ``requires_gradient_sync`` off, the flat
    gradient is kept unsharded (in ``reduce_dtype``) and added to the next
    backward's; nothing is communicated until a backward with sync on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from simplefsdp.eager_executor.collectives import Collectives, Work
from simplefsdp.eager_executor.flat_bucket import FlatBucket
from simplefsdp.frontend import rank_check

logger = logging.getLogger(__name__)


def output_tensors(output: object) -> list[torch.Tensor]:
    """The tensors in a module's output: inside lists, tuples (named ones
    too), sets, mappings and dataclass instances, at any depth, as FSDP2 looks
    for them. Backward regathers a resharded bucket from a hook on these, so
    one missed (a dataclass is no pytree node) meant a backward reading a
    freed buffer."""
    found: list[torch.Tensor] = []
    stack, seen = [output], set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
    return found


# Reductions in flight before the oldest is finished: one, like FSDP2, so the
# reduce-scatter inputs alive at once stay bounded by about two buckets.
_MAX_REDUCTIONS_IN_FLIGHT = 1


class BucketStatus(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class TraceEvent:
    """One scheduling decision, for tests and debugging.

    Attributes:
        kind: ``"unshard"`` (gather issued), ``"reduce"`` (reduction issued),
            ``"accumulate"`` (gradient kept, no sync) or ``"reshard"`` (freed).
        bucket: bucket index in the plan.
        phase: ``"forward"`` or ``"backward"``.
        prefetch: for ``"unshard"``: issued ahead of use.
    """

    kind: str
    bucket: int
    phase: str
    prefetch: bool = False


@dataclass
class EagerStats:
    """High-water marks and counts since the last ``reset_stats``.

    Attributes:
        max_unused_gathers: most buckets gathered (or gathering) but not yet
            used at once; at most ``limit_all_gathers`` when prefetching.
        max_unsharded_buckets: most buckets holding unsharded memory at once.
        all_gathers: all-gather collectives issued.
        reductions: bucket reductions issued.
    """

    max_unused_gathers: int = 0
    max_unsharded_buckets: int = 0
    all_gathers: int = 0
    reductions: int = 0


@dataclass(frozen=True)
class EagerOptions:
    """The executor's validated knobs (see ``simplefsdp.eager``)."""

    forward_prefetch: bool
    backward_prefetch: bool
    limit_all_gathers: int
    cpu_offload: bool
    reshard_after_forward: bool
    reduce_op: str


@dataclass
class _BucketState:
    status: BucketStatus = BucketStatus.SHARDED
    gather_work: Work | None = None
    gather_buffers: tuple[torch.Tensor, ...] = ()  # (input, output) while in flight
    awaiting_use: bool = False
    owners_pending: set[int] = field(default_factory=set)
    unreduced_grad: torch.Tensor | None = None  # flat, reduce_dtype (no-sync)


@dataclass
class _PendingReduction:
    bucket: int
    works: list[Work]
    sharded: torch.Tensor | None  # reduce-scatter output (shard_numel,)
    replicated: torch.Tensor | None  # all-reduced in place
    keep_alive: torch.Tensor | None  # reduce-scatter input, until waited


# (views dict of an owner module, parameter name there, canonical FQN)
ViewTarget = tuple[dict, str, str]


class EagerExecutor:
    """Runs a ``data_parallel`` model's bucket plan eagerly. Made by ``simplefsdp.eager``.

    See Note: [Eager schedule]. Read-only for users apart from the gradient
    sync switch; ``trace`` and ``stats`` are for tests and debugging.

    Attributes:
        buckets: the flat buckets, in plan order.
        forward_order: bucket indices in the order forward first used them
            (recorded in the first iteration; empty before).
        backward_order: the order backward prefetch follows.
        root_bucket: the bucket kept unsharded after forward, or None.
        trace: this iteration's ``TraceEvent`` s.
        stats: ``EagerStats``.
        comm: the ``Collectives`` used (replaceable, e.g. to inject a delay).
    """

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        view_targets: Sequence[Sequence[ViewTarget]],
        owner_ids: Sequence[set[int]],
        options: EagerOptions,
    ) -> None:
        self.buckets = list(buckets)
        self.options = options
        self.comm = Collectives()
        self.forward_order: tuple[int, ...] = ()
        self.backward_order: tuple[int, ...] = ()
        self.root_bucket: int | None = None
        self.trace: list[TraceEvent] = []
        self.stats = EagerStats()
        self.requires_gradient_sync = True
        self.handles: list[RemovableHandle] = []
        self._view_targets = [list(t) for t in view_targets]
        self._owner_ids = [set(o) for o in owner_ids]
        self._states = [_BucketState() for _ in self.buckets]
        self._begun: list[int] | None = []  # recording (first iteration); None after
        self._ended: list[int] = []
        self._pending: deque[_PendingReduction] = deque()
        self._in_backward = False

    # ------------------------------------------------------------------ API

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Reduce gradients in the following backwards (``True``, default), or
        accumulate them unsharded without communication (``False``)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}"
            )
        self.requires_gradient_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them inside the block.

        Example::

            for micro_batch in micro_batches[:-1]:
                with executor.no_sync():
                    loss_fn(model(micro_batch)).backward()
            loss_fn(model(micro_batches[-1])).backward()  # reduces the sum once
        """
        previous = self.requires_gradient_sync
        self.requires_gradient_sync = False
        try:
            yield
        finally:
            self.requires_gradient_sync = previous

    def reset_stats(self) -> None:
        self.stats = EagerStats()

    def uninstall(self) -> None:
        """Remove the hooks and free the buffers (``remove_eager`` calls this and
        also removes the views dicts); kept (no-sync) gradients are dropped."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for index in range(len(self.buckets)):
            self._reshard(index)
            self._states[index].unreduced_grad = None

    # ---------------------------------------------------------- bookkeeping

    def _phase(self) -> str:
        return "backward" if self._in_backward else "forward"

    def _record(self, kind: str, index: int, prefetch: bool = False) -> None:
        self.trace.append(TraceEvent(kind, index, self._phase(), prefetch))

    def _update_high_water_marks(self) -> None:
        unused = sum(s.awaiting_use for s in self._states)
        unsharded = sum(s.status is not BucketStatus.SHARDED for s in self._states)
        self.stats.max_unused_gathers = max(self.stats.max_unused_gathers, unused)
        self.stats.max_unsharded_buckets = max(self.stats.max_unsharded_buckets, unsharded)

    # --------------------------------------------------- gather and reshard

    def _issue_gather(self, index: int, prefetch: bool) -> None:
        state, bucket = self._states[index], self.buckets[index]
        rank_check.record(f"{index}:{bucket.name}")  # Note: [Same gathers on every rank]
        if bucket.sharded:
            segment = bucket.copy_in()  # (shard_numel,)
            gathered = torch.empty(
                bucket.sharded_region_numel, dtype=bucket.compute_dtype, device=bucket.device
            )
            group = bucket.groups.shard_group
            state.gather_work = self.comm.all_gather(gathered, segment, group, bucket.name)
            state.gather_buffers = (segment, gathered)
            self.stats.all_gathers += 1
        state.status = BucketStatus.GATHERING
        state.awaiting_use = prefetch
        self._record("unshard", index, prefetch)
        self._update_high_water_marks()

    def _finish_gather(self, index: int) -> None:
        state = self._states[index]
        if state.gather_work is not None:
            state.gather_work.wait()
        gathered = state.gather_buffers[1] if state.gather_buffers else None
        self.buckets[index].copy_out(gathered)
        state.gather_work, state.gather_buffers = None, ()
        state.status = BucketStatus.UNSHARDED

    def _prefetch(self, order: tuple[int, ...], after: int | None) -> None:
        """Gather the buckets following ``after`` in ``order``, within the limit."""
        start = order.index(after) + 1 if after in order else 0
        for index in order[start:]:
            if sum(s.awaiting_use for s in self._states) >= self.options.limit_all_gathers:
                return
            if self._states[index].status is BucketStatus.SHARDED:
                self._issue_gather(index, prefetch=True)

    def _begin_use(self, index: int, *, forward: bool) -> None:
        """Make bucket ``index`` usable now; prefetch what follows it."""
        state = self._states[index]
        if state.status is BucketStatus.SHARDED:
            self._issue_gather(index, prefetch=False)
        state.awaiting_use = False
        if forward and self.options.forward_prefetch and not self._in_backward:
            self._prefetch(self.forward_order, index)
        elif not forward and self.options.backward_prefetch:
            self._prefetch(self.backward_order, index)
        if state.status is BucketStatus.GATHERING:
            self._finish_gather(index)
        if forward:
            self._bind_views(index)

    def _bind_views(self, index: int) -> None:
        views = self.buckets[index].views()
        for owner_views, name, fqn in self._view_targets[index]:
            owner_views[name] = views[fqn]

    def _reshard(self, index: int) -> None:
        state = self._states[index]
        if state.status is BucketStatus.SHARDED:
            return
        if state.gather_work is not None:
            state.gather_work.wait()  # never leave a collective unwaited
        state.gather_work, state.gather_buffers = None, ()
        self.buckets[index].free()
        for owner_views, name, _ in self._view_targets[index]:
            owner_views.pop(name, None)
        state.status = BucketStatus.SHARDED
        state.awaiting_use = False
        self._record("reshard", index)

    # ---------------------------------------------------------- forward hooks

    def root_pre_forward(self, _module: nn.Module, _args: object) -> None:
        if self._in_backward:  # recomputation (activation checkpointing)
            return
        self.trace.clear()
        for state in self._states:
            state.owners_pending.clear()
        if self.options.forward_prefetch and self.forward_order:
            self._prefetch(self.forward_order, None)

    def pre_forward(self, index: int, _module: nn.Module, _args: object) -> None:
        state = self._states[index]
        if state.owners_pending:  # another owner already began this bucket
            return
        state.owners_pending = set(self._owner_ids[index])
        if self._begun is not None and index not in self._begun:
            self._begun.append(index)
        self._begin_use(index, forward=True)

    def post_forward(self, index: int, module: nn.Module, _args: object, output: object) -> None:
        if torch.is_grad_enabled():
            tensors = [t for t in output_tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grad: self._pre_backward(index), mode="any"
                )
        state = self._states[index]
        state.owners_pending.discard(id(module))
        if not state.owners_pending:
            self._end_forward(index)

    def _end_forward(self, index: int) -> None:
        if self._begun is not None:
            self._ended.append(index)
        if self._in_backward:
            return
        if self.options.reshard_after_forward and index != self.root_bucket:
            self._reshard(index)

    def root_post_forward(self, _module: nn.Module, _args: object, _output: object) -> None:
        if self._in_backward:
            return
        for index, state in enumerate(self._states):
            if state.owners_pending:  # an owner module did not run this time
                state.owners_pending.clear()
                self._end_forward(index)
        no_backward_follows = not torch.is_grad_enabled()
        for index, state in enumerate(self._states):
            if state.awaiting_use or no_backward_follows:
                self._reshard(index)  # prefetched but unused, or nothing needs it
        if self._begun is not None:
            self._finish_recording()

    def _finish_recording(self) -> None:
        assert self._begun is not None
        last_end = {index: position for position, index in enumerate(self._ended)}
        ended = sorted(last_end, key=last_end.__getitem__)
        self.forward_order = tuple(self._begun)
        self.backward_order = tuple(reversed(ended))
        self.root_bucket = ended[-1] if ended else None
        self._begun, self._ended = None, []
        logger.debug(
            "eager: forward order %s, backward order %s, root bucket %s",
            self.forward_order,
            self.backward_order,
            self.root_bucket,
        )

    # --------------------------------------------------------- backward hooks

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._post_backward_final)

    def _pre_backward(self, index: int) -> None:
        self._enter_backward()
        self._begin_use(index, forward=False)

    def post_accumulate_grad(self, index: int, flat: torch.Tensor) -> None:
        """The bucket's last gradient is in ``flat.grad``: reduce (or keep) it."""
        self._enter_backward()
        grad, flat.grad = flat.grad, None
        state, bucket = self._states[index], self.buckets[index]
        if grad is not None:
            if state.unreduced_grad is not None:
                grad = state.unreduced_grad.add_(grad)
                state.unreduced_grad = None
            if self.requires_gradient_sync:
                self._reduce(index, grad)
            else:
                state.unreduced_grad = grad.to(bucket.reduce_dtype)
                self._record("accumulate", index)
        self._reshard(index)

    def _reduce(self, index: int, flat_grad: torch.Tensor) -> None:
        bucket = self.buckets[index]
        scatter_input, replicated = bucket.reduce_inputs(flat_grad)
        works: list[Work] = []
        sharded = None
        group = bucket.groups.shard_group
        if scatter_input is not None:
            sharded = torch.empty(
                bucket.shard_numel, dtype=bucket.reduce_dtype, device=bucket.device
            )
            works.append(self.comm.reduce_scatter(sharded, scatter_input, group, bucket.name))
        if replicated is not None:
            works.append(self.comm.all_reduce(replicated, group, bucket.name))
        self._pending.append(_PendingReduction(index, works, sharded, replicated, scatter_input))
        self.stats.reductions += 1
        self._record("reduce", index)
        while len(self._pending) > _MAX_REDUCTIONS_IN_FLIGHT:
            self._finish_reduction(self._pending.popleft())

    def _finish_reduction(self, pending: _PendingReduction) -> None:
        for work in pending.works:
            work.wait()
        bucket = self.buckets[pending.bucket]
        replicate_group = bucket.groups.replicate_group
        if replicate_group is not None:  # hybrid: then across the replicas
            works = [
                self.comm.all_reduce(t, replicate_group, bucket.name)
                for t in (pending.sharded, pending.replicated)
                if t is not None
            ]
            for work in works:
                work.wait()
        divide_by = bucket.groups.dp_size if self.options.reduce_op == "avg" else 1
        bucket.write_grads(pending.sharded, pending.replicated, divide_by)

    def _post_backward_final(self) -> None:
        """End of backward (autograd engine callback): finish everything, free."""
        try:
            while self._pending:
                self._finish_reduction(self._pending.popleft())
            for index in range(len(self.buckets)):
                self._reshard(index)
            if self.options.cpu_offload:
                # Offloaded gradients were copied to the host asynchronously.
                torch.cuda.current_stream().synchronize()
        finally:
            self._in_backward = False
