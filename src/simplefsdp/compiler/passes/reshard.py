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
    those; an int keeps the last N buckets; a list of module or parameter
    FQNs keeps the buckets holding them. The cost in memory is each kept
    bucket's gathered bytes from its forward use to its backward use; the
    forward graph's report lists the kept buckets and their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.compiler.patterns import (
    ALL_GATHER,
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


def mark_reshard(graph: fx.Graph, reshard_after_forward: bool, keep: Collection[str] = ()) -> int:
    """Tag the FSDP all-gather chains of a joint graph; returns how many.

    ``keep``: names of graph inputs (shards) whose gathered parameter is
    saved for backward even when ``reshard_after_forward`` is true (Note:
    [Keeping gathered parameters]). See Note: [Resharding by recompute tags].
    """
    chains = find_gather_chains(graph)
    for chain in chains:
        if reshard_after_forward and chain.placeholder.name not in keep:
            for node in (*chain.pre, chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta.pop("ac_graph_id", None)
        else:
            for node in (chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    logger.debug(
        "reshard pass: %d all-gather chains tagged %s (%d kept)",
        len(chains),
        "MUST_RECOMPUTE" if reshard_after_forward else "MUST_SAVE",
        len(keep),
    )
    return len(chains)


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
    chains = find_gather_chains(graph)
    order: list[int] = []  # buckets by their first all-gather (forward order)
    names: dict[int, str] = {}
    members: dict[int, list[GatherChain]] = {}
    for chain in chains:
        fqn = fqn_of(chain.placeholder.name)
        bucket = bucket_of(fqn) if fqn is not None else None
        if bucket is None:
            continue
        index, name = bucket
        if index not in members:
            order.append(index)
            names[index] = name
        members.setdefault(index, []).append(chain)
    if isinstance(keep_gathered, int):
        chosen = order[len(order) - keep_gathered :] if keep_gathered > 0 else []
    else:
        prefixes = tuple(keep_gathered)

        def named(chain: GatherChain) -> bool:
            fqn = fqn_of(chain.placeholder.name) or ""
            return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)

        chosen = [i for i in order if any(named(c) for c in members[i])]
    kept = {c.placeholder.name for i in chosen for c in members[i]}
    nbytes = sum(_gathered_bytes(c.wait) for i in chosen for c in members[i])
    return kept, [names[i] for i in chosen], nbytes


def _gathered_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    if value is None or not hasattr(value, "numel"):
        return 0
    return int(value.numel() * value.element_size())
