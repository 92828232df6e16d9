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
"""

from __future__ import annotations

import logging
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


def mark_reshard(graph: fx.Graph, reshard_after_forward: bool) -> int:
    """Tag the FSDP all-gather chains of a joint graph; returns how many.

    See Note: [Resharding by recompute tags].
    """
    chains = find_gather_chains(graph)
    for chain in chains:
        if reshard_after_forward:
            for node in (*chain.pre, chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta.pop("ac_graph_id", None)
        else:
            for node in (chain.all_gather, chain.wait, *chain.post):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    logger.debug(
        "reshard pass: %d all-gather chains tagged %s",
        len(chains),
        "MUST_RECOMPUTE" if reshard_after_forward else "MUST_SAVE",
    )
    return len(chains)
