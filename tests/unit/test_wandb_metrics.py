"""``metrics.wandb``: every record's numbers go to Weights & Biases beside the
JSON lines, under the run id (a resumed run continues the same W&B run)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from simplefsdp.train.metrics import MetricsWriter


class _FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", dict(data), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_records_are_logged_to_wandb_under_the_run_id(tmp_path, monkeypatch):
    calls: list = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricsWriter(
        tmp_path, run_id="r1", wandb=True, wandb_project="p", config={"training": {"lr": 0.1}}
    )
    writer.write({"loss": 2.5, "lr": 1e-3, "event_name": "x", "flag": True}, step=3)
    writer.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["id"], init["resume"]) == ("p", "r1", "r1", "allow")
    assert init["config"] == {"training": {"lr": 0.1}} and init["dir"] == str(tmp_path)
    assert calls[1:] == [("log", {"loss": 2.5, "lr": 1e-3}, 3), ("finish",)]
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["loss"] == 2.5  # the JSON lines as before


def test_without_wandb_installed_it_warns_and_writes_json(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    writer = MetricsWriter(tmp_path, run_id="r1", wandb=True)
    writer.write({"loss": 1.0}, step=1)
    writer.close()
    assert "wandb is not installed" in caplog.text
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_offline_wandb_writes_the_run_locally(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, run_id="offline1", wandb=True, wandb_project="t")
    writer.write({"loss": 1.0}, step=1)
    writer.close()
    assert list((tmp_path / "wandb").glob("offline-run-*offline1"))
