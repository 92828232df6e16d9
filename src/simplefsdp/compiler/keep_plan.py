"""What to keep gathered from forward to backward, within a memory budget.

Note: [Keeping what eager FSDP2 would hold]
    ``keep_gathered="auto"`` (the default of ``bucketing="auto"``) is a
    decision of the planner, made in our partitioner before the real
    partition of each joint graph:

    1. A trial partition of a copy of the joint graph, tagged with only the
       free buckets kept (the last ``prefetch_distance + 1``, gathered at the
       forward/backward boundary anyway; Note: [Keeping gathered
       parameters]), gives the forward graph as it would be: its unbucketed
       peak ``P`` and the activations it saves for backward, ``S_c`` (the
       backward graph's saved inputs that are neither tangents, graph
       inputs nor gathered parameters).
    2. ``S_e`` is what eager autograd saves for the same step: the forward
       tensors of the joint graph that its backward reads (the joint
       backward is traced from the same derivative formulas eager runs), less
       the FSDP gather chains (eager FSDP2 frees its gathered parameters too)
       and less what activation checkpointing recomputes (only a checkpointed
       region's inputs are saved). The min-cut partitioner recomputes cheap
       ops instead of saving their outputs, so usually ``S_c < S_e``.
    3. The budget is the user's ``memory_budget_bytes``, else what eager
       FSDP2 would hold: ``P + X + max(S_e - S_c, 0)``, with ``X`` the
       prefetch memory of one bucket per block (worst ``2 B_i + B_{i+1}``,
       Note: [Greedy auto-wrapping]). The slack ``budget - (P + X)`` is
       spent on keeping buckets, the last ones of the forward first (they are
       the first backward needs and the shortest-lived): a bucket is kept
       while the gathered bytes of the kept ones, beyond the free ones, stay
       within the slack. Every kept bucket saves its backward all-gather.
    4. The same budget then bounds the auto bucket plan of the forward graph,
       whose unbucketed peak now includes the kept parameters, so what the
       keeping spent is no longer there for larger buckets.

    Everything is a function of the graph's shapes (the same on every rank:
    the gather chains, where uneven shards pad, are left out), so every rank
    keeps the same buckets. The cost is one more min-cut partition per
    compiled graph. With activation checkpointing ``S_c`` is close to
    ``S_e`` and little beyond the free buckets is kept. Partial resharding
    (``reshard_after_forward=N``) keeps only the free buckets.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.compiler.memory_estimate import _is_alias
from simplefsdp.compiler.passes.reshard import _tangent_dependent, find_gather_chains
from simplefsdp.compiler.patterns import node_bytes

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` views (a getitem of a multi-output op,
    whose value is a tuple, is its own storage)."""
    while _is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        if not isinstance(source.meta.get("val"), torch.Tensor) and source.op != "placeholder":
            if node.target is operator.getitem:
                break
        node = source
    return node


def eager_saved_bytes(graph: fx.Graph) -> int:
    """Bytes of the activations eager autograd would save for the joint
    graph's backward (step 2 of Note: [Keeping what eager FSDP2 would hold])."""
    backward = _tangent_dependent(graph)
    chain_nodes: set[fx.Node] = set()
    for chain in find_gather_chains(graph):
        chain_nodes.update((*chain.pre, chain.all_gather, chain.wait, *chain.post))
    saved: set[fx.Node] = set()
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or node in chain_nodes:
            continue
        if node.meta.get("recompute") in _RECOMPUTED:
            continue  # inside a checkpointed region: eager recomputes it
        if any(u in backward or u.meta.get("recompute") in _RECOMPUTED for u in node.users):
            root = _storage_root(node)
            if root.op != "placeholder" and root not in chain_nodes:
                saved.add(root)
    return sum(node_bytes(n) for n in saved)


def gather_chain_names(graph: fx.Graph) -> set[str]:
    """Names of the gathered parameters (and their views) in a joint graph."""
    return {
        n.name
        for chain in find_gather_chains(graph)
        for n in (chain.all_gather, chain.wait, *chain.post)
    }


def compiled_saved_bytes(backward: fx.GraphModule, gathered: set[str]) -> int:
    """Bytes of the activations a partitioned forward saves for ``backward``:
    its inputs other than tangents, the joint graph's own inputs and the
    ``gathered`` parameters kept for backward (by node name)."""
    return sum(
        node_bytes(p)
        for p in backward.graph.find_nodes(op="placeholder")
        if not p.name.startswith(("tangents", "primals")) and p.name not in gathered
    )


def copy_joint(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of a joint graph module to tag and partition on trial: new
    nodes (with shallow copies of their ``meta``), the same submodules."""
    graph = fx.Graph()
    graph._codegen = joint.graph._codegen  # the joint's (primals, tangents) signature
    value, old_output = graph.graph_copy(joint.graph, {}, return_output_node=True)
    output = graph.output(value)
    output.meta = copy.copy(old_output.meta)
    return fx.GraphModule(joint, graph)


def choose_kept(bucket_bytes: Sequence[int], free: int, slack_bytes: int) -> tuple[int, int]:
    """How many of the last buckets to keep gathered (step 3 of Note: [Keeping
    what eager FSDP2 would hold]).

    Args:
        bucket_bytes: gathered bytes per bucket, in forward order.
        free: how many of the last buckets are kept at no cost.
        slack_bytes: memory left for the others.

    Returns:
        ``(number of last buckets kept, their gathered bytes beyond the free ones)``.
    """
    count = min(free, len(bucket_bytes))
    spent = 0
    for nbytes in reversed(bucket_bytes[: len(bucket_bytes) - count]):
        if spent + nbytes > slack_bytes:
            break
        spent += nbytes
        count += 1
    return count, spent
