"""``simplefsdp plan`` for models with routed experts and ``--ep``: the
analytic model's parameter counts, memory, all-to-all time and errors, and
the one planner path (spec-driven method, one prediction type)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import plan_profiles
from simplefsdp.models.registry import family_names, get_spec, resolve_flavor, spec_for_config
from simplefsdp.plan import analytic, predict
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.analytic import ExpertLayout as MoELayout
from simplefsdp.plan.hardware import PROFILES

GiB = 2**30

FIXED = dataclasses.replace(plan_profiles.FIXED, memory_bytes=640 * GiB)
MOE = get_spec("moe")


def get_config(name):
    spec, config = resolve_flavor(name)
    assert spec.plan_method == "analytic"
    return config


def num_params(config, exclude_embeddings=False):
    return spec_for_config(config).num_params(config, exclude_embeddings=exclude_embeddings)


def num_active_params(config, exclude_embeddings=False):
    return spec_for_config(config).active_params(config, exclude_embeddings=exclude_embeddings)


def predict_moe(config, layout, hw):
    return predict(spec_for_config(config), config, layout, hw)


def test_parameters_total_and_activated() -> None:
    args = get_config("deepseek_v3_16b")
    pred = predict_moe(args, MoELayout(gpus=8, batch=1, seq=4096, ep=2), PROFILES["h100"])
    assert pred.params["total"] == num_params(args)
    assert pred.params["activated"] == num_active_params(args)
    assert 15.5e9 < pred.params["total"] < 16e9  # DeepSeek-V2-Lite's 15.7B
    assert pred.params["activated"] < pred.params["total"] / 5
    assert pred.params["routed_experts"] == 26 * 64 * 3 * 2048 * 1408


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_state_is_sharded_over_all_ranks_whatever_the_ep_degree(ep) -> None:
    # Experts: num_experts / ep per EP rank, sharded over the dp / ep ranks
    # holding the same ones; dense parameters over all dp ranks.
    args = get_config("moe_small")
    pred = predict_moe(args, MoELayout(gpus=8, batch=1, seq=512, ep=ep), FIXED)
    shard = num_params(args) / 8
    assert pred.memory["parameters"] == pytest.approx(4 * shard)
    assert pred.memory["gradients"] == pytest.approx(4 * shard)
    assert pred.memory["optimizer"] == pytest.approx(8 * shard)
    assert pred.peak_bytes == pytest.approx(sum(pred.memory.values()))


def test_all_to_all_by_hand_and_its_link() -> None:
    # Per MoE layer: dispatch + combine, forward and backward (4; 6 with
    # full AC's recomputation), each tokens * top_k * dim bf16 bytes per
    # rank, (ep - 1) / ep of them leaving it.
    args = get_config("moe_small")
    tokens = 2 * 512
    a2a_bytes = 2 * tokens * args.top_k * args.dim
    layout = MoELayout(gpus=4, batch=2, seq=512, ep=2)
    pred = predict_moe(args, layout, FIXED)
    per = 1e-5 + 0.5 * a2a_bytes / 1e10  # NVLink: 2 ranks in a node of 4
    assert pred.time["ep_comm_total"] == pytest.approx(4 * args.n_moe_layers * per)
    full = predict_moe(args, dataclasses.replace(layout, ac="full"), FIXED)
    assert full.time["ep_comm_total"] == pytest.approx(6 * args.n_moe_layers * per)
    assert predict_moe(args, dataclasses.replace(layout, ep=1), FIXED).time[
        "ep_comm_total"
    ] == pytest.approx(0.0)
    # 8 EP ranks span two nodes of 4: the NIC.
    wide = predict_moe(args, MoELayout(gpus=8, batch=2, seq=512, ep=8), FIXED)
    per_nic = 1e-4 + 7 / 8 * a2a_bytes / 1e9
    assert wide.time["ep_comm_total"] == pytest.approx(4 * args.n_moe_layers * per_nic)
    assert pred.time["ep_comm_total"] <= pred.time["exposed_comm"]


def test_ep_gathers_only_the_local_experts_and_imbalance_costs() -> None:
    args = get_config("moe_small")
    base = MoELayout(gpus=8, batch=2, seq=512, ep=1)
    one, four = (
        predict_moe(args, base, FIXED),
        predict_moe(args, dataclasses.replace(base, ep=4), FIXED),
    )
    assert four.memory["gathered"] < one.memory["gathered"]
    skewed = predict_moe(args, dataclasses.replace(base, ep=4, imbalance=1.5), FIXED)
    assert skewed.step_s > four.step_s
    assert skewed.memory["activations"] > four.memory["activations"]
    assert skewed.time["ep_comm_total"] == pytest.approx(1.5 * four.time["ep_comm_total"], rel=0.05)


def test_ac_modes_order_activations() -> None:
    args = get_config("deepseek_v3_16b")
    preds = {
        ac: predict_moe(args, MoELayout(gpus=8, batch=1, seq=4096, ep=2, ac=ac), FIXED)
        for ac in ("none", "selective", "full")
    }
    acts = [preds[ac].memory["activations"] for ac in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2] > 0
    assert preds["full"].time["compute"] > preds["none"].time["compute"]


def test_selective_ac_recomputes_half_the_dense_matmuls_and_no_expert() -> None:
    # the engines' selective policy saves the grouped matmuls' outputs and
    # every second other matmul's (Note: [Selective activation checkpointing])
    args = get_config("deepseek_v3_16b")
    flops = {
        ac: predict_moe(args, MoELayout(gpus=8, batch=1, seq=4096, ep=2, ac=ac), FIXED).time[
            "flops"
        ]
        for ac in ("none", "selective", "full")
    }
    per_expert = 3 * args.dim * args.moe_hidden_dim
    routed_forward = 4096 * 2 * args.n_moe_layers * args.top_k * per_expert
    dense_forward = flops["full"] - flops["none"] - routed_forward
    assert flops["selective"] - flops["none"] == pytest.approx(dense_forward / 2, rel=1e-9)
    # recomputing the experts too (torchtitan's op list): their forward again,
    # and none of their three grouped matmuls' outputs (w1, w3, w2) kept
    layout = MoELayout(gpus=8, batch=1, seq=4096, ep=2, recompute_experts=True)
    lean = predict_moe(args, layout, FIXED)
    saved = predict_moe(args, dataclasses.replace(layout, recompute_experts=False), FIXED)
    extra = lean.time["flops"] - flops["selective"]
    assert extra == pytest.approx(routed_forward, rel=1e-9)
    per_token = args.n_moe_layers * args.top_k * (2 * args.moe_hidden_dim + args.dim)
    dropped = saved.memory["activations"] - lean.memory["activations"]
    assert dropped == pytest.approx(2 * per_token * 4096, rel=1e-9)  # bf16
    assert lean.step_s > saved.step_s


@pytest.mark.parametrize("engine", ["simplefsdp", "fsdp2"])
def test_without_resharding_every_block_stays_gathered(engine) -> None:
    args = get_config("deepseek_v3_16b")
    layout = MoELayout(gpus=8, batch=1, seq=4096, ep=2, engine=engine)
    kept = predict_moe(args, dataclasses.replace(layout, reshard_after_forward=False), FIXED)
    resharded = predict_moe(args, layout, FIXED)
    spec = spec_for_config(args)
    experts = args.n_moe_layers * args.num_experts * 3 * args.dim * args.moe_hidden_dim
    outer = 2 * args.vocab_size * args.dim + args.dim  # embeddings, output, final norm
    # the blocks' parameters, of the experts this rank's 32 of 64
    local_blocks = spec.num_params(args) - outer - experts / 2
    # bf16 parameters of every block (its local experts), one block's gradients
    # beside; FSDP2's final norm and output group gathered throughout too
    root = 2 * (args.vocab_size * args.dim + args.dim) if engine == "fsdp2" else 0
    assert kept.memory["gathered"] - root == pytest.approx(2 * local_blocks, rel=0.05)
    assert kept.memory["gathered"] - root > 2 * local_blocks > 5 * resharded.memory["gathered"]
    assert resharded.memory["gathered"] - root == pytest.approx(
        6 * local_blocks / args.n_moe_layers, rel=0.2
    )
    assert kept.peak_bytes > resharded.peak_bytes
    assert kept.time["dp_comm_total"] < resharded.time["dp_comm_total"]  # no second gather


def test_cli_moe_sweep_ranks_ep_degrees_ac_and_resharding(capsys) -> None:
    spec, config = resolve_flavor("deepseek_v3_16b")
    base = MoELayout(gpus=8, batch=1, seq=4096, cp=2)
    layouts = plan_cli.sweep_expert_layouts(spec, config, base)
    # EP 1, and the multiples of CP 2 that divide 64 experts and 8 GPUs
    assert sorted({lay.ep for lay in layouts}) == [1, 2, 4, 8]
    # AC none, selective, selective recomputing the experts, full; resharding or not
    assert len(layouts) == 4 * 4 * 2 and {lay.cp for lay in layouts} == {2}
    assert sum(lay.recompute_experts for lay in layouts) == 4 * 2
    argv = ["--model", "deepseek_v3_16b", "--gpus", "4", "--batch", "1", "--seq", "2048"]
    assert plan_cli.main(argv + ["--hardware", "h100", "--sweep"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tok/s/GPU" in lines[0] and lines[1].split()[-1] == "best"
    assert sum("ep4 ac=" in line for line in lines) == 8  # 4 AC options x resharding
    assert sum(" ac=" in line for line in lines) == 3 * 4 * 2  # EP 1, 2 and 4
    assert sum("ac=selective+experts" in line for line in lines) == 3 * 2
    column = lines[0].index(" peak GiB")  # every layout fits its column
    assert all(line[column] == " " for line in lines[1:] if " ac=" in line)
    # Under --pp: no pipeline too, and at --pp 2 the 1F1B and interleaved
    # schedules with 2 and 4 microbatches (EP over the 4 ranks of a stage).
    piped = plan_cli.sweep_expert_layouts(spec, config, MoELayout(gpus=8, batch=4, seq=4096, pp=2))
    pipelines = {(lay.pp, lay.pp_schedule, lay.microbatches) for lay in piped}
    assert pipelines == {
        (1, "1f1b", 1),
        *((2, schedule, m) for schedule in ("1f1b", "interleaved_1f1b") for m in (2, 4)),
    }
    assert sorted({lay.ep for lay in piped if lay.pp == 2}) == [1, 2, 4]


def test_cli_moe_plan_prints_parameters_and_all_to_all(capsys) -> None:
    argv = ["--model", "deepseek_v3_16b", "--gpus", "8", "--ep", "2", "--batch", "1"]
    assert plan_cli.main(argv + ["--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "B activated per token" in out and "EP all-to-all" in out and "dp8 ep2" in out
    assert plan_cli.main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pred = data["predictions"][0]
    assert pred["layout"]["ep"] == 2 and pred["parameters"]["total"] > 15e9


def test_a_compiled_loss_holds_only_the_bf16_logits_and_their_gradient(capsys) -> None:
    # torchtitan compiles the loss (compile.components "loss"): no fp32 copy
    # of the logits, no fp32 gradient; 4 bytes per logit against eager's 10.
    from simplefsdp.plan.allocator import Alloc
    from simplefsdp.plan.host import EagerStep, eager_step_events

    spec, config = resolve_flavor("moe_small")
    base = MoELayout(gpus=8, batch=2, seq=512, ep=2, engine="fsdp2")
    eager = predict_moe(config, base, FIXED)
    fused = predict_moe(config, dataclasses.replace(base, fused_loss=True), FIXED)
    logits = 2 * 512 * config.vocab_size
    assert eager.memory["temporary"] - fused.memory["temporary"] == 6 * logits
    assert "fused-loss" in fused.layout.describe() and "fused" not in eager.layout.describe()
    # what the allocator simulation is fed: the fp32 logits only when eager
    sizes = {}
    for fused_loss in (False, True):
        step = EagerStep(spec, config, "selective", 2, 2, 512, fused_loss=fused_loss)
        sizes[fused_loss] = {e.size for e in eager_step_events(step) if isinstance(e, Alloc)}
    assert 4 * logits in sizes[False] and 4 * logits not in sizes[True]
    assert 2 * logits in sizes[True]
    argv = ["--model", "moe_small", "--gpus", "8", "--ep", "2", "--batch", "2", "--seq", "512"]
    assert plan_cli.main(argv + ["--fused-loss"]) == 0
    assert "fused-loss" in capsys.readouterr().out


def test_cli_bad_moe_layouts_are_one_line_errors(capsys) -> None:
    cases = [
        (
            ["--model", "deepseek_v3_16b", "--gpus", "6", "--ep", "3"],
            "ep 3 does not divide the 64 experts of the model",
        ),
        (
            ["--model", "moe_small", "--gpus", "6", "--ep", "4"],
            "--ep 4 does not divide the 6 FSDP ranks (dp x cp); valid --ep: 1, 2",
        ),
        (["--model", "debug", "--ep", "2"], "--ep needs a model with expert parallelism"),
        (["--model", "debug", "--expert-imbalance", "2"], "--expert-imbalance is not planned"),
        (["--model", "moe_debug", "--tp", "2"], "--tp is not planned for 'moe_debug'"),
        (
            ["--model", "moe_small", "--gpus", "8", "--cp", "4", "--ep", "2"],
            "--ep 2 is not a multiple of --cp 4 (an EP group spans whole CP groups); "
            "valid --ep: 1, 4, 8",
        ),
        (
            ["--model", "moe_small", "--gpus", "6", "--cp", "4"],
            "--cp 4 does not divide the 6 GPUs; valid --cp: 1, 2, 3, 6",
        ),
        (
            ["--model", "moe_small", "--cp", "2", "--seq", "510"],
            "--seq 510 does not split over --cp 2",
        ),
        (
            ["--model", "moe_debug", "--float8", "--engine", "fsdp2"],
            "--float8 with --engine fsdp2 is not planned for a model with routed experts",
        ),
        (
            ["--model", "moe_debug", "--ep", "2", "--measure"],
            "--measure runs one rank, whose experts' all-to-all needs the other ranks' tokens; "
            "got --ep 2",
        ),
        (
            ["--model", "moe_debug", "--ac", "full", "--recompute-experts"],
            "--recompute-experts applies to selective activation checkpointing; the mode is 'full'",
        ),
        (["--model", "debug", "--recompute-experts"], "--recompute-experts is not planned"),
        (
            ["--model", "moe_debug", "--loss-parallel"],
            "--loss-parallel is not planned for 'moe_debug'",
        ),
        (["--model", "moe_debug", "--ep", "0"], "--ep must be >= 1, got 0"),
        (
            ["--model", "moe_debug", "--expert-imbalance", "0.5"],
            "--expert-imbalance must be >= 1",
        ),
    ]
    for argv, message in cases:
        assert plan_cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_measure_runs_one_rank_of_a_model_planned_from_its_shapes() -> None:
    # --ep 1: the experts sharded by FSDP over every rank, the other ranks
    # faked; selective AC with the experts recomputed, as planned
    import torch

    from simplefsdp.plan.measure import measure_step

    spec, config = resolve_flavor("moe_debug")
    layout = MoELayout(
        gpus=4, batch=1, seq=32, ac="selective", engine="fsdp2", recompute_experts=True
    )
    measured = measure_step(spec, config, layout, torch.device("cpu"), warmup=1)
    assert measured.device == "cpu" and measured.step_s > 0 and measured.peak_bytes > 0
    assert not torch.distributed.is_initialized()  # the fake group is gone


def test_mfu_counts_the_specs_flops_per_token() -> None:
    # Multi-head latent attention by its head dims (torchtitan's count);
    # grouped-query attention as 12 * n_layers * dim * seq.
    args = get_config("deepseek_v3_16b")
    pred = predict_moe(args, MoELayout(gpus=8, batch=1, seq=4096, ep=2), FIXED)
    flops = spec_for_config(args).flops_per_token(args, 4096)
    assert pred.mfu == pytest.approx(pred.tokens_per_s_per_gpu * flops / FIXED.peak_bf16_flops)
    attention = 6 * args.n_layers * args.n_heads * (192 + 128) * 4096
    assert flops == 6 * num_active_params(args, exclude_embeddings=True) + attention
    gqa = get_config("moe_small")
    assert MOE.flops_per_token(gqa, 512) == (
        6 * num_active_params(gqa, exclude_embeddings=True) + 12 * gqa.n_layers * gqa.dim * 512
    )


def test_one_prediction_record_for_both_plan_methods(capsys) -> None:
    # One record: the analytic plan adds its parameter counts and has no
    # bucket plan, the traced one has a bucket plan and no counts.
    from simplefsdp.plan import Prediction
    from simplefsdp.plan.predict import Layout

    parts = dict(memory={"parameters": 1.0}, peak_bytes=1.0, usable_bytes=2.0, time={})
    parts |= dict(step_s=1.0, tokens_per_s_per_gpu=1.0, mfu=0.5, hardware="h100")
    traced = Prediction(layout=Layout(gpus=2, batch=1, seq=8), buckets=[["w"]], **parts)
    analytic = Prediction(
        layout=MoELayout(gpus=2, batch=1, seq=8), buckets=None, params={"total": 3}, **parts
    )
    common = ["layout", "hardware", "fits", "peak_bytes", "usable_bytes", "memory_bytes"]
    common += ["time_s", "step_s", "tokens_per_s_per_gpu", "mfu"]
    assert list(traced.to_dict()) == [*common, "num_buckets", "buckets", "kept_gathered", "notes"]
    assert list(analytic.to_dict()) == [*common[:2], "parameters", *common[2:], "notes"]
    assert analytic.to_dict()["layout"]["ep"] == 1 and traced.to_dict()["layout"]["dp"] == 2
    # The analytic plan's notes say what it leaves out in words.
    argv = ["--model", "moe_debug", "--gpus", "2", "--hardware", "cpu-gloo", "--json"]
    assert plan_cli.main(argv) == 0
    notes = json.loads(capsys.readouterr().out)["predictions"][0]["notes"]
    assert any("not modelled" in note for note in notes)
    assert not any("Note:" in note for note in notes)


def test_plan_names_no_family_and_every_plan_method_is_known() -> None:
    source = Path(plan_cli.__file__).parent
    for path in source.glob("*.py"):
        if path.name == "layout.py":  # the layout's own module
            continue
        text = path.read_text()
        for family in family_names():
            assert f"simplefsdp.models.{family}" not in text, (path.name, family)
        assert "is_moe_model" not in text and "LLAMA3_CONFIGS" not in text, path.name
    for family in family_names():
        spec = get_spec(family)
        assert spec.plan_method in plan_cli.METHOD_FLAGS
        for flavor in spec.reference_layouts:
            assert spec.flavors.get(flavor) is not None, (family, flavor)


def test_copies_around_the_collectives_as_the_traced_plans_count_them() -> None:
    # per all-gather the shards in and the block out, per reduce-scatter the
    # gradients in (copy_written_bytes): a gather fewer without resharding,
    # nothing on one rank
    args = get_config("moe_small")
    base = MoELayout(gpus=8, batch=2, seq=512, ep=2)
    copies = predict_moe(args, base, FIXED).time["copies"]
    kept = predict_moe(args, dataclasses.replace(base, reshard_after_forward=False), FIXED)
    assert 0 < kept.time["copies"] < copies
    # two gathers and a reduce-scatter against one and one: (2 (1 + 1/g) + 1)
    # over (1 + 1/g + 1) with g the group (8 dense, 4 experts): between
    lo, hi = sorted((2 * (1 + 1 / g) + 1) / ((1 + 1 / g) + 1) for g in (4, 8))
    assert lo <= copies / kept.time["copies"] <= hi
    single = predict_moe(args, MoELayout(gpus=1, batch=2, seq=512), FIXED)
    assert single.time["copies"] == 0.0


def test_pipeline_and_accumulation_of_a_model_planned_from_its_shapes() -> None:
    # --pp: the family's pipeline_split puts 6 of moe_small's 12 blocks on
    # each of 2 ranks, the dense first block on the first; the rank planned
    # is the second, all 6 with routed experts (with the embedding and the
    # output);
    # 1F1B runs m + p - 1 microbatch slots, the first rank holding two
    # microbatches in flight at its peak beside the fp32 gradient sums of
    # its parameters, whole (Note: [Gradient accumulation in the plan]).
    args = get_config("moe_small")
    spec = spec_for_config(args)
    base = MoELayout(gpus=8, batch=4, seq=512, ep=2, ac="full", microbatches=4)
    piped = predict_moe(args, dataclasses.replace(base, pp=2), FIXED)
    assert args.n_dense_layers == 1
    stage = dataclasses.replace(args, n_layers=6, n_dense_layers=0)
    local = spec.num_params(stage) - (1 - 1 / 2) * analytic.expert_params(stage)
    assert piped.memory["accumulated"] == pytest.approx(4 * local)
    assert piped.memory["activations"] == pytest.approx(2 * (6 * args.dim) * 512 * 2)
    assert piped.memory["parameters"] == pytest.approx(4 * spec.num_params(stage) / 4)
    slots = 4 + 2 - 1
    slot = (piped.step_s - piped.time["optimizer"]) / slots
    assert piped.time["bubble"] == pytest.approx(slot)
    assert piped.tokens_per_s_per_gpu == pytest.approx(4 * 512 * 4 / piped.step_s / 8)
    # Accumulation without a pipeline: one microbatch's activations, the
    # sums of all the parameters, four slots of one microbatch's work.
    accum = predict_moe(args, base, FIXED)
    once = predict_moe(args, dataclasses.replace(base, batch=1, microbatches=1), FIXED)
    assert accum.memory["activations"] == pytest.approx(once.memory["activations"])
    assert once.memory["accumulated"] == 0.0
    whole = spec.num_params(args) - (1 - 1 / 2) * analytic.expert_params(args)
    assert accum.memory["accumulated"] == pytest.approx(4 * whole)
    assert accum.time["bubble"] == 0.0
    work = accum.step_s - accum.time["optimizer"]
    assert work == pytest.approx(4 * (once.step_s - once.time["optimizer"]))


def test_pipeline_plans_each_rank_that_may_be_the_most_loaded() -> None:
    # moe_small's dense first block sits on the first of 2 ranks: its 6
    # blocks (5 with routed experts) and the second's 6 (all) are both
    # planned; the memory is the heavier's, the step the slower's.
    from simplefsdp.plan.pipeline import stage_compositions

    args = get_config("moe_small")
    spec = spec_for_config(args)
    assert stage_compositions(spec, args, 2) == [(6, 6), (6, 5)]
    assert stage_compositions(spec, args, 1) == [(12, 11)]
    layout = MoELayout(gpus=8, batch=4, seq=512, ep=2, ac="full", microbatches=4, pp=2)
    both = [analytic._predict_rank(spec, args, layout, FIXED, r) for r in [(6, 6), (6, 5)]]
    plan = predict_moe(args, layout, FIXED)
    assert both[0].peak_bytes > both[1].peak_bytes  # the experts weigh more
    assert plan.peak_bytes == max(p.peak_bytes for p in both)
    assert plan.memory == max(both, key=lambda p: p.peak_bytes).memory
    assert plan.step_s == max(p.step_s for p in both)
    assert any("pipeline ranks planned: 2" in note for note in plan.notes)
    # a model's own dense blocks kept, by the field its family counts them in
    qwen = resolve_flavor("qwen3_moe_debug", n_layers=8, mlp_only_layers=(0, 1))[1]
    cut = analytic.stage_config(get_spec("qwen3_moe"), qwen, 4, 3)
    assert (cut.n_layers, cut.n_moe_layers) == (4, 3)


def test_fsdp2_under_a_pipeline_without_resharding_talks_once_per_step() -> None:
    # torch's stages leave FSDP2's groups gathered and unsynchronised between
    # microbatches: one slot carries the data-parallel collectives; the
    # compiled engine gathers and reduces every microbatch.
    args = get_config("moe_small")
    comm = {}
    for engine in ("fsdp2", "simplefsdp"):
        for m in (2, 4):
            layout = MoELayout(
                gpus=8, batch=m, seq=512, ep=2, ac="full", engine=engine, pp=2, microbatches=m,
                reshard_after_forward=False,
            )  # fmt: skip
            comm[engine, m] = predict_moe(args, layout, PROFILES["h100"]).time["dp_comm_total"]
    assert comm["fsdp2", 4] == pytest.approx(comm["fsdp2", 2])
    assert comm["simplefsdp", 4] == pytest.approx(2 * comm["simplefsdp", 2])


def test_cli_plans_a_pipeline_of_a_model_planned_from_its_shapes(capsys) -> None:
    argv = ["--model", "moe_small", "--gpus", "8", "--ep", "2", "--batch", "4", "--seq", "512"]
    assert plan_cli.main([*argv, "--pp", "2", "--pp-schedule", "interleaved_1f1b"]) == 0
    out = capsys.readouterr().out
    assert "dp4 ep2 pp2 m2 interleaved_1f1b v2" in out
    assert "pipeline: interleaved 1F1B, 2 stage(s) per rank, 6 blocks" in out
    cases = [
        (["--pp", "3"], "--pp 3 does not divide the 8 GPUs; valid --pp: 1, 2, 4, 8"),
        (["--pp-schedule", "gpipe"], "--pp-schedule schedules a pipeline; it needs --pp > 1"),
        (["--pp", "2", "--microbatches", "1"], "--microbatches 1 is below --pp 2"),
    ]
    for extra, message in cases:
        assert plan_cli.main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_changes_that_fit_include_a_larger_ep(capsys) -> None:
    # Under a pipeline each rank sums its local experts' gradients whole: a
    # larger EP degree is the change that fits (EP 4 on the 40 GB part).
    argv = ["--model", "deepseek_v3_16b", "--gpus", "16", "--batch", "2", "--seq", "4096"]
    argv += ["--ep", "1", "--pp", "2", "--ac", "full", "--hardware", "a100-40gb"]
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "changes that fit, fastest first:" in err and "--ep 4 (30.9 GiB" in err, err
    assert "--ep 2 (" not in err  # the smallest degree that fits, not every one


def test_float8_converts_the_blocks_dense_linears_and_no_routed_expert(capsys) -> None:
    # simplefsdp train --float8.enable on DeepSeek-V3: multi-head latent
    # attention's four projections and the dense or shared feed-forward
    # network; not the router, the routed experts or the output.
    spec, config = resolve_flavor("deepseek_v3_16b")
    heads, d = config.n_heads, config.dim
    attention = d * heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    attention += d * (config.kv_lora_rank + config.qk_rope_head_dim)
    attention += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    attention += heads * config.v_head_dim * d
    shared = 3 * d * config.num_shared_experts * config.moe_hidden_dim
    found = analytic.float8_linears(spec, config)
    sizes = {kind: sum(i * o for i, o in shapes) for kind, shapes in found.items()}
    assert sizes == {
        "moe": attention + shared,
        "dense": attention + 3 * d * config.dense_hidden_dim,
    }

    layout = MoELayout(gpus=8, batch=1, seq=1024, ep=2, ac="selective")
    hw = dataclasses.replace(FIXED, peak_fp8_flops=4e12, fp8_matmul_efficiency=0.5)
    bf16 = predict_moe(config, layout, hw)
    fp8 = predict_moe(config, dataclasses.replace(layout, float8=True), hw)
    assert "float8" in fp8.layout.describe()
    # Memory: only the gathered blocks shrink, one byte per converted weight
    # (two blocks gathered and one copied out, resharding after forward).
    for part, value in bf16.memory.items():
        expected = value - 3 * sizes["moe"] if part == "gathered" else value
        assert fp8.memory[part] == pytest.approx(expected), part
    # Time: the converted matmuls at four times the rate, less the casts
    tokens = layout.batch * layout.seq
    flops = (
        6 * tokens * (config.n_moe_layers * sizes["moe"] + config.n_dense_layers * sizes["dense"])
    )
    flops *= 1 + 0.5 / 3  # selective AC recomputes half of the forward
    rate = hw.peak_bf16_flops * hw.matmul_efficiency
    saved = flops / rate - flops / (4 * rate)
    casts = fp8.time["compute"] - (bf16.time["compute"] - saved)
    assert 0 < casts < 0.2 * saved
    # The same rate as bf16: slower by the casts alone
    even = dataclasses.replace(hw, peak_fp8_flops=1e12)
    slower = predict_moe(config, dataclasses.replace(layout, float8=True), even)
    assert slower.time["compute"] - bf16.time["compute"] == pytest.approx(casts, rel=1e-6)

    # One line where it is not planned: an eager engine, a part without float8
    argv = ["--model", "deepseek_v3_16b", "--gpus", "8", "--ep", "2", "--float8"]
    assert plan_cli.main([*argv, "--engine", "fsdp2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--float8 with --engine fsdp2 is not planned" in err[0]
    assert plan_cli.main([*argv, "--hardware", "a100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hardware 'a100' has no float8 peak" in err[0]
    assert plan_cli.main([*argv, "--hardware", "h100"]) == 0
    assert "float8" in capsys.readouterr().out
