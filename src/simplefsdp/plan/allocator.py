"""Reserved memory: a simulation of PyTorch's CUDA caching allocator.

The planner predicts the bytes tensors hold (allocated memory); what a job
measures and runs out of is what the caching allocator reserves from the
device (``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``,
torchtitan's ``max_reserved_gib``). The difference is the free memory the
allocator keeps cached at the reserved peak: freed blocks too small, or on
the wrong stream, for the requests that came after them.

Note: [Caching allocator simulation]
    :class:`CachingAllocator` replays allocation and free events with the
    rules of ``c10/cuda/CUDACachingAllocator.cpp`` (its defaults):

      rounding     every request rounds up to a multiple of 512 bytes;
      pools        requests of at most 1 MiB come from the small pool,
                   larger ones from the large pool; a cached block serves
                   only its own pool and stream;
      best fit     a request takes the smallest cached free block of its
                   pool and stream that holds it (lowest address on ties);
      split        a larger block is split and the rest cached where the
                   rest is at least 512 bytes (small pool) or above 1 MiB
                   (large pool);
      merge        a freed block merges with free neighbours of its segment;
      segments     where no cached block fits, a new segment is reserved:
                   2 MiB for the small pool, 20 MiB for large requests under
                   10 MiB, else the request rounded up to 2 MiB;
      capacity     memory goes back to the device only when a segment would
                   pass ``capacity_bytes``: every cached segment not split is
                   released and the request retried (``retries``, what
                   torchtitan logs as ``num_alloc_retries``); one that still
                   does not fit is counted in ``ooms`` and reserved anyway.

    With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``, which torchtitan's ``run_train.sh`` sets)
    each pool and stream has one segment of virtual addresses that grows by
    mapping pages (2 MiB small pool, 20 MiB large pool) at its end: a
    request no cached block holds extends the segment, starting at the free
    block that ends it, if any; blocks of both pools split wherever the rest
    is at least 512 bytes; a release on capacity unmaps the whole pages
    inside free blocks.

    Not modelled: ``max_split_size_mb``, ``roundup_power2_divisions``,
    ``garbage_collection_threshold`` (all off by default), CUDA graphs'
    private pools, and the deferred free of a block another stream still
    uses (``record_stream``: the simulation frees at the event).

Note: [Events of a training step]
    :func:`step_events` turns traced graphs into the allocation and free
    events of training steps, in execution order: the parameter shards
    first (fp32, one tensor each); per step the gradients of the previous
    step freed (``zero_grad``, set to None), the forward graph, the
    backward graph, then AdamW: on the first step its two moments per
    parameter (allocated lazily, ``zeros_like``, interleaved per
    parameter), and on every step the foreach implementation's one
    temporary per parameter (``_foreach_sqrt`` of the second moment),
    freed when the step ends. Within a graph what allocates and when it is
    freed is :func:`~simplefsdp.compiler.planning.estimate_memory`'s rule
    (a node's output when it runs, aliases nothing, freed after the last
    use of every alias, a collective's inputs alive until its wait), so the
    simulation's requested peak of one graph is its ``peak_bytes``; an
    output no node uses and the graph does not return is freed when the
    graph ends. The forward's outputs are the loss (freed after the
    optimizer) and the tensors saved for backward, each freed after its
    last use in the backward graph (matched by name: AOTAutograd names a
    backward input after the forward node it saves). The backward's
    outputs are the gradients. Every tensor is allocated on the compute
    stream unless ``stream_of`` says otherwise (eager FSDP2's collective
    streams: :func:`fsdp2_stream`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request rounds up to it
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the small pool's largest request
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small-pool segment (and page)
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: a segment for requests < 10 MiB (and page)
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger segments round up to it


def round_size(size: int) -> int:
    """``size`` rounded up to the allocator's 512-byte blocks (at least one)."""
    return max(MIN_BLOCK_BYTES, -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(size: int) -> int:
    """Bytes of the segment reserved for a (rounded) request no cached block
    holds, without expandable segments."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class Alloc(NamedTuple):
    """Allocate ``size`` bytes for tensor ``key`` on ``stream``."""

    key: object
    size: int
    stream: int = 0


class Free(NamedTuple):
    """Free tensor ``key``."""

    key: object


class Previous(NamedTuple):
    """The key of a tensor the previous step allocated: ``Free(Previous(k))``
    in one step's events frees the step before's ``k`` (the gradients
    ``zero_grad`` frees as a step starts); nothing on the first step."""

    key: object


Event = Alloc | Free


@dataclass(frozen=True)
class AllocatorStats:
    """Peaks of a simulation (bytes).

    Attributes:
        requested_peak_bytes: most bytes the tensors asked for at once.
        allocated_peak_bytes: most bytes in allocated blocks at once (the
            requests rounded, and blocks not split; ``allocated_bytes``).
        reserved_peak_bytes: most bytes reserved from the device at once
            (``reserved_bytes``).
        retries: allocations that released the cache and retried
            (``num_alloc_retries``).
        ooms: allocations that did not fit ``capacity_bytes`` even then.
    """

    requested_peak_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    retries: int = 0
    ooms: int = 0

    @property
    def cached_bytes(self) -> int:
        """Reserved beyond allocated at the peaks: the memory the allocator
        holds free."""
        return self.reserved_peak_bytes - self.allocated_peak_bytes


class _Block:
    """A block of a segment: ``pool`` is True for the small pool; ``prev``
    and ``next`` its neighbours in the segment."""

    __slots__ = ("addr", "size", "pool", "stream", "prev", "next", "allocated", "mapped")

    def __init__(self, addr, size, pool, stream, mapped=True):
        self.addr, self.size, self.pool, self.stream = addr, size, pool, stream
        self.prev = self.next = None
        self.allocated = False
        self.mapped = mapped

    def order(self) -> tuple[int, int]:
        return (self.size, self.addr)


class CachingAllocator:
    """PyTorch's CUDA caching allocator, replayed on sizes only (Note:
    [Caching allocator simulation]).

    Args:
        capacity_bytes: the device memory the allocator may reserve (``None``:
            unbounded, nothing is ever released).
        expandable_segments: simulate ``expandable_segments:True``.

    Raises:
        ValueError: ``capacity_bytes`` is not positive.
    """

    def __init__(self, capacity_bytes: int | None = None, *, expandable_segments: bool = False):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(
                f"capacity_bytes must be positive or None (unbounded), got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.expandable = expandable_segments
        # (small pool?, stream) -> cached free mapped blocks sorted by (size, addr)
        self._free: dict[tuple[bool, int], list[tuple[int, int, _Block]]] = {}
        # expandable: (small pool?, stream) -> the unmapped block at the segment's end
        self._tails: dict[tuple[bool, int], _Block] = {}
        self._blocks: dict[object, tuple[_Block, int]] = {}
        self._next_addr = 0
        self.requested = self.allocated = self.reserved = 0
        self.requested_peak = self.allocated_peak = self.reserved_peak = 0
        self.retries = self.ooms = 0

    # ---------------------------------------------------------------- events

    def run(self, events: Iterable[Event]) -> AllocatorStats:
        """Replay ``events`` in order and return the peaks so far."""
        for event in events:
            if isinstance(event, Alloc):
                self.malloc(event.key, event.size, event.stream)
            else:
                self.free(event.key)
        return self.stats()

    def stats(self) -> AllocatorStats:
        """The peaks so far."""
        return AllocatorStats(
            self.requested_peak, self.allocated_peak, self.reserved_peak, self.retries, self.ooms
        )

    def malloc(self, key: object, size: int, stream: int = 0) -> None:
        """Allocate ``size`` bytes for ``key`` (a key not allocated now)."""
        assert key not in self._blocks, key
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE_BYTES
        block = self._best_fit(small, stream, rounded)
        if block is None:
            block = self._new_block(small, stream, rounded)
        if block.size - rounded >= (
            MIN_BLOCK_BYTES if small or self.expandable else SMALL_SIZE_BYTES + 1
        ):
            rest = _Block(block.addr + rounded, block.size - rounded, small, stream)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            self._cache(rest)
        block.allocated = True
        self._blocks[key] = (block, size)
        self.requested += size
        self.allocated += block.size
        self.requested_peak = max(self.requested_peak, self.requested)
        self.allocated_peak = max(self.allocated_peak, self.allocated)

    def free(self, key: object) -> None:
        """Free ``key``'s block: it merges with its free neighbours and is
        cached."""
        block, size = self._blocks.pop(key)
        self.requested -= size
        self.allocated -= block.size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                self._uncache(neighbour)
                self._merge(block, neighbour)
        self._cache(block)

    # ---------------------------------------------------------------- blocks

    def _cache(self, block: _Block) -> None:
        bisect.insort(
            self._free.setdefault((block.pool, block.stream), []), (*block.order(), block)
        )

    def _uncache(self, block: _Block) -> None:
        free = self._free[(block.pool, block.stream)]
        i = bisect.bisect_left(free, block.order(), key=lambda t: t[:2])
        assert free[i][2] is block
        del free[i]

    @staticmethod
    def _merge(block: _Block, other: _Block) -> None:
        """Absorb ``other``, ``block``'s neighbour, into ``block``."""
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def _best_fit(self, small: bool, stream: int, size: int) -> _Block | None:
        free = self._free.get((small, stream))
        if not free:
            return None
        i = bisect.bisect_left(free, (size, -1), key=lambda t: t[:2])
        if i == len(free):
            return None
        block = free.pop(i)[2]
        return block

    def _new_block(self, small: bool, stream: int, size: int) -> _Block:
        """A free block of at least ``size`` from new device memory, after
        releasing the cache and retrying where the device is full."""
        need = self._reserve_bytes(small, stream, size)
        if self.capacity_bytes is not None and self.reserved + need > self.capacity_bytes:
            self._release_cache()
            self.retries += 1
            need = self._reserve_bytes(small, stream, size)
            if self.reserved + need > self.capacity_bytes:
                self.ooms += 1
        self.reserved += need
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        if not self.expandable:
            addr = self._next_addr
            self._next_addr += need
            return _Block(addr, need, small, stream)
        return self._extend(small, stream, size, need)

    def _page(self, small: bool) -> int:
        return SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES

    def _tail(self, small: bool, stream: int) -> _Block:
        tail = self._tails.get((small, stream))
        if tail is None:
            tail = _Block(0, 1 << 62, small, stream, mapped=False)
            self._tails[(small, stream)] = tail
        return tail

    def _reserve_bytes(self, small: bool, stream: int, size: int) -> int:
        """New device memory a request of ``size`` no cached block holds takes."""
        if not self.expandable:
            return segment_size(size)
        tail = self._tail(small, stream)
        before = tail.prev
        have = before.size if before is not None and not before.allocated else 0
        page = self._page(small)
        return -(-(size - have) // page) * page

    def _extend(self, small: bool, stream: int, size: int, need: int) -> _Block:
        """Map ``need`` bytes at the end of the pool's expandable segment and
        return the free block ending there (holding ``size``)."""
        tail = self._tail(small, stream)
        mapped = _Block(tail.addr, need, small, stream)
        mapped.prev, mapped.next = tail.prev, tail
        if tail.prev is not None:
            tail.prev.next = mapped
        tail.prev = mapped
        tail.addr += need
        before = mapped.prev
        if before is not None and not before.allocated and before.mapped:
            self._uncache(before)
            self._merge(mapped, before)
        assert mapped.size >= size
        return mapped

    def _release_cache(self) -> None:
        """Give the device back what the cache holds: every free segment not
        split (expandable: every whole page inside a free block)."""
        for key, free in list(self._free.items()):
            keep = []
            for entry in free:
                block = entry[2]
                if not self.expandable:
                    if block.prev is None and block.next is None:
                        self.reserved -= block.size
                    else:
                        keep.append(entry)
                    continue
                page = self._page(block.pool)
                start = -(-block.addr // page) * page
                end = (block.addr + block.size) // page * page
                if end <= start:
                    keep.append(entry)
                    continue
                # The pages in [start, end) are unmapped: the address space
                # stays, as an unmapped block no request uses again here
                # (the segment grows at its end), a conservative simplification.
                self.reserved -= end - start
                hole = _Block(start, end - start, block.pool, block.stream, False)
                hole.allocated = True  # never merged with, never cached
                pieces = []
                if start > block.addr:
                    pieces.append(_Block(block.addr, start - block.addr, block.pool, block.stream))
                pieces.append(hole)
                if block.addr + block.size > end:
                    pieces.append(
                        _Block(end, block.addr + block.size - end, block.pool, block.stream)
                    )
                prev = block.prev
                for piece in pieces:
                    piece.prev = prev
                    if prev is not None:
                        prev.next = piece
                    prev = piece
                prev.next = block.next
                if block.next is not None:
                    block.next.prev = prev
                keep += [(*p.order(), p) for p in pieces if p.mapped]
            self._free[key] = sorted(keep, key=lambda t: t[:2])


# ------------------------------------------------------------ training-step events


def graph_events(
    gm: fx.GraphModule,
    tag: str,
    inputs: dict[str, object],
    stream_of: Callable[[fx.Node], int] | None = None,
    skip: Callable[[fx.Node], bool] | None = None,
) -> tuple[list[Event], dict[str, object]]:
    """Events of one run of ``gm`` (Note: [Events of a training step]).

    ``inputs``: placeholder name -> key of a tensor allocated before the
    graph that this graph frees after its last use (saved activations;
    several placeholders may share a key); the keys of those the graph
    never uses are left in ``inputs``. ``stream_of``: the stream a node's
    output is allocated on (default: all on stream 0). Returns the events
    and, per output name, the key of the tensor it leaves allocated.
    """
    from simplefsdp.compiler.planning import collective_waits, node_bytes, storage_root

    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        source = storage_root(node)
        root[node] = node if source is node else root[source]
    leaves = nodes[-1].all_input_nodes
    outputs = {root[n] for n in leaves}
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for user in node.users:
            r = root[node]
            last_use[r] = max(last_use.get(r, -1), index[user])
    for node, wait in collective_waits(nodes, index).items():
        for arg in node.all_input_nodes:
            last_use[root[arg]] = max(last_use[root[arg]], wait)
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last_use.items():
        if r not in outputs:
            frees.setdefault(i, []).append(r)
    pending: dict[object, int] = {}
    for key in inputs.values():
        pending[key] = pending.get(key, 0) + 1
    events: list[Event] = []
    allocated: set[fx.Node] = set()
    for i, node in enumerate(nodes):
        if root[node] is node and node.op == "call_function":
            size = node_bytes(node) if skip is None or not skip(node) else 0
            if size:
                stream = stream_of(node) if stream_of is not None else 0
                events.append(Alloc((tag, node.name), size, stream))
                allocated.add(node)
        for r in frees.get(i, ()):
            if r in allocated:
                events.append(Free((tag, r.name)))
            elif r.op == "placeholder" and r.name in inputs:
                key = inputs.pop(r.name)
                pending[key] -= 1
                if not pending[key]:
                    events.append(Free(key))
    # Allocated, never used and not returned: freed when the graph ends.
    events += [Free((tag, n.name)) for n in allocated if n not in outputs and n not in last_use]
    left = {n.name: (tag, root[n].name) for n in leaves if root[n] in allocated}
    return events, left


def step_events(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    param_bytes: Sequence[int],
    *,
    steps: int = 2,
    stream_of: Callable[[fx.Node], int] | None = None,
    skip: Callable[[fx.Node], bool] | None = None,
) -> list[Event]:
    """Allocation and free events of ``steps`` training steps of the traced
    ``forward`` and ``backward`` graphs with AdamW over parameter shards of
    ``param_bytes`` (Note: [Events of a training step]); ``stream_of`` and
    ``skip`` as for :func:`graph_events`.

    Raises:
        ValueError: ``steps`` is below 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    events: list[Event] = [Alloc(("param", i), b) for i, b in enumerate(param_bytes)]
    grads: list[object] = []
    for step in range(steps):
        events += [Free(g) for g in grads]
        fw, saved = graph_events(forward, f"fw{step}", {}, stream_of, skip)
        bw_inputs = {
            n.name: saved[n.name]
            for n in backward.graph.find_nodes(op="placeholder")
            if n.name in saved
        }
        passed = set(bw_inputs.values())
        bw, left = graph_events(backward, f"bw{step}", bw_inputs, stream_of, skip)
        events += fw + bw
        # Saved tensors backward never reads: released with autograd's graph.
        events += [Free(k) for k in dict.fromkeys(bw_inputs.values())]
        grads = list(dict.fromkeys(left.values()))
        if step == 0:
            for i, b in enumerate(param_bytes):
                events += [Alloc(("exp_avg", i), b), Alloc(("exp_avg_sq", i), b)]
        events += [Alloc(("sqrt", step, i), b) for i, b in enumerate(param_bytes)]
        events += [Free(("sqrt", step, i)) for i in range(len(param_bytes))]
        events += [Free(k) for k in dict.fromkeys(saved.values()) if k not in passed]  # the loss
    return events


def fsdp2_stream(node: fx.Node) -> int:
    """The stream eager FSDP2 allocates ``node``'s output on: 1 for an
    all-gather's output and its copy-in (the parameter shards cast to the
    compute dtype), 2 for a reduce-scatter's output (the gradient shards)
    and its copy-in (the gradients cast to the reduce dtype), 0 (compute)
    for the rest."""
    from simplefsdp.compiler.planning import collective_kind

    def stream(n: fx.Node) -> int:
        kind = collective_kind(n)
        return {"all_gather": 1, "reduce_scatter": 2}.get(kind or "", 0)

    own = stream(node)
    if own or len(node.users) != 1:
        return own
    return stream(next(iter(node.users)))


def fused_loss_skips(vocab: int) -> Callable[[fx.Node], bool]:
    """Whether a node is one a fused (compiled) cross-entropy never
    materialises: an fp32 tensor whose last dimension is ``vocab`` (the
    upcast logits, their log-probabilities and the gradients of both; the
    fused kernels read the bf16 logits and write their bf16 gradient)."""
    import torch

    def skip(node: fx.Node) -> bool:
        val = node.meta.get("val")
        return (
            isinstance(val, torch.Tensor)
            and val.dtype == torch.float32
            and val.dim() > 0
            and val.shape[-1] == vocab
        )

    return skip


def parameter_shard_bytes(forward: fx.GraphModule, primal_names: dict[str, str]) -> list[int]:
    """Bytes of each parameter shard the traced ``forward`` graph takes as an
    input (``primal_names``: placeholder name -> parameter FQN), in order."""
    from simplefsdp.compiler.planning import node_bytes

    return [
        node_bytes(n) for n in forward.graph.find_nodes(op="placeholder") if n.name in primal_names
    ]


def simulate_traced(
    traced,
    *,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
    steps: int = 2,
    collective_streams: bool = False,
    fused_loss_vocab: int = 0,
) -> AllocatorStats:
    """The caching allocator over ``steps`` training steps of a trace
    (``simplefsdp.plan.trace.Traced``; Notes: [Caching allocator
    simulation], [Events of a training step]); with
    ``collective_streams`` the collectives' buffers on streams of their
    own, as eager FSDP2 allocates them (:func:`fsdp2_stream`); with
    ``fused_loss_vocab`` (the logits' local vocabulary) the loss compiled
    into one kernel, which materialises none of the traced eager loss's
    fp32 tensors of the vocabulary's width (:func:`fused_loss_skips`).

    Raises:
        ValueError: ``steps`` below 1 or ``capacity_bytes`` not positive.
    """
    params = parameter_shard_bytes(traced.forward, traced.primal_names)
    stream_of = fsdp2_stream if collective_streams else None
    skip = fused_loss_skips(fused_loss_vocab) if fused_loss_vocab else None
    events = step_events(
        traced.forward, traced.backward, params, steps=steps, stream_of=stream_of, skip=skip
    )
    allocator = CachingAllocator(capacity_bytes, expandable_segments=expandable_segments)
    return allocator.run(events)


def cached_bytes(
    step: Sequence[Event],
    allocated: float,
    usable: float,
    steps: int = 2,
    expandable: bool = False,
) -> tuple[float, int]:
    """Reserved minus allocated bytes at the caching allocator's peaks over
    ``steps`` repetitions of one step's events, and its allocation retries,
    on a device of ``usable`` bytes of which ``allocated`` (the plan's
    tensors) less the simulated ones are taken: past that capacity the
    cache is released and the allocation retried, and the reserved peak is
    the usable memory at most. A ``Free`` of a :class:`Previous` key frees
    the step before's tensor. ``expandable``: the allocator's expandable
    segments."""
    events: list[Event] = []
    for n in range(steps):
        for e in step:
            if isinstance(e, Alloc):
                events.append(Alloc((n, e.key), e.size, e.stream))
            elif isinstance(e.key, Previous):
                if n:
                    events.append(Free((n - 1, e.key.key)))
            else:
                events.append(Free((n, e.key)))
    free = CachingAllocator(expandable_segments=expandable).run(events)
    capacity = usable - max(allocated - free.allocated_peak_bytes, 0.0)
    if capacity <= 0 or free.reserved_peak_bytes <= capacity:
        return float(free.cached_bytes), 0
    capped = CachingAllocator(int(capacity), expandable_segments=expandable).run(events)
    cached = min(max(capped.cached_bytes, 0), max(usable - allocated, 0.0))
    return float(cached), capped.retries
