"""Reshard-after-forward as activation checkpointing of the FSDP all-gathers.

Note: [Resharding by recompute tags]
    In the joint forward-backward graph every FSDP parameter read is a chain

        primal (stored shard) -> cast/pad -> all_gather -> wait -> slice/view -> compute

    With ``reshard_after_forward=True`` every node of that chain (and pure
    views of the gathered tensor, such as a linear's weight transpose) is
    tagged ``MUST_RECOMPUTE``: the partitioner may not keep the gathered
    parameter alive for backward and instead replays the chain in the
    backward graph from the stored shard, i.e. the backward all-gathers again.
    With ``False`` the gathered tensor is tagged ``MUST_SAVE`` (ZeRO-2).
    The tags are a deterministic function of the graph, so every rank makes
    the same decision; nothing is left to the partitioner's cost heuristics,
    which could differ between ranks and deadlock them.

Note: [Keeping gathered parameters]
    ``simplefsdp.compile(keep_gathered=...)`` decides per bucket: the
    buckets it names are tagged ``MUST_SAVE`` (kept gathered from their
    forward use to their backward use, as FSDP2 keeps its root), the others
    follow ``reshard_after_forward``. Backward runs the buckets in reverse
    forward order, so the last buckets of the forward are the first that
    backward regathers: with reordering, the last ``prefetch_distance + 1``
    buckets are gathered at the forward/backward boundary anyway (the one
    in use and the prefetched ones), and keeping exactly those removes their
    regather (the exposed first all-gather of backward included) without
    raising the memory at that boundary. ``keep_gathered="auto"`` keeps
    those and, with full resharding, the buckets before them that fit in
    the memory budget (Note: [Keeping what eager FSDP2 would hold]); an int
    keeps the last N buckets; a list of module or parameter
    FQNs keeps the buckets holding them. The cost in memory is each kept
    bucket's gathered bytes from its forward use to its backward use; the
    forward graph's report lists the kept buckets and their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.compiler.patterns import (
    ALL_GATHER,
    VIEW_OPS,
    WAIT,
    aten,
    carries_float8,
    collective_group,
    path_from_placeholder,
    shaping_closure,
    source_placeholder,
    wait_of,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherChain:
    """One FSDP parameter read in a graph."""

    placeholder: fx.Node
    pre: tuple[fx.Node, ...]  # casts/pads between the shard and the all-gather
    all_gather: fx.Node
    wait: fx.Node
    post: tuple[fx.Node, ...]  # slices/views of the gathered tensor (views included)


def find_gather_chains(graph: fx.Graph) -> list[GatherChain]:
    """Every all-gather whose input is a graph input seen through shaping ops."""
    chains = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not ALL_GATHER:
            continue
        source = node.args[0]
        placeholder = source_placeholder(source)
        wait = wait_of(node)
        if placeholder is None or wait is None:
            continue
        pre = tuple(path_from_placeholder(source))
        post = tuple(shaping_closure(wait, include_views=True))
        chains.append(GatherChain(placeholder, pre, node, wait, post))
    return chains


@dataclass
class ReshardResult:
    """What :func:`mark_reshard` did to a joint graph."""

    chains: int = 0
    # Note: [Partial resharding in the graph]: chains regathered over a
    # smaller group, the bytes of the pieces they keep, and chains that
    # stayed fully resharded (activation checkpointing, uneven rows).
    partial: int = 0
    partial_bytes: int = 0
    partial_skipped: int = 0
    # piece node name -> the shard's graph input name: the backward graph's
    # input holding a saved piece has the piece's name.
    pieces: dict[str, str] = field(default_factory=dict)


def mark_reshard(
    graph: fx.Graph,
    reshard_after_forward: bool,
    keep: Collection[str] = (),
    partial_groups: Mapping[str, Any] | None = None,
) -> ReshardResult:
    """Tag (and for partial resharding rewrite) the FSDP all-gather chains of a joint graph.

    ``keep``: names of graph inputs (shards) whose gathered parameter is
    saved for backward even when ``reshard_after_forward`` is true (Note:
    [Keeping gathered parameters]). ``partial_groups``: shard group name ->
    ``PartialReshardGroup`` (``group_name``, ``size``, ``rank``) for
    ``reshard_after_forward=N`` (Note: [Partial resharding in the graph]).
    See Note: [Resharding by recompute tags].
    """
    chains = find_gather_chains(graph)
    result = ReshardResult(chains=len(chains))
    backward = _tangent_dependent(graph) if partial_groups else set()
    for chain in chains:
        if reshard_after_forward and chain.placeholder.name not in keep:
            target = (partial_groups or {}).get(collective_group(chain.all_gather) or "")
            for node in (*chain.pre, chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta.pop("ac_graph_id", None)
            if target is not None:
                piece = _regather_from_piece(graph, chain, target, backward)
                if piece is None:
                    result.partial_skipped += 1
                elif piece.op != "placeholder":
                    result.partial += 1
                    result.partial_bytes += _gathered_bytes(piece)
                    result.pieces[piece.name] = chain.placeholder.name
        else:
            for node in (chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    _mark_float8_reshard(graph, {c.all_gather for c in chains}, reshard_after_forward, keep)
    logger.debug(
        "reshard pass: %d all-gather chains tagged %s (%d kept, %d partially resharded)",
        len(chains),
        "MUST_RECOMPUTE" if reshard_after_forward else "MUST_SAVE",
        len(keep),
        result.partial,
    )
    return result


# Note: [Resharding float8 all-gathers]
# A float8 all-gather (Note: [Float8 all-gather]) is not a shaping chain: its
# input is the shard scaled by a scale that an all-reduce of the shard's amax
# computed. Every node between the shard and the all-gather derives from that
# one graph input, so with resharding the whole read (amax, all-reduce, cast,
# all-gather) is tagged ``MUST_RECOMPUTE`` with the byte views after it, and
# backward gathers the float8 bytes again (the scale, one number computed by
# the amax all-reduce, is saved rather than reduced again); without, the
# gathered bytes are saved. Such gathers stay out of partial resharding.
_FLOAT8_VIEWS = VIEW_OPS | {WAIT, aten.view.dtype, aten.view.default, aten.alias.default}


def _mark_float8_reshard(
    graph: fx.Graph, plain: set[fx.Node], reshard_after_forward: bool, keep: Collection[str]
) -> int:
    """Tag the float8 all-gather reads of a joint graph: Note: [Resharding
    float8 all-gathers]. Returns how many it tagged."""
    tagged = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not ALL_GATHER or node in plain:
            continue
        wait = wait_of(node)
        source = node.args[0]
        if wait is None or not isinstance(source, fx.Node) or not carries_float8(source):
            continue
        pre, placeholders = _ancestors(source)
        if len(placeholders) != 1 or any(n.target is ALL_GATHER for n in pre):
            continue
        post: list[fx.Node] = []
        frontier = [wait]
        while frontier:
            current = frontier.pop()
            for user in current.users:
                if user.op == "call_function" and user.target in _FLOAT8_VIEWS and user not in post:
                    post.append(user)
                    frontier.append(user)
        if reshard_after_forward and next(iter(placeholders)).name not in keep:
            for n in (*pre, node, wait, *post):
                scalar = n in pre and _is_scalar_value(n)
                n.meta["recompute"] = (
                    CheckpointPolicy.MUST_SAVE if scalar else CheckpointPolicy.MUST_RECOMPUTE
                )
                n.meta.pop("ac_graph_id", None)
        else:
            for n in (node, wait, *post):
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged += 1
    return tagged


def _is_scalar_value(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == 1


def _ancestors(node: fx.Node) -> tuple[list[fx.Node], set[fx.Node]]:
    """The non-placeholder ancestors of ``node`` (itself included), in graph
    order, and the placeholders they read."""
    seen: set[fx.Node] = set()
    placeholders: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        if current.op == "placeholder":
            placeholders.add(current)
            continue
        seen.add(current)
        frontier.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__), placeholders


# Note: [Partial resharding in the graph]
# For ``reshard_after_forward=N`` (Note: [Partial resharding] in
# frontend/data_parallel.py) a fully resharded chain
#     shard -> all_gather(W) -> wait -> views -> compute
# gets, right after the wait, ``piece = clone(gathered[r*L/N:(r+1)*L/N])``
# (r: this rank's index in its group of N, L: the gathered rows), tagged
# MUST_SAVE, and a second chain ``piece -> all_gather(N) -> wait -> copies of
# the views``, tagged MUST_RECOMPUTE. The all-gather over N concatenates the N
# pieces in group order, so it rebuilds the gathered parameter exactly. Every
# backward use of the gathered parameter or its views (a node that depends
# on a tangent) is rewired to the second chain; the partitioner then saves the
# piece and replays only the small all-gather in backward, while the full
# chain stays MUST_RECOMPUTE with no backward user left, so it is neither
# saved nor replayed. Chains read inside activation-checkpointed regions keep
# full resharding: the forward recomputed in backward reads the parameter
# through the full chain. So do chains whose rows do not split into N.
def _tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on a tangent input: the backward of a joint graph."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                found.add(node)
        elif any(i in found for i in node.all_input_nodes):
            found.add(node)
    return found


def _regather_from_piece(
    graph: fx.Graph, chain: GatherChain, group: Any, backward: set[fx.Node]
) -> fx.Node | None:
    """Rewrite one chain (Note: [Partial resharding in the graph]); the piece
    node (the shard's input when nothing in backward reads the parameter),
    or ``None`` when the chain keeps full resharding."""
    gathered = chain.wait.meta.get("val")
    members = {chain.wait, *chain.post}
    users = {u for n in members for u in n.users if u not in members}
    if gathered is None or gathered.ndim == 0 or gathered.shape[0] % group.size:
        return None
    if any("ac_graph_id" in u.meta for u in users if u not in backward):
        return None  # read inside activation checkpointing: Note above
    if not any(u in backward for u in users):
        return chain.placeholder  # no backward use: nothing to regather
    rows = gathered.shape[0] // group.size
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_backward = min((u for u in users if u in backward), key=order.__getitem__)

    def add(target: Any, args: tuple, tag: CheckpointPolicy) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        node.meta["recompute"] = tag
        return node

    with graph.inserting_after(chain.wait):
        part = add(aten.slice.Tensor, (chain.wait, 0, group.rank * rows, (group.rank + 1) * rows),
                   CheckpointPolicy.MUST_RECOMPUTE)  # fmt: skip
    with graph.inserting_after(part):
        piece = add(aten.clone.default, (part,), CheckpointPolicy.MUST_SAVE)
    env: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first_backward):
        again = add(
            ALL_GATHER, (piece, group.size, group.group_name), CheckpointPolicy.MUST_RECOMPUTE
        )
        env[chain.wait] = add(WAIT, (again,), CheckpointPolicy.MUST_RECOMPUTE)
        for node in sorted(chain.post, key=order.__getitem__):
            copy = graph.node_copy(node, lambda n: env.get(n, n))
            copy.meta = {**node.meta, "recompute": CheckpointPolicy.MUST_RECOMPUTE}
            copy.meta.pop("ac_graph_id", None)
            env[node] = copy
    for node in members:
        for user in list(node.users):
            if user in backward and user not in members:
                user.replace_input_with(node, env[node])
    for node in sorted([*env.values(), *chain.post], key=lambda n: -order.get(n, len(order))):
        if not node.users and node.op == "call_function" and node.target is not WAIT:
            graph.erase_node(node)
    return piece


def drop_unused_gathers(graph: fx.Graph, groups: Collection[str]) -> int:
    """Remove the all-gathers over ``groups`` whose result nothing reads; how many.

    The partitioner copies every node that depends on no tangent into the
    forward graph and keeps collectives there even when unused (they have
    side effects): the regather from the piece (Note: [Partial resharding in
    the graph]) would run in forward too. Every rank's graph has the same
    structure, so every rank drops the same collectives.
    """
    dropped = 0
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.target is not ALL_GATHER:
            continue
        if collective_group(node) not in groups:
            continue
        users = list(node.users)
        if all(u.target is WAIT and not u.users for u in users):
            for user in users:
                graph.erase_node(user)
            graph.erase_node(node)
            dropped += 1
    return dropped


def kept_buckets(
    graph: fx.Graph,
    bucket_of: Callable[[str], tuple[int, str] | None],
    keep_gathered: int | Sequence[str],
    fqn_of: Callable[[str], str | None],
) -> tuple[set[str], list[str], int]:
    """Which shards to keep gathered (Note: [Keeping gathered parameters]).

    Args:
        graph: the joint graph.
        bucket_of: ``fqn -> (bucket index, bucket name)`` (``None``: unknown).
        keep_gathered: the last N buckets (forward order), or module /
            parameter FQNs whose buckets are kept.
        fqn_of: graph input name -> parameter FQN (``None``: not a parameter).

    Returns:
        ``(placeholder names, kept bucket names in forward order, gathered
        bytes of the kept buckets)``.
    """
    order, names, members = _buckets_in_forward_order(graph, bucket_of, fqn_of)
    chosen = choose_buckets(
        order, members, keep_gathered, lambda c: fqn_of(c.placeholder.name) or ""
    )
    kept = {c.placeholder.name for i in chosen for c in members[i]}
    nbytes = sum(_gathered_bytes(c.wait) for i in chosen for c in members[i])
    return kept, [names[i] for i in chosen], nbytes


def _buckets_in_forward_order(
    graph: fx.Graph,
    bucket_of: Callable[[str], tuple[int, str] | None],
    fqn_of: Callable[[str], str | None],
) -> tuple[list[int], dict[int, str], dict[int, list[GatherChain]]]:
    """Bucket indices by their first all-gather, their names and chains."""
    return group_by_bucket(
        find_gather_chains(graph), lambda c: fqn_of(c.placeholder.name), bucket_of
    )


def group_by_bucket(
    items: Sequence[Any],
    fqn_of: Callable[[Any], str | None],
    bucket_of: Callable[[str], tuple[int, str] | None],
) -> tuple[list[int], dict[int, str], dict[int, list[Any]]]:
    """``items`` (in forward order) grouped by their parameter's bucket:
    bucket indices in order of first appearance, their names and members.
    Items without a parameter or bucket are left out."""
    order: list[int] = []
    names: dict[int, str] = {}
    members: dict[int, list[Any]] = {}
    for item in items:
        fqn = fqn_of(item)
        bucket = bucket_of(fqn) if fqn is not None else None
        if bucket is None:
            continue
        index, name = bucket
        if index not in members:
            order.append(index)
            names[index] = name
        members.setdefault(index, []).append(item)
    return order, names, members


def choose_buckets(
    order: list[int],
    members: dict[int, list[Any]],
    keep_gathered: int | Sequence[str],
    fqn_of: Callable[[Any], str],
) -> list[int]:
    """The buckets ``keep_gathered`` keeps (Note: [Keeping gathered
    parameters]): the last N of ``order``, or those holding a member whose
    FQN is or lies under one it names."""
    if isinstance(keep_gathered, int):
        return order[len(order) - keep_gathered :] if keep_gathered > 0 else []
    prefixes = tuple(keep_gathered)

    def named(item: Any) -> bool:
        fqn = fqn_of(item)
        return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)

    return [i for i in order if any(named(m) for m in members[i])]


def gathered_bucket_bytes(
    graph: fx.Graph,
    bucket_of: Callable[[str], tuple[int, str] | None],
    fqn_of: Callable[[str], str | None],
) -> list[int]:
    """Gathered bytes of each bucket read in ``graph``, in forward order (the
    order :func:`kept_buckets` counts an int ``keep_gathered`` in)."""
    order, _, members = _buckets_in_forward_order(graph, bucket_of, fqn_of)
    return [sum(_gathered_bytes(c.wait) for c in members[i]) for i in order]


def _gathered_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    if value is None or not hasattr(value, "numel"):
        return 0
    return int(value.numel() * value.element_size())
