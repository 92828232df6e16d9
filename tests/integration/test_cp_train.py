"""``simplefsdp train --parallel.cp 2`` end to end with document masks, and its
checkpoint resumed at cp 1 (cp does not change parameter shapes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _train(cwd: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "simplefsdp.cli", "train", *small_args(4),
           "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck",
           "--data.mask_document_boundaries", "true", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_cp2_run_resumes_at_cp1(tmp_path):
    proc = _train(tmp_path, "cp", ["--nproc", "2", "--parallel.cp", "2",
                                   "--parallel.cp_backend", "ring"])  # fmt: skip
    assert "mesh ('dp_shard', 'cp') (1, 2)" in proc.stdout + proc.stderr
    cp2 = losses(only_run(tmp_path / "cp") / "metrics.jsonl")
    assert sorted(cp2) == [1, 2, 3, 4] and cp2[4] < cp2[1]
    ck = checkpoints(only_run(tmp_path / "cp"))
    one = checkpoint_as_run(ck / "step-2", tmp_path / "one")
    proc = _train(tmp_path, "one", ["--nproc", "1", "--resume"])
    assert "steps          2 -> 4" in proc.stdout
    resumed = losses(one / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # the same batches, split or not: fp32 tolerance
        assert resumed[step] == pytest.approx(cp2[step], rel=1e-4), (resumed, cp2)
