"""Float8 all-gathers in the compiled graph: one amax all-reduce per graph.

Note: [One amax all-reduce per graph]
    Each float8 weight's read (Note: [Float8 all-gather]) all-reduces the
    amax of its shard with MAX over its data-parallel group before casting
    the shard, one tiny collective per weight, each waited on right away.
    FSDP2 users call torchao's ``precompute_float8_dynamic_scale_for_fsdp``
    after the optimizer step to do them all in one all-reduce. With
    bucketing on, this pass does the same inside the graph: the amaxes of
    all float8 weights of a graph on one process group are concatenated and
    all-reduced once (MAX), at the top of the graph, and each weight's scale
    reads its slice of the result. The amaxes only read the stored shards
    (graph inputs), so computing them all first is always possible. MAX is
    exact, so the scales, the casts and the gathered bytes are bitwise those
    of one all-reduce per weight. The merged all-reduce keeps its place (the
    reordering pass does not move it): every float8 cast reads it, and with
    its wait at the top the casts can move with the all-gathers they feed
    (bucketed and prefetched). Backward graphs have none: the scale is saved
    from forward (Note: [Resharding float8 all-gathers]).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    ALL_REDUCE,
    WAIT,
    CollectiveGroups,
    carries_float8,
    collective_group,
    collective_kind,
    is_wait,
    node_bytes,
    node_dtype,
    wait_of,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten

#: Set on the merged amax all-reduce: the reordering pass leaves it in place.
AMAX_META = "simplefsdp_float8_amax"
AMAX_BUCKET = "float8 amax"


def fold_double_waits(graph: fx.Graph) -> int:
    """Replace each ``wait_tensor`` of a ``wait_tensor`` (a no-op: the
    float8 read waits on the functional collective's result twice) by its
    input. Returns how many it removed."""
    folded = 0
    for node in list(graph.nodes):
        if is_wait(node) and isinstance(node.args[0], fx.Node) and is_wait(node.args[0]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            folded += 1
    return folded


def _amax_all_reduces(graph: fx.Graph, groups: CollectiveGroups) -> list[fx.Node]:
    """The MAX all-reduces whose results scale a float8 all-gather's input
    (through the scale computation, never through another collective)."""
    found: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if collective_kind(node) != "all_gather" or not carries_float8(node.args[0]):
            continue
        seen: set[fx.Node] = set()
        frontier = [node.args[0]]
        while frontier:
            current = frontier.pop()
            if current in seen or current.op != "call_function":
                continue
            seen.add(current)
            kind = collective_kind(current)
            if kind == "all_reduce":
                if current.args[1] == "max" and groups.is_data_parallel(current):
                    found[current] = None
                continue
            if kind is not None:
                continue
            frontier.extend(current.all_input_nodes)
    return list(found)


def _producers(node: fx.Node) -> list[fx.Node] | None:
    """The nodes computing ``node`` from graph inputs only, in graph order;
    ``None`` if it reads a collective's result."""
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if current in seen or current.op in ("placeholder", "get_attr"):
            continue
        if current.op != "call_function" or is_wait(current) or collective_kind(current):
            return None
        seen.add(current)
        frontier.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def merge_amax_all_reduces(
    gm: fx.GraphModule,
    fake_mode,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
    primal_names: dict[str, str] | None = None,
) -> list[dict]:
    """Merge the float8 amax all-reduces of ``gm``, per process group, into
    one at the top of the graph (Note: [One amax all-reduce per graph]).

    Args:
        fake_mode: the graph's fake mode (for the new nodes' ``val``).
        groups: which collectives are data parallel (only those merge).
        primal_names: placeholder name -> parameter FQN, to name the
            weights each merged all-reduce carries.

    Returns:
        One dict per merged all-reduce (``params``, ``bytes``, ``dtype``,
        ``merged``: how many it replaced), for the report.
    """
    from simplefsdp.compiler.passes.bucketing import _NodeMaker

    graph = gm.graph
    by_key: dict[tuple, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for reduce in _amax_all_reduces(graph, groups):
        inp = reduce.args[0]
        producers = _producers(inp)
        if wait_of(reduce) is None or producers is None or "val" not in inp.meta:
            continue
        key = (collective_group(reduce), node_dtype(inp))
        by_key.setdefault(key, []).append((reduce, producers))
    merged_info = []
    make = _NodeMaker(graph, fake_mode)
    for (group, dtype), members in by_key.items():
        if len(members) < 2:
            continue
        # Every producer reads graph inputs only: all of them go first, in
        # graph order, before the first node that is none of them.
        moving = {p for _, producers in members for p in producers}
        top = next(n for n in graph.nodes if n.op != "placeholder" and n not in moving)
        for producer in [n for n in graph.nodes if n in moving]:
            top.prepend(producer)
        with graph.inserting_before(top):
            flat = make(
                aten.cat.default, [make(aten.reshape.default, r.args[0], [-1]) for r, _ in members]
            )
            reduced = make(ALL_REDUCE, flat, "max", group)
            waited = make(WAIT, reduced)
            offset = 0
            for reduce, _ in members:
                numel = reduce.args[0].meta["val"].numel()
                piece = make(aten.slice.Tensor, waited, 0, offset, offset + numel)
                shaped = make(aten.reshape.default, piece, list(reduce.args[0].meta["val"].shape))
                wait_of(reduce).replace_all_uses_with(shaped)
                offset += numel
        params = []
        for reduce, _ in members:
            graph.erase_node(wait_of(reduce))
            graph.erase_node(reduce)
        for reduce_input in flat.args[0]:
            params.extend(_shard_names(reduce_input, primal_names or {}))
        reduced.meta[AMAX_META] = True
        reduced.meta["simplefsdp_params"] = params
        reduced.meta["simplefsdp_bucket"] = AMAX_BUCKET
        merged_info.append(
            {
                "params": params,
                "bytes": node_bytes(flat),
                "dtype": str(dtype).replace("torch.", ""),
                "merged": len(members),
            }
        )
    if merged_info:
        graph.lint()
        gm.recompile()
        logger.debug("float8 amax all-reduces merged: %s", merged_info)
    return merged_info


def _shard_names(node: fx.Node, primal_names: dict[str, str]) -> list[str]:
    """The parameter FQNs among the graph inputs ``node`` reads."""
    names: list[str] = []
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and current.name in primal_names:
            names.append(primal_names[current.name])
        frontier.extend(current.all_input_nodes)
    return names
