"""The estimator's check of an auto plan (Note: [Checking the plan with the
estimator]): replanning under a lowered budget until the estimate fits."""

from __future__ import annotations

from simplefsdp.bucket_plan import Bucket, BucketPlan
from simplefsdp.compiler.auto_bucketing import AutoPlan
from simplefsdp.compiler.estimate_check import ROUNDS, fit_to_reference

REFERENCE = BucketPlan((Bucket("block", ("w",), "per_block"),))


def _planner(estimates: dict[int, int]):
    """``plan_with(budget)`` and ``estimate(plan)``: a plan per budget whose
    estimate is ``estimates[budget]`` (the reference's: 100)."""
    made: dict[int, AutoPlan] = {}

    def plan_with(budget: int) -> AutoPlan:
        if budget < 0:
            raise ValueError("below the minimum")
        plan = BucketPlan((Bucket(f"auto:{budget}", ("w",), "auto"),))
        made[budget] = AutoPlan(plan, [], {"num_buckets": 1, "memory_budget_bytes": budget}, [])
        return made[budget]

    def estimate(plan: BucketPlan | None) -> int:
        if plan is REFERENCE:
            return 100
        budget = int(plan.buckets[0].name.split(":")[1])
        return estimates.get(budget, budget + 20)  # the bucket model 20 bytes short

    return plan_with, estimate, made


def test_a_plan_within_the_reference_and_slack_is_kept() -> None:
    plan_with, estimate, _ = _planner({})
    first = plan_with(85)  # estimated 105 = 100 + the slack of 5
    fitted, notes = fit_to_reference(first, plan_with, estimate, REFERENCE, 5)
    assert fitted is first
    assert len(notes) == 1 and "within" in notes[0] and "replans" not in notes[0]


def test_a_plan_over_is_replanned_under_the_excess_lowered_budget() -> None:
    plan_with, estimate, made = _planner({})
    first = plan_with(100)  # estimated 120: 15 over 100 + 5
    fitted, notes = fit_to_reference(first, plan_with, estimate, REFERENCE, 5)
    assert fitted is made[85] and fitted.data["memory_budget_bytes"] == 85
    assert "15 B over" in notes[0] and "budget lowered to 85 bytes" in notes[0]
    assert "within" in notes[1] and "after 1 replans, 2 bisections" in notes[1]
    assert sorted(made) == [85, 88, 92, 100]  # bisected: 92 and 88 are over


def test_bisection_finds_a_larger_plan_that_fits() -> None:
    # lowering 100 by its excess (25) overshoots: 87 fits too, 93 does not
    plan_with, estimate, made = _planner({100: 130, 75: 90, 87: 104, 93: 110})
    fitted, notes = fit_to_reference(plan_with(100), plan_with, estimate, REFERENCE, 5)
    assert fitted is made[87] and "104 B at their peak" in notes[-1]


def test_unspent_slack_below_zero_allows_only_the_reference() -> None:
    plan_with, estimate, made = _planner({})
    fitted, _ = fit_to_reference(plan_with(100), plan_with, estimate, REFERENCE, -50)
    assert fitted is made[80]  # 120 against 100: lowered by 20


def test_no_fitting_plan_falls_back_to_the_reference() -> None:
    # far over: the lowered budget is below the minimum (plan_with raises)
    plan_with, estimate, made = _planner({500: 1000})
    fitted, notes = fit_to_reference(plan_with(500), plan_with, estimate, REFERENCE, 0)
    assert fitted is None and notes[-1].endswith("using the per-block plan")
    assert list(made) == [500]
    # always 1 byte over: ROUNDS replans, then the per-block plan
    plan_with, estimate, made = _planner({b: 101 for b in range(1000)})
    fitted, notes = fit_to_reference(plan_with(500), plan_with, estimate, REFERENCE, 0)
    assert fitted is None and len(made) == 1 + ROUNDS and "giving up" in notes[-2]


def test_graphs_with_symbolic_shapes_are_not_checked() -> None:
    import torch
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    from simplefsdp.compiler.estimate_check import _symbolic

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    dynamic = mode.from_tensor(torch.empty(4, 3), symbolic_context=context)
    static = FakeTensorMode().from_tensor(torch.empty(4, 3))  # no shape environment

    def graph(value) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = value
        g.output(x)
        return fx.GraphModule(torch.nn.Module(), g)

    assert not _symbolic(graph(static), graph(static))
    assert _symbolic(graph(static), graph(dynamic))  # the backward's counts too
