"""``simplefsdp train --parallel.tp 2`` end to end: dp2 x tp2 on 4 CPU processes,
then the run resumed from its checkpoint on another layout (dp2, no TP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

pytestmark = pytest.mark.slow


def _train(cwd: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "simplefsdp.cli", "train", *small_args(4),
           "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_tp_run_resumes_on_another_layout(tmp_path):
    proc = _train(tmp_path, "tp", ["--nproc", "4", "--parallel.tp", "2"])
    assert "starting 4 processes on cpu" in proc.stdout
    two_d = losses(only_run(tmp_path / "tp") / "metrics.jsonl")
    assert sorted(two_d) == [1, 2, 3, 4] and two_d[4] < two_d[1]
    ck = checkpoints(only_run(tmp_path / "tp"))
    state = json.loads((ck / "step-2" / "trainer_state.json").read_text())
    # a TP group reads one batch: the loader advanced by the 2 data-parallel ranks only
    assert state["data_loader"]["position"] == 2 * 2 * 2  # steps * dp ranks * batch
    # resume step 2 of the (dp2, tp2) run on (dp2): weights, AdamW state and data order
    dp_run = checkpoint_as_run(ck / "step-2", tmp_path / "dp")
    proc = _train(tmp_path, "dp", ["--nproc", "2", "--resume"])
    assert "steps          2 -> 4" in proc.stdout
    resumed = losses(dp_run / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # same math, TP's reduction order: fp32 tolerance
        assert resumed[step] == pytest.approx(two_d[step], rel=1e-4), (resumed, two_d)
