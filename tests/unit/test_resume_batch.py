"""Resuming on another number of processes keeps the global batch (Note: [Global
batch on resume]), or refuses in one line naming the flag that accepts a new one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simplefsdp.train.config import config_to_dict, load_config
from simplefsdp.train.resume import Resume, keep_global_batch
from simplefsdp.train.runs import RunInfo


def _resume(tmp_path: Path, world: int, *extra: str, given: tuple[str, ...] = ()) -> Resume:
    """A run whose step-5 checkpoint was saved by ``world`` processes with ``extra``."""
    folder = tmp_path / "run" / "checkpoints" / "step-5"
    folder.mkdir(parents=True)
    saved = load_config(None, list(extra))
    (folder / "config.json").write_text(json.dumps({"job": config_to_dict(saved)}))
    (folder / "manifest.json").write_text(json.dumps({"step": 5, "world_size": world}))
    run = RunInfo("r1", tmp_path / "run", "stopped", folder.parent)
    return Resume(run, 5, given=given)


def test_fewer_processes_double_the_per_rank_batch(tmp_path):
    resume = _resume(tmp_path, 4, "--data.batch_size", "8")  # 32 sequences per step
    job = load_config(None, ["--data.batch_size", "8"])
    job, resume = keep_global_batch(job, resume, 2)
    assert (job.data.batch_size, job.training.grad_accum_steps) == (16, 1)
    assert "processes 4 -> 2, data.batch_size 8 -> 16, global batch kept at 32" in resume.line()


def test_accumulation_takes_what_the_batch_cannot(tmp_path):
    extra = ("--data.batch_size", "3", "--training.grad_accum_steps", "2")  # 2 x 3 x 2 = 12
    job, resume = keep_global_batch(load_config(None, list(extra)), _resume(tmp_path, 2, *extra), 1)
    assert job.data.batch_size * job.training.grad_accum_steps == 12
    assert "processes 2 -> 1" in resume.line() and "global batch kept at 12" in resume.line()


def test_no_split_is_refused_naming_the_flag(tmp_path):
    resume = _resume(tmp_path, 2, "--data.batch_size", "2")  # 4 sequences
    with pytest.raises(ValueError, match=r"does not divide over 3 .*--data\.batch_size N"):
        keep_global_batch(load_config(None, ["--data.batch_size", "2"]), resume, 3)


def test_a_batch_named_on_the_command_line_changes_the_global_batch(tmp_path):
    resume = _resume(tmp_path, 2, "--data.batch_size", "2", given=("data.batch_size",))
    job, resume = keep_global_batch(load_config(None, ["--data.batch_size", "5"]), resume, 3)
    assert job.data.batch_size == 5
    assert "processes 2 -> 3, global batch 4 -> 15 sequences" in resume.line()
