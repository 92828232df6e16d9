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

Note: [Mixed dtypes in one all-gather bucket]
    The all-gathers of a bucket on one process group become one collective
    whatever their dtypes: float8 weights (whose bytes travel as ``uint8``,
    Note: [Float8 all-gather]) beside the bf16/fp32 parameters that stay in
    high precision (norms, biases, an unconverted output layer), or
    parameters kept in fp32 under a bf16 ``param_dtype``. With one dtype the
    bucket travels in it; with several, every member's flat shard is viewed
    as bytes (``uint8``), the members wider first so each one's offset in
    the buffer is a multiple of its element size, one ``uint8`` all-gather
    moves them, and each member's rank rows are copied out and viewed back
    as its dtype. An all-gather only moves bytes, so this is exact; each
    member costs what it weighs (one byte per float8 element). Reductions
    (reduce-scatter, all-reduce) compute on their elements: a bucket's
    reductions split by dtype and reduce op.
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
    FSDP_KINDS,
    REDUCE_SCATTER,
    WAIT,
    CollectiveGroups,
    carries_float8,
    collective_kind,
    downstream_output_index,
    gather_prep,
    gather_source,
    node_bytes,
    node_dtype,
    path_from_placeholder,
    stable_topological_sort,
    wait_of,
    wire_dtype,
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
    # A float8 all-gather's gradient bytes (its elements at the stored
    # shard's element size; ``None``: its own bytes): Note: [Float8 bytes in
    # the planner].
    grad_bytes: int | None = None

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

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype it carries (a float8 dtype for float8 bytes)."""
        return wire_dtype(self.input)

    @property
    def float8(self) -> bool:
        """A float8 all-gather (Note: [Float8 all-gather])."""
        return self.kind == "all_gather" and carries_float8(self.input)


def dtype_names(sites: Sequence[CollectiveSite]) -> str:
    """The dtypes ``sites`` carry, ``"+"``-joined in order of appearance."""
    names = dict.fromkeys(str(s.dtype).replace("torch.", "") for s in sites)
    return "+".join(names)


def dtype_bytes(sites: Sequence[CollectiveSite]) -> dict[str, int]:
    """Bytes per carried dtype (gathered or reduced) of ``sites``."""
    result: dict[str, int] = {}
    for site in sites:
        name = str(site.dtype).replace("torch.", "")
        result[name] = result.get(name, 0) + site.bytes
    return result


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
        """The carried dtype; several ``"+"``-joined (Note: [Mixed dtypes in
        one all-gather bucket])."""
        return dtype_names(self.sites)


def _site_fqn(node: fx.Node, kind: str, primal_fqns: dict[str, str], output_fqns) -> str | None:
    if kind == "all_gather":
        source = gather_source(node.args[0], primal_fqns)
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
    collectives only]), are left alone. All-gathers of one process group
    share a key whatever their dtype (Note: [Mixed dtypes in one all-gather
    bucket])."""
    sites = []
    for node in graph.nodes:
        kind = collective_kind(node)
        wait = wait_of(node) if kind else None
        if kind not in FSDP_KINDS or wait is None or "val" not in node.args[0].meta:
            continue
        if not groups.is_data_parallel(node):
            continue
        fqn = _site_fqn(node, kind, primal_fqns, output_fqns)
        if fqn is None:
            continue
        dtype = node_dtype(node.args[0])
        if kind == "all_gather":
            key = (kind, node.args[2], node.args[1])  # group, size
        elif kind == "reduce_scatter":
            key = (kind, node.args[3], node.args[2], node.args[1], dtype)  # + op
        else:
            key = (kind, node.args[2], node.args[1], dtype)  # group, op, dtype
        grad_bytes = None
        if kind == "all_gather" and carries_float8(node.args[0]):
            source = gather_source(node.args[0], primal_fqns)
            itemsize = source.meta["val"].element_size() if "val" in source.meta else 4
            grad_bytes = node_bytes(node) * itemsize  # one byte per gathered element
        sites.append(CollectiveSite(kind, node, wait, fqn, key, grad_bytes))
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


def _copy_in_nodes(site: CollectiveSite, anchor: fx.Node, order: dict[fx.Node, int]):
    """What computes ``site``'s input and must precede the bucket's
    collective at ``anchor``: the shaping path from its shard or, for float8
    bytes, the scale and the cast (those not before ``anchor`` already)."""
    if not site.float8:
        return path_from_placeholder(site.input)
    return [n for n in gather_prep(site.node) if order[n] > order[anchor]]


def _bucket_all_gather(graph: fx.Graph, make: _NodeMaker, bucket: GraphBucket) -> fx.Node:
    order = _order(graph)
    sites = sorted(bucket.sites, key=lambda s: order[s.node])
    anchor = sites[0].node
    for site in sites[1:]:  # copy-in inputs only depend on graph inputs
        for pre in _copy_in_nodes(site, anchor, order):
            anchor.prepend(pre)
    group_size, group_name = sites[0].node.args[1], sites[0].node.args[2]
    dtypes = {site.input.meta["val"].dtype for site in sites}
    if len(dtypes) > 1:  # Note: [Mixed dtypes in one all-gather bucket]
        sites.sort(key=lambda s: -s.input.meta["val"].element_size())
    with graph.inserting_before(anchor):
        if len(dtypes) == 1:
            sizes = [s.numel for s in sites]
            flat = make(
                aten.cat.default, [make(aten.reshape.default, s.input, [-1]) for s in sites]
            )
        else:
            sizes = [s.numel * s.input.meta["val"].element_size() for s in sites]
            flat = make(
                aten.cat.default,
                [
                    make(aten.view.dtype, make(aten.reshape.default, s.input, [-1]), torch.uint8)
                    for s in sites
                ],
            )
        total = sum(sizes)
        gathered = make(ALL_GATHER, flat, group_size, group_name)
        waited = make(WAIT, gathered)
        rows = make(aten.view.default, waited, [group_size, total])  # (G, total)
        if len(dtypes) == 1:
            _split_into_waits(make, rows, 1, sites, sizes, aten.reshape.default)
        else:
            offset = 0
            for site, size in zip(sites, sizes):
                piece = make(aten.slice.Tensor, rows, 1, offset, offset + size)
                flat_piece = make(aten.reshape.default, piece, [group_size * size])
                typed = make(aten.view.dtype, flat_piece, site.input.meta["val"].dtype)
                site.wait.replace_all_uses_with(
                    make(aten.reshape.default, typed, _shape(site.wait))
                )
                offset += size
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
    node.meta["simplefsdp_dtype_bytes"] = dtype_bytes(bucket.sites)


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
