"""Automatic bucketing (``bucketing="auto"``): greedy, cost-model driven,
memory-budgeted plans from a forward graph.

Note: [Greedy auto-wrapping]
    The forward graph's FSDP all-gathers are walked in order of first use
    (one "unit" per parameter). A bucket hides its communication under the
    compute of the bucket before it (prefetch distance 1). Its communication
    per step is the forward all-gather, the backward all-gather when
    parameters are resharded, and the backward reduce-scatter; its compute
    window is its forward compute times 3 (forward plus a backward of about
    twice the forward). ``pipeline_time_s`` replays the buckets on one link
    (collectives serialise) and one compute stream with prefetch distance 1.
    Unit u joins the current bucket if the replayed time of the plan so far
    with ``cur + u`` is no longer than with ``cur`` and ``u`` apart (merging
    saves a collective's latency; splitting lets u's transfer hide under
    cur's compute, as far as the cost model's ``comm_overlap`` lets
    communication run beside compute), and if the predicted peak memory
    of the plan stays within the budget (Note: [Where in the step a
    bucket's memory is held]); a bucket stops growing when the units after
    it, one per bucket, would no longer fit. The plan is plain data
    (parameter FQNs per bucket), computed alike on every rank (Note:
    [Identical plans without compile-time collectives]).

Note: [Where in the step a bucket's memory is held]
    The unbucketed forward graph's peak ``P`` is reached with almost every
    activation it saves for backward (``A`` in all) alive; the rest,
    ``R = P - A``, is taken as held throughout. Each unit records the saved
    activations produced before its window (``saved_before_bytes``) and in
    it (``saved_bytes``), so a bucket spans ``a_s`` (saved before it) to
    ``a_e`` (saved by its end). Beyond ``R`` a plan needs, per bucket, the
    worst of:

    - forward, with the next bucket prefetched: ``a_e + 2 B_i + B_{i+1}``
      (the gathered bucket and its copy-out buffer; alone ``a_e + 2 B_i``);
    - backward, when it starts (the activations of the buckets after it are
      freed; the bucket before it is prefetched): ``a_e + B_i + B_{i-1} +
      g_a``, with ``g_a`` the sharded gradients of the buckets after it
      (reduce-scattered already, held until the optimizer step);
    - backward, when its gradients are complete (its own activations are
      freed): ``a_s + 3 B_i + B_{i-1} + g_a + B_i / N`` (gathered, gradients,
      the reduce-scatter's input and its sharded output, over ``N`` ranks).

    Activations fall and sharded gradients grow through backward: with
    gradients as large as a model's (parameter-heavy workloads) the last
    buckets of backward, the first of forward, hold the most.

    The parameters of a bucket kept gathered from forward to backward are in
    ``R`` already (they are outputs of the forward graph, but not
    activations), so such a bucket is charged only its all-gather buffer in
    forward (``B_i`` for ``2 B_i``) and no regather in backward (``a_e +
    B_{i-1}`` and ``a_s + 2 B_i + B_{i-1}``), and no ``B_{i-1}`` is charged
    in backward when the bucket before is kept. Within a bucket's backward,
    activations fall as its gradients grow, so the two ends bound it.
    Without positions (``A = 0``: an inference graph, or units built without
    them) this is ``P`` plus the worst of ``2 B_i + B_{i+1}`` and ``3 B_i +
    B_{i-1}`` with the sharded gradients: close to the model before
    positions, which charged a whole-model bucket its gradients on top of
    every activation (and left the sharded gradients out). Gradient bytes
    are taken as gathered bytes (a reduce dtype wider than the gather dtype
    is not modelled). The planner's memory numbers are relative to ``P``
    (``step_extra_bytes``); they are never negative, since the last bucket's
    forward term is at least ``A``.

Note: [Planning around tensor-parallel collectives]
    In a 2-D (data x tensor parallel) graph the TP plan's collectives stay
    where they are (Note: [Data-parallel collectives only]) and are waited on
    right away: they are fixed communication that no bucketing can hide. Each
    unit also carries ``fixed_comm_s``, the cost-model time of the non
    data-parallel collectives in its forward window (from its first use to
    the next unit's); a bucket's per-step fixed time is twice its units' sum
    (the forward ones plus their mirror in backward: an all-gather's backward
    is a reduce-scatter of the same bytes and vice versa; the small
    all-reduces of replicated parameters' gradients are left out). In the
    replay the fixed time of a bucket both lengthens its compute window (the
    compute stream waits on those collectives) and occupies the one link
    while the next bucket's communication hides under that window, so it
    delays that communication by as much: TP time is counted as exposed and
    never as room to hide data-parallel traffic. Collectives before the
    first unit's first use are left out, like the compute there. Without TP
    collectives every ``fixed_comm_s`` is 0 and plans are unchanged.

Note: [Float8 bytes in the planner]
    A float8 weight (Note: [Float8 all-gather]) is gathered at one byte per
    element and its gradient reduce-scattered in high precision. Its unit's
    ``gathered_bytes`` are the float8 bytes (the all-gathers and the
    gathered parameter's memory) and its ``grad_bytes`` the elements at the
    stored shard's element size (the reduce-scatter, the gradients and
    their shards). Other units have ``grad_bytes = gathered_bytes``, as the
    memory model assumes throughout.

Note: [Identical plans without compile-time collectives]
    Ranks must bucket identically or their collectives mismatch and hang. The
    plan is a deterministic function of the forward graph and the cost model;
    the cost model is calibrated when ``simplefsdp.compile`` is called (all
    ranks call it together) and rank 0's numbers are broadcast then. Nothing
    communicates during compilation itself, where one rank may compile a graph
    another rank does not (e.g. a recompile on one rank only: it reuses the
    first graph's plan, Note: [Plans from sizes, not guards]), and the inputs
    that legitimately differ between ranks (the padding of uneven shards) are
    left out of the estimates.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import logging
import operator
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch.fx as fx

from simplefsdp.bucket_plan import Bucket, BucketPlan
from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.compiler.memory_estimate import (
    estimate_memory,
    output_leaves,
    storage_root,
)
from simplefsdp.compiler.passes.bucketing import CollectiveSite, find_sites
from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    CollectiveGroups,
    collective_kind,
    is_compute,
    node_bytes,
    path_from_placeholder,
    wait_of,
)

logger = logging.getLogger(__name__)
Fqns = Collection[str]  # parameters kept gathered from forward to backward


@dataclass(frozen=True)
class GatherUnit:
    """One parameter's all-gather in the forward graph."""

    fqn: str
    gathered_bytes: int
    group_size: int
    compute_s: float  # forward compute from its first use to the next unit's
    # Non data-parallel (TP) collectives in that window, seconds (Note:
    # [Planning around tensor-parallel collectives]).
    fixed_comm_s: float = 0.0
    # Activations saved for backward before that window and in it (Note:
    # [Where in the step a bucket's memory is held]).
    saved_before_bytes: int = 0
    saved_bytes: int = 0
    # Gradient bytes (Note: [Float8 bytes in the planner]); None: gathered_bytes.
    grad_bytes: int | None = None

    @property
    def reduced_bytes(self) -> int:
        """The bytes its reduce-scatter takes in (its gradient)."""
        return self.gathered_bytes if self.grad_bytes is None else self.grad_bytes


def saved_activations(gm: fx.GraphModule, num_user_outputs: int | None) -> dict[int, int]:
    """Node index -> bytes of the activations a partitioned forward graph
    saves for backward: its outputs after the first ``num_user_outputs``
    (the user's), by storage, less graph inputs and gathered parameters
    (kept for backward). ``None`` (no backward known): nothing."""
    if num_user_outputs is None:
        return {}
    from simplefsdp.compiler.passes.reshard import find_gather_chains

    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    leaves = output_leaves(gm.graph)
    user = {storage_root(n) for n in leaves[:num_user_outputs] if isinstance(n, fx.Node)}
    gathered = {
        n
        for chain in find_gather_chains(gm.graph)
        for n in (chain.all_gather, chain.wait, *chain.post)
    }
    roots = {storage_root(n) for n in leaves[num_user_outputs:] if isinstance(n, fx.Node)}
    return {
        index[r]: node_bytes(r)
        for r in roots
        if r.op == "call_function" and r not in gathered and r not in user
    }


def gather_units(
    gm: fx.GraphModule,
    sites: Sequence[CollectiveSite],
    cost_model: CostModel | None,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
    saved: dict[int, int] | None = None,
) -> list[GatherUnit]:
    """All-gather sites in order of first use, with the compute each precedes
    and the fixed (non data-parallel) communication among it (none without
    a ``cost_model``), and the ``saved`` activations (``saved_activations``)
    before and in its window."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    positions = sorted((saved or {}).items())
    cumulative = list(itertools.accumulate((b for _, b in positions), initial=0))

    def saved_before(i: int) -> int:
        return cumulative[bisect.bisect_left(positions, (i, -1))]

    def first_use(site: CollectiveSite) -> int:
        frontier, best = [wait_of(site.node) or site.node], len(nodes)
        seen = set(frontier)
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if is_compute(user):
                    best = min(best, index[user])
                elif user not in seen:
                    seen.add(user)
                    frontier.append(user)
        return best

    gathers = sorted(
        ((first_use(s), index[s.node], s) for s in sites if s.kind == "all_gather" and s.fqn),
        key=lambda item: item[:2],
    )
    gathers = [(start, site) for start, _, site in gathers]
    units, seen_fqns = [], set()
    for k, (start, site) in enumerate(gathers):
        if site.fqn in seen_fqns:
            continue
        seen_fqns.add(site.fqn)
        end = gathers[k + 1][0] if k + 1 < len(gathers) else len(nodes)
        window = nodes[start:end]
        compute = fixed = 0.0
        if cost_model is not None:
            compute = sum(cost_model.node_time(n) for n in window)
            fixed = sum(
                cost_model.collective_time(n, groups.role(n))
                for n in window
                if collective_kind(n) is not None and not groups.is_data_parallel(n)
            )
        before = saved_before(start)
        within = saved_before(end) - before
        units.append(
            GatherUnit(
                site.fqn,
                site.bytes,
                int(site.node.args[1]),
                compute,
                fixed,
                before,
                within,
                site.grad_bytes,
            )
        )
    if units:  # the last window reaches the graph's end: every activation is in one
        last = units[-1]
        units[-1] = dataclasses.replace(last, saved_bytes=cumulative[-1] - last.saved_before_bytes)
    return units


def gathers_per_step(bucket: Sequence[GatherUnit], reshard: bool, kept: Fqns = ()) -> int:
    """2 when resharded after forward and not every parameter is ``kept``, else 1."""
    return 2 if reshard and not all(u.fqn in kept for u in bucket) else 1


def bucket_comm_s(
    units: Sequence[GatherUnit], cm: CostModel, reshard: bool, kept: Fqns = ()
) -> float:
    """A bucket's communication per step: its all-gathers and reduce-scatter."""
    if not units:
        return 0.0
    size, group = sum(u.gathered_bytes for u in units), units[0].group_size
    reduced = sum(u.reduced_bytes for u in units)
    all_gather = gathers_per_step(units, reshard, kept) * cm.comm_time("all_gather", group, size)
    return all_gather + cm.comm_time("reduce_scatter", group, reduced)


def _window_s(units: Sequence[GatherUnit]) -> float:
    return 3.0 * sum(u.compute_s for u in units)


def _fixed_s(units: Sequence[GatherUnit]) -> float:
    """Per-step TP communication of a bucket: forward plus its mirror in backward."""
    return 2.0 * sum(u.fixed_comm_s for u in units)


@dataclass(frozen=True)
class _Span:
    """A bucket as the memory model sees it (Note: [Where in the step a
    bucket's memory is held]): gathered bytes, whether it is kept gathered,
    the activations saved before it and by its end, and the sharded
    gradients alive when its backward starts (of the buckets after it) and
    when it ends (its own too)."""

    nbytes: int
    kept: bool
    saved_start: int
    saved_end: int
    grads_at_start: int
    grads_at_end: int
    grad_nbytes: int  # its gradients (Note: [Float8 bytes in the planner])

    def __add__(self, other: _Span) -> _Span:
        return _Span(
            self.nbytes + other.nbytes,
            self.kept and other.kept,
            min(self.saved_start, other.saved_start),
            max(self.saved_end, other.saved_end),
            min(self.grads_at_start, other.grads_at_start),
            max(self.grads_at_end, other.grads_at_end),
            self.grad_nbytes + other.grad_nbytes,
        )


def _singles(units: Sequence[GatherUnit], kept: Collection[str] = ()) -> list[_Span]:
    """One span per unit, in the order of ``units`` (forward order)."""
    shards = [u.reduced_bytes // max(u.group_size, 1) for u in units]
    after = list(itertools.accumulate(reversed(shards), initial=0))[::-1]  # after[k]: k..
    return [
        _Span(
            u.gathered_bytes,
            u.fqn in kept,
            u.saved_before_bytes,
            u.saved_before_bytes + u.saved_bytes,
            after[k + 1],
            after[k],
            u.reduced_bytes,
        )
        for k, u in enumerate(units)
    ]


def _spans(buckets: Sequence[Sequence[GatherUnit]], kept: Collection[str] = ()) -> list[_Span]:
    singles = iter(_singles([u for b in buckets for u in b], kept))
    return [functools.reduce(operator.add, itertools.islice(singles, len(b))) for b in buckets]


def _forward_bytes(span: _Span) -> int:
    """A bucket's memory in its forward: the all-gather buffer and, unless
    kept (already in ``R``), its copy-out."""
    return span.nbytes if span.kept else 2 * span.nbytes


def _term(previous: _Span | None, span: _Span) -> int:
    """Memory beyond ``R`` while ``span`` runs: alone in forward, in its
    backward (with ``previous``, the bucket before it, prefetched) and in
    ``previous``'s forward with ``span`` prefetched."""
    regather = 0 if span.kept else span.nbytes
    before = 0 if previous is None or previous.kept else previous.nbytes
    backward = before + max(
        span.saved_end + regather + span.grads_at_start,
        span.saved_start + 2 * span.grad_nbytes + regather + span.grads_at_end,
    )
    terms = [span.saved_end + _forward_bytes(span), backward]
    if previous is not None:
        terms.append(previous.saved_end + _forward_bytes(previous) + span.nbytes)
    return max(terms)


def _worst(spans: Sequence[_Span]) -> int:
    return max((_term(spans[i - 1] if i else None, s) for i, s in enumerate(spans)), default=0)


def _saved_total(units: Sequence[GatherUnit]) -> int:
    return max((u.saved_before_bytes + u.saved_bytes for u in units), default=0)


def step_extra_bytes(buckets: Sequence[Sequence[GatherUnit]], kept: Collection[str] = ()) -> int:
    """Memory beyond the unbucketed graph's peak over forward and backward
    (Note: [Where in the step a bucket's memory is held])."""
    buckets = [b for b in buckets if b]
    return _worst(_spans(buckets, kept)) - _saved_total([u for b in buckets for u in b])


def greedy_buckets(
    units: Sequence[GatherUnit],
    cost_model: CostModel,
    *,
    reshard_after_forward: bool,
    base_peak_bytes: int,
    memory_budget_bytes: int | None,
    kept: Collection[str] = (),
) -> list[list[GatherUnit]]:
    """Group ``units`` per Note: [Greedy auto-wrapping]. ``base_peak_bytes``:
    the unbucketed graph's peak; ``kept``: FQNs kept gathered from forward
    to backward (in the base peak already; a bucket of only those is not
    regathered in backward).

    Raises:
        ValueError: the budget is below the unavoidable minimum (one parameter
            per bucket); the message names that minimum.
    """
    singles = _singles(units, kept)
    rest = base_peak_bytes - _saved_total(units)  # R: held throughout
    minimum = rest + _worst(singles)
    if memory_budget_bytes is not None and memory_budget_bytes < minimum:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes} is below the unavoidable minimum of "
            f"{minimum} bytes (the graph's own peak plus prefetching one parameter at a time)"
        )
    headroom = float("inf") if memory_budget_bytes is None else memory_budget_bytes - rest
    # after[k]: the worst term of units k.. as single buckets, but unit k's
    # own with the bucket before it. A bucket grows only while the units
    # after it still fit one per bucket, so the plan always stays feasible.
    after = [0] * (len(units) + 1)
    for k in range(len(units) - 2, -1, -1):
        after[k] = max(_term(singles[k], singles[k + 1]), after[k + 1])
    buckets: list[list[GatherUnit]] = []
    current: list[GatherUnit] = []
    # Carried across units rather than recomputed from every closed bucket:
    # the replay after the closed buckets, the worst memory term among them
    # and the last one's span.
    closed, closed_worst = _Pipeline(), 0
    last: _Span | None = None
    span: _Span | None = None
    for k, unit in enumerate(units):
        if not current:
            current, span = [unit], singles[k]
            continue
        grown = span + singles[k]
        merged = closed.then([*current, unit], cost_model, reshard_after_forward)
        split = closed.then(current, cost_model, reshard_after_forward).then(
            [unit], cost_model, reshard_after_forward
        )
        worst = max(closed_worst, _term(last, grown))
        if k + 1 < len(units):
            worst = max(worst, _term(grown, singles[k + 1]), after[k + 1])
        if merged.compute_end <= split.compute_end and worst <= headroom:
            current.append(unit)
            span = grown
        else:
            buckets.append(current)
            closed = closed.then(current, cost_model, reshard_after_forward)
            closed_worst = max(closed_worst, _term(last, span))
            last = span
            current, span = [unit], singles[k]
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class _Pipeline:
    """Replay state of ``pipeline_time_s`` after some buckets: when the link is
    free, when the last bucket's compute ends, when the one before's did
    (the issue point of the next bucket's communication), and the last
    bucket's fixed (TP) communication, which shares the link with the next
    bucket's (Note: [Planning around tensor-parallel collectives])."""

    comm_end: float = 0.0
    compute_end: float = 0.0
    previous_compute_end: float = 0.0
    fixed_s: float = 0.0

    def then(self, bucket: Sequence[GatherUnit], cm: CostModel, reshard: bool, kept: Fqns = ()):
        comm = bucket_comm_s(bucket, cm, reshard, kept)
        comm_start = max(self.comm_end, self.previous_compute_end)
        # While the transfer runs beside the previous bucket's compute, the
        # part of it that cannot overlap delays both (they take turns on a
        # CPU; Note: [Communication competing with compute]).
        concurrent = min(max(self.compute_end - comm_start, 0.0), comm)
        delay = (1.0 - cm.comm_overlap) * concurrent
        previous_end = self.compute_end + delay
        comm_end = comm_start + comm + delay + self.fixed_s
        start = max(previous_end, comm_end)
        fixed = _fixed_s(bucket)
        return _Pipeline(comm_end, start + _window_s(bucket) + fixed, previous_end, fixed)


def pipeline_time_s(
    buckets: Sequence[Sequence[GatherUnit]], cost_model: CostModel, reshard: bool, kept: Fqns = ()
) -> float:
    """Step time of ``buckets`` on one link and one compute stream, with
    prefetch distance 1: bucket i's communication is issued when the compute
    of bucket i-2 ends (before the wait of bucket i-1), runs after the previous
    communication (and after bucket i-1's fixed TP communication), and bucket
    i's compute (with its own fixed communication) starts when both its
    communication and the previous compute are done; a bucket all ``kept`` is not regathered."""
    state = _Pipeline()
    for bucket in buckets:
        state = state.then(bucket, cost_model, reshard, kept)
    return state.compute_end


def to_plan(buckets: Sequence[Sequence[GatherUnit]], all_fqns: Sequence[str]) -> BucketPlan:
    """A ``BucketPlan``; parameters never gathered in forward get their own buckets."""
    planned = {u.fqn for b in buckets for u in b}
    result = [
        Bucket(name=f"auto:{i}", param_fqns=tuple(u.fqn for u in b), origin="auto")
        for i, b in enumerate(buckets)
    ]
    result += [Bucket(f, (f,), "single") for f in all_fqns if f not in planned]
    return BucketPlan(tuple(result))


@dataclass(frozen=True)
class AutoPlan:
    """What ``plan_forward_graph`` found and decided for one forward graph.

    Attributes:
        plan: the bucket plan (``"auto"`` buckets, then single parameters
            never gathered in forward).
        notes: lines for the communication report.
        data: planning statistics (time, units, budget, unbucketed peak).
        sites: the FSDP collectives of the (unbucketed) forward graph, for the
            bucketing pass to reuse as long as the graph is unchanged.
    """

    plan: BucketPlan
    notes: list[str]
    data: dict
    sites: list[CollectiveSite]


def reference_extra_bytes(reference_plan: BucketPlan, units: Sequence[GatherUnit]) -> int:
    """Bucket memory (``step_extra_bytes``) of ``reference_plan``'s buckets
    of ``units`` (parameters not among them are left out)."""
    by_fqn = {u.fqn: u for u in units}
    buckets = [[by_fqn[f] for f in b.param_fqns if f in by_fqn] for b in reference_plan.buckets]
    return step_extra_bytes([b for b in buckets if b])


def forward_memory_terms(
    gm: fx.GraphModule,
    primal_names: dict[str, str],
    reference_plan: BucketPlan,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
    num_user_outputs: int | None = None,
) -> tuple[int, int]:
    """``(unbucketed peak, reference_plan's bucket memory)`` of a forward
    graph, in the planner's terms (padding of uneven shards left out;
    ``num_user_outputs``: see ``saved_activations``)."""
    sites = find_sites(gm.graph, primal_names, {}, groups)
    units = gather_units(gm, sites, None, groups, saved_activations(gm, num_user_outputs))
    peak = estimate_memory(gm, ignore=_padding(sites)).peak_bytes
    return peak, reference_extra_bytes(reference_plan, units)


def _padding(sites: Sequence[CollectiveSite]) -> set[fx.Node]:
    """The nodes padding uneven shards into all-gather inputs: they differ
    between ranks, so memory estimates leave them out."""
    return {
        n for site in sites if site.kind == "all_gather" for n in path_from_placeholder(site.input)
    }


def plan_forward_graph(
    gm: fx.GraphModule,
    primal_names: dict[str, str],
    all_fqns: list[str],
    cost_model: CostModel,
    *,
    reshard_after_forward: bool,
    memory_budget_bytes: int | None,
    reference_plan: BucketPlan | None,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
    default_budget_bytes: int | None = None,
    kept_fqns: Collection[str] = (),
    num_user_outputs: int | None = None,
) -> AutoPlan:
    """Plan buckets for one Dynamo graph from its (unbucketed) forward graph.

    Without ``memory_budget_bytes`` the budget is ``default_budget_bytes``
    when given (Note: [Keeping what eager FSDP2 would hold]), else what
    ``reference_plan`` (per block) needs: no more predicted memory than
    per-block wrapping. ``groups``: which collectives are data parallel
    (planned); the others are fixed communication (Note: [Planning around
    tensor-parallel collectives]). ``num_user_outputs``: how many of the
    graph's outputs are the user's, the rest saved for backward (``None``:
    no positions, Note: [Where in the step a bucket's memory is held]).
    """
    start = time.perf_counter()
    sites = find_sites(gm.graph, primal_names, {}, groups)
    saved = saved_activations(gm, num_user_outputs)
    units = gather_units(gm, sites, cost_model, groups, saved)
    # Ranks with uneven shards pad their all-gather inputs; leave those nodes
    # out so every rank computes the same numbers and so the same plan.
    base_peak = estimate_memory(gm, ignore=_padding(sites)).peak_bytes
    budget = memory_budget_bytes
    default_budget = None
    if budget is None and default_budget_bytes is not None:
        default_budget = budget = default_budget_bytes
    elif budget is None and reference_plan is not None:
        default_budget = budget = base_peak + reference_extra_bytes(reference_plan, units)
    buckets = greedy_buckets(
        units,
        cost_model,
        reshard_after_forward=reshard_after_forward,
        base_peak_bytes=base_peak,
        memory_budget_bytes=budget,
        kept=kept_fqns,
    )
    plan = to_plan(buckets, all_fqns)
    planning_s = time.perf_counter() - start
    data = {
        "planning_s": planning_s,
        "num_units": len(units),
        "num_buckets": sum(1 for b in plan.buckets if b.origin == "auto"),
        "memory_budget_bytes": budget,
        "budget_is_default": default_budget is not None,
        "unbucketed_peak_bytes": base_peak,
        "saved_activation_bytes": _saved_total(units),
        "fixed_comm_s": sum(_fixed_s([u]) for u in units),
    }
    origin = (
        ""
        if not default_budget
        else " (default: what eager FSDP2 would hold)"
        if default_budget_bytes is not None
        else " (default: per-block plan's peak)"
    )
    notes = [
        f"auto plan: {data['num_units']} all-gathers -> {data['num_buckets']} buckets in "
        f"{1000 * planning_s:.1f} ms; memory budget "
        + ("none" if budget is None else f"{budget} bytes{origin}")
    ]
    if data["fixed_comm_s"]:
        notes.append(
            f"auto plan: {1e3 * data['fixed_comm_s']:.3f} ms per step of tensor-parallel "
            "communication planned around as fixed"
        )
    logger.debug("%s", notes[0])
    return AutoPlan(plan, notes, data, sites)
