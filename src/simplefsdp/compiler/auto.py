"""Glue between a forward graph and the greedy planner (``bucketing="auto"``).

Note: [Identical plans without compile-time collectives]
    Ranks must bucket identically or their collectives mismatch and hang. The
    plan is a deterministic function of the forward graph and the cost model;
    the cost model is calibrated when ``simplefsdp.compile`` is called (all
    ranks call it together) and rank 0's numbers are broadcast then. Nothing
    communicates during compilation itself, where one rank may compile a graph
    another rank does not (e.g. a recompile on one rank only), and the inputs
    that legitimately differ between ranks (the padding of uneven shards) are
    left out of the estimates.
"""

from __future__ import annotations

import logging
import time

import torch.fx as fx

from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.compiler.memory import estimate_memory
from simplefsdp.compiler.passes.bucketing import find_sites
from simplefsdp.compiler.patterns import path_from_placeholder
from simplefsdp.compiler.planner import (
    gather_units,
    greedy_buckets,
    prefetch_extra_bytes,
    to_plan,
)
from simplefsdp.plan import BucketPlan

logger = logging.getLogger(__name__)


def plan_forward_graph(
    gm: fx.GraphModule,
    primal_names: dict[str, str],
    all_fqns: list[str],
    cost_model: CostModel,
    *,
    reshard_after_forward: bool,
    memory_budget_bytes: int | None,
    reference_plan: BucketPlan | None,
) -> tuple[BucketPlan, list[str], dict]:
    """Plan buckets for one Dynamo graph from its (unbucketed) forward graph.

    ``reference_plan`` (per block) sets the default budget: no more predicted
    memory than per-block wrapping needs. Returns (plan, report notes, data).
    """
    start = time.perf_counter()
    sites = find_sites(gm.graph, primal_names, {})
    units = gather_units(gm, sites, cost_model)
    # Ranks with uneven shards pad their all-gather inputs; leave those nodes
    # out so every rank computes the same numbers and so the same plan.
    padding = {
        n for site in sites if site.kind == "all_gather" for n in path_from_placeholder(site.input)
    }
    base = estimate_memory(gm, ignore=padding)
    base_peak = base.peak_bytes
    budget = memory_budget_bytes
    default_budget = None
    if budget is None and reference_plan is not None:
        by_fqn = {u.fqn: u for u in units}
        reference = [
            [by_fqn[f] for f in b.param_fqns if f in by_fqn] for b in reference_plan.buckets
        ]
        default_budget = base_peak + prefetch_extra_bytes([b for b in reference if b])
        budget = default_budget
    buckets = greedy_buckets(
        units,
        cost_model,
        reshard_after_forward=reshard_after_forward,
        base_peak_bytes=base_peak,
        memory_budget_bytes=budget,
    )
    plan = to_plan(buckets, all_fqns)
    planning_s = time.perf_counter() - start
    data = {
        "planning_s": planning_s,
        "num_units": len(units),
        "num_buckets": sum(1 for b in plan.buckets if b.origin == "auto"),
        "memory_budget_bytes": budget,
        "budget_is_default": default_budget is not None,
        "unbucketed_peak_bytes": base_peak,
    }
    notes = [
        f"auto plan: {data['num_units']} all-gathers -> {data['num_buckets']} buckets in "
        f"{1000 * planning_s:.1f} ms; memory budget "
        + (
            f"{budget} bytes" + (" (default: per-block plan's peak)" if default_budget else "")
            if budget is not None
            else "none"
        )
    ]
    logger.debug("%s", notes[0])
    return plan, notes, data
