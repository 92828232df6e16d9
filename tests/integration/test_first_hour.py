"""What a new user meets in the first hour: fast one-line errors, reruns, Ctrl-C.

Runs are tiny and uncompiled (2 CPU processes, seq 64, a few steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runs import checkpoints, children, only_run, run_dirs

SMALL = [
    "--data.max_bytes", "300000", "--data.seq_len", "64", "--data.batch_size", "2",
    "--metrics.log_interval", "1", "--metrics.val_interval", "0", "--compile.enable", "false",
    "--metrics.output_dir", "out", "--checkpoint.folder", "out/ck",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _only_line(stderr: str) -> str:
    """The one error line (rank 0's INFO log lines may come before it)."""
    lines = [line for line in stderr.splitlines() if line.strip() and "] INFO " not in line]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and lines[0].startswith("simplefsdp ")
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["train", "--help"],
        ["bench", "--help"],
        ["bench", "--configs", "nope"],
        ["train", "--training.stpes", "3"],
    ],
    ids=["help", "version", "train-help", "bench-help", "bench-error", "config-error"],
)
def test_help_and_config_errors_do_not_import_torch(args):
    code = (
        "import sys\n"
        "from simplefsdp.cli import main\n"
        "try:\n"
        f"    code = main({args!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.stdout.splitlines()[-1] in ("NO-TORCH 0", "NO-TORCH 2"), proc.stdout + proc.stderr
    if args[-1] == "3":
        assert "Did you mean 'steps'" in _only_line(proc.stderr)


def test_empty_data_and_missing_resume_are_one_line_errors(tmp_path):
    (tmp_path / "e.txt").write_text("")
    proc = _cli(["train", *SMALL, "--data.path", "e.txt"], tmp_path)
    assert proc.returncode == 2
    assert "data.path 'e.txt' is empty" in _only_line(proc.stderr)
    proc = _cli(["train", *SMALL, "--resume"], tmp_path)
    assert proc.returncode == 2
    line = _only_line(proc.stderr)
    assert "--resume: no run in out has a complete checkpoint (there are no runs in out)" in line
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.slow
def test_a_rerun_is_a_new_run_and_never_mixes_files(tmp_path):
    first = _cli(["train", *SMALL, "--training.steps", "4", "--checkpoint.interval", "2"], tmp_path)
    assert first.returncode == 0, first.stderr
    run1 = only_run(tmp_path / "out")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    second = _cli(["train", *SMALL, "--training.steps", "3", "--checkpoint.interval", "1",
                   "--checkpoint.keep_last", "2"], tmp_path)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert "moved" not in second.stdout
    old, run2 = run_dirs(tmp_path / "out")
    assert old == run1
    # nothing of the first run moved or changed (its run.json and files are where they were)
    assert all((tmp_path / p).exists() for p in before)
    assert {r["run_id"] for r in _records(run1 / "metrics.jsonl")} == {run1.name}
    records = _records(run2 / "metrics.jsonl")
    assert {r["run_id"] for r in records} == {run2.name}
    assert records[0]["event"] == "run_started"
    assert [r["step"] for r in records[1:]] == [1, 2, 3]
    # Each run's checkpoints in its own folder (keep_last 2 counts this run's).
    assert sorted(p.name for p in checkpoints(run2).iterdir()) == ["step-2", "step-3"]
    assert sorted(p.name for p in checkpoints(run1).iterdir()) == ["step-2", "step-4"]
    # "latest" is the newest run with a checkpoint: export picks step-3, resume continues run 2.
    export = _cli(["export", "--checkpoint", "out", "--out", "m.safetensors"], tmp_path)
    assert export.returncode == 0, export.stderr
    assert json.loads((tmp_path / "m.config.json").read_text())["step"] == 3
    resumed = _cli(["train", *SMALL, "--training.steps", "4", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    records = _records(run2 / "metrics.jsonl")
    assert {r["run_id"] for r in records} == {run2.name}
    assert records[-2]["event"] == "run_resumed" and records[-1]["step"] == 4
    assert run_dirs(tmp_path / "out") == [run1, run2]
    # (A checkpoint that does not fit the model: test_checkpoint_cli.py.)


def _training(tmp_path: Path, stderr: int, *extra: str) -> subprocess.Popen:
    """A 500-step run in its own session, returned once it logs its first step."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "simplefsdp.cli", "train", *SMALL, "--training.steps", "500",
         "--checkpoint.interval", "100", *extra],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until training runs
        if line.startswith("step") or time.monotonic() > deadline:
            break
    return proc


def _stop_line(out: str, text: str) -> tuple[str, int]:
    """Rank 0's one stop line, which contains ``text``, and the step it names."""
    (line,) = [x for x in out.splitlines() if text in x]
    return line, int(line.split("after step ")[1].split(":")[0])


@pytest.mark.slow
def test_sigint_finishes_the_step_saves_and_exits_with_one_line(tmp_path):
    proc = _training(tmp_path, stderr=subprocess.PIPE)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    line, step = _stop_line(out, "stopped by SIGINT")
    run = only_run(tmp_path / "out")
    assert line.endswith(
        f"saved out/ck/{run.name}/step-{step}; continue with: simplefsdp train --resume out/{run.name}"
    )
    assert (checkpoints(run) / f"step-{step}" / "manifest.json").is_file()
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    resumed = _cli(
        ["train", "--resume", f"out/{run.name}", "--training.steps", str(step + 1)], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"steps          {step} -> {step + 1}" in resumed.stdout


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_signal_to_one_worker_stops_both_and_rank_0_names_it(tmp_path):
    """Note: [Clean stop]: SIGTERM to rank 1 alone (a scheduler stopping one
    process); both ranks stop after the same step and rank 0, which received
    nothing, reports the signal that rank 1 received. A stop is no failure:
    --max-restarts does not start the run again."""
    proc = _training(tmp_path, subprocess.PIPE, "--max-restarts", "1")
    (rank_1,) = [
        pid
        for pid in children(proc.pid)
        if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    ]
    os.kill(rank_1, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    line, step = _stop_line(out, "stopped by SIGTERM (received by another rank)")
    run = only_run(tmp_path / "out")
    assert (checkpoints(run) / f"step-{step}" / "manifest.json").is_file()
    assert out.splitlines()[-1] == line, out  # no step after the stop
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").open()]
    assert max(steps) == step, steps


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_workers_of_a_killed_launcher_stop_and_save(tmp_path):
    """Note: [Orphaned workers]: SIGKILL to the launcher alone (as the OOM
    killer sends it) leaves workers in sessions of their own; they stop
    cleanly after the same step and save it, rather than train on, and
    remove the launcher's error folder, which the launcher cannot."""
    proc = _training(tmp_path, stderr=subprocess.STDOUT)
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    environ = Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
    (error_dir,) = [
        Path(v.split(b"=", 1)[1].decode())
        for v in environ
        if v.startswith(b"SIMPLEFSDP_ERROR_DIR=")
    ]
    assert error_dir.is_dir()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{pid}").exists() for pid in workers):
        if time.monotonic() > deadline:
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            pytest.fail("the workers went on after their launcher was killed")
        time.sleep(0.5)
    out = proc.stdout.read()  # the workers exited: the pipe is closed
    line, step = _stop_line(out, "stopped by SIGTERM")
    assert step < 500, line
    run = only_run(tmp_path / "out")
    assert (checkpoints(run) / f"step-{step}" / "manifest.json").is_file()
    assert not error_dir.exists(), sorted(error_dir.iterdir())
    for pid in workers:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
