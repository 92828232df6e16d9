"""``simplefsdp runs``: the step a run reached beside its checkpoint, the model
column, ``--root`` after the subcommand; runs filed under the model they train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simplefsdp.train import cli, runs, runs_cli
from simplefsdp.train.config import load_config
from simplefsdp.train.resume import run_config_text


@pytest.fixture(autouse=True)
def _checkpoint_at_27(monkeypatch):
    """Every run's newest complete checkpoint is step 27 (no torch.distributed.checkpoint)."""
    monkeypatch.setattr(runs.RunInfo, "latest_step", lambda self: 27)


def _stopped_run(root: Path) -> Path:
    """A moe_debug run logged at step 25 and stopped (and saved) at step 27."""
    run = root / "20260101-000000-aaaa"
    (run / "checkpoints").mkdir(parents=True)
    record = {"id": run.name, "started": run.name, "status": "stopped",
              "checkpoint_folder": str(run / "checkpoints")}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 25, "loss": 1.0}) + "\n")
    job = load_config("debug", ["--model.name", "moe_debug"])
    (run / "config.toml").write_text(run_config_text(job))
    return run


def test_runs_lists_the_step_reached_and_the_model(tmp_path, capsys):
    _stopped_run(tmp_path)
    assert runs_cli.main(["--root", str(tmp_path)]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split()[:5] == ["run", "status", "step", "checkpoint", "model"]
    assert line.split()[1:5] == ["stopped", "27", "step-27", "moe_debug"]


def test_root_after_the_subcommand(tmp_path, capsys):
    _stopped_run(tmp_path)
    assert runs_cli.main(["prune", "--keep", "1", "--root", str(tmp_path)]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert runs_cli.main(["list", "--root", str(tmp_path / "none")]) == 0
    assert "no runs in" in capsys.readouterr().out


def test_a_model_flag_files_the_run_under_that_model():
    _, job, _ = cli._parse(["--model", "moe_debug"])
    assert Path(job.metrics.output_dir) == Path("outputs/moe_debug")
    _, job, _ = cli._parse(["--model", "moe_debug", "--metrics.output_dir", "mine"])
    assert job.metrics.output_dir == "mine"
    _, job, _ = cli._parse([])
    assert Path(job.metrics.output_dir) == Path("outputs/debug")
