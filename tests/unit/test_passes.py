"""Bucketing and reordering passes on real traced graphs, in one process.

A fake process group (no communication) stands in for 2 ranks: the graphs are
exactly those simplefsdp.compile builds, and the tests inspect them. The mesh
is built on "cpu" explicitly, where the models live, also on machines with a
GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import simplefsdp
from simplefsdp.bucket_plan import repeated_blocks, resolve_plan
from simplefsdp.compiler.patterns import collective_kind, is_compute, wait_of
from toy_models import BlockStack, ResidualBlock


@pytest.fixture
def fake_mesh():
    """A 2-rank fake process group and a "cpu" mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Each test compiles a fresh model of the same class: start from an empty
    # Dynamo cache so the recompile limit is never reached.
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _compile_and_run(mesh, bucketing, reorder=True, mode="fully_shard", reshard=True, prefetch=1):
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(BlockStack(), mesh, mode=mode, reshard_after_forward=reshard)
    simplefsdp.compile(
        model, backend="aot_eager", bucketing=bucketing, reorder=reorder, prefetch_distance=prefetch
    )
    tokens = torch.randint(0, 23, (2, 5))
    model(tokens).sum().backward()
    backend = model.__dict__["_simplefsdp_backend"]
    return {name: gm for name, gm in backend.graph_modules}, simplefsdp.comm_report(model)


def _collectives(gm, kind):
    return [n for n in gm.graph.nodes if collective_kind(n) == kind]


def _compute_positions(gm):
    pos, seen = {}, 0
    for node in gm.graph.nodes:
        if is_compute(node):
            seen += 1
        pos[node] = seen
    return pos


def test_bucket_count_equals_plan_buckets(fake_mesh) -> None:
    graphs, report = _compile_and_run(fake_mesh, "per_block")
    fw, bw = graphs["forward"], graphs["backward"]
    # embed | 3 blocks | norm + head: five buckets
    assert len(_collectives(fw, "all_gather")) == 5
    assert len(_collectives(bw, "reduce_scatter")) == 5
    # resharded: backward regathers the buckets whose weights it needs
    assert len(_collectives(bw, "all_gather")) == 4
    for gm in graphs.values():
        gm.graph.lint()
    names = [b.name for b in report.graph("forward").buckets]
    assert names == ["rest:embed.weight", "blocks.0", "blocks.1", "blocks.2", "rest:norm.weight"]
    blocks0 = report.graph("forward").buckets[1]
    assert sorted(blocks0.params) == sorted(
        f"blocks.0.{n}"
        for n in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias")
    )
    assert "bucketing" in " ".join(report.graph("forward").notes)


def test_none_keeps_one_collective_per_parameter(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "none", reorder=False)
    n_params = 1 + 3 * 6 + 2 + 1
    assert len(_collectives(graphs["forward"], "all_gather")) == n_params
    assert len(_collectives(graphs["backward"], "reduce_scatter")) == n_params


def test_manual_plan_of_lists_and_uncovered_params(fake_mesh) -> None:
    plan = [["embed", "blocks.0"], ["blocks.1", "blocks.2"]]
    graphs, report = _compile_and_run(fake_mesh, plan)
    assert len(_collectives(graphs["forward"], "all_gather")) == 3
    names = [b.name for b in report.graph("forward").buckets]
    assert names == ["embed,blocks.0", "blocks.1,blocks.2", "rest:norm.weight"]


def test_class_plan_matches_per_block(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, ResidualBlock)
    assert len(_collectives(graphs["forward"], "all_gather")) == 5


def test_forward_prefetch_order(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "per_block", prefetch=1)
    fw = graphs["forward"]
    pos = _compute_positions(fw)
    gathers = _collectives(fw, "all_gather")
    waits = [wait_of(ag) for ag in gathers]
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    for i in range(1, len(gathers)):
        # AG_i is issued before W_{i-1}, i.e. before bucket i-1's compute begins
        assert order[gathers[i]] < order[waits[i - 1]]
        # ... but not before AG_{i-1} (issue order is bucket order)
        assert order[gathers[i - 1]] < order[gathers[i]]
    for wait in waits:
        # each wait sits right before the first compute node that reads it
        first_compute_after = next(n for n in list(fw.graph.nodes)[order[wait] :] if is_compute(n))
        assert pos[first_compute_after] == pos[wait] + 1


def test_prefetch_distance_two(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "per_block", prefetch=2)
    fw = graphs["forward"]
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    gathers = _collectives(fw, "all_gather")
    waits = [wait_of(ag) for ag in gathers]
    for i in range(2, len(gathers)):
        assert order[gathers[i]] < order[waits[i - 2]]


def test_no_reorder_keeps_waits_next_to_issues(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "per_block", reorder=False)
    pos = _compute_positions(graphs["forward"])
    for ag in _collectives(graphs["forward"], "all_gather"):
        assert pos[ag] == pos[wait_of(ag)]


def test_backward_reductions_issue_early_and_wait_late(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "per_block")
    bw = graphs["backward"]
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    reductions = _collectives(bw, "reduce_scatter")
    for i, rs in enumerate(reductions):
        inputs = rs.args[0]
        # issued right after its input exists (only shaping ops in between)
        between = list(bw.graph.nodes)[order[inputs] + 1 : order[rs]]
        assert not any(is_compute(n) for n in between), between
        wait = wait_of(rs)
        if i + 1 < len(reductions):  # waited right before the next reduce-scatter
            assert order[wait] < order[reductions[i + 1]]
            assert not any(
                collective_kind(n) == "reduce_scatter"
                for n in list(bw.graph.nodes)[order[wait] + 1 : order[reductions[i + 1]]]
            )
            assert order[wait] == order[reductions[i + 1]] - 1 - sum(
                1 for n in list(bw.graph.nodes)[order[wait] + 1 : order[reductions[i + 1]]]
            )
    # at most one reduce-scatter in flight at any point
    in_flight = 0
    for node in bw.graph.nodes:
        if collective_kind(node) == "reduce_scatter":
            in_flight += 1
            assert in_flight <= 1
        elif node.args and any(wait_of(r) is node for r in reductions):
            in_flight -= 1


def test_replicate_mode_buckets_all_reduces(fake_mesh) -> None:
    graphs, _ = _compile_and_run(fake_mesh, "per_block", mode="replicate")
    assert _collectives(graphs["forward"], "all_gather") == []
    assert len(_collectives(graphs["backward"], "all_reduce")) == 5


def test_bad_plans_raise(fake_mesh) -> None:
    model = simplefsdp.data_parallel(BlockStack(), fake_mesh)
    with pytest.raises(ValueError, match="'blocks.7' names no module"):
        simplefsdp.compile(model, bucketing=[["blocks.7"]])
    with pytest.raises(ValueError, match="is in two buckets"):
        simplefsdp.compile(model, bucketing=[["blocks"], ["blocks.0"]])
    with pytest.raises(TypeError, match="did you mean"):
        simplefsdp.compile(model, bucketing=["blocks.0"])


def test_resolve_plan_shapes() -> None:
    model = BlockStack()
    per_block = resolve_plan(model, "per_block")
    assert [b.origin for b in per_block.buckets] == [
        "uncovered",
        "manual",
        "manual",
        "manual",
        "uncovered",
    ]
    by_predicate = resolve_plan(model, lambda fqn, m: isinstance(m, nn.LayerNorm))
    assert [b.name for b in by_predicate.buckets if b.origin == "manual"] == [
        "blocks.0.norm",
        "blocks.1.norm",
        "blocks.2.norm",
        "norm",
    ]
    covered = [f for b in by_predicate.buckets for f in b.param_fqns]
    assert sorted(covered) == sorted(n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="unknown bucket plan 'per_layer'"):
        resolve_plan(model, "per_layer")


def test_repeated_blocks_are_the_per_block_buckets() -> None:
    model = BlockStack()
    blocks = repeated_blocks(model)
    assert [name for name, _ in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(module is model.blocks[i] for i, (_, module) in enumerate(blocks))
    per_block = resolve_plan(model, "per_block")
    assert [b.name for b in per_block.buckets if b.origin == "manual"] == [n for n, _ in blocks]

    # Outermost only, containers themselves are not blocks, parameter-free
    # children are skipped, and a ModuleDict counts like a ModuleList.
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)]), nn.Linear(2, 2)])
            self.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "act": nn.ReLU()})

    assert [name for name, _ in repeated_blocks(Nested())] == [
        "stages.0.0",
        "stages.1",
        "heads.a",
    ]


# The default mesh (mesh=None) follows the parameters' device. Where CUDA is
# visible, the fake backend (which serves every device type) used to get a
# cuda mesh, and data_parallel moved a CPU model's parameters there, away from
# its CPU inputs. torch.cuda.is_available is patched to simulate a GPU
# machine; no CUDA tensor is created.


def test_default_mesh_follows_cpu_parameters_with_cuda_visible(fake_mesh, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = simplefsdp.data_parallel(BlockStack())
    mesh = simplefsdp.get_data_parallel_state(model).mesh
    assert mesh.device_type == "cpu"
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model(torch.randint(0, 23, (2, 5))).sum().backward()


def test_default_device_type_decision(fake_mesh, monkeypatch) -> None:
    from simplefsdp.frontend import mesh as mesh_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pick = mesh_module.default_device_type
    assert pick({"cpu"}) == "cpu"
    assert pick({"cuda"}) == "cuda"
    # Nothing to follow (meta, none, mixed): the backend's device.
    assert pick({"meta"}) == pick(()) == pick({"cpu", "cuda"}) == "cuda"
    # NCCL cannot serve CPU parameters: cuda mesh (they move there, as FSDP2's).
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_backend_config", lambda *a: "cuda:nccl")
    assert pick({"cpu"}) == "cuda"
    # gloo serves both: follow the parameters; nothing to follow -> cpu.
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "get_backend_config", lambda *a: "cpu:gloo,cuda:gloo")
    assert pick({"cpu"}) == "cpu"
    assert pick({"meta"}) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "fake")
    assert pick({"meta"}) == "cpu"


def test_cost_model_calibrates_on_the_mesh_device(fake_mesh, monkeypatch) -> None:
    from simplefsdp.compiler.cost_model import calibration_device
    from simplefsdp.compiler.wrapped_model import mesh_device_type

    # torch's default backend with CUDA visible is "cpu:gloo,cuda:nccl": the
    # backend name alone said cpu, so a cuda mesh was calibrated with gloo.
    monkeypatch.setattr(dist, "get_backend", lambda *a: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert calibration_device("cuda") == torch.device("cuda", 3)
    assert calibration_device("cpu") == torch.device("cpu")
    assert calibration_device(None) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    assert calibration_device(None) == torch.device("cuda", 3)
    model = simplefsdp.data_parallel(BlockStack(), fake_mesh)
    assert mesh_device_type(model) == "cpu"
    assert mesh_device_type(BlockStack()) is None


# ------------------------------------------- data-parallel vs other collectives


def _node_order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def test_passes_leave_other_process_groups_alone(fake_mesh) -> None:
    """Collectives on a group that is not data parallel (e.g. tensor
    parallelism's) are neither bucketed nor moved."""
    import copy

    from simplefsdp.compiler.passes.bucketing import find_sites
    from simplefsdp.compiler.passes.reordering import reorder
    from simplefsdp.compiler.patterns import ALL_DATA_PARALLEL, CollectiveGroups
    from simplefsdp.compiler.wrapped_model import collective_groups

    torch.manual_seed(0)
    model = simplefsdp.data_parallel(BlockStack(), fake_mesh)
    groups = collective_groups(model)
    assert groups.data_parallel == {fake_mesh.get_group().group_name}
    assert groups.tensor_parallel == frozenset()
    graphs, _ = _compile_and_run(fake_mesh, "none", reorder=False)
    elsewhere = CollectiveGroups(data_parallel=frozenset({"elsewhere"}))
    for name, gm in graphs.items():
        primals = {n.name: n.name for n in gm.graph.nodes if n.op == "placeholder"}
        assert find_sites(gm.graph, primals, {}, elsewhere) == []
        assert find_sites(gm.graph, primals, {}) == find_sites(gm.graph, primals, {}, groups)
        for node in gm.graph.nodes:
            if collective_kind(node):
                assert elsewhere.role(node) == "other" and groups.role(node) == "dp"
        untouched, moved = copy.deepcopy(gm), copy.deepcopy(gm)
        before = _node_order(gm)
        assert reorder(untouched, 1, elsewhere) == {
            "prefetched_all_gathers": 0,
            "early_reductions": 0,
        }
        assert _node_order(untouched) == before
        reorder(moved, 1, ALL_DATA_PARALLEL)
        assert _node_order(moved) != before, name


def test_report_lists_tp_collectives_apart() -> None:
    from simplefsdp.compiler.report import CollectiveInfo, CommReport, GraphReport

    def info(kind, role, size):
        return CollectiveInfo(kind, f"n_{kind}_{role}", "float32", size, 2, [], 0, 1, "g", role)

    graph = GraphReport(
        graph="forward",
        graph_id=0,
        num_compute_nodes=3,
        collectives=[
            info("all_gather", "dp", 100),
            info("all_gather", "tp", 10),
            info("reduce_scatter", "tp", 20),
            info("all_gather", "tp", 30),
        ],
    )
    report = CommReport(graphs=[graph])
    assert report.count("forward", "all_gather") == 3  # every collective, as before
    assert report.count("forward", "all_gather", "dp") == 1
    assert graph.count("all_gather", "tp") == 2
    assert graph.total_bytes(role="tp") == 60 and graph.total_bytes() == 160
    data = report.to_dict()["graphs"][0]
    assert data["collectives"][1]["role"] == "tp" and data["collectives"][1]["group"] == "g"
    assert data["by_role"] == {
        "dp": {"all_gather": {"count": 1, "bytes": 100}},
        "tp": {
            "all_gather": {"count": 2, "bytes": 40},
            "reduce_scatter": {"count": 1, "bytes": 20},
        },
    }
    text = str(report)
    assert "data parallel: 1 all_gather, 0 reduce_scatter, 0 all_reduce; 100 B" in text
    assert (
        "tensor-parallel collectives (left in place): 2 all_gather, 1 reduce_scatter; 60 B" in text
    )


def test_inductor_overlap_counts_data_parallel_groups() -> None:
    from simplefsdp.compiler.report import inductor_overlap

    source = "\n".join(
        [
            "buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 2, '1')",
            "buf3 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf2, 2, '3')",
            "cpp_fused_add_0(buf4)",
            "torch.ops._c10d_functional.wait_tensor.default(buf1)",
            "torch.ops._c10d_functional.wait_tensor.default(buf3)",
        ]
    )
    assert inductor_overlap(source) == (2, 2)
    assert inductor_overlap(source, frozenset({"1"})) == (1, 1)


def test_cost_model_times_tp_collectives_with_their_fit() -> None:
    from simplefsdp.compiler.cost_model import CostModel, LinearFit

    model = CostModel(
        comm={"all_gather/2": LinearFit(1.0, 0.0), "tp:all_gather/2": LinearFit(2.0, 0.0)},
        default_comm=LinearFit(5.0, 0.0),
    )
    assert model.comm_time("all_gather", 2, 10) == 1.0
    assert model.comm_time("all_gather", 2, 10, "dp") == 1.0
    assert model.comm_time("all_gather", 2, 10, "tp") == 2.0
    assert model.comm_time("all_gather", 2, 10, "other") == 1.0  # role-less fit
    assert model.comm_time("reduce_scatter", 2, 10, "tp") == 5.0  # defaults


def test_planner_counts_tp_collectives_as_fixed_communication() -> None:
    """Note: [Planning around tensor-parallel collectives]."""
    from simplefsdp.compiler.auto_bucketing import GatherUnit, greedy_buckets, pipeline_time_s
    from simplefsdp.compiler.cost_model import CostModel, LinearFit

    mib = 2**20
    fit = LinearFit(1e-3, 1e-3 / mib)
    cost = CostModel(comm={f"{k}/2": fit for k in ("all_gather", "reduce_scatter")})

    def units(fixed_s):
        return [GatherUnit(f"p{i}", mib, 2, 1e-3, fixed_s) for i in range(4)]

    plain, fixed = units(0.0), units(2e-3)
    assert plain == [GatherUnit(f"p{i}", mib, 2, 1e-3) for i in range(4)]
    # One bucket: its comm (3 * 2 ms) exposed, then its window plus its fixed
    # TP time (forward and backward).
    assert pipeline_time_s([plain[:1]], cost, True) == pytest.approx(6e-3 + 3e-3)
    assert pipeline_time_s([fixed[:1]], cost, True) == pytest.approx(6e-3 + 3e-3 + 4e-3)
    # Two buckets: the second one's comm shares the link with the first one's
    # TP collectives, so the TP time never hides data-parallel traffic.
    two = pipeline_time_s([fixed[:1], fixed[1:2]], cost, True)
    assert two == pytest.approx(pipeline_time_s([plain[:1], plain[1:2]], cost, True) + 8e-3)
    kwargs = dict(reshard_after_forward=True, base_peak_bytes=0, memory_budget_bytes=None)
    buckets = greedy_buckets(fixed, cost, **kwargs)
    assert [u.fqn for b in buckets for u in b] == [u.fqn for u in fixed]


def test_outer_modules_split_at_the_blocks_unless_the_embeddings_are_tied() -> None:
    transformers = pytest.importorskip("transformers")
    from simplefsdp.bucket_plan import outer_modules

    for tied in (False, True):
        config = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=64,
            tie_word_embeddings=tied,
        )
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        outer = outer_modules(model, repeated_blocks(model))
        if tied:  # one parameter on both sides: no split
            assert outer is None
        else:
            before, after = ([name for name, _ in side] for side in outer)
            assert (before, after) == (["model.embed_tokens"], ["model.norm", "lm_head"])
