"""The compiler's passes on float8 all-gathers, mixed-dtype buckets and
expert parallelism's all-to-alls, on small traced graphs in one process (a
1-rank gloo group: every collective is the identity, so a rewritten graph
must return bitwise what the original returns)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp.compiler.passes.bucketing import apply_buckets, find_sites, plan_buckets
from simplefsdp.compiler.passes.float8 import (
    AMAX_META,
    fold_double_waits,
    merge_amax_all_reduces,
)
from simplefsdp.compiler.passes.reordering import reorder
from simplefsdp.compiler.patterns import CollectiveGroups, collective_kind
from simplefsdp.compiler.report import CommReport, build_graph_report, format_report

F8 = torch.float8_e4m3fn
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@pytest.fixture
def group():
    """A 1-rank gloo process group (and a second one over the same rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD, dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _float8_read(x: torch.Tensor, group) -> torch.Tensor:
    """A float8 weight read as the parametrization traces it: amax
    all-reduce (MAX), scale, saturated cast, the bytes all-gathered."""
    amax = funcol.wait_tensor(funcol.all_reduce(x.abs().max(), "max", group))
    scale = (448.0 / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    bits = (x * scale).clamp(-448.0, 448.0).to(F8).view(torch.uint8)
    gathered = funcol.wait_tensor(_all_gather(bits, 0, group))
    return gathered.view(F8).to(torch.float32) / scale


def _collectives(gm, kind):
    return [n for n in gm.graph.nodes if collective_kind(n) == kind]


def _trace(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm, {n.name: n.name for n in gm.graph.nodes if n.op == "placeholder"}


def _fake_mode(gm):
    return next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder").fake_mode


def test_float8_and_high_precision_gathers_share_one_bucket(group):
    """Note: [Mixed dtypes in one all-gather bucket] and Note: [One amax
    all-reduce per graph]: one uint8 all-gather and one amax all-reduce,
    exact; float8 members first in the graph (odd byte counts) and the
    wider members still land aligned."""
    world, _ = group
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(5, 3, generator=gen), torch.randn(3, 3, generator=gen) * 100
    bias = torch.randn(7, generator=gen)
    norm = torch.randn(3, generator=gen).to(torch.bfloat16)

    def step(w1, w2, bias, norm):
        a = _float8_read(w1, world)
        b = _all_gather(bias, 0, world)
        c = _float8_read(w2, world)
        d = _all_gather(norm, 0, world)
        return a.sum(0) + c.sum(0), funcol.wait_tensor(b) * 2, funcol.wait_tensor(d) + 1

    args = (w1, w2, bias, norm)
    expected = step(*args)
    gm, names = _trace(step, *args)
    fake_mode = _fake_mode(gm)
    assert len(_collectives(gm, "all_reduce")) == 2
    fold_double_waits(gm.graph)
    merged = merge_amax_all_reduces(gm, fake_mode, primal_names=names)
    assert [m["merged"] for m in merged] == [2] and sorted(merged[0]["params"]) == ["w1_1", "w2_1"]
    (amax,) = _collectives(gm, "all_reduce")
    assert amax.meta[AMAX_META] and amax.args[1] == "max"
    sites = find_sites(gm.graph, names, {})
    assert {s.fqn: str(s.dtype) for s in sites} == {
        "w1_1": "torch.float8_e4m3fn",
        "bias_1": "torch.float32",
        "w2_1": "torch.float8_e4m3fn",
        "norm_1": "torch.bfloat16",
    }
    # float8 sites price their gradient at the stored shard's element size
    assert {s.fqn: s.grad_bytes for s in sites if s.float8} == {"w1_1": 60, "w2_1": 36}
    buckets = plan_buckets(sites, {s.fqn: 0 for s in sites}, ["all"])
    assert len(buckets) == 1 and buckets[0].dtype == "float8_e4m3fn+float32+bfloat16"
    apply_buckets(gm, buckets, fake_mode)
    (gather,) = _collectives(gm, "all_gather")
    assert gather.args[0].meta["val"].dtype == torch.uint8
    assert gather.meta["simplefsdp_dtype_bytes"] == {
        "float8_e4m3fn": 24,
        "float32": 28,
        "bfloat16": 6,
    }
    reorder(gm, 1)
    for got, want in zip(gm(*args), expected):
        assert torch.equal(got, want)
    report = build_graph_report(gm, "forward", 0, names, {})
    rows = {c.kind: c for c in report.collectives}
    assert rows["all_gather"].dtype == "float8_e4m3fn+float32+bfloat16"
    assert rows["all_gather"].bytes == 58 and rows["all_reduce"].bytes == 8


def test_buckets_never_span_process_groups(group):
    world, other = group

    def step(a, b, c, d):
        outs = [_all_gather(t, 0, g) for t, g in ((a, world), (b, other), (c, world), (d, other))]
        return [funcol.wait_tensor(o) * 1 for o in outs]

    args = [torch.randn(4) for _ in range(4)]
    gm, names = _trace(step, *args)
    sites = find_sites(gm.graph, names, {})
    buckets = plan_buckets(sites, {s.fqn: 0 for s in sites}, ["block"])
    assert sorted(sorted(s.fqn for s in b.sites) for b in buckets) == [
        ["a_1", "c_1"],
        ["b_1", "d_1"],
    ]
    apply_buckets(gm, buckets, _fake_mode(gm))
    groups = sorted(n.args[2] for n in _collectives(gm, "all_gather"))
    assert groups == sorted([world.group_name, other.group_name])


def test_all_to_all_has_role_ep_and_stays_in_place(group):
    """Note: [All-to-alls of expert parallelism]."""
    from simplefsdp.compiler.cost_model import CostModel, LinearFit, simulate

    world, _ = group

    def step(w, tokens):
        gathered = funcol.wait_tensor(_all_gather(w, 0, world))
        routed = funcol.wait_tensor(funcol.all_to_all_single(tokens, [6], [6], world))
        return routed @ gathered.view(4, 4)

    args = (torch.randn(16), torch.randn(6, 4))
    gm, names = _trace(step, *args)
    groups = CollectiveGroups(data_parallel=frozenset({world.group_name}))
    (a2a,) = _collectives(gm, "all_to_all")
    assert groups.role(a2a) == "ep" and groups.role(_collectives(gm, "all_gather")[0]) == "dp"
    assert [s.kind for s in find_sites(gm.graph, names, {}, groups)] == ["all_gather"]
    before = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    position = before.index(a2a.name)
    reorder(gm, 1, groups)
    assert [n.name for n in gm.graph.nodes].index(a2a.name) - len(names) == position
    report = build_graph_report(gm, "forward", 0, names, {}, groups)
    (row,) = [c for c in report.collectives if c.kind == "all_to_all"]
    assert (row.role, row.bytes, row.group_size) == ("ep", 96, 1)
    assert report.by_role()["ep"] == {"all_to_all": {"count": 1, "bytes": 96}}
    text = format_report(CommReport(graphs=[report]))
    assert "expert-parallel collectives (left in place): 1 all_to_all; 96 B" in text
    # Priced on its link: the ep fit, else as an all-gather of its bytes.
    gather_fit = CostModel(comm={"all_gather/1": LinearFit(1.0, 0.0)})
    assert gather_fit.comm_time("all_to_all", 1, 96, "ep") == 1.0
    ep_fit = CostModel(comm={"ep:all_to_all/1": LinearFit(3.0, 0.0)})
    assert ep_fit.collective_time(a2a, "ep") == 3.0
    assert simulate(gm, ep_fit, groups)["ep_comm_s"] == 3.0


def test_planner_prices_float8_units_at_their_bytes():
    """Note: [Float8 bytes in the planner]: gathered at one byte per element,
    reduce-scattered at the gradient's element size."""
    from simplefsdp.compiler.auto_bucketing import GatherUnit, bucket_comm_s, step_extra_bytes
    from simplefsdp.compiler.cost_model import CostModel, LinearFit

    mib = 2**20
    cost = CostModel(
        comm={
            "all_gather/2": LinearFit(0.0, 1.0 / mib),
            "reduce_scatter/2": LinearFit(0.0, 10.0 / mib),
        }
    )
    float8 = GatherUnit("w", mib, 2, 1e-3, grad_bytes=4 * mib)
    plain = GatherUnit("w", 4 * mib, 2, 1e-3)
    # two all-gathers (resharded) of 1 MiB, one reduce-scatter of 4 MiB
    assert bucket_comm_s([float8], cost, True) == pytest.approx(2 + 40)
    assert bucket_comm_s([plain], cost, True) == pytest.approx(8 + 40)
    # Backward at its end holds the regathered weight, its gradient and the
    # reduce-scatter's input and output: the gradients weigh what the
    # high-precision weight does, the regathered weight a quarter.
    assert step_extra_bytes([[float8]]) == mib + 2 * 4 * mib + 4 * mib // 2
    assert step_extra_bytes([[plain]]) == 4 * mib + 2 * 4 * mib + 4 * mib // 2
