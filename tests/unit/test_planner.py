"""The auto planner, cost model and memory estimator with fixed inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp.compiler.auto_bucketing import (
    GatherUnit,
    greedy_buckets,
    pipeline_time_s,
    step_extra_bytes,
    to_plan,
)
from simplefsdp.compiler.cost_model import CostModel, LinearFit, node_flops, simulate
from simplefsdp.compiler.memory_estimate import estimate_memory
from simplefsdp.plan.predict import prefetch_extra_bytes

MiB = 2**20


def _units(sizes_mib, compute_s):
    return [GatherUnit(f"p{i}", int(size * MiB), 2, compute_s) for i, size in enumerate(sizes_mib)]


def _model(latency_s=1e-3, seconds_per_mib=1e-3) -> CostModel:
    fit = LinearFit(latency_s, seconds_per_mib / MiB)
    return CostModel(comm={f"{k}/2": fit for k in ("all_gather", "reduce_scatter", "all_reduce")})


def _names(buckets):
    return [[u.fqn for u in b] for b in buckets]


def test_latency_bound_merges_everything_without_budget() -> None:
    # Tiny compute: every merge saves latency and nothing can be hidden anyway.
    buckets = greedy_buckets(
        _units([1] * 6, compute_s=0.0),
        _model(),
        reshard_after_forward=True,
        base_peak_bytes=0,
        memory_budget_bytes=None,
    )
    assert _names(buckets) == [[f"p{i}" for i in range(6)]]


def test_first_bucket_alone_then_grow_while_hidden() -> None:
    # One unit: comm = 3 * (1 ms + 1 ms/MiB) = 6 ms; window = 3 * compute.
    # The first bucket is exposed whatever it holds, so p1 is better off in
    # its own bucket hidden under p0's compute; with 5 ms of compute per unit
    # (15 ms window) the next buckets grow while their comm still hides.
    buckets = greedy_buckets(
        _units([1] * 4, compute_s=5e-3),
        _model(),
        reshard_after_forward=True,
        base_peak_bytes=0,
        memory_budget_bytes=None,
    )
    assert _names(buckets) == [["p0"], ["p1", "p2", "p3"]]


def test_short_windows_keep_parameters_apart() -> None:
    # 2.5 ms compute (7.5 ms window): two units' comm (9 ms) would not hide.
    buckets = greedy_buckets(
        _units([1] * 4, compute_s=2.5e-3),
        _model(),
        reshard_after_forward=True,
        base_peak_bytes=0,
        memory_budget_bytes=None,
    )
    assert _names(buckets) == [["p0"], ["p1"], ["p2"], ["p3"]]


def test_no_overlap_merges_what_overlap_would_keep_apart() -> None:
    # The windows of the test above, but communication cannot run beside
    # compute (a CPU with gloo): splitting hides nothing and each merge saves
    # a latency, so the planner merges; the replay charges the collectives to
    # the compute stream.
    units = _units([1] * 4, compute_s=2.5e-3)
    model = _model()
    model.comm_overlap = 0.0
    buckets = greedy_buckets(
        units, model, reshard_after_forward=True, base_peak_bytes=0, memory_budget_bytes=None
    )
    assert _names(buckets) == [["p0", "p1", "p2", "p3"]]
    # One bucket's 3 collectives of 1 ms + 4 ms (exposed: nothing to hide
    # under) then 4 units x 7.5 ms of compute.
    assert pipeline_time_s(buckets, model, True) == pytest.approx(0.015 + 0.030)
    # Kept apart, every transfer is serialised with compute: 3 latencies more.
    split = [[u] for u in units]
    assert pipeline_time_s(split, model, True) == pytest.approx(4 * 3 * 2e-3 + 0.030)


def test_tighter_budget_gives_smaller_buckets() -> None:
    units = _units([1] * 8, compute_s=0.0)
    sizes = []
    for budget_mib in (None, 24, 12, 7.5):  # 7.5: the minimum (singles)
        buckets = greedy_buckets(
            units,
            _model(),
            reshard_after_forward=True,
            base_peak_bytes=0,
            memory_budget_bytes=None if budget_mib is None else int(budget_mib * MiB),
        )
        largest = max(sum(u.gathered_bytes for u in b) for b in buckets)
        sizes.append(largest)
        if budget_mib is not None:
            assert step_extra_bytes(buckets) <= budget_mib * MiB
            assert prefetch_extra_bytes(buckets) <= step_extra_bytes(buckets)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert sizes[-1] == 1 * MiB


def test_budget_below_minimum_names_the_minimum() -> None:
    units = _units([1, 2, 1], compute_s=0.0)
    # base + worst of singles: 3 * B_i + B_{i-1} in backward (3 * 2 + 1 MiB)
    # with the sharded gradients of p1 and p2 (1 + 0.5 MiB)
    minimum = 100 + 3 * 2 * MiB + 1 * MiB + 3 * MiB // 2
    with pytest.raises(ValueError, match=f"unavoidable minimum of {minimum} bytes"):
        greedy_buckets(
            units,
            _model(),
            reshard_after_forward=True,
            base_peak_bytes=100,
            memory_budget_bytes=minimum - 1,
        )


def test_plan_is_data_and_covers_every_parameter() -> None:
    units = _units([1, 1], compute_s=0.0)
    plan = to_plan([units], ["p0", "p1", "frozen_in_backward_only"])
    assert [b.param_fqns for b in plan.buckets] == [("p0", "p1"), ("frozen_in_backward_only",)]
    assert plan.to_dict()["buckets"][0]["origin"] == "auto"


def test_flops_and_memory_estimates_on_a_traced_graph() -> None:
    def f(x, w1, w2):
        h = torch.relu(x @ w1)  # (8, 32)
        return (h @ w2).sum()

    args = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4))
    gm = make_fx(f, tracing_mode="fake")(*args)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [node_flops(n) for n in mms] == [2 * 8 * 16 * 32, 2 * 8 * 32 * 4]
    estimate = estimate_memory(gm)
    assert estimate.input_bytes == 4 * (8 * 16 + 16 * 32 + 32 * 4)
    # mm1 (8x32) and relu (8x32) are alive together, then relu + mm2 (8x4)
    assert estimate.peak_bytes == 4 * (8 * 32 * 2)
    timeline = simulate(gm, CostModel(flops_per_s=1e9, bytes_per_s=1e12, kernel_overhead_s=0))
    assert timeline["comm_s"] == 0 and timeline["exposed_comm_s"] == 0
    assert timeline["compute_s"] == pytest.approx(
        (2 * 8 * 16 * 32 + 2 * 8 * 32 * 4) / 1e9, rel=0.01
    )


def test_each_output_of_a_multi_output_op_is_counted() -> None:
    # torch.sort returns values and indices: the op's value is a tuple (no
    # bytes of its own), each getitem its own tensor; both stay alive as
    # outputs, as attention's output and log-sum-exp do when saved.
    def f(x):
        values, indices = torch.sort(x)
        return values, indices

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64))
    estimate = estimate_memory(gm)
    assert estimate.output_bytes == 64 * 4 + 64 * 8
    assert estimate.peak_bytes == 64 * 4 + 64 * 8


def _reduce_scatter_waited_late() -> torch.fx.GraphModule:
    """A backward-like graph: a gradient reduce-scattered, then more compute
    before the wait (as the reordering pass leaves it). float32, 1 KiB per
    256 elements; the tangent is an input that is not state, the shard is."""
    from simplefsdp.compiler.patterns import REDUCE_SCATTER, WAIT

    aten = torch.ops.aten
    g = torch.fx.Graph()

    def node(n, numel):
        n.meta["val"] = torch.empty(numel)
        return n

    tangent = node(g.placeholder("tangents_1"), 256)
    shard = node(g.placeholder("primals_1"), 256)
    grad = node(g.call_function(aten.mul.Tensor, (tangent, shard)), 256)
    rs = node(g.call_function(REDUCE_SCATTER, (grad, "sum", 2, "g")), 128)
    later = node(g.call_function(aten.mul.Tensor, (tangent, tangent)), 256)
    waited = node(g.call_function(WAIT, (rs,)), 128)
    g.output((waited, later))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_collective_inputs_live_until_the_wait_and_gloo_stages() -> None:
    gm = _reduce_scatter_waited_late()
    KiB = 1024
    # The gradient (1 KiB) is held by the reduce-scatter until its wait, so it
    # is alive beside the sharded output (0.5) and the later product (1).
    assert estimate_memory(gm).peak_bytes == 2.5 * KiB
    # gloo reduces a copy of its input: another KiB from issue to wait.
    from simplefsdp.compiler.memory_estimate import staged_on_cpu

    staged = estimate_memory(gm, staged=staged_on_cpu)
    assert staged.peak_bytes == 3.5 * KiB
    # Beyond the state: the tangent too, freed after its last use (the later
    # product), so it is in the peak; the shard is state and never counted.
    assert staged.live_peak_bytes == 4.5 * KiB
    assert estimate_memory(gm, staged=lambda node: False).peak_bytes == 2.5 * KiB


def test_transient_peak_leaves_out_the_outputs_produced_so_far() -> None:
    """A backward-like graph whose temporary dies before most gradients
    exist: its peak less all its outputs (0) understates the temporary."""
    aten = torch.ops.aten
    g = torch.fx.Graph()

    def node(n):
        n.meta["val"] = torch.empty(256)  # 1 KiB each
        return n

    tangent = node(g.placeholder("tangents_1"))
    temp = node(g.call_function(aten.mul.Tensor, (tangent, tangent)))
    grads = [node(g.call_function(aten.mul.Tensor, (temp, tangent)))]
    grads += [node(g.call_function(aten.mul.Tensor, (tangent, tangent))) for _ in range(2)]
    g.output(tuple(grads))
    estimate = estimate_memory(torch.fx.GraphModule(torch.nn.Module(), g))
    KiB = 1024
    assert (estimate.peak_bytes, estimate.output_bytes) == (3 * KiB, 3 * KiB)
    # The temporary beside the first gradient: 1 KiB beyond it.
    assert estimate.transient_peak_bytes == 1 * KiB


def test_staging_follows_the_groups_backend() -> None:
    """gloo stages, other backends (NCCL, MPI, the fake group) do not; a
    group whose backend is unknown falls back to the tensors' device."""
    from simplefsdp.compiler.memory_estimate import backend_for, staged_by

    gm = _reduce_scatter_waited_late()  # its reduce-scatter runs on group "g", CPU tensors
    KiB = 1024
    for backends, peak in [
        ({"g": "gloo"}, 3.5),
        ({"g": "cpu:gloo,cuda:nccl"}, 3.5),
        ({"g": "mpi"}, 2.5),
        ({"g": "fake"}, 2.5),
        ({"g": "cuda:nccl"}, 2.5),  # nothing named for CPU
        ({}, 3.5),
    ]:
        assert estimate_memory(gm, staged=staged_by(backends)).peak_bytes == peak * KiB, backends
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for("nccl", "cuda") == "nccl"


def test_comm_overlap_from_timings_and_old_cost_model_files() -> None:
    from simplefsdp.compiler.cost_model import measure_comm_overlap

    def timings(*seconds):
        it = iter(seconds)
        return lambda fn: next(it)  # comm, one matmul, matmuls, both together

    cpu = torch.device("cpu")
    # Taking turns: together as long as apart.
    assert measure_comm_overlap(None, cpu, timings(0.1, 0.01, 0.1, 0.2)) == 0.0
    assert measure_comm_overlap(None, cpu, timings(0.1, 0.01, 0.1, 0.1)) == 1.0
    assert measure_comm_overlap(None, cpu, timings(0.1, 0.01, 0.1, 0.15)) == pytest.approx(0.5)
    data = CostModel().to_dict()
    assert data["comm_overlap"] == 1.0
    del data["comm_overlap"]  # a cache file written before it was measured
    assert CostModel.from_dict(data).comm_overlap == 1.0


def test_keep_choice_spends_the_slack_on_the_last_buckets() -> None:
    from simplefsdp.compiler.keep_gathered import choose_kept

    sizes = [5, 1, 2, 3, 4]  # forward order; the last 2 are free
    assert choose_kept(sizes, free=2, slack_bytes=0) == (2, 0)
    assert choose_kept(sizes, free=2, slack_bytes=2) == (3, 2)
    # the next one back (1) would fit, but buckets are kept from the end only
    assert choose_kept(sizes, free=2, slack_bytes=2.5) == (3, 2)
    assert choose_kept(sizes, free=2, slack_bytes=3) == (4, 3)
    assert choose_kept(sizes, free=2, slack_bytes=100) == (5, 8)
    assert choose_kept(sizes, free=2, slack_bytes=-5) == (2, 0)
    assert choose_kept([7], free=2, slack_bytes=0) == (1, 0)


def test_kept_buckets_are_not_charged_a_regather() -> None:
    # Latency bound (every merge wins), 9 MiB of headroom: a regathered
    # bucket costs 3 * B_i (+ B_{i-1}) in backward, a kept one 2 * B_i, both
    # plus the sharded gradients (half of each unit's 1 MiB) of it and after.
    units = _units([1] * 4, compute_s=0.0)
    kwargs = dict(reshard_after_forward=True, base_peak_bytes=0, memory_budget_bytes=9 * MiB)
    regathered = greedy_buckets(units, _model(), **kwargs)
    kept = greedy_buckets(units, _model(), kept={u.fqn for u in units}, **kwargs)
    # [p2, p3] ends its backward at 3 * 2 + 2 + 1 MiB
    assert _names(regathered) == [["p0", "p1"], ["p2", "p3"]]
    assert step_extra_bytes(regathered) == 9 * MiB
    # kept: [p0, p1, p2] ends at 2 * 3 + 2 MiB (p3's 1 MiB is kept: no
    # prefetch); all 4 together would need 2 * 4 + 2 MiB
    assert _names(kept) == [["p0", "p1", "p2"], ["p3"]]
    assert step_extra_bytes(kept, kept={u.fqn for u in units}) == 8 * MiB


def test_backward_is_charged_where_activations_are_freed() -> None:
    # 4 units of 1 MiB, each saving 4 MiB of activations in its window; the
    # unbucketed peak is those 16 MiB (R = 0); 6 MiB of headroom above it.
    def units(positions: bool):
        return [
            GatherUnit(f"p{i}", MiB, 2, 0.0, 0.0, 4 * i * MiB if positions else 0,
                       4 * MiB if positions else 0)
            for i in range(4)
        ]  # fmt: skip

    kwargs = dict(reshard_after_forward=True, memory_budget_bytes=22 * MiB)
    # Without positions every bucket's backward is charged on top of all
    # 16 MiB: 3 * B_i + B_{i-1} and the sharded gradients (0.5 MiB per
    # unit, of it and after it) within 6 MiB: [p0, p1] would need 8.
    flat = greedy_buckets(units(False), _model(), base_peak_bytes=16 * MiB, **kwargs)
    assert _names(flat) == [["p0"], ["p1"], ["p2"], ["p3"]]
    # With them, a bucket's backward ends with only the activations before
    # it alive. 3 units together: its gradients complete with 0 MiB of
    # activations (9 + 2 MiB of sharded gradients), p3's backward starts
    # with all 16 and both gathered (16 + 1 + 3 = 20 MiB). A whole-model
    # bucket is stopped by its forward alone: 16 MiB + 2 * 4 MiB > 22 MiB.
    placed = greedy_buckets(units(True), _model(), base_peak_bytes=16 * MiB, **kwargs)
    assert _names(placed) == [["p0", "p1", "p2"], ["p3"]]
    assert 16 * MiB + step_extra_bytes(placed) == 20 * MiB
    assert step_extra_bytes([units(True)]) == 8 * MiB
    # Without positions: 3 * 4 MiB and all 2 MiB of sharded gradients.
    assert step_extra_bytes([units(False)]) == 14 * MiB


def test_saved_activations_are_the_outputs_after_the_users() -> None:
    from simplefsdp.compiler.auto_bucketing import saved_activations

    def f(x, w):
        h = x @ w  # (8, 32) saved
        r = torch.relu(h)  # saved, also seen through a view
        return r.sum(), h, r.view(-1), x

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    nodes = list(gm.graph.nodes)
    saved = saved_activations(gm, num_user_outputs=1)
    mm = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default)
    relu = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.relu.default)
    # x is a graph input (resident anyway); the view is relu's storage
    assert saved == {mm: 8 * 32 * 4, relu: 8 * 32 * 4}
    assert saved_activations(gm, num_user_outputs=None) == {}


def test_kept_buckets_are_not_gathered_again_in_the_replay() -> None:
    # Every bucket kept gathered from forward to backward: each is gathered
    # once, exactly as without resharding; one kept bucket of two saves
    # exactly one all-gather of its size.
    units = _units([4, 4, 4, 4], compute_s=1e-3)
    buckets = [units[:2], units[2:]]
    cm = dataclasses.replace(_model(), comm_overlap=0.0)  # nothing hides: times add
    every = {u.fqn for u in units}
    assert pipeline_time_s(buckets, cm, True, kept=every) == pytest.approx(
        pipeline_time_s(buckets, cm, False)
    )
    last = {u.fqn for u in buckets[1]}
    saved = pipeline_time_s(buckets, cm, True) - pipeline_time_s(buckets, cm, True, kept=last)
    assert saved == pytest.approx(cm.comm_time("all_gather", 2, 8 * MiB))
    # A bucket only partly kept is still gathered again.
    partly = {units[3].fqn}
    assert pipeline_time_s(buckets, cm, True, kept=partly) == pipeline_time_s(buckets, cm, True)


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """A one-rank gloo group and an empty calibration cache under ``tmp_path``,
    with the communication calibration replaced by a fixed fit; yields the
    cache file's path and that fit."""
    import torch.distributed as dist

    from simplefsdp.compiler import cost_model as cm

    fit = {f"{kind}/1": LinearFit(1e-4, 1e-9) for kind in ("all_gather", "reduce_scatter")}
    monkeypatch.setattr(cm, "calibrate_comm", lambda group, device, prefix="": fit)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SIMPLEFSDP_RECALIBRATE", raising=False)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        path = cm._cache_path("gloo", 1, "cpu")
        path.parent.mkdir(parents=True)
        yield path, fit
    finally:
        dist.destroy_process_group()


def test_the_cached_overlap_is_a_median_and_single_measurements_are_recalibrated(
    calibration_cache, monkeypatch
) -> None:
    # Note: [Communication competing with compute]: one measurement ranged
    # 0-0.52 on a 2-core CPU; the cache keeps a median of several,
    # and a cache file with one measurement in it is measured again.
    import json

    from simplefsdp.compiler import cost_model as cm

    path, fit = calibration_cache
    samples = iter([0.5, 0.0, 0.1, 0.9, 0.2] * 2)
    calls = []

    def overlap(group, device, timer=None):
        calls.append(1)
        return next(samples)

    monkeypatch.setattr(cm, "measure_comm_overlap", overlap)
    monkeypatch.setattr(cm, "_calibrate_compute", lambda device: (1e10, 1e9, {}))
    one = CostModel(comm=dict(fit), comm_overlap=0.52)  # one measurement, no rounds
    path.write_text(json.dumps(one.to_dict()))
    model = cm.calibrated_cost_model(device_type="cpu")
    assert len(calls) == cm.OVERLAP_ROUNDS == 5
    assert model.comm_overlap == pytest.approx(0.2)  # median of 0.5, 0, 0.1, 0.9, 0.2
    assert json.loads(path.read_text())["overlap_rounds"] == cm.OVERLAP_ROUNDS
    again = cm.calibrated_cost_model(device_type="cpu")  # from the cache now
    assert len(calls) == 5 and again.comm_overlap == pytest.approx(0.2)


def test_matmuls_are_priced_at_their_dtype_rate() -> None:
    # Note: [Matmul rates by dtype]: a bf16 graph's matmuls run at the bf16
    # rate (on an H200 about 14 times float32's); dtypes without a rate fall
    # back to flops_per_s, and elementwise nodes are unaffected.
    def f(a, b):
        return torch.mm(a, b).relu()

    model = CostModel(
        flops_per_s=1e12,
        flops_per_s_by_dtype={"bfloat16": 1e14},
        bytes_per_s=1e30,
        kernel_overhead_s=0.0,
    )
    flops = 2.0 * 256 * 512 * 128

    def mm_and_relu(dtype):
        gm = make_fx(f, tracing_mode="fake")(
            torch.randn(256, 512, dtype=dtype), torch.randn(512, 128, dtype=dtype)
        )
        mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
        return model.node_time(mm), model.node_time(relu)

    no_time = pytest.approx(0.0, abs=1e-20)  # relu: bytes only, at an unbounded bandwidth
    assert mm_and_relu(torch.float32) == (pytest.approx(flops / 1e12), no_time)
    assert mm_and_relu(torch.bfloat16) == (pytest.approx(flops / 1e14), no_time)
    assert mm_and_relu(torch.float16)[0] == pytest.approx(flops / 1e12)  # not calibrated
    data = model.to_dict()
    assert CostModel.from_dict(data).flops_per_s_by_dtype == {"bfloat16": 1e14}
    del data["flops_per_s_by_dtype"]  # a cache file written before the rates
    assert CostModel.from_dict(data).flops_per_s_by_dtype == {}


def test_a_cached_cost_model_without_dtype_rates_is_recalibrated(
    calibration_cache, monkeypatch
) -> None:
    import json

    from simplefsdp.compiler import cost_model as cm

    path, fit = calibration_cache
    calls = []

    def compute(device):
        calls.append(device)
        return 1e10, 1e9, {"bfloat16": 3e11}

    monkeypatch.setattr(cm, "measure_comm_overlap", lambda group, device, timer=None: 0.5)
    monkeypatch.setattr(cm, "_calibrate_compute", compute)
    old = CostModel(comm=dict(fit), comm_overlap=0.5).to_dict()
    del old["flops_per_s_by_dtype"]  # written before the rates by dtype
    path.write_text(json.dumps({**old, "overlap_rounds": cm.OVERLAP_ROUNDS}))
    model = cm.calibrated_cost_model(device_type="cpu")
    assert len(calls) == 1 and model.flops_per_s_by_dtype == {"bfloat16": 3e11}
    assert json.loads(path.read_text())["flops_per_s_by_dtype"] == {"bfloat16": 3e11}
    again = cm.calibrated_cost_model(device_type="cpu")  # from the cache now
    assert len(calls) == 1 and again.flops_per_s_by_dtype == {"bfloat16": 3e11}


def test_the_calibration_measures_a_bf16_matmul_rate_on_this_device() -> None:
    from simplefsdp.compiler.cost_model import _calibrate_compute

    flops, bandwidth, by_dtype = _calibrate_compute(torch.device("cpu"))
    assert flops > 0 and bandwidth > 0
    assert set(by_dtype) == {"bfloat16"} and by_dtype["bfloat16"] > 0
