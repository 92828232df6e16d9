"""``simplefsdp plan`` for mixture-of-experts models with ``--ep``: the
analytic model's parameter counts, memory, all-to-all time and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

import plan_profiles
from simplefsdp.models.moe import get_config, num_active_params, num_params
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.moe import MoELayout, predict_moe

GiB = 2**30

FIXED = dataclasses.replace(plan_profiles.FIXED, memory_bytes=640 * GiB)


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


def test_cli_moe_plan_prints_parameters_and_all_to_all(capsys) -> None:
    argv = ["--model", "deepseek_v3_16b", "--gpus", "8", "--ep", "2", "--batch", "1"]
    assert plan_cli.main(argv + ["--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "B activated per token" in out and "EP all-to-all" in out and "dp8 ep2" in out
    assert plan_cli.main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pred = data["predictions"][0]
    assert pred["layout"]["ep"] == 2 and pred["parameters"]["total"] > 15e9


def test_cli_bad_moe_layouts_are_one_line_errors(capsys) -> None:
    cases = [
        (
            ["--model", "deepseek_v3_16b", "--gpus", "6", "--ep", "3"],
            "--ep 3 does not divide the model's 64 experts; valid --ep on 6 GPUs: 1, 2",
        ),
        (
            ["--model", "moe_small", "--gpus", "6", "--ep", "4"],
            "--ep 4 does not divide the 6 data-parallel ranks; valid --ep: 1, 2",
        ),
        (["--model", "llama3_debug", "--ep", "2"], "--ep 2 needs a mixture-of-experts --model"),
        (["--model", "moe_debug", "--tp", "2"], "--tp is not planned for mixture-of-experts"),
        (["--model", "moe_debug", "--float8"], "--float8 is not planned for mixture-of-experts"),
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
