"""simplefsdp.compile on 2-D (data x tensor parallel) models.

The compiler buckets and reorders only the data-parallel collectives; the
tensor-parallel plan's collectives (sequence-parallel all-gathers and
reduce-scatters of activations, all-reduces of the replicated norm's
gradients) stay where they are, and the report lists them with role "tp".

One 4-process gloo run (dp2 x tp2) trains an eager model and two compiled
copies (``per_block``, ``auto``) side by side; the tests below check what it
returned. A single-process graph test covers hybrid sharding + TP on a
(2, 2, 2) mesh with torch's fake process group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.compiler import CostModel, LinearFit
from simplefsdp.compiler.patterns import collective_group, collective_kind
from simplefsdp.testing import run_distributed

DIM, HIDDEN, SEQ, BATCH = 8, 12, 4, 4
NUM_BLOCKS = 2
STEPS = 3
KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# Per block: forward all-gathers the sequence-parallel norm output (input of
# the colwise layer) and reduce-scatters the rowwise output; backward mirrors
# both and all-reduces the norm's weight and bias gradients.
TP_COUNTS = {
    "forward": {"all_gather": NUM_BLOCKS, "reduce_scatter": NUM_BLOCKS, "all_reduce": 0},
    "backward": {
        "all_gather": NUM_BLOCKS,
        "reduce_scatter": NUM_BLOCKS,
        "all_reduce": 2 * NUM_BLOCKS,
    },
}


# A fixed cost model for "auto" (calibration takes longer than the rest of
# the run on a small machine; test_cost_model_calibrates_tp_groups covers it):
# TP on a faster link than DP, compute slow enough to hide some of DP.
COST_MODEL = CostModel(
    comm={
        **{f"{k}/2": LinearFit(50e-6, 1e-9) for k in KINDS},
        **{f"tp:{k}/2": LinearFit(10e-6, 1e-10) for k in KINDS},
    },
    flops_per_s=1e8,
    bytes_per_s=1e9,
)


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class TPStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock() for _ in range(NUM_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _tensor_parallel(model: TPStack, tp_mesh) -> TPStack:
    """Sequence parallel norm, colwise then rowwise linear layers."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model


def _graph_collectives(model) -> dict[str, list[dict]]:
    """Per graph, each collective's kind, group and bucket tag (rank 0's)."""
    backend = model.__dict__["_simplefsdp_backend"]
    result = {}
    for name, gm in backend.graph_modules:
        result[name] = [
            {
                "kind": collective_kind(n),
                "group": collective_group(n),
                "bucket": n.meta.get("simplefsdp_bucket"),
                "params": list(n.meta.get("simplefsdp_params", [])),
            }
            for n in gm.graph.nodes
            if collective_kind(n) is not None
        ]
    return result


def _two_d_body() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = TPStack()
    models = {}
    for name in ("eager", "per_block", "auto"):
        model = simplefsdp.data_parallel(
            _tensor_parallel(copy.deepcopy(base), mesh["tp"]), mesh["dp"]
        )
        if name != "eager":
            simplefsdp.compile(model, backend="aot_eager", bucketing=name, cost_model=COST_MODEL)
        models[name] = model
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    per_dp, per_tp = BATCH // 2, SEQ // 2
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH, SEQ, DIM, generator=gen)
        local = x[
            dp_rank * per_dp : (dp_rank + 1) * per_dp, tp_rank * per_tp : (tp_rank + 1) * per_tp
        ]
        for name, model in models.items():
            model(local.contiguous()).pow(2).mean().backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
    mismatched = [
        (name, fqn)
        for name in ("per_block", "auto")
        for (fqn, p), (_, q) in zip(
            models["eager"].named_parameters(), models[name].named_parameters()
        )
        if not torch.equal(p.to_local(), q.to_local())
    ]
    auto_backend = models["auto"].__dict__["_simplefsdp_backend"]
    groups = auto_backend.groups
    return {
        "mismatched": mismatched,
        "reports": {k: simplefsdp.comm_report(models[k]).to_dict() for k in ("per_block", "auto")},
        "graphs": {k: _graph_collectives(models[k]) for k in ("per_block", "auto")},
        "dp_groups": sorted(groups.data_parallel),
        "tp_groups": sorted(groups.tensor_parallel),
        "expected_dp": [mesh["dp"].get_group().group_name],
        "expected_tp": [mesh["tp"].get_group().group_name],
    }


@pytest.fixture(scope="module")
def two_d() -> list[dict]:
    return run_distributed(_two_d_body, world_size=4, timeout_s=300)


def _by_graph(report: dict) -> dict[str, dict]:
    return {g["graph"]: g for g in report["graphs"]}


def _count(graph: dict, role: str, kind: str) -> int:
    return sum(1 for c in graph["collectives"] if c["role"] == role and c["kind"] == kind)


def test_compiled_2d_bitwise_equal_to_eager(two_d) -> None:
    for rank, result in enumerate(two_d):
        assert result["mismatched"] == [], (rank, result["mismatched"])


def test_groups_from_the_data_parallel_state(two_d) -> None:
    for result in two_d:
        assert result["dp_groups"] == result["expected_dp"]
        assert result["tp_groups"] == result["expected_tp"]


def test_report_counts_bucketed_dp_and_unchanged_tp_collectives(two_d) -> None:
    reports = two_d[0]["reports"]
    per_block = _by_graph(reports["per_block"])
    # One bucket per block; parameters are resharded after forward.
    assert _count(per_block["forward"], "dp", "all_gather") == NUM_BLOCKS
    assert _count(per_block["backward"], "dp", "all_gather") == NUM_BLOCKS
    assert _count(per_block["backward"], "dp", "reduce_scatter") == NUM_BLOCKS
    assert _count(per_block["backward"], "dp", "all_reduce") == 0
    num_params = 6 * NUM_BLOCKS
    auto = _by_graph(reports["auto"])
    assert 1 <= _count(auto["forward"], "dp", "all_gather") < num_params
    for name, report in (("per_block", per_block), ("auto", auto)):
        for graph_name, expected in TP_COUNTS.items():
            graph = report[graph_name]
            tp = {k: _count(graph, "tp", k) for k in KINDS}
            assert tp == expected, (name, graph_name, tp)
            assert {c["role"] for c in graph["collectives"]} == {"dp", "tp"}
            assert all(c["params"] == [] for c in graph["collectives"] if c["role"] == "tp")
            by_role = graph["by_role"]["tp"]
            assert {k: v["count"] for k, v in by_role.items()} == {
                k: n for k, n in expected.items() if n
            }
        # The bucket tables hold data-parallel collectives only, every
        # parameter once per gather / reduction.
        for graph_name, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            buckets = [b for b in report[graph_name]["buckets"] if b["kind"] == kind]
            assert sum(len(b["params"]) for b in buckets) == num_params, (name, graph_name)
    # Bucketing and planning do not change the TP collectives.
    for graph_name in TP_COUNTS:
        assert per_block[graph_name]["by_role"]["tp"] == auto[graph_name]["by_role"]["tp"]
    # The auto plan times the TP collectives and plans around them.
    assert auto["forward"]["predicted"]["tp_comm_s"] > 0
    assert any("tensor-parallel" in note for note in auto["forward"]["notes"])


def test_no_tp_collective_in_a_dp_bucket(two_d) -> None:
    result = two_d[0]
    (dp_group,), (tp_group,) = result["dp_groups"], result["tp_groups"]
    for name, graphs in result["graphs"].items():
        for graph_name, collectives in graphs.items():
            for c in collectives:
                assert c["group"] in (dp_group, tp_group), (name, graph_name, c)
                if c["group"] == tp_group:
                    assert c["bucket"] is None and c["params"] == [], (name, graph_name, c)
                else:
                    assert c["bucket"] is not None, (name, graph_name, c)


# -------------------------------------------------- hybrid + TP, fake process group


@pytest.fixture
def fake_world_8():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _compile_hybrid(mesh, bucketing: str, reorder: bool, mode: str = "hybrid_shard"):
    torch.manual_seed(0)
    model = _tensor_parallel(TPStack(), mesh["tp"])
    dp_mesh = mesh["rep", "shard"] if mode == "hybrid_shard" else mesh["rep"]
    simplefsdp.data_parallel(model, dp_mesh, mode=mode)
    simplefsdp.compile(model, backend="aot_eager", bucketing=bucketing, reorder=reorder)
    model(torch.randn(2, SEQ // 2, DIM)).sum().backward()
    backend = model.__dict__["_simplefsdp_backend"]
    return backend, simplefsdp.comm_report(model)


def test_hybrid_tp_buckets_only_data_parallel_collectives(fake_world_8) -> None:
    mesh = fake_world_8
    rep, shard, tp = (mesh[d].get_group().group_name for d in ("rep", "shard", "tp"))
    plain, plain_report = _compile_hybrid(mesh, "none", reorder=False)
    bucketed, report = _compile_hybrid(mesh, "per_block", reorder=True)
    assert plain.groups.data_parallel >= {rep, shard}
    assert plain.groups.tensor_parallel == {tp}
    graphs = dict(bucketed.graph_modules)
    expected_dp = {
        "forward": {("all_gather", shard): NUM_BLOCKS},
        "backward": {
            ("all_gather", shard): NUM_BLOCKS,
            ("reduce_scatter", shard): NUM_BLOCKS,
            ("all_reduce", rep): NUM_BLOCKS,  # across replicas, after the reduce-scatter
        },
    }
    for graph_name, gm in graphs.items():
        dp_counts: dict[tuple, int] = {}
        tp_counts = dict.fromkeys(KINDS, 0)
        for node in gm.graph.nodes:
            kind, group = collective_kind(node), collective_group(node)
            if kind is None:
                continue
            if group == tp:
                tp_counts[kind] += 1
                assert "simplefsdp_bucket" not in node.meta, (graph_name, node)
            else:
                dp_counts[(kind, group)] = dp_counts.get((kind, group), 0) + 1
                assert node.meta["simplefsdp_bucket"].startswith("blocks."), (graph_name, node)
        assert dp_counts == expected_dp[graph_name]
        assert tp_counts == TP_COUNTS[graph_name]
    # TP collectives keep their place among the compute nodes; DP ones move.
    for graph_name in ("forward", "backward"):
        before, after = plain_report.graph(graph_name), report.graph(graph_name)
        assert before.num_compute_nodes == after.num_compute_nodes

        def positions(g, tp_group: bool):
            return [
                (c.kind, c.issue_pos, c.wait_pos)
                for c in g.collectives
                if (c.group == tp) == tp_group
            ]

        assert positions(before, True) == positions(after, True), graph_name
        assert len(positions(after, False)) < len(positions(before, False))
        assert {c.role for c in after.collectives if c.group == tp} == {"tp"}
    assert "tensor-parallel collectives" in str(report)


def test_replicate_tp_keeps_tp_gradient_all_reduces_apart(fake_world_8) -> None:
    # The TP all-reduce of the norm's gradients feeds the data-parallel
    # all-reduce of the same gradient: attributed to the parameter by graph
    # structure alone, it would be bucketed with the other TP all-reduces.
    mesh = fake_world_8
    rep, tp = mesh["rep"].get_group().group_name, mesh["tp"].get_group().group_name
    backend, _ = _compile_hybrid(mesh, "per_block", reorder=True, mode="replicate")
    gm = dict(backend.graph_modules)["backward"]
    reduces = [n for n in gm.graph.nodes if collective_kind(n) == "all_reduce"]
    tp_reduces = [n for n in reduces if collective_group(n) == tp]
    dp_reduces = [n for n in reduces if collective_group(n) == rep]
    assert len(tp_reduces) == TP_COUNTS["backward"]["all_reduce"]
    assert all("simplefsdp_bucket" not in n.meta for n in tp_reduces)
    assert [n.meta["simplefsdp_bucket"] for n in dp_reduces] == ["blocks.1", "blocks.0"]


def test_cost_model_calibrates_tp_groups(fake_world_8, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mesh = fake_world_8
    model = _tensor_parallel(TPStack(), mesh["tp"])
    simplefsdp.data_parallel(model, mesh["rep", "shard"], mode="hybrid_shard")
    simplefsdp.compile(model, backend="aot_eager", bucketing="auto")  # calibrates now
    comm = model.__dict__["_simplefsdp_backend"].cost_model(required=False).comm
    assert {f"{k}/2" for k in KINDS} | {f"tp:{k}/2" for k in KINDS} <= set(comm)
