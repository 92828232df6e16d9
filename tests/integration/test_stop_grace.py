"""A stop (SIGINT to ``simplefsdp train``) waits for a step and save that take
longer than torchrun's shutdown timeout, instead of killing the workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cli_runs import checkpoints, only_run, small_args, train_env


@pytest.mark.heavy  # ~30 s: start-up, two slow steps and a save
@pytest.mark.skipif(sys.platform != "linux", reason="process groups as on Linux")
def test_a_stop_waits_for_a_slow_step_and_its_save(tmp_path):
    env = train_env(
        SIMPLEFSDP_TEST_STEP_SLEEP_S="2",  # every step takes > 2 s
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1",  # torchrun's agent would kill after 1 s
    )
    args = [*small_args(20), "--checkpoint.interval", "100", "--checkpoint.async_mode", "async",
            "--metrics.output_dir", "out"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "simplefsdp.cli", "train", "--nproc", "2", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until training runs
        if line.startswith("step") or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, in the middle of a 2 s step
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "before saving" not in err and "forcefully" not in err, err
    (stop,) = [x for x in out.splitlines() if "stopped by SIGINT" in x]
    step = int(stop.split("after step ")[1].split(":")[0])
    assert (checkpoints(only_run(tmp_path / "out")) / f"step-{step}" / "manifest.json").is_file()
