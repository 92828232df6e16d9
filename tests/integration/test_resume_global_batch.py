"""Resuming a 2-process run on 1 process keeps the global batch and the data
position: the resumed steps' losses equal the uninterrupted run's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli_runs import losses, only_run, small_args, train_env


def _train(cwd, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", "train", *extra],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.mark.heavy  # three short trainings, ~40 s
def test_resume_on_fewer_processes_trains_on_the_same_batches(tmp_path):
    _train(tmp_path, "--nproc", "2", *small_args(4), "--metrics.output_dir", "whole")
    _train(tmp_path, "--nproc", "2", *small_args(2), "--metrics.output_dir", "split")
    run = only_run(tmp_path / "split")
    resumed = _train(tmp_path, "--nproc", "1", "--resume", str(run), "--training.steps", "4")
    assert (
        "changed: training.steps 2 -> 4, processes 2 -> 1, data.batch_size 2 -> 4, "
        "global batch kept at 4 sequences" in resumed.stdout
    ), resumed.stdout
    whole = losses(only_run(tmp_path / "whole") / "metrics.jsonl")
    split = losses(run / "metrics.jsonl")
    assert split[3] == pytest.approx(whole[3], rel=1e-4)
    assert split[4] == pytest.approx(whole[4], rel=1e-4)
