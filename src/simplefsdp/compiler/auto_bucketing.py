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
    communication run beside compute), and if the predicted peak memory with
    the grown bucket prefetched stays within the budget: the unbucketed
    graph's peak plus, for
    the worst adjacent pair, the gathered bucket, its copy-out buffer and the
    prefetched next bucket (2 * B_i + B_{i+1}) in forward, and in backward
    the regathered bucket, its full gradients, the reduce-scatter's input and
    the prefetched bucket before it (3 * B_i + B_{i-1}: backward holds more
    per bucket than forward, when almost every saved activation is still
    alive; a bucket kept gathered from forward to backward is charged
    2 * B_i there and no B_{i-1} when that one is kept: nothing is
    regathered); a bucket stops growing while the largest single parameter
    could still follow it. The plan is plain data
    (parameter FQNs per bucket), computed alike on every rank (Note:
    [Identical plans without compile-time collectives]).

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

Note: [Identical plans without compile-time collectives]
    Ranks must bucket identically or their collectives mismatch and hang. The
    plan is a deterministic function of the forward graph and the cost model;
    the cost model is calibrated when ``simplefsdp.compile`` is called (all
    ranks call it together) and rank 0's numbers are broadcast then. Nothing
    communicates during compilation itself, where one rank may compile a graph
    another rank does not (e.g. a recompile on one rank only), and the inputs
    that legitimately differ between ranks (the padding of uneven shards) are
    left out of the estimates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch.fx as fx

from simplefsdp.bucket_plan import Bucket, BucketPlan
from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.compiler.memory_estimate import estimate_memory
from simplefsdp.compiler.passes.bucketing import CollectiveSite, find_sites
from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    CollectiveGroups,
    collective_kind,
    is_compute,
    path_from_placeholder,
    wait_of,
)

logger = logging.getLogger(__name__)


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


def gather_units(
    gm: fx.GraphModule,
    sites: Sequence[CollectiveSite],
    cost_model: CostModel,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
) -> list[GatherUnit]:
    """All-gather sites in order of first use, with the compute each precedes
    and the fixed (non data-parallel) communication among it."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}

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
        compute = sum(cost_model.node_time(n) for n in window)
        fixed = sum(
            cost_model.collective_time(n, groups.role(n))
            for n in window
            if collective_kind(n) is not None and not groups.is_data_parallel(n)
        )
        units.append(GatherUnit(site.fqn, site.bytes, int(site.node.args[1]), compute, fixed))
    return units


def _comm_s(units: Sequence[GatherUnit], cost_model: CostModel, reshard: bool) -> float:
    if not units:
        return 0.0
    size, group = sum(u.gathered_bytes for u in units), units[0].group_size
    gathers = 2 if reshard else 1
    return gathers * cost_model.comm_time("all_gather", group, size) + cost_model.comm_time(
        "reduce_scatter", group, size
    )


def _window_s(units: Sequence[GatherUnit]) -> float:
    return 3.0 * sum(u.compute_s for u in units)


def _fixed_s(units: Sequence[GatherUnit]) -> float:
    """Per-step TP communication of a bucket: forward plus its mirror in backward."""
    return 2.0 * sum(u.fixed_comm_s for u in units)


def prefetch_extra_bytes(buckets: Sequence[Sequence[GatherUnit]]) -> int:
    """Memory beyond the unbucketed graph: worst 2 * B_i + B_{i+1}."""
    return _prefetch_extra([sum(u.gathered_bytes for u in b) for b in buckets])


def step_extra_bytes(buckets: Sequence[Sequence[GatherUnit]]) -> int:
    """Memory beyond the unbucketed graph over forward and backward (Note:
    [Greedy auto-wrapping]): worst of 2 * B_i + B_{i+1} and 3 * B_i + B_{i-1}."""
    return _step_extra([sum(u.gathered_bytes for u in b) for b in buckets])


def _step_extra(sizes: Sequence[int]) -> int:
    if not sizes:
        return 0
    forward = _prefetch_extra(sizes)
    backward = max(3 * s + (sizes[i - 1] if i > 0 else 0) for i, s in enumerate(sizes))
    return max(forward, backward)


def _prefetch_extra(sizes: Sequence[int]) -> int:
    if not sizes:
        return 0
    return max(2 * s + (sizes[i + 1] if i + 1 < len(sizes) else 0) for i, s in enumerate(sizes))


def greedy_buckets(
    units: Sequence[GatherUnit],
    cost_model: CostModel,
    *,
    reshard_after_forward: bool,
    base_peak_bytes: int,
    memory_budget_bytes: int | None,
    kept: Collection[str] = (),
) -> list[list[GatherUnit]]:
    """Group ``units`` per Note: [Greedy auto-wrapping]. ``kept``: FQNs kept
    gathered from forward to backward (in the base peak already; a bucket of
    only those is not regathered in backward).

    Raises:
        ValueError: the budget is below the unavoidable minimum (one parameter
            per bucket); the message names that minimum.
    """
    singles = [[u] for u in units]
    minimum = base_peak_bytes + step_extra_bytes(singles)
    if memory_budget_bytes is not None and memory_budget_bytes < minimum:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes} is below the unavoidable minimum of "
            f"{minimum} bytes (the graph's own peak plus prefetching one parameter at a time)"
        )
    # Memory: the plan so far must satisfy 2 * B_i + B_{i+1} <= headroom in
    # forward and 3 * B_i + B_{i-1} in backward (2 * B_i for a kept bucket,
    # and no B_{i-1} when that one is kept: nothing is regathered), and a
    # bucket may grow only while any single next parameter still fits after it.
    headroom = (
        float("inf") if memory_budget_bytes is None else memory_budget_bytes - base_peak_bytes
    )
    largest_unit = max((u.gathered_bytes for u in units), default=0)
    buckets: list[list[GatherUnit]] = []
    current: list[GatherUnit] = []
    # Carried across units rather than recomputed from every closed bucket:
    # the replay after the closed buckets, the worst memory term among them,
    # and the last one's size and whether it is kept.
    closed, closed_worst, last_bytes, current_bytes = _Pipeline(), 0, None, 0
    last_kept, current_kept = False, False
    for unit in units:
        unit_kept = unit.fqn in kept
        if not current:
            current, current_bytes, current_kept = [unit], unit.gathered_bytes, unit_kept
            continue
        grown_bytes = current_bytes + unit.gathered_bytes
        grown_kept = current_kept and unit_kept
        merged = closed.then([*current, unit], cost_model, reshard_after_forward)
        split = closed.then(current, cost_model, reshard_after_forward).then(
            [unit], cost_model, reshard_after_forward
        )
        term = _bucket_term(grown_bytes, grown_kept, last_bytes, last_kept)
        worst = max(closed_worst, term)
        share = 2 if grown_kept else 3
        fits = grown_bytes <= (headroom - largest_unit) / share and worst <= headroom
        if merged.compute_end <= split.compute_end and fits:
            current.append(unit)
            current_bytes, current_kept = grown_bytes, grown_kept
        else:
            buckets.append(current)
            closed = closed.then(current, cost_model, reshard_after_forward)
            closed_worst = max(
                closed_worst, _bucket_term(current_bytes, current_kept, last_bytes, last_kept)
            )
            last_bytes, last_kept = current_bytes, current_kept
            current, current_bytes, current_kept = [unit], unit.gathered_bytes, unit_kept
    if current:
        buckets.append(current)
    return buckets


def _bucket_term(size: int, kept: bool, previous: int | None, previous_kept: bool) -> int:
    """Memory of a bucket of ``size`` beyond the base peak: forward
    ``2 * B_{i-1} + B_i`` (with the bucket before it), backward ``3 * B_i +
    B_{i-1}`` (``2 * B_i`` when kept; no ``B_{i-1}`` when that one is kept)."""
    backward = (2 if kept else 3) * size
    if previous is None:
        return max(2 * size, backward)
    forward = 2 * previous + size
    return max(forward, backward + (0 if previous_kept else previous))


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

    def then(self, bucket: Sequence[GatherUnit], cost_model: CostModel, reshard: bool):
        comm = _comm_s(bucket, cost_model, reshard)
        comm_start = max(self.comm_end, self.previous_compute_end)
        # While the transfer runs beside the previous bucket's compute, the
        # part of it that cannot overlap delays both (they take turns on a
        # CPU; Note: [Communication competing with compute]).
        concurrent = min(max(self.compute_end - comm_start, 0.0), comm)
        delay = (1.0 - cost_model.comm_overlap) * concurrent
        previous_end = self.compute_end + delay
        comm_end = comm_start + comm + delay + self.fixed_s
        start = max(previous_end, comm_end)
        fixed = _fixed_s(bucket)
        return _Pipeline(comm_end, start + _window_s(bucket) + fixed, previous_end, fixed)


def pipeline_time_s(
    buckets: Sequence[Sequence[GatherUnit]], cost_model: CostModel, reshard: bool
) -> float:
    """Step time of ``buckets`` on one link and one compute stream, with
    prefetch distance 1: bucket i's communication is issued when the compute
    of bucket i-2 ends (before the wait of bucket i-1), runs after the previous
    communication (and after bucket i-1's fixed TP communication), and bucket
    i's compute (with its own fixed communication) starts when both its
    communication and the previous compute are done."""
    state = _Pipeline()
    for bucket in buckets:
        state = state.then(bucket, cost_model, reshard)
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


def reference_extra_bytes(reference_plan: BucketPlan, gathered: dict[str, int]) -> int:
    """Bucket memory (``step_extra_bytes``) of ``reference_plan``'s buckets,
    with ``gathered``: parameter FQN -> gathered bytes in the graph."""
    sizes = [sum(gathered.get(f, 0) for f in b.param_fqns) for b in reference_plan.buckets]
    return _step_extra([s for s in sizes if s])


def forward_memory_terms(
    gm: fx.GraphModule,
    primal_names: dict[str, str],
    reference_plan: BucketPlan,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
) -> tuple[int, int]:
    """``(unbucketed peak, reference_plan's prefetch memory)`` of a forward
    graph, in the planner's terms (padding of uneven shards left out)."""
    sites = find_sites(gm.graph, primal_names, {}, groups)
    gathered: dict[str, int] = {}
    for site in sites:
        if site.kind == "all_gather" and site.fqn:
            gathered.setdefault(site.fqn, site.bytes)
    peak = estimate_memory(gm, ignore=_padding(sites)).peak_bytes
    return peak, reference_extra_bytes(reference_plan, gathered)


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
) -> AutoPlan:
    """Plan buckets for one Dynamo graph from its (unbucketed) forward graph.

    Without ``memory_budget_bytes`` the budget is ``default_budget_bytes``
    when given (Note: [Keeping what eager FSDP2 would hold]), else what
    ``reference_plan`` (per block) needs: no more predicted memory than
    per-block wrapping. ``groups``: which collectives are data parallel
    (planned); the others are fixed communication (Note: [Planning around
    tensor-parallel collectives]).
    """
    start = time.perf_counter()
    sites = find_sites(gm.graph, primal_names, {}, groups)
    units = gather_units(gm, sites, cost_model, groups)
    # Ranks with uneven shards pad their all-gather inputs; leave those nodes
    # out so every rank computes the same numbers and so the same plan.
    base_peak = estimate_memory(gm, ignore=_padding(sites)).peak_bytes
    budget = memory_budget_bytes
    default_budget = None
    if budget is None and default_budget_bytes is not None:
        default_budget = budget = default_budget_bytes
    elif budget is None and reference_plan is not None:
        gathered = {u.fqn: u.gathered_bytes for u in units}
        default_budget = budget = base_peak + reference_extra_bytes(reference_plan, gathered)
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
