"""Runs through the CLI: the stop hint resumes this run, a resume restores the
run's configuration, output folders are checked before any process starts,
export finds a run's checkpoint however it is named.

Runs are tiny and eager (2 CPU processes, seq 64, a few steps).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runs import checkpoints, losses, only_run, run_dirs, small_args, train_env

TIMEOUT_S = 240


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *args],
        cwd=cwd,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line on stderr; no process was started."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout, proc.stdout
    return lines[0]


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.slow
def test_the_printed_resume_command_resumes_this_run(tmp_path):
    # another run, newer checkpoints, in the default folder (outputs/debug)
    other = _cli(["train", *small_args(4)], tmp_path)
    assert other.returncode == 0, other.stderr
    other_run = only_run(tmp_path / "outputs" / "debug")
    args = [*small_args(30), "--checkpoint.interval", "100",
            "--checkpoint.folder", "B/ckpt", "--metrics.output_dir", "B"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "simplefsdp.cli", "train", *args],
        cwd=tmp_path, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # wait until training runs
        if line.startswith("step") or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    (line,) = [x for x in out.splitlines() if "stopped by SIGINT" in x]
    step = int(line.split("after step ")[1].split(":")[0])
    run = only_run(tmp_path / "B")
    assert f"saved B/ckpt/{run.name}/step-{step}" in line
    command = line.split("continue with: ")[1]
    assert command == f"simplefsdp train --resume B/{run.name}"
    resumed = _cli(shlex.split(command)[1:], tmp_path)  # exactly the printed command
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming run {run.name} at step {step} (B/{run.name})" in resumed.stdout
    assert f"run            {run.name}" in resumed.stdout
    assert f"steps          {step} -> 30" in resumed.stdout  # its own training.steps
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in records} == {run.name}
    assert sorted(losses(run / "metrics.jsonl")) == list(range(1, 31))
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert sorted(losses(other_run / "metrics.jsonl")) == [1, 2, 3, 4]  # untouched
    assert run_dirs(tmp_path / "outputs" / "debug") == [other_run]


@pytest.mark.parametrize(
    "flags",
    [
        ["--checkpoint.folder", "/proc/ckpt"],
        ["--metrics.output_dir", "/proc/out"],
        ["--metrics.output_dir", "/proc/out", "--metrics.tensorboard", "true"],
    ],
    ids=["checkpoint", "metrics", "tensorboard"],
)
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_unwritable_output_folders_fail_before_anything_starts(tmp_path, flags):
    previous = tmp_path / "outputs" / "debug" / "20000101-000000-prev"
    previous.mkdir(parents=True)
    (previous / "run.json").write_text('{"id": "20000101-000000-prev", "status": "finished"}')
    (previous / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = _tree(tmp_path)
    proc = _cli(["train", *small_args(4), *flags], tmp_path)
    assert proc.returncode == 2
    line = _error_line(proc)
    what = flags[0].lstrip("-")
    assert line.startswith(f"simplefsdp train: error: {what}: cannot write to /proc/"), line
    assert _tree(tmp_path) == before  # nothing written, nothing moved


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    """A 4-step run on its own text file, folders and steps, checkpoints at 2 and 4."""
    cwd = tmp_path_factory.mktemp("runs")
    (cwd / "corpus.txt").write_text(
        "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(3000))
    )
    args = [*small_args(4), "--data.path", "corpus.txt", "--metrics.output_dir", "mine"]
    proc = _cli(["train", *args], cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd, only_run(cwd / "mine")


@pytest.mark.slow
def test_resume_restores_the_run_configuration(custom_run):
    cwd, run = custom_run
    bad = _cli(["train", "--resume", f"mine/{run.name}", "--model.vocab_size", "300"], cwd)
    assert bad.returncode == 2
    line = _error_line(bad)
    assert f"model.vocab_size 300 cannot apply to run {run.name}" in line
    missing = _cli(["train", "--resume", "nope", "--metrics.output_dir", "mine"], cwd)
    assert missing.returncode == 2
    assert f"runs in mine: {run.name} (step 4)" in _error_line(missing)
    # only --resume RUN and one change: data.path, folders, the rest come from the run
    proc = _cli(["train", "--resume", f"mine/{run.name}", "--training.steps", "6"], cwd)
    assert proc.returncode == 0, proc.stderr
    assert (
        f"resuming run {run.name} at step 4 (mine/{run.name}); changed: training.steps 4 -> 6"
        in proc.stdout
    )
    assert "steps          4 -> 6" in proc.stdout
    assert sorted(losses(run / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert 'path = "corpus.txt"' in (run / "config.toml").read_text()
    assert "steps = 6" in (run / "config.toml").read_text()
    assert sorted(p.name for p in checkpoints(run).iterdir()) == ["step-4", "step-6"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["runs", "run", "run-abs", "checkpoints", "step"])
def test_export_accepts_a_run_its_checkpoints_or_a_step(custom_run, what):
    pytest.importorskip("safetensors")
    cwd, run = custom_run
    ckpts = checkpoints(run)
    steps = sorted(int(p.name.split("-")[1]) for p in ckpts.iterdir())
    given = {
        "runs": "mine",
        "run": f"mine/{run.name}",
        "run-abs": str(run.resolve()),
        "checkpoints": str(ckpts),
        "step": str(ckpts / f"step-{steps[0]}"),
    }[what]
    proc = _cli(["export", "--checkpoint", given, "--out", f"{what}.safetensors"], cwd)
    assert proc.returncode == 0, proc.stderr
    step = json.loads((cwd / f"{what}.config.json").read_text())["step"]
    assert len(steps) > 1 and step == (steps[0] if what == "step" else steps[-1])
