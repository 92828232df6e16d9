"""Bucketing: merge the FSDP collectives of several parameters into one.

The pass is split as predicates -> keys -> plan (data) -> rewrite:
``find_sites`` lists the FSDP collectives of a graph, ``plan_buckets`` groups
them (by the user's bucket plan, then by process group / dtype / op) and
returns data that tests can inspect, ``apply_buckets`` rewrites the graph.

Note: [Bucket layouts]
    all-gather: every member's (padded, equal-size on all ranks) input shard is
        flattened and concatenated (copy-in) into one flat buffer; one
        all-gather yields ``(group_size, total)`` rank rows; member i's
        gathered tensor is the column slice ``[:, off_i:off_i+n_i]`` reshaped
        to the original gathered shape ``(group_size * s0, ...)`` (copy-out).
    reduce-scatter: each member's input ``(group_size * s0, ...)`` is viewed
        as ``(group_size, n_i)`` rank rows; the rows are concatenated along
        dim 1 so that rank r's chunk of the flat buffer holds rank r's slice
        of every member; one reduce-scatter returns ``(total,)`` and member i
        is the contiguous view ``[off_i:off_i+n_i]`` of it.
    all-reduce: members are flattened and concatenated; slices are views.
    All three only move bytes, so bucketing never changes numerics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    CollectiveGroups,
    collective_kind,
    downstream_output_index,
    node_bytes,
    node_dtype,
    path_from_placeholder,
    source_placeholder,
    stable_topological_sort,
    wait_of,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class CollectiveSite:
    """One FSDP collective in a graph, with what is needed to bucket it."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    node: fx.Node
    wait: fx.Node
    fqn: str | None
    key: tuple  # sites may share a bucket only if their keys are equal

    @property
    def input(self) -> fx.Node:
        return self.node.args[0]

    @property
    def numel(self) -> int:
        val = self.input.meta["val"]
        return val.numel()

    @property
    def bytes(self) -> int:
        return node_bytes(self.node) if self.kind == "all_gather" else node_bytes(self.input)


@dataclass(frozen=True)
class GraphBucket:
    """Collectives of one graph that one rewritten collective will carry."""

    kind: str
    name: str
    sites: tuple[CollectiveSite, ...]

    @property
    def fqns(self) -> list[str]:
        return [s.fqn for s in self.sites if s.fqn]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sites)

    @property
    def dtype(self) -> str:
        return str(node_dtype(self.sites[0].input)).replace("torch.", "")


def _site_fqn(node: fx.Node, kind: str, primal_fqns: dict[str, str], output_fqns) -> str | None:
    if kind == "all_gather":
        source = source_placeholder(node.args[0])
        return primal_fqns.get(source.name) if source is not None else None
    positions = downstream_output_index(wait_of(node) or node)
    fqns = [output_fqns[p] for p in positions if output_fqns.get(p)]
    return fqns[0] if len(fqns) == 1 else None


def find_sites(
    graph: fx.Graph,
    primal_fqns: dict[str, str],
    output_fqns: dict[int, str | None],
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
) -> list[CollectiveSite]:
    """FSDP collectives of ``graph``: all-gathers of stored shards (graph
    inputs), and reductions whose result is returned as a parameter gradient.
    Collectives that cannot be attributed to a parameter, and those on other
    than the data-parallel process groups of ``groups`` (Note: [Data-parallel
    collectives only]), are left alone."""
    sites = []
    for node in graph.nodes:
        kind = collective_kind(node)
        wait = wait_of(node) if kind else None
        if kind is None or wait is None or "val" not in node.args[0].meta:
            continue
        if not groups.is_data_parallel(node):
            continue
        fqn = _site_fqn(node, kind, primal_fqns, output_fqns)
        if fqn is None:
            continue
        dtype = node_dtype(node.args[0])
        if kind == "all_gather":
            key = (kind, node.args[2], node.args[1], dtype)  # group, size, dtype
        elif kind == "reduce_scatter":
            key = (kind, node.args[3], node.args[2], node.args[1], dtype)  # + op
        else:
            key = (kind, node.args[2], node.args[1], dtype)  # group, op, dtype
        sites.append(CollectiveSite(kind, node, wait, fqn, key))
    return sites


def plan_buckets(
    sites: Sequence[CollectiveSite], bucket_of: dict[str, int], bucket_names: Sequence[str]
) -> list[GraphBucket]:
    """Group sites by plan bucket and key, preserving graph order.

    Args:
        bucket_of: parameter FQN -> plan bucket index; parameters missing from
            it stay in buckets of their own.
        bucket_names: plan bucket index -> name for the report.
    """
    groups: dict[tuple, list[CollectiveSite]] = {}
    for site in sites:
        index = bucket_of.get(site.fqn)
        group_key = (site.key, index if index is not None else ("single", site.node.name))
        groups.setdefault(group_key, []).append(site)
    buckets = []
    for (key, index), members in groups.items():
        name = bucket_names[index] if isinstance(index, int) else members[0].fqn
        buckets.append(GraphBucket(kind=key[0], name=name, sites=tuple(members)))
    return buckets


class _NodeMaker:
    """Adds nodes with ``meta["val"]`` computed under the graph's fake mode."""

    def __init__(self, graph: fx.Graph, fake_mode) -> None:
        self.graph = graph
        self.fake_mode = fake_mode

    def __call__(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = fx.node.map_arg(args, lambda n: n.meta["val"])
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*vals)
        return node


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _shape(node: fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def _split_into_waits(make, source: fx.Node, dim: int, sites, sizes, reshape) -> None:
    """Slice ``source`` along ``dim`` into consecutive pieces of ``sizes`` and
    let each piece, shaped like the site's original wait, replace that wait."""
    offset = 0
    for site, size in zip(sites, sizes):
        piece = make(aten.slice.Tensor, source, dim, offset, offset + size)
        site.wait.replace_all_uses_with(make(reshape, piece, _shape(site.wait)))
        offset += size


def _bucket_all_gather(graph: fx.Graph, make: _NodeMaker, bucket: GraphBucket) -> fx.Node:
    order = _order(graph)
    sites = sorted(bucket.sites, key=lambda s: order[s.node])
    anchor = sites[0].node
    for site in sites[1:]:  # copy-in inputs only depend on graph inputs
        for pre in path_from_placeholder(site.input):
            anchor.prepend(pre)
    group_size, group_name = sites[0].node.args[1], sites[0].node.args[2]
    sizes = [s.numel for s in sites]
    total = sum(sizes)
    with graph.inserting_before(anchor):
        flat = make(aten.cat.default, [make(aten.reshape.default, s.input, [-1]) for s in sites])
        gathered = make(ALL_GATHER, flat, group_size, group_name)
        waited = make(WAIT, gathered)
        rows = make(aten.view.default, waited, [group_size, total])  # (G, total)
        _split_into_waits(make, rows, 1, sites, sizes, aten.reshape.default)
    _tag(gathered, bucket)
    return gathered


def _bucket_reduction(graph: fx.Graph, make: _NodeMaker, bucket: GraphBucket) -> fx.Node:
    order = _order(graph)
    sites = sorted(bucket.sites, key=lambda s: order[s.node])
    anchor = sites[-1].node  # every member's input exists by then
    sizes = [s.numel for s in sites]
    first = sites[0].node
    with graph.inserting_before(anchor):
        if bucket.kind == "reduce_scatter":
            reduce_op, group_size, group_name = first.args[1], first.args[2], first.args[3]
            per_rank = [n // group_size for n in sizes]
            rows = [  # (G, n_i / G): rank r's slice of member i in row r
                make(aten.reshape.default, s.input, [group_size, n])
                for s, n in zip(sites, per_rank)
            ]
            flat = make(aten.reshape.default, make(aten.cat.default, rows, 1), [-1])
            reduced = make(REDUCE_SCATTER, flat, reduce_op, group_size, group_name)
        else:
            reduce_op, group_name = first.args[1], first.args[2]
            flat = make(
                aten.cat.default, [make(aten.reshape.default, s.input, [-1]) for s in sites]
            )
            reduced = make(ALL_REDUCE, flat, reduce_op, group_name)
            per_rank = sizes
        waited = make(WAIT, reduced)
        _split_into_waits(make, waited, 0, sites, per_rank, aten.view.default)
    _tag(reduced, bucket)
    return reduced


def _tag(node: fx.Node, bucket: GraphBucket) -> None:
    node.meta["simplefsdp_params"] = bucket.fqns
    node.meta["simplefsdp_bucket"] = bucket.name


def apply_buckets(gm: fx.GraphModule, buckets: Sequence[GraphBucket], fake_mode) -> int:
    """Rewrite ``gm`` so each multi-member bucket is one collective.

    Single-member buckets are only tagged. Returns the number of collectives
    removed. The graph is linted afterwards.
    """
    graph = gm.graph
    make = _NodeMaker(graph, fake_mode)
    removed = 0
    for bucket in buckets:
        if len(bucket.sites) == 1:
            _tag(bucket.sites[0].node, bucket)
            continue
        if bucket.kind == "all_gather":
            _bucket_all_gather(graph, make, bucket)
        else:
            _bucket_reduction(graph, make, bucket)
        for site in bucket.sites:
            graph.erase_node(site.wait)
            graph.erase_node(site.node)
        removed += len(bucket.sites) - 1
    # Readers of a replaced wait may sit before the bucket's new definition.
    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return removed
