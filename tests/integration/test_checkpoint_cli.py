"""Checkpoints through the CLI on 2 CPU processes: a rank SIGKILLed mid-training
restarts and resumes automatically (``simplefsdp train --max-restarts`` and
``torchrun --max-restarts``) to the bitwise-same final model; bad checkpoints
give one-line errors.

Runs are tiny and eager (6 steps of the debug model on 300 kB of the stdlib
corpus, checkpoints every 2 steps); rank 1 is killed by the test-only hook
``SIMPLEFSDP_TEST_KILL_AT_STEP`` (see ``simplefsdp._faults``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env
from simplefsdp._faults import DEFAULT_KILL_MARKER, KILL_AT_STEP_ENV

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AT = 3  # after the checkpoint of step 2: the restart resumes from step 2
SMALL = small_args(STEPS)
TIMEOUT_S = 240


def _train(cwd: Path, name: str, *, launcher: str = "simplefsdp", extra=(), env=None):
    args = [*SMALL, "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck", *extra]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", "-m", "simplefsdp.train", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "simplefsdp.cli", "train", *args]
    return subprocess.run(
        cmd, cwd=cwd, env=env or train_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, full shapes, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from simplefsdp.checkpoint import SafeFileSystemReader

    reader = SafeFileSystemReader(str(folder))
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("rng.")
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    cwd = tmp_path_factory.mktemp("ckcli")
    proc = _train(cwd, "ref")
    assert proc.returncode == 0, proc.stderr
    return cwd


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("launcher", ["simplefsdp", "torchrun"])
def test_sigkill_of_a_rank_restarts_and_matches_the_uninterrupted_run(reference, launcher):
    cwd = reference
    name = f"killed-{launcher}"
    extra = ["--max-restarts", "1"] if launcher == "simplefsdp" else []
    proc = _train(
        cwd, name, launcher=launcher, extra=extra, env=train_env(**{KILL_AT_STEP_ENV: str(KILL_AT)})
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert (cwd / name / DEFAULT_KILL_MARKER).is_file()  # rank 1 was killed ...
    if launcher == "simplefsdp":
        # One line for the death (Note: [Worker failures]), none of the
        # survivor's collective errors.
        deaths = [line for line in proc.stderr.splitlines() if "died of" in line]
        run_id = only_run(cwd / name).name
        assert deaths == [
            f"simplefsdp train: rank 1 died of SIGKILL in step {KILL_AT}; restart 1 of 1, "
            f"resuming from {name}/ck/{run_id}/step-2"
        ], proc.stderr
        output = proc.stdout + proc.stderr
        assert "Traceback" not in output and "Connection closed by peer" not in output, output
        assert "exitcode: -9" not in proc.stderr  # torchelastic's own record is dropped
    else:
        assert "exitcode: -9" in proc.stderr  # the agent saw the SIGKILL and restarted
    assert f"steps          2 -> {STEPS}" in proc.stdout  # ... and the restart resumed at 2
    ref, run = only_run(cwd / "ref"), only_run(cwd / name)  # the restart continued the run
    want = _tensors(checkpoints(ref) / f"step-{STEPS}")
    got = _tensors(checkpoints(run) / f"step-{STEPS}")
    assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in got)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key  # bitwise
    assert losses(run / "metrics.jsonl") == losses(ref / "metrics.jsonl")


def test_export_of_a_truncated_checkpoint_is_a_one_line_error(reference, tmp_path):
    damaged = tmp_path / "step-6"
    shutil.copytree(checkpoints(only_run(reference / "ref")) / f"step-{STEPS}", damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    cmd = [sys.executable, "-m", "simplefsdp.cli", "export", "--checkpoint", str(damaged),
           "--out", str(tmp_path / "x.safetensors")]  # fmt: skip
    proc = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(shard) in lines[0] and "truncated" in lines[0], proc.stderr


def test_resume_with_another_model_config_is_a_one_line_error(reference):
    cwd = reference
    # a checkpoint copied into a run of another model (a run folder without a
    # config.toml trains with the command's configuration; with one, resume
    # refuses the change before any process starts: test_run_folders_cli.py)
    checkpoint_as_run(checkpoints(only_run(cwd / "ref")) / f"step-{STEPS}", cwd / "wrong")
    proc = _train(cwd, "wrong", extra=["--resume", "--model.vocab_size", "300"])
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "simplefsdp train: error:" in line]
    assert len(errors) == 1, proc.stderr  # the lowest rank's reason, once, from the launcher
    assert f"step-{STEPS}/.metadata: model tensor 'tok_embeddings.weight' has shape" in errors[0]
    assert "Traceback" not in proc.stderr


def test_damaged_latest_checkpoint_stops_resume_and_load_step_falls_back(reference):
    """A truncated shard in the latest checkpoint: --resume stops with one line naming
    it, the previous good step and the flag; that flag resumes from it, and the
    first resumed step follows the new schedule (here 8 steps instead of 6)."""
    cwd = reference
    source = checkpoints(only_run(cwd / "ref"))
    run = checkpoint_as_run(source / "step-4", cwd / "damaged")
    shutil.copytree(source / f"step-{STEPS}", checkpoints(run) / f"step-{STEPS}")
    shard = checkpoints(run) / f"step-{STEPS}" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = _train(cwd, "damaged", extra=["--resume"])
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "ignoring" not in proc.stderr, proc.stderr
    assert str(shard.resolve()) in errors[0] and "truncated" in errors[0]
    assert "previous good checkpoint is step 4: pass --checkpoint.load_step 4" in errors[0]

    extra = ["--resume", "--checkpoint.load_step", "4", "--training.steps", "8"]
    proc = _train(cwd, "damaged", extra=extra)
    assert proc.returncode == 0, proc.stderr
    assert "steps          4 -> 8" in proc.stdout
    from simplefsdp.train.schedule import lr_factor

    lr = losses(run / "metrics.jsonl", key="lr")
    want = 3e-3 * lr_factor(4, warmup_steps=2, total_steps=8, min_lr_ratio=0.1)
    assert lr[5] == pytest.approx(want, rel=1e-6)
