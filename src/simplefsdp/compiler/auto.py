"""Glue between a forward graph and the greedy planner (``bucketing="auto"``)."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.compiler.memory import estimate_memory
from simplefsdp.compiler.passes.bucketing import find_sites
from simplefsdp.compiler.planner import (
    gather_units,
    greedy_buckets,
    prefetch_extra_bytes,
    to_plan,
)
from simplefsdp.plan import BucketPlan

logger = logging.getLogger(__name__)


def _broadcast_plan(plan: BucketPlan) -> BucketPlan:
    """Rank 0's plan on every rank (ranks that planned differently would hang)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    payload = [plan]
    with unset_fake_temporarily():  # we run inside compilation's fake mode
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


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
    base = estimate_memory(gm)
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
    plan = _broadcast_plan(to_plan(buckets, all_fqns))
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
