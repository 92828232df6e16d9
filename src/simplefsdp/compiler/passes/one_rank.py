"""Resharding where a parameter's gather is a cast alone.

Note: [Resharding a one-rank gather]
    Where every mesh dim that shards a parameter has one rank (a 1-rank mesh,
    or hybrid sharding with shard groups of one), reading it all-gathers
    nothing: DTensor's redistribute is the cast to ``param_dtype`` and views,
    so the graph has no gather chain to tag. Left to itself, the min-cut
    partitioner saved the cast parameters for backward. On one H200 (1.0B
    Llama, bf16 compute) the allocator's snapshot at the backward peak held
    the bf16 copies of every block's weights (928 MiB) and of the output
    projection (501 MiB): 31.54 GiB against eager FSDP2's 31.22, which frees its
    blocks' bf16 parameters after forward. With ``reshard_after_forward=True``
    these casts (and their views) are tagged ``MUST_RECOMPUTE`` too: backward
    casts the stored parameter again, as FSDP2's regather does. Parameters a
    ``keep_gathered`` list names are saved instead. Casts of parameters the
    compiler does not manage, and reads without a dtype change (nothing to
    free: the stored parameter is alive anyway), are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy

from simplefsdp.compiler.patterns import aten, prims, shaping_closure
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


def mark_one_rank_casts(
    graph: fx.Graph, options, primal_names: Mapping[str, str], one_rank: Collection[str]
) -> tuple[int, int]:
    """With ``reshard_after_forward=True``, recompute the casts of the
    parameters ``one_rank`` names (FQNs) that ``graph`` reads, except those a
    ``keep_gathered`` list names. Returns (casts tagged, their bytes)."""
    if options.reshard_after_forward is not True or not one_rank:
        return 0, 0
    local = {name for name, fqn in primal_names.items() if fqn in one_rank}
    keep = options.keep_gathered
    listed = keep if isinstance(keep, (list, tuple)) else ()

    def kept(name: str) -> bool:
        fqn = primal_names[name]
        return any(fqn == f or fqn.startswith(f + ".") for f in listed)

    return mark_local_casts(graph, local, kept)


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


def mark_local_casts(
    graph: fx.Graph, placeholders: Collection[str], keep: Callable[[str], bool] = lambda n: False
) -> tuple[int, int]:
    """Tag the one-rank parameter casts of ``graph`` ``MUST_RECOMPUTE``
    (Note: [Resharding a one-rank gather]), except those of inputs ``keep``
    accepts. Returns (casts tagged, their bytes in the cast dtype)."""
    count = nbytes = 0
    for placeholder, nodes in find_local_cast_chains(graph, placeholders):
        if keep(placeholder.name):
            continue
        for node in nodes:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta.pop("ac_graph_id", None)
        count += 1
        nbytes += max(_gathered_bytes(n) for n in nodes if _changes_dtype(n))
    return count, nbytes


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
