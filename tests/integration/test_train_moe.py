"""``simplefsdp train --model moe_debug --parallel.ep 2`` end to end on 2 CPU
processes (ep = world size): expert-load metrics, export of plain full
weights, and the run resumed with another expert-parallel degree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

pytestmark = pytest.mark.slow

MOE_LAYERS = ["layers.1.moe", "layers.2.moe", "layers.3.moe"]  # moe_debug: 1 dense + 3 MoE


def _train(cwd: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "simplefsdp.cli", "train", "--model", "moe_debug",
           *small_args(4), "--metrics.output_dir", name, "--nproc", "2", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("moe")
    # validation (steps 2, 4) runs the model in training mode: its tokens must not count
    proc = _train(root, "ep2", ["--parallel.ep", "2", "--metrics.val_interval", "2",
                                "--metrics.val_batches", "1"])  # fmt: skip
    return root, proc


def test_moe_ep_run_logs_expert_load_and_exports(ep2_run, capsys):
    root, proc = ep2_run
    assert "simplefsdp (fully_shard x ep 2; not compiled)" in proc.stderr
    step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 4 and all(" | moe imb " in line for line in step_lines)
    run = only_run(root / "ep2")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert ["val_loss" in r for r in steps] == [False, True, False, True]
    for record in steps:
        layers = record["moe_layers"]
        assert sorted(layers) == MOE_LAYERS
        for entry in layers.values():
            counts = entry["tokens_per_expert"]
            # every routed slot of the step on both ranks: 2 ranks x 2 x 64 tokens x top 2
            assert len(counts) == 8 and sum(counts) == 2 * 2 * 64 * 2
            assert entry["imbalance"] == pytest.approx(max(counts) * 8 / sum(counts), abs=1e-4)
        assert record["moe_imbalance"] == max(e["imbalance"] for e in layers.values())
    loss = losses(run / "metrics.jsonl")
    assert loss[4] < loss[1]

    import torch
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.moe import Transformer
    from simplefsdp.train import export_cli

    out = root / "moe.safetensors"
    assert export_cli.main(["--checkpoint", str(run), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (
        export_cli.main(["--checkpoint", str(run), "--format", "hf", "--out", str(root / "hf")])
        == 2
    )
    assert "the 'moe' model family has no Hugging Face format" in (capsys.readouterr().err)

    tensors = load_file(str(out))
    w1 = tensors["layers.1.moe.experts.w1"]
    assert w1.shape == (8, 256, 256)  # all experts, full shape
    assert not torch.equal(w1[:4], w1[4:])  # the two ranks' experts are not copies
    assert tensors["layers.1.moe.expert_bias"].abs().sum() > 0  # the routing bias moved
    config = json.loads(out.with_name("moe.config.json").read_text())
    assert config["model"]["family"] == "moe" and config["model"]["flavor"] == "moe_debug"
    model = Transformer(model_args_from_config(config))
    model.load_state_dict(tensors)  # strict: plain names, nothing missing


@pytest.mark.heavy
def test_moe_run_resumes_with_another_ep(ep2_run):
    root, _ = ep2_run
    run = only_run(root / "ep2")
    trained = losses(run / "metrics.jsonl")
    # resume step 2 of the ep 2 run with ep 1: DCP reshards the experts
    ep1_run = checkpoint_as_run(checkpoints(run) / "step-2", root / "ep1")
    proc = _train(root, "ep1", ["--parallel.ep", "1", "--resume"])
    assert "steps          2 -> 4" in proc.stdout
    resumed = losses(ep1_run / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # same math, another reduction order: fp32 tolerance
        assert resumed[step] == pytest.approx(trained[step], rel=1e-4), (resumed, trained)
