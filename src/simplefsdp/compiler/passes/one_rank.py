"""Resharding where a parameter's gather is a cast alone.

Note: [Resharding a one-rank gather]
    Where every mesh dim that shards a parameter has one rank (a 1-rank mesh,
    or hybrid sharding with shard groups of one), reading it all-gathers
    nothing: DTensor's redistribute is the cast to ``param_dtype`` and views,
    so the graph has no gather chain to tag. Left to itself, the min-cut
    partitioner saves the cast parameters for backward: a bf16 copy of every
    weight alive at the backward peak, which eager FSDP2 frees after forward
    (docs/benchmarks.md, world size 1). With ``reshard_after_forward=True``
    these casts (and their views) are tagged ``MUST_RECOMPUTE`` too: backward
    casts the stored parameter again, as FSDP2's regather does. The buckets
    ``keep_gathered`` keeps are saved instead, counted as for gathered ones
    (Note: [Keeping gathered parameters]): ``"auto"`` keeps the last
    ``prefetch_distance + 1`` of the forward, whose casts backward needs first
    (as FSDP2 keeps its root), an int N the last N, a list the buckets holding
    the FQNs it names; the budgeted keep search does not run where every
    parameter is read so (there is no gathered bucket). Casts of parameters the
    compiler does not manage, and reads without a dtype change (nothing to
    free: the stored parameter is alive anyway), are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.compiler.passes.reshard import choose_buckets, group_by_bucket
from simplefsdp.compiler.patterns import aten, prims, shaping_closure
from simplefsdp.compiler.report import format_bytes
from simplefsdp.frontend.parametrization import SPECS_ATTR


def one_rank_gathers(model: nn.Module) -> frozenset[str]:
    """FQNs of the sharded parameters whose every sharding mesh dim has one
    rank: reading them gathers nothing (Note: [Resharding a one-rank gather])."""
    fqns = set()
    for module in model.modules():
        for name, spec in module.__dict__.get(SPECS_ATTR, {}).items():
            param = module._parameters.get(name)
            if not isinstance(param, DTensor):
                continue
            dp = param.placements[: len(spec.dp_placements)]
            dims = [i for i, placement in enumerate(dp) if placement.is_shard()]
            if dims and all(param.device_mesh.size(i) == 1 for i in dims):
                fqns.add(spec.fqn)
    return frozenset(fqns)


@dataclass
class OneRankCasts:
    """What :func:`mark_one_rank_casts` did to a joint graph."""

    recomputed: int = 0  # casts recomputed in backward
    recomputed_bytes: int = 0
    kept_buckets: list[str] = field(default_factory=list)  # forward order
    kept_bytes: int = 0

    def note(self) -> str | None:
        """The forward report's line (``None``: nothing to say)."""
        if not self.recomputed and not self.kept_buckets:
            return None
        text = (
            f"resharded after forward on one rank: {self.recomputed} parameter casts "
            f"recomputed in backward ({format_bytes(self.recomputed_bytes)} not held)"
        )
        if self.kept_buckets:
            text += (
                f"; casts kept for backward: {', '.join(self.kept_buckets)} "
                f"({format_bytes(self.kept_bytes)} held)"
            )
        return text


def mark_one_rank_casts(
    graph: fx.Graph,
    options,
    primal_names: Mapping[str, str],
    one_rank: Collection[str],
    bucket_of: Callable[[str], tuple[int, str] | None],
    free_keep: int,
) -> OneRankCasts:
    """With ``reshard_after_forward=True``, tag the casts of the parameters
    ``one_rank`` names (FQNs) that ``graph`` reads ``MUST_RECOMPUTE``, except
    the buckets ``keep_gathered`` keeps, counted as for gathered buckets:
    ``"auto"`` keeps the last ``free_keep`` buckets of the forward (their
    casts are used at the forward/backward boundary anyway), an int N the
    last N, a list of module/parameter FQNs the buckets holding them
    (Note: [Resharding a one-rank gather])."""
    result = OneRankCasts()
    if options.reshard_after_forward is not True or not one_rank:
        return result
    local = {name for name, fqn in primal_names.items() if fqn in one_rank}
    chains = find_local_cast_chains(graph, local)
    # Buckets in the order of their first use in forward.
    position = {node: i for i, node in enumerate(graph.nodes)}
    first_use = {chain[0]: _first_use(chain[1], position) for chain in chains}
    ordered = sorted(chains, key=lambda c: first_use[c[0]])
    fqn = lambda chain: primal_names[chain[0].name]  # noqa: E731
    order, names, members = group_by_bucket(ordered, fqn, bucket_of)
    keep = options.resolved_keep_gathered()
    chosen = choose_buckets(order, members, free_keep if keep == "auto" else keep, fqn)
    kept = {c[0] for i in chosen for c in members[i]}
    result.kept_buckets = [names[i] for i in chosen]
    for placeholder, nodes in chains:
        nbytes = max(_gathered_bytes(n) for n in nodes if _changes_dtype(n))
        if placeholder in kept:
            result.kept_bytes += nbytes
            continue
        for node in nodes:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta.pop("ac_graph_id", None)
        result.recomputed += 1
        result.recomputed_bytes += nbytes
    return result


def _first_use(nodes: tuple[fx.Node, ...], position: Mapping[fx.Node, int]) -> int:
    """Graph position of the first node outside ``nodes`` that reads one of them."""
    members = set(nodes)
    uses = [position[u] for n in nodes for u in n.users if u not in members]
    return min(uses, default=len(position))


def find_local_cast_chains(
    graph: fx.Graph, placeholders: Collection[str]
) -> list[tuple[fx.Node, tuple[fx.Node, ...]]]:
    """``(placeholder, cast and view nodes)`` for each named graph input read
    through a dtype cast and no collective (Note: [Resharding a one-rank gather])."""
    chains = []
    for node in graph.nodes:
        if node.op != "placeholder" or node.name not in placeholders:
            continue
        closure = tuple(shaping_closure(node, include_views=True))
        if any(_changes_dtype(n) for n in closure):
            chains.append((node, closure))
    return chains


def _gathered_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else 0


def _changes_dtype(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (
        aten._to_copy.default,
        prims.convert_element_type.default,
    ):
        return False
    val, source = node.meta.get("val"), node.args[0] if node.args else None
    source_val = source.meta.get("val") if isinstance(source, fx.Node) else None
    dtype = getattr(val, "dtype", None)
    return dtype is not None and dtype != getattr(source_val, "dtype", dtype)
