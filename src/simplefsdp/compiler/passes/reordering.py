"""Reordering: prefetch all-gathers, issue reductions early, wait late.

Note: [Reordering rules]
    Let AG_1..AG_n be the all-gathers of a graph in the order their results
    are first used. Each wait W_i (with the copy-out slices/views after it) is
    moved right before the first compute node that reads its result. With
    prefetch distance d, AG_i (with its copy-in) is moved right before
    W_{i-d}: it is issued before the compute of bucket i-d begins and runs
    underneath it. At most d+1 all-gathers are in flight, so prefetching
    raises peak memory by at most d buckets.
    Reductions (reduce-scatter, all-reduce) are moved to right after their
    last input is produced (issued as soon as their gradients exist) and
    their waits to right before the next reduction of the same process group
    is issued (one reduction in flight per group), or before the graph's
    output for the last one, unless something reads the result earlier.
    The rules are functions of the graph only, so every rank reorders alike.
    Only data-parallel collectives move (Note: [Data-parallel collectives
    only]); the others (tensor parallelism's, expert parallelism's
    all-to-alls) keep their place, and the prefetch distance counts
    data-parallel all-gathers only. A float8 all-gather (Note: [Float8
    all-gather]) moves with the cast of its shard and the scale computation
    (``gather_prep``), which read the stored shard and the amax all-reduce's
    result; that all-reduce stays at the top of the graph (Note: [One amax
    all-reduce per graph]).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from simplefsdp.compiler.passes.float8 import AMAX_META
from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    CollectiveGroups,
    carries_float8,
    collective_group,
    collective_kind,
    gather_prep,
    is_shaping,
    is_view,
    wait_of,
)

logger = logging.getLogger(__name__)


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _passthrough(node: fx.Node) -> bool:
    return is_shaping(node) or is_view(node)


def _copy_out(wait: fx.Node) -> list[fx.Node]:
    """Shaping/view nodes fed only by ``wait`` (transitively): they move with it."""
    members = {wait}
    result = []
    changed = True
    while changed:
        changed = False
        for node in list(members):
            for user in node.users:
                if (
                    user not in members
                    and _passthrough(user)
                    and all(i in members for i in user.all_input_nodes)
                ):
                    members.add(user)
                    result.append(user)
                    changed = True
    return result


def _first_consumer(wait: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
    """The earliest node that is not part of ``wait``'s copy-out and reads it."""
    copy_out = set(_copy_out(wait)) | {wait}
    consumers = [u for n in copy_out for u in n.users if u not in copy_out]
    return min(consumers, key=order.__getitem__) if consumers else None


def _copy_in(collective: fx.Node) -> list[fx.Node]:
    """Shaping nodes that only feed ``collective`` (cat, reshape, casts, pads)."""
    members = {collective}
    changed = True
    while changed:
        changed = False
        for member in list(members):
            for inp in member.all_input_nodes:
                if inp in members or inp.op != "call_function" or not _passthrough(inp):
                    continue
                if all(user in members for user in inp.users):
                    members.add(inp)
                    changed = True
    members.discard(collective)
    return list(members)


def _carries_float8(collective: fx.Node) -> bool:
    """A float8 all-gather, alone or in a bucket (Note: [Mixed dtypes in one
    all-gather bucket])."""
    carried = collective.meta.get("simplefsdp_dtype_bytes") or {}
    return carries_float8(collective.args[0]) or any(d.startswith("float8") for d in carried)


def _gather_group(ag: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """``ag`` and what must move with it to issue it before ``anchor``: its
    copy-in, and for float8 bytes the cast and scale not yet before ``anchor``."""
    if not _carries_float8(ag):
        return [*_copy_in(ag), ag]
    return [*(n for n in gather_prep(ag) if order[n] > order[anchor]), ag]


def _move_before(anchor: fx.Node, nodes: list[fx.Node], order: dict[fx.Node, int]) -> None:
    for node in sorted(nodes, key=order.__getitem__):
        anchor.prepend(node)


def _inputs_ready_before(nodes: list[fx.Node], anchor: fx.Node, order) -> bool:
    moving = set(nodes)
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in moving and order[inp] >= order[anchor]:
                return False
    return True


def reorder_all_gathers(
    graph: fx.Graph, prefetch_distance: int, groups: CollectiveGroups = ALL_DATA_PARALLEL
) -> int:
    """Late waits and prefetched all-gathers; returns how many were prefetched."""
    order = _order(graph)
    gathers = [
        n
        for n in graph.nodes
        if collective_kind(n) == "all_gather" and wait_of(n) and groups.is_data_parallel(n)
    ]
    # 1. waits right before their first consumer
    for ag in gathers:
        wait = wait_of(ag)
        consumer = _first_consumer(wait, order)
        if consumer is not None:
            _move_before(consumer, [wait, *_copy_out(wait)], order)
            order = _order(graph)
    # 2. prefetch: AG_i before W_{i-d}, in order of first use
    gathers.sort(key=lambda ag: order[wait_of(ag)])
    prefetched = 0
    for i in range(1 if prefetch_distance > 0 else len(gathers), len(gathers)):
        ag = gathers[i]
        # the first d buckets all go out before the first wait
        anchor = wait_of(gathers[max(i - prefetch_distance, 0)])
        if order[ag] < order[anchor]:
            continue
        group = _gather_group(ag, anchor, order)
        if not _inputs_ready_before(group, anchor, order):
            continue
        _move_before(anchor, group, order)
        order = _order(graph)
        prefetched += 1
    return prefetched


def reorder_reductions(graph: fx.Graph, groups: CollectiveGroups = ALL_DATA_PARALLEL) -> int:
    """Issue reductions early and wait late; returns how many were moved."""
    order = _order(graph)
    reductions = [
        n
        for n in graph.nodes
        if collective_kind(n) in ("reduce_scatter", "all_reduce")
        and wait_of(n)
        and groups.is_data_parallel(n)
        and not n.meta.get(AMAX_META)  # Note: [One amax all-reduce per graph]
    ]
    moved = 0
    # 1. issue right after the last input (its copy-in moves along)
    for red in reductions:
        group = [*_copy_in(red), red]
        producers = [i for n in group for i in n.all_input_nodes if i not in group]
        if not producers:
            continue
        last = max(producers, key=order.__getitem__)
        anchor = last.next
        if order.get(anchor, -1) < order[min(group, key=order.__getitem__)]:
            _move_before(anchor, group, order)
            order = _order(graph)
            moved += 1
    # 2. each wait right before the next reduction of its group, or the output
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    by_group: dict[object, list[fx.Node]] = {}
    for red in sorted(reductions, key=order.__getitem__):
        by_group.setdefault(collective_group(red), []).append(red)
    for members in by_group.values():
        for i, red in enumerate(members):
            wait = wait_of(red)
            target = members[i + 1] if i + 1 < len(members) else output
            consumer = _first_consumer(wait, order)
            if consumer is not None and consumer is not output and order[consumer] < order[target]:
                target = consumer
            if order[target] > order[wait]:
                _move_before(target, [wait, *_copy_out(wait)], order)
                order = _order(graph)
    return moved


def reorder(
    gm: fx.GraphModule, prefetch_distance: int, groups: CollectiveGroups = ALL_DATA_PARALLEL
) -> dict[str, int]:
    """Apply the rules of Note: [Reordering rules] to ``gm`` in place, to the
    data-parallel collectives of ``groups``."""
    prefetched = reorder_all_gathers(gm.graph, prefetch_distance, groups)
    moved = reorder_reductions(gm.graph, groups)
    gm.graph.lint()
    gm.recompile()
    return {"prefetched_all_gathers": prefetched, "early_reductions": moved}
