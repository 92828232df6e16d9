"""The auto plan of one compiled graph, checked with the memory estimator.

Note: [Checking the plan with the estimator]
    The greedy planner (Note: [Greedy auto-wrapping]) asks its bucket model
    (Note: [Where in the step a bucket's memory is held]) once per unit, so
    the model is kept simple; it leaves out what a bucketed and reordered
    graph holds beyond it: gloo's staging copies and reduce-scatter inputs
    held to their waits (Note: [Collective buffers until the wait]), and an
    all-gather issued beside another where the reordering puts two in
    flight. Larger buckets hold more of these, so under a budget set by the
    per-block plan the model lets buckets grow past what the per-block plan
    would hold, and a plan within the default budget by the model can hold
    more than eager FSDP2 (docs/design.md, auto plans).

    So under the default budget (Note: [Keeping what eager FSDP2 would
    hold]; a budget the user sets is the user's, in the planner's terms) the
    plan is checked once made: copies of the partitioned forward and
    backward graphs are bucketed and reordered as they will be
    (``run_graph_passes``), once with the per-block reference plan and once
    with the auto plan, and ``estimate_memory``'s live peak (the larger of
    the two graphs', staging included where the process group stages) is
    compared. The auto plan may hold what the reference holds plus the
    slack the keep search left unspent. If it holds more, the budget is
    lowered by the excess and the forward graph planned again, at most
    ``ROUNDS`` times; if no plan fits, the reference plan is used. Once a
    replan fits, ``REFINE`` bisections of the budget between it and the
    last plan over look for a larger plan that fits too (lowering by the
    estimate's excess overshoots where the bucket model's shortfall is
    smaller than the estimate's).

    Every rank must decide alike without communicating (Note: [Identical
    plans without compile-time collectives]). The graphs are the same on
    every rank except where a rank's shard is shorter than the others'
    (uneven sharding: its padding before an all-gather, the narrowing of its
    gradient), and a byte there could flip a comparison, so the check runs
    only when every sharded dimension divides evenly (``shards_evenly``);
    otherwise the plan is used as the planner made it, with a note. Nor with
    dynamic shapes: passes run on copies of symbolic graphs would add guards
    to the shape environment the real graphs share. The cost
    is two graph copies and pass runs per estimate: about two seconds per
    estimate for the memory workload's 147 parameters.

Note: [Plans from sizes, not guards]
    Dynamo compiles a graph again when its inputs change shape (a shorter
    last batch, variable sequence lengths; with ``dynamic`` shapes once,
    then symbolically), and it may do so on one rank only. Two rules keep
    every rank's collectives alike and the recompiles few:

    - Decisions are made once per graph of a set of parameters: the auto
      plan of a ``forward`` (or ``inference``) graph and the keep search of
      its joint graph are recorded by the backend under the graph's kind and
      parameter FQNs (``decision_key``), and a later graph of the same kind
      over the same parameters (a recompile) reuses them instead of planning
      from its own activation sizes, which can differ between ranks. So the
      one plan is the first step's: ranks agree as long as that step's
      inputs have the same shapes on every rank.
    - Estimates read sizes, never compare symbols: a byte count or a matmul
      shape of a symbolic graph is taken at its hint (``concrete``, the
      example being compiled), because comparing symbolic sizes (``max``,
      ``<``) installs guards on them, and each guard makes Dynamo recompile
      at the next size that falls on its other side: the planner and the
      memory estimator did this, one recompile per new sequence length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.nn as nn

from simplefsdp.bucket_plan import BucketPlan
from simplefsdp.compiler.auto_bucketing import AutoPlan, plan_forward_graph
from simplefsdp.compiler.keep_gathered import copy_joint
from simplefsdp.compiler.memory_estimate import estimate_memory
from simplefsdp.compiler.pass_sequence import run_graph_passes
from simplefsdp.compiler.report import format_bytes

ROUNDS = 3


class GraphInPlanning(Protocol):
    """What the planner reads of a graph being compiled (the backend's
    per-graph state); it changes none of it."""

    backend: Any
    graph_id: int
    fqns: list[str | None]
    primal_names: dict[str, str]
    default_budget_bytes: int | None
    kept_fqns: set[str]
    num_fwd_outputs: int | None
    keep_search: dict


@dataclass
class GraphPlan:
    """The planner's decision for one forward (or inference) graph.

    Attributes:
        plan: the buckets (``None``: no bucketing).
        sites: the collective sites the planner found on the graph, for the
            bucketing pass (``None``: it finds them itself).
        notes: what the report says about the decision.
    """

    plan: BucketPlan | None
    sites: list | None = None
    notes: list[str] = field(default_factory=list)


def shards_evenly(model: nn.Module) -> bool:
    """Whether every DTensor parameter's sharded dimensions divide evenly by
    the mesh dimensions sharding them (no rank holds a shorter shard)."""
    from torch.distributed.tensor import DTensor, Shard

    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        ways: dict[int, int] = {}
        for size, placement in zip(param.device_mesh.shape, param.placements):
            if isinstance(placement, Shard):
                ways[placement.dim] = ways.get(placement.dim, 1) * size
        if any(param.shape[dim] % n for dim, n in ways.items()):
            return False
    return True


def estimated_peak(
    graphs: Sequence[tuple[str, fx.GraphModule]],
    plan: BucketPlan | None,
    compilation: GraphInPlanning,
) -> int:
    """The larger live peak (``estimate_memory``) of copies of ``graphs``
    (``(name, module)``, left unchanged) after the passes with ``plan``."""
    backend = compilation.backend
    peak = 0
    for name, gm in graphs:
        trial = copy_joint(gm)
        output_fqns = dict(enumerate(compilation.fqns)) if name == "backward" else {}
        run_graph_passes(
            trial,
            name,
            backend.options,
            plan,
            compilation.primal_names,
            output_fqns,
            groups=backend.groups,
        )
        live = estimate_memory(trial, staged=backend.staging).live_peak_bytes
        peak = max(peak, live)
    return peak


def fit_to_reference(
    first: AutoPlan,
    plan_with: Callable[[int], AutoPlan],
    estimate: Callable[[BucketPlan | None], int],
    reference: BucketPlan | None,
    slack_bytes: int,
) -> tuple[AutoPlan | None, list[str]]:
    """Note: [Checking the plan with the estimator]: ``first`` or a replan
    (``plan_with(budget)``) whose ``estimate`` is within the reference's
    plus ``slack_bytes``, with report notes; ``None``: none fits, use the
    reference. Lowering a budget by the estimate's excess can overshoot (the
    bucket model's shortfall is not the estimate's), so once a replan fits,
    up to ``REFINE`` bisections between it and the last budget over look
    for a larger plan that fits too."""
    reference_peak, slack = estimate(reference), max(slack_bytes, 0)
    allowed = reference_peak + slack
    auto, notes = first, []
    over: AutoPlan | None = None  # the last plan over the limit
    for round_ in range(ROUNDS + 1):
        peak = estimate(auto.plan)
        if peak <= allowed:
            auto, peak, refined = _refine(auto, peak, over, plan_with, estimate, allowed)
            notes.append(
                f"estimate check: {auto.data['num_buckets']} buckets hold {format_bytes(peak)} "
                f"at their peak, within the per-block plan's {format_bytes(reference_peak)} + "
                f"{format_bytes(slack)} slack"
                + (f" (after {round_} replans, {refined} bisections)" if round_ else "")
            )
            return auto, notes
        budget = auto.data["memory_budget_bytes"] - (peak - allowed)
        notes.append(
            f"estimate check: {auto.data['num_buckets']} buckets hold {format_bytes(peak)}, "
            f"{format_bytes(peak - allowed)} over the per-block plan's + slack; "
            + (f"budget lowered to {budget} bytes" if round_ < ROUNDS else "giving up")
        )
        if round_ == ROUNDS:
            break
        over = auto
        try:
            auto = plan_with(budget)
        except ValueError:  # below one parameter per bucket
            break
    notes.append("estimate check: no auto plan fits; using the per-block plan")
    return None, notes


REFINE = 2


def _refine(fit, peak, over, plan_with, estimate, allowed) -> tuple[AutoPlan, int, int]:
    """Bisect the budget between plan ``fit`` (within ``allowed``) and plan
    ``over`` (over it; ``None``: nothing to refine) for the largest budget
    whose plan fits: (plan, its estimate, bisections run)."""
    if over is None:
        return fit, peak, 0
    low, high = fit.data["memory_budget_bytes"], over.data["memory_budget_bytes"]
    runs = 0
    while runs < REFINE and high - low > 1:
        mid = (low + high) // 2
        runs += 1
        trial = plan_with(mid)
        if trial.plan == fit.plan:
            low = mid
            continue
        if trial.plan == over.plan:
            high = mid
            continue
        trial_peak = estimate(trial.plan)
        if trial_peak <= allowed:
            fit, peak, low = trial, trial_peak, mid
        else:
            high = mid
    return fit, peak, runs


def _symbolic(*graphs: fx.GraphModule) -> bool:
    """Whether any tensor of ``graphs`` has a symbolic size or stride
    (dynamic shapes): passes run on copies would add guards to the shape
    environment the real graphs share."""
    for gm in graphs:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            values = value if isinstance(value, (tuple, list)) else (value,)
            for v in values:
                if isinstance(v, torch.Tensor) and any(
                    not isinstance(d, int) for d in (*v.shape, *v.stride())
                ):
                    return True
    return False


def plan_graph(
    compilation: GraphInPlanning, gm: fx.GraphModule, backward: fx.GraphModule | None
) -> GraphPlan:
    """The auto buckets of ``compilation``'s forward (or inference) graph
    ``gm``, checked under the default budget against its partitioned
    ``backward`` graph when there is one (Note: [Checking the plan with the
    estimator])."""
    backend = compilation.backend
    options = backend.options
    fqns = [f for f in dict.fromkeys(compilation.fqns) if f]

    def plan_with(default_budget: int | None) -> AutoPlan:
        return plan_forward_graph(
            gm,
            compilation.primal_names,
            fqns,
            backend.cost_model(required=True),
            reshard_after_forward=options.reshard_after_forward,
            memory_budget_bytes=options.memory_budget_bytes,
            reference_plan=backend.plan(),
            groups=backend.groups,
            default_budget_bytes=default_budget,
            kept_fqns=compilation.kept_fqns,
            num_user_outputs=compilation.num_fwd_outputs,
        )

    first = plan_with(compilation.default_budget_bytes)
    auto: AutoPlan | None = first
    check_notes: list[str] = []
    if (
        backward is not None
        and options.memory_budget_bytes is None
        and compilation.default_budget_bytes is not None
        and any(b.origin == "auto" for b in first.plan.buckets)
    ):
        if not backend.shards_evenly:
            check_notes.append("estimate check: skipped (uneven shards differ between ranks)")
        elif _symbolic(gm, backward):
            check_notes.append("estimate check: skipped (dynamic shapes)")
        else:
            graphs = [("forward", gm), ("backward", backward)]
            search = compilation.keep_search
            auto, check_notes = fit_to_reference(
                first,
                plan_with,
                lambda plan: estimated_peak(graphs, plan, compilation),
                backend.plan(),
                search.get("slack_bytes", 0) - search.get("spent_bytes", 0),
            )
    if auto is None:  # no auto plan fits the check
        return GraphPlan(backend.plan(), None, first.notes + check_notes)
    decided = GraphPlan(
        auto.plan, auto.sites, first.notes + check_notes + (auto.notes if auto is not first else [])
    )
    if not any(b.origin == "auto" for b in decided.plan.buckets):
        # No all-gathers (replicate mode): keep the per-block plan.
        decided.plan = backend.plan()
        decided.notes.append("auto: no all-gathers to plan; using the per-block plan")
    return decided
