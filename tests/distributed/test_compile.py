"""simplefsdp.compile on 2-4 CPU processes: parity with eager data_parallel,
resharding visible in the graphs, activation checkpointing, config hygiene,
and measured memory."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.compiler.cost_model import OVERLAP_ROUNDS
from simplefsdp.testing import run_distributed
from toy_models import BiasFreeMLP, DropoutAttentionStack, build, loss_fn, make_batch

LOCAL_BATCH = 2


def _mesh(mode: str):
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world // 2))
    return init_device_mesh("cpu", (world,))


def _local(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def _train(model, model_name: str, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(model_name, step, LOCAL_BATCH * dist.get_world_size())
        loss = loss_fn(model_name, model(_local(inputs)), _local(targets))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _parity_body(model_name, mode, backend, reshard, mp, steps=10) -> dict:
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    base = build(model_name)
    kwargs = dict(mode=mode, reshard_after_forward=reshard, mp_policy=policy)
    eager = simplefsdp.data_parallel(copy.deepcopy(base), _mesh(mode), **kwargs)
    compiled = simplefsdp.data_parallel(copy.deepcopy(base), _mesh(mode), **kwargs)
    simplefsdp.compile(compiled, backend=backend, bucketing="none")
    eager_losses = _train(eager, model_name, steps)
    compiled_losses = _train(compiled, model_name, steps)
    params = zip(eager.named_parameters(), compiled.named_parameters())
    if backend == "aot_eager":
        for step, (a, b) in enumerate(zip(eager_losses, compiled_losses)):
            assert torch.equal(a, b), (step, a.item(), b.item())
        for (name, p), (_, q) in params:
            assert torch.equal(p.to_local(), q.to_local()), name
    else:
        torch.testing.assert_close(
            torch.stack(compiled_losses), torch.stack(eager_losses), rtol=1e-4, atol=1e-5
        )
        for (_, p), (_, q) in params:
            torch.testing.assert_close(q.to_local(), p.to_local(), rtol=1e-4, atol=1e-5)
    return simplefsdp.comm_report(compiled).to_dict()


# Inductor's parity with eager: test_inductor_full_checkpointing_of_attention_blocks
# here and test_no_sync.py::test_inductor_bucketed (against a single process).
# replicate gathers nothing, so resharding does not apply to it.
@pytest.mark.parametrize(
    ("mode", "reshard"),
    [("replicate", True), ("fully_shard", True), ("fully_shard", False)],
    ids=["replicate", "reshard-fully_shard", "no_reshard-fully_shard"],
)
def test_aot_eager_bitwise_equal_to_eager(mode: str, reshard: bool) -> None:
    run_distributed(_parity_body, 2, args=("blocks", mode, "aot_eager", reshard, False))


def test_aot_eager_bitwise_hybrid_shard_4_ranks() -> None:
    run_distributed(_parity_body, 4, args=("tied", "hybrid_shard", "aot_eager", True, False))


def test_aot_eager_bitwise_mixed_precision() -> None:
    run_distributed(_parity_body, 2, args=("mlp", "fully_shard", "aot_eager", True, True))


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
def test_composes_with_activation_checkpointing(checkpoint: str) -> None:
    report = run_distributed(
        _parity_body, 2, args=(f"blocks-{checkpoint}", "fully_shard", "aot_eager", True, False)
    )[0]
    graphs = {g["graph"]: g for g in report["graphs"]}
    assert any(c["kind"] == "all_gather" for c in graphs["backward"]["collectives"])


def test_full_checkpointing_of_attention_blocks_bitwise() -> None:
    # Recomputed attention saves an RNG state next to the mesh the recomputed
    # all-gather needs (Note: [RNG states saved next to opaque objects]).
    report = run_distributed(
        _parity_body, 2, args=("blocks-attn-full", "fully_shard", "aot_eager", True, False)
    )[0]
    graphs = {g["graph"]: g for g in report["graphs"]}
    assert any(c["kind"] == "all_gather" for c in graphs["backward"]["collectives"])


def _dropout_grads(checkpoint: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(DropoutAttentionStack(checkpoint), _mesh("fully_shard"))
    simplefsdp.compile(model, backend="aot_eager", bucketing="none")
    tokens = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    torch.manual_seed(1234)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _dropout_replay_body() -> None:
    # Six random ops (SDPA dropout + two dropouts, per block): recomputation
    # must replay each one's saved RNG state, or masks and gradients differ.
    loss_ac, grads_ac = _dropout_grads(checkpoint=True)
    torch._dynamo.reset()
    loss_plain, grads_plain = _dropout_grads(checkpoint=False)
    assert torch.equal(loss_ac, loss_plain), (loss_ac.item(), loss_plain.item())
    for name, grad in grads_plain.items():
        assert torch.equal(grads_ac[name], grad), name


def test_full_checkpointing_replays_dropout_masks_bitwise() -> None:
    run_distributed(_dropout_replay_body, 2)


@pytest.mark.heavy  # minutes-long on 2 CPU cores; run with -m heavy
def test_inductor_full_checkpointing_of_attention_blocks() -> None:
    # Inductor partitions through our custom_partitioner_fn (the RNG-state repair).
    run_distributed(
        _parity_body,
        2,
        args=("blocks-attn-full", "fully_shard", "inductor", True, False),
        timeout_s=600,
    )


def _report_body(mode: str, reshard: bool) -> dict:
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(BiasFreeMLP(), mode=mode, reshard_after_forward=reshard)
    simplefsdp.compile(model, backend="aot_eager", bucketing="none")
    x = torch.randn(4, 9, requires_grad=True)  # input grads need every weight in backward
    model(x).sum().backward()
    report = simplefsdp.comm_report(model)
    text = str(report)
    assert "forward graph" in text and "backward graph" in text
    return report.to_dict()


def _by_graph(report: dict) -> dict[str, list[dict]]:
    return {g["graph"]: g["collectives"] for g in report["graphs"]}


def _kinds(collectives: list[dict], kind: str) -> list[dict]:
    return [c for c in collectives if c["kind"] == kind]


def test_report_resharding_regathers_in_backward() -> None:
    report = run_distributed(_report_body, 2, args=("fully_shard", True))[0]
    graphs = _by_graph(report)
    fw_gathers = _kinds(graphs["forward"], "all_gather")
    bw_gathers = _kinds(graphs["backward"], "all_gather")
    assert len(fw_gathers) == 3 and len(bw_gathers) == len(fw_gathers)
    assert sorted(c["params"][0] for c in bw_gathers) == ["l1.weight", "l2.weight", "l3.weight"]
    reduce_scatters = _kinds(graphs["backward"], "reduce_scatter")
    assert sorted(c["params"][0] for c in reduce_scatters) == [
        "l1.weight",
        "l2.weight",
        "l3.weight",
    ]
    assert all(c["bytes"] > 0 and c["dtype"] == "float32" for c in fw_gathers)
    assert all(c["wait_pos"] >= c["issue_pos"] for c in graphs["backward"])


def test_report_without_resharding_has_no_backward_gathers() -> None:
    graphs = _by_graph(run_distributed(_report_body, 2, args=("fully_shard", False))[0])
    assert len(_kinds(graphs["forward"], "all_gather")) == 3
    assert _kinds(graphs["backward"], "all_gather") == []
    assert len(_kinds(graphs["backward"], "reduce_scatter")) == 3


def test_report_replicate_mode_all_reduces_only() -> None:
    graphs = _by_graph(run_distributed(_report_body, 2, args=("replicate", True))[0])
    assert all(c["kind"] == "all_reduce" for g in graphs.values() for c in g)
    assert len(_kinds(graphs["backward"], "all_reduce")) == 3


def _bad_options_body() -> None:
    model = simplefsdp.data_parallel(build("mlp"))
    with pytest.raises(ValueError, match="unknown backend 'eager'"):
        simplefsdp.compile(model, backend="eager")
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        simplefsdp.compile(model, memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="not wrapped by simplefsdp.data_parallel"):
        simplefsdp.compile(build("mlp"))
    with pytest.raises(ValueError, match="no graph compiled yet"):
        simplefsdp.comm_report(simplefsdp.compile(model, backend="aot_eager"))


def test_bad_options_raise_clear_errors() -> None:
    run_distributed(_bad_options_body, 2)


class _WideStack(torch.nn.Module):
    """Parameters dominate memory: 8 x (512 x 512) fp32 = 8 MiB, batch of 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, bias=False) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _peak_memory_body(reshard: bool) -> int:
    from simplefsdp.engines.memory import MemoryProbe, lower_mmap_threshold

    assert lower_mmap_threshold(64 * 1024)
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(_WideStack(), reshard_after_forward=reshard)
    simplefsdp.compile(model, backend="aot_eager", bucketing="none")
    x = torch.randn(2, 512)
    model(x).sum().backward()  # compile + warm up
    for p in model.parameters():
        p.grad = None
    peaks = []
    for _ in range(3):
        with MemoryProbe("cpu") as peak:
            model(x).sum().backward()
        for p in model.parameters():
            p.grad = None
        peaks.append(peak.peak)
    return min(peaks)


def test_resharding_lowers_measured_peak_memory() -> None:
    # How: glibc's mmap threshold is lowered so freed tensors leave the RSS, the
    # kernel's RSS high-water mark is reset before a step and read after it.
    # Without resharding all 8 gathered weights (8 MiB) stay alive until
    # backward; with it, about one at a time does.
    resharded = run_distributed(_peak_memory_body, 2, args=(True,))[0]
    kept = run_distributed(_peak_memory_body, 2, args=(False,))[0]
    assert resharded is not None and kept is not None
    assert kept - resharded > 4 * 2**20, (resharded, kept)


def _bucketing_parity_body(mode: str, mp: bool, bucketing) -> dict:
    """Bucketed + reordered training is bitwise equal to bucketing="none"."""
    policy = (
        simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mp
        else None
    )
    base = build("blocks")
    models = []
    for plan in ("none", bucketing):
        model = simplefsdp.data_parallel(
            copy.deepcopy(base), _mesh(mode), mode=mode, mp_policy=policy
        )
        simplefsdp.compile(model, backend="aot_eager", bucketing=plan, reorder=plan != "none")
        models.append(model)
    losses = [_train(m, "blocks", 10) for m in models]
    for step, (a, b) in enumerate(zip(*losses)):
        assert torch.equal(a, b), (step, a.item(), b.item())
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    report = simplefsdp.comm_report(models[1])
    return {
        g.graph: {k: g.count(k) for k in ("all_gather", "reduce_scatter", "all_reduce")}
        for g in report.graphs
    }


@pytest.mark.parametrize(
    ("mode", "mp"),
    [("fully_shard", False), ("fully_shard", True), ("replicate", False)],
    ids=["fully_shard", "fully_shard-bf16", "replicate"],
)
def test_bucketing_bitwise_equal_to_none(mode: str, mp: bool) -> None:
    counts = run_distributed(_bucketing_parity_body, 2, args=(mode, mp, "per_block"))[0]
    if mode == "fully_shard":
        assert counts["forward"]["all_gather"] == 5
        assert counts["backward"]["reduce_scatter"] == 5
    else:
        assert counts["backward"]["all_reduce"] == 5


@pytest.mark.heavy  # half a minute on 2 CPU cores; run with -m heavy
def test_bucketing_bitwise_hybrid_shard_4_ranks() -> None:
    counts = run_distributed(_bucketing_parity_body, 4, args=("hybrid_shard", False, "per_block"))[
        0
    ]
    # hybrid buckets both its reduce-scatter and its all-reduce
    assert counts["backward"]["reduce_scatter"] == 5
    assert counts["backward"]["all_reduce"] == 5


def test_auto_bitwise_equal_to_none() -> None:
    counts = run_distributed(_bucketing_parity_body, 2, args=("fully_shard", False, "auto"))[0]
    assert 1 <= counts["forward"]["all_gather"] < 22  # 22 parameters, fewer collectives


def _rank_dependent_timings_body(cache_dir: str) -> dict:
    """Ranks that measure different timings must still build the same graphs."""
    import os

    from simplefsdp.compiler import LinearFit, cost_model

    os.environ["XDG_CACHE_HOME"] = cache_dir  # no cache: calibrate now
    rank = dist.get_rank()
    # Rank 0 measures a slow link (merge everything), rank 1 a fast one (split).
    fit = LinearFit(1e-2, 1e-6) if rank == 0 else LinearFit(1e-9, 1e-15)
    cost_model.calibrate_comm = lambda group, device: {
        f"{k}/{dist.get_world_size(group)}": fit
        for k in ("all_gather", "reduce_scatter", "all_reduce")
    }
    cost_model._calibrate_compute = lambda device: (1e9 * (1 + 100 * rank), 1e9, {})
    model = simplefsdp.data_parallel(build("blocks"))
    simplefsdp.compile(model, backend="aot_eager", bucketing="auto")
    _train(model, "blocks", 2)
    report = simplefsdp.comm_report(model)
    return {g.graph: [b.params for b in g.buckets] for g in report.graphs}


def test_auto_plan_identical_on_ranks_with_different_timings(tmp_path) -> None:
    plans = run_distributed(_rank_dependent_timings_body, 2, args=(str(tmp_path),), timeout_s=240)
    assert plans[0] == plans[1]
    assert plans[0]["forward"]


def _predictions_body() -> dict:
    model = simplefsdp.data_parallel(build("blocks"))
    simplefsdp.compile(model, backend="aot_eager", bucketing="auto")  # calibrates
    _train(model, "blocks", 1)
    report = simplefsdp.comm_report(model)
    return {g.graph: g.predicted for g in report.graphs}


def test_auto_reports_predictions_from_a_calibrated_cost_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    predicted = run_distributed(_predictions_body, 2, timeout_s=240)[0]
    for graph in ("forward", "backward"):
        p = predicted[graph]
        assert p["time_s"] > 0 and p["compute_s"] > 0 and p["comm_s"] > 0
        assert p["exposed_comm_s"] <= p["comm_s"] + 1e-12
        assert p["peak_bytes"] > 0
    cached = list((tmp_path / "simplefsdp").glob("cost-*.json"))
    assert len(cached) == 1  # calibration is cached for later runs
    data = json.loads(cached[0].read_text())
    assert 0.0 <= data["comm_overlap"] <= 1.0
    assert data["overlap_rounds"] == OVERLAP_ROUNDS  # a median, not one measurement


def _keep_gathered_body(variants: list[dict]) -> list[dict]:
    """Keeping buckets gathered for backward changes no number, only where the
    all-gathers run (fewer in backward). ``variants``: ``simplefsdp.compile``
    options (``keep_gathered``, ``memory_budget_bytes``); the first is the
    reference."""
    base = build("blocks")
    results = []
    for variant in variants:
        model = simplefsdp.data_parallel(copy.deepcopy(base), _mesh("fully_shard"))
        simplefsdp.compile(model, backend="aot_eager", bucketing="per_block", **variant)
        losses = _train(model, "blocks", 3)
        report = simplefsdp.comm_report(model)
        results.append(
            {
                "losses": losses,
                "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
                "backward_all_gathers": report.graph("backward").count("all_gather"),
                "kept": report.graph("forward").kept_gathered,
                "notes": report.graph("forward").notes,
            }
        )
    reference = results[0]
    for result in results[1:]:
        for step, (a, b) in enumerate(zip(reference["losses"], result["losses"])):
            assert torch.equal(a, b), (step, a.item(), b.item())
        for name, value in reference["params"].items():
            assert torch.equal(value, result["params"][name]), name
    return [{k: v for k, v in r.items() if k not in ("losses", "params")} for r in results]


def test_keep_gathered_buckets_skip_their_backward_all_gather() -> None:
    variants = [{"keep_gathered": k} for k in (None, "auto", 1, ["blocks.1", "head"])]
    reference, *results = run_distributed(_keep_gathered_body, 2, args=(variants,))[0]
    # 5 per-block buckets (embed, 3 blocks, norm + head); backward regathers all
    # but the embedding's (its weight gradient does not read the weight)
    assert reference["backward_all_gathers"] == 4 and not reference["kept"]
    for result, kept_buckets in zip(results, (2, 1, 2)):
        assert result["backward_all_gathers"] == 4 - kept_buckets, result
        assert len(result["kept"]["buckets"]) == kept_buckets and result["kept"]["bytes"] > 0
        assert any(n.startswith("kept gathered for backward") for n in result["notes"])
    assert results[0]["kept"]["buckets"] == ["blocks.2", "rest:norm.weight"]  # the last two


def test_keep_search_spends_the_activation_slack_within_the_budget() -> None:
    # keep_gathered="auto" decided within a budget (Note: [Keeping what eager
    # FSDP2 would hold]): the numbers of regathering everything.
    variants = [
        {"keep_gathered": keep, "memory_budget_bytes": budget}
        for keep, budget in ((0, None), ("auto", None), ("auto", 1), ("auto", 1 << 40))
    ]
    reference, default, tight, ample = run_distributed(_keep_gathered_body, 2, args=(variants,))[0]
    assert reference["backward_all_gathers"] == 4 and not reference["kept"]
    search = default["kept"]
    # the default budget's slack: what eager would save beyond the min-cut partition
    assert search["eager_saved_bytes"] > 0 and search["compiled_saved_bytes"] > 0
    gap = search["eager_saved_bytes"] - search["compiled_saved_bytes"]
    assert search["slack_bytes"] == max(gap, 0)
    assert 0 <= search["spent_bytes"] <= search["slack_bytes"]
    kept = len(search["buckets"])
    assert kept >= 2 and search["free"] == 2 and search["candidate_buckets"] == 5
    assert default["backward_all_gathers"] == 4 - min(kept, 4)  # the embedding is never regathered
    assert any(n.startswith("keep search: kept the last") for n in default["notes"])
    # a budget below what the graph needs anyway leaves only the free buckets
    assert tight["kept"]["buckets"] == ["blocks.2", "rest:norm.weight"]
    assert tight["kept"]["spent_bytes"] == 0 and tight["kept"]["slack_bytes"] < 0
    assert tight["backward_all_gathers"] == 2
    # a budget with room for everything keeps every bucket: no regather at all
    assert len(ample["kept"]["buckets"]) == 5 and ample["backward_all_gathers"] == 0
    assert ample["kept"]["spent_bytes"] == ample["kept"]["bytes"] - tight["kept"]["bytes"]


def test_keep_gathered_rejects_bad_values() -> None:
    from simplefsdp.compiler.backend import CompileOptions

    for bad in (-1, "some", [""], True):
        with pytest.raises(ValueError, match="keep_gathered must be None, 'auto', an int >= 0"):
            CompileOptions(keep_gathered=bad)


def _gathers(graph) -> list[dict]:
    return [dataclasses.asdict(c) for c in graph.collectives if c.kind == "all_gather"]


def _partial_reshard_body() -> list[dict]:
    """reshard_after_forward=2 on 4 ranks: the numbers of full resharding,
    backward all-gathers over groups of 2 (Note: [Partial resharding])."""
    base = build("blocks")
    results = []
    for reshard in (True, 2):
        model = simplefsdp.data_parallel(
            copy.deepcopy(base), _mesh("fully_shard"), reshard_after_forward=reshard
        )
        simplefsdp.compile(model, backend="aot_eager", bucketing="per_block", keep_gathered=0)
        losses = _train(model, "blocks", 3)
        report = simplefsdp.comm_report(model)
        results.append(
            {
                "losses": losses,
                "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
                "forward": _gathers(report.graph("forward")),
                "backward": _gathers(report.graph("backward")),
                "notes": report.graph("forward").notes,
            }
        )
    full, partial = results
    for step, (a, b) in enumerate(zip(full["losses"], partial["losses"])):
        assert torch.equal(a, b), (step, a.item(), b.item())
    for name, value in full["params"].items():
        assert torch.equal(value, partial["params"][name]), name
    return [{k: v for k, v in r.items() if k not in ("losses", "params")} for r in results]


def test_partial_reshard_regathers_within_groups_bitwise() -> None:
    full, partial = run_distributed(_partial_reshard_body, 4)[0]
    assert {c["group_size"] for c in full["forward"] + full["backward"]} == {4}
    assert {c["group_size"] for c in partial["forward"]} == {4}
    # the same bucketed backward all-gathers, each over a group of 2 and of
    # the same bytes (the gathered parameters)
    assert len(partial["backward"]) == len(full["backward"]) > 0
    assert {c["group_size"] for c in partial["backward"]} == {2}
    assert [c["bytes"] for c in partial["backward"]] == [c["bytes"] for c in full["backward"]]
    assert [c["params"] for c in partial["backward"]] == [c["params"] for c in full["backward"]]
    assert any(n.startswith("resharded to groups of 2 after forward") for n in partial["notes"])


def _partial_reshard_errors_body() -> None:
    for bad, match in ((3, "must divide the shard group size 4"), (4, "strictly between")):
        with pytest.raises(ValueError, match=match):
            simplefsdp.data_parallel(build("blocks"), _mesh("fully_shard"),
                                     reshard_after_forward=bad)  # fmt: skip
    with pytest.raises(ValueError, match="mode='replicate' gathers nothing"):
        simplefsdp.data_parallel(build("blocks"), _mesh("replicate"), mode="replicate",
                                 reshard_after_forward=2)  # fmt: skip


def test_partial_reshard_rejects_bad_group_sizes() -> None:
    run_distributed(_partial_reshard_errors_body, 4)
