"""``simplefsdp train --model moe_debug`` compiled with expert parallelism
over many steps on 4 CPU processes (ep 2 x dp 2): routing, hence every
rank's expert token counts, changes each step and between ranks, and the
run neither recompiles into Dynamo's limit nor diverges between ranks
(Note: [Expert parallelism under torch.compile]); it validates and
checkpoints, and its checkpoint resumes at ep 4. Heavy: about 6 minutes on
2 cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

pytestmark = pytest.mark.heavy

STEPS, MORE = 200, 20


def _train(cwd: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "simplefsdp.cli", "train", "--model", "moe_debug",
           *small_args(STEPS), "--metrics.output_dir", name, "--nproc", "4",
           "--compile.enable", "true", "--metrics.log_interval", "10", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=3000
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-20000:]}"
    assert "recompile_limit" not in proc.stderr
    return proc


def test_compiled_moe_trains_validates_and_resumes_at_another_ep(tmp_path):
    proc = _train(tmp_path, "ep2", ["--parallel.ep", "2", "--metrics.val_interval", "50",
                                    "--checkpoint.interval", "50"])  # fmt: skip
    assert f"steps          0 -> {STEPS}" in proc.stdout
    run = only_run(tmp_path / "ep2")
    trained = losses(run / "metrics.jsonl")
    assert set(range(10, STEPS + 1, 10)) <= set(trained) and max(trained) == STEPS
    assert sorted(losses(run / "metrics.jsonl", "val_loss")) == [50, 100, 150, 200]
    assert trained[STEPS] < trained[10]
    assert (checkpoints(run) / f"step-{STEPS}").is_dir()

    resumed_run = checkpoint_as_run(checkpoints(run) / f"step-{STEPS}", tmp_path / "ep4")
    proc = _train(tmp_path, "ep4", ["--parallel.ep", "4", "--training.steps",
                                    str(STEPS + MORE), "--resume"])  # fmt: skip
    assert f"steps          {STEPS} -> {STEPS + MORE}" in proc.stdout
    resumed = losses(resumed_run / "metrics.jsonl")
    assert min(resumed) > STEPS and max(resumed) == STEPS + MORE
    assert resumed[STEPS + MORE] < trained[10]
