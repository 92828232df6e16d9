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
       backward is traced from the same derivative formulas eager runs; it
       is what the forward outputs, the first ``num_fwd_outputs``, do not
       need, so a formula's term of forward values alone, such as ``2 * x``
       of ``x ** 2``, is backward and its input the saved tensor), less
       the FSDP gather chains (eager FSDP2 frees its gathered parameters too)
       and less what activation checkpointing recomputes (only a checkpointed
       region's inputs are saved). The min-cut partitioner recomputes cheap
       ops instead of saving their outputs, so usually ``S_c < S_e``.
    3. The budget is the user's ``memory_budget_bytes``, else what eager
       FSDP2 would hold: ``P + X + max(S_e - S_c, 0)``, with ``X`` the
       bucket memory of one bucket per block beyond ``P`` (Note: [Where in
       the step a bucket's memory is held]). The slack ``budget - (P + X)`` is
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
    (``reshard_after_forward=N``) keeps only the free buckets, and so does
    Inductor on a torch without ``custom_partitioner_fn`` (our tags then go
    in through ``joint_custom_post_pass``, where no trial partition can run).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.bucket_plan import BucketPlan
from simplefsdp.compiler.memory_estimate import output_leaves, storage_root
from simplefsdp.compiler.passes.reshard import find_gather_chains, gathered_bucket_bytes
from simplefsdp.compiler.patterns import ALL_DATA_PARALLEL, CollectiveGroups, node_bytes
from simplefsdp.compiler.report import format_bytes

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _backward_nodes(graph: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """The joint graph's backward: what the forward outputs (the first
    ``num_fwd_outputs``) do not need. (What depends on a tangent would miss
    backward formulas' terms of forward values alone, e.g. ``2 * x`` of
    ``x ** 2``.)"""
    forward: set[fx.Node] = set()
    stack = [n for n in output_leaves(graph)[:num_fwd_outputs] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    return {n for n in graph.nodes if n not in forward and n.op != "output"}


def eager_saved_bytes(graph: fx.Graph, num_fwd_outputs: int) -> int:
    """Bytes of the activations eager autograd would save for the joint
    graph's backward (step 2 of Note: [Keeping what eager FSDP2 would hold])."""
    backward = _backward_nodes(graph, num_fwd_outputs)
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
            root = storage_root(node)
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


def free_keep_count(prefetch_distance: int, reorder: bool) -> int:
    """The buckets gathered at the forward/backward boundary anyway."""
    return prefetch_distance + 1 if reorder else 1


def bucket_lookup(plan: BucketPlan | None) -> Callable[[str], tuple[int, str]]:
    """``fqn -> (bucket index, bucket name)`` in ``plan``; parameters it does
    not hold are buckets of their own, after the plan's."""
    index = plan.bucket_index() if plan is not None else {}
    singles: dict[str, int] = {}

    def bucket_of(fqn: str) -> tuple[int, str]:
        if fqn in index:
            return index[fqn], plan.buckets[index[fqn]].name  # type: ignore[union-attr]
        return len(index) + singles.setdefault(fqn, len(singles)), fqn

    return bucket_of


@dataclass(frozen=True)
class KeepSearch:
    """What :func:`search_keep` found (bytes)."""

    count: int  # the last ``count`` buckets are kept
    candidate_buckets: int  # buckets read in the graph
    free: int
    eager_saved_bytes: int
    compiled_saved_bytes: int
    budget_bytes: int
    slack_bytes: int
    spent_bytes: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def note(self) -> str:
        return (
            f"keep search: kept the last {self.count} of {self.candidate_buckets} buckets "
            f"({self.free} gathered at the boundary anyway, {format_bytes(self.spent_bytes)} "
            f"spent of {format_bytes(max(self.slack_bytes, 0))} slack; eager would save "
            f"{format_bytes(self.eager_saved_bytes)} of activations, this graph saves "
            f"{format_bytes(self.compiled_saved_bytes)})"
        )


def search_keep(
    joint: fx.GraphModule,
    trial_partition: Callable[[fx.GraphModule, int], tuple[fx.GraphModule, fx.GraphModule]],
    *,
    free: int,
    plan: BucketPlan,
    bucket_of: Callable[[str], tuple[int, str] | None],
    primal_names: dict[str, str],
    num_fwd_outputs: int,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
    memory_budget_bytes: int | None = None,
) -> KeepSearch:
    """Steps 1-3 of Note: [Keeping what eager FSDP2 would hold].

    Args:
        joint: the joint graph, not yet tagged (left unchanged).
        trial_partition: ``(copy, free) -> (forward, backward)``: tags the
            copy keeping the last ``free`` buckets and partitions it.
        free: buckets kept at no cost.
        plan: the reference (per-block) plan whose buckets are kept.
        bucket_of: ``fqn -> (bucket index, name)`` in ``plan``.
        primal_names: graph input name -> parameter FQN.
        num_fwd_outputs: how many of the joint graph's outputs are the
            forward's (the partitioner's argument).
        groups: which collectives are data parallel.
        memory_budget_bytes: the user's budget (``None``: the default).
    """
    from simplefsdp.compiler.auto_bucketing import forward_memory_terms

    eager_saved = eager_saved_bytes(joint.graph, num_fwd_outputs)
    gathered = gather_chain_names(joint.graph)  # the copy's nodes keep these names
    fw, bw = trial_partition(copy_joint(joint), free)
    compiled_saved = compiled_saved_bytes(bw, gathered)
    peak, extra = forward_memory_terms(fw, primal_names, plan, groups, num_fwd_outputs)
    budget = memory_budget_bytes
    if budget is None:
        budget = peak + extra + max(eager_saved - compiled_saved, 0)
    sizes = gathered_bucket_bytes(joint.graph, bucket_of, primal_names.get)
    slack = budget - (peak + extra)
    count, spent = choose_kept(list(sizes), free, slack)
    return KeepSearch(
        count=count,
        candidate_buckets=len(sizes),
        free=min(free, len(sizes)),
        eager_saved_bytes=eager_saved,
        compiled_saved_bytes=compiled_saved,
        budget_bytes=budget,
        slack_bytes=slack,
        spent_bytes=spent,
    )
