"""Run folders without training: lookup, resume choice, output checks, ``simplefsdp runs``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from simplefsdp.train import cli, resume, runs, runs_cli
from simplefsdp.train.config import load_config


def _run(root: Path, run_id: str, *, step: int | None = None, config: str | None = None) -> Path:
    """A run folder; ``step``: pretend its newest complete checkpoint is that step."""
    folder = root / run_id
    (folder / "checkpoints").mkdir(parents=True)
    record = {"id": run_id, "started": run_id, "status": "finished",
              "checkpoint_folder": str(folder / "checkpoints")}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(record))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": step or 0, "run_id": run_id}) + "\n")
    if step is not None:
        (folder / "checkpoints" / "STEP").write_text(str(step))
    if config is not None:
        (folder / "config.toml").write_text(config)
    return folder


@pytest.fixture(autouse=True)
def _fake_checkpoints(monkeypatch):
    def latest_step(self):
        marker = self.checkpoint_folder / "STEP"
        return int(marker.read_text()) if marker.is_file() else None

    monkeypatch.setattr(runs.RunInfo, "latest_step", latest_step)
    monkeypatch.setattr(runs.RunInfo, "resume_step", lambda self, load_step=-1: latest_step(self))


def _job(root: Path, *extra: str):
    return load_config("debug", ["--metrics.output_dir", str(root), *extra])


def _saved_config(root: Path, *extra: str) -> str:
    return resume.run_config_text(_job(root, "--data.path", "corpus.txt", *extra))


def test_resume_picks_the_newest_run_with_a_checkpoint_and_lists_runs(tmp_path):
    _run(tmp_path, "20260101-000000-aaaa", step=4)
    _run(tmp_path, "20260102-000000-bbbb", step=2)
    _run(tmp_path, "20260103-000000-cccc")  # no checkpoint
    job, choice = resume.resolve_resume(_job(tmp_path, "--checkpoint.resume"), None, [])
    assert choice.run.run_id == "20260102-000000-bbbb" and choice.step == 2
    with pytest.raises(ValueError, match="20260103-000000-cccc has no complete checkpoint"):
        resume.resolve_resume(_job(tmp_path, "--checkpoint.resume"), "20260103-000000-cccc", [])
    empty = tmp_path / "empty"
    with pytest.raises(ValueError, match="no run in .* has a complete checkpoint .*no runs in"):
        resume.resolve_resume(_job(empty, "--checkpoint.resume"), None, [])
    job, choice = resume.resolve_resume(_job(empty, "--checkpoint.resume_if_possible"), None, [])
    assert choice is None  # a new run
    with pytest.raises(ValueError, match="20260101-000000-aaaa .step 4., 20260102-000000-bbbb"):
        resume.resolve_resume(_job(tmp_path, "--checkpoint.resume"), "nope", [])


def test_resume_restores_the_saved_config_and_names_the_changes(tmp_path):
    config = _saved_config(tmp_path, "--training.steps", "10", "--data.seq_len", "64")
    run = _run(tmp_path, "20260101-000000-aaaa", step=4, config=config)
    overrides = ["--training.steps", "20", "--checkpoint.resume", "true"]
    job, choice = resume.resolve_resume(_job(tmp_path, *overrides), str(run), overrides)
    assert job.data.path == "corpus.txt" and job.data.seq_len == 64
    assert job.training.steps == 20 and job.checkpoint.resume
    assert choice.changes == ("training.steps 10 -> 20",)
    assert choice.line().endswith("; changed: training.steps 10 -> 20")
    for flags in (["--model.vocab_size", "300"], ["--data.tokenizer", "tok.json"]):
        with pytest.raises(ValueError, match=f"{flags[0][2:]} .* cannot apply to run"):
            args = [*flags, *overrides]
            resume.resolve_resume(_job(tmp_path, *args), str(run), args)


def test_resume_of_a_moved_run_uses_its_folders(tmp_path):
    config = _saved_config(tmp_path / "elsewhere")
    run = _run(tmp_path / "moved", "20260101-000000-aaaa", step=4, config=config)
    overrides = ["--checkpoint.resume", "true"]
    job, choice = resume.resolve_resume(_job(tmp_path, *overrides), str(run), overrides)
    assert job.metrics.output_dir == str(tmp_path / "moved") and job.checkpoint.folder == ""
    assert choice.changes == ()


def test_print_config_with_resume_shows_the_run_config(tmp_path, capsys):
    run = _run(tmp_path, "20260101-000000-aaaa", step=4, config=_saved_config(tmp_path))
    assert cli.main(["--print-config", "--resume", str(run), "--training.steps", "9"]) == 0
    out = capsys.readouterr().out
    assert 'path = "corpus.txt"' in out and "steps = 9" in out


def test_worker_argv_names_the_resumed_run(tmp_path):
    run = runs.read_run(_run(tmp_path, "20260101-000000-aaaa", step=4))
    choice = resume.Resume(run, 4)
    for flags in (["--resume"], ["--resume", "x"], ["--resume=x"], ["--resume-if-possible"]):
        argv = ["--nproc", "2", *flags, "--training.steps", "5"]
        assert cli._worker_argv(argv, choice) == [
            "--training.steps",
            "5",
            "--resume",
            str(run.path),
        ]


def test_output_folders_are_probed_and_left_as_found(tmp_path):
    job = _job(tmp_path / "out", "--metrics.tensorboard", "true", "--checkpoint.folder", "ck")
    folders = resume.output_folders(job, tmp_path / "out" / "RUN")
    assert folders == {
        "metrics.output_dir": tmp_path / "out" / "RUN",
        "checkpoint.folder": Path("ck") / "RUN",
        "metrics.tensorboard": tmp_path / "out" / "RUN" / "tensorboard",
    }
    folders["checkpoint.folder"] = tmp_path / "ck" / "RUN"
    runs.check_output_folders(folders)
    assert list(tmp_path.iterdir()) == []  # created, written, removed
    (tmp_path / "out" / "RUN").mkdir(parents=True)
    (tmp_path / "out" / "RUN" / "tensorboard").write_text("a file")
    with pytest.raises(ValueError, match="^metrics.tensorboard: cannot write to .*tensorboard"):
        runs.check_output_folders(folders)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["RUN", "out", "tensorboard"]


def test_runs_command_lists_removes_and_prunes_only_with_yes(tmp_path, capsys):
    for i in range(4):
        _run(tmp_path, f"2026010{i}-000000-aaaa", step=i or None)
    assert runs_cli.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[1].startswith("20260100-000000-aaaa") and "step-3" in out[4]
    assert runs_cli.main(["--root", str(tmp_path), "remove", "20260101-000000-aaaa"]) == 0
    assert "nothing removed: add --yes" in capsys.readouterr().out
    assert len(runs.list_runs(tmp_path)) == 4
    assert runs_cli.main(["--root", str(tmp_path), "remove", "20260101-000000-aaaa", "--yes"]) == 0
    assert [r.run_id for r in runs.list_runs(tmp_path)] == [
        "20260100-000000-aaaa", "20260102-000000-aaaa", "20260103-000000-aaaa"
    ]  # fmt: skip
    assert runs_cli.main(["--root", str(tmp_path), "prune", "--keep", "1"]) == 0
    assert len(runs.list_runs(tmp_path)) == 3
    assert runs_cli.main(["--root", str(tmp_path), "prune", "--keep", "1", "--yes"]) == 0
    assert [r.run_id for r in runs.list_runs(tmp_path)] == ["20260103-000000-aaaa"]
    assert runs_cli.main(["--root", str(tmp_path), "remove", "nope"]) == 2
    assert "no run folder 'nope'" in capsys.readouterr().err


def test_runs_never_removes_a_live_run_and_shows_a_dead_one_as_killed(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for run_id, pid in (("20260101-000000-aaaa", os.getpid()), ("20260102-000000-aaaa", dead.pid)):
        folder = _run(tmp_path, run_id)
        record = json.loads((folder / "run.json").read_text())
        record.update(status="running", pid=pid, host=socket.gethostname())
        (folder / "run.json").write_text(json.dumps(record))
    _run(tmp_path, "20260103-000000-aaaa")
    live, killed, _ = runs.list_runs(tmp_path)
    assert live.is_running() and not killed.is_running()
    assert runs_cli.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "aaaa     running" in out.replace("20260101-000000-", "") and "killed" in out
    assert runs_cli.main(["--root", str(tmp_path), "remove", live.run_id, "--yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"simplefsdp runs: error: run {live.run_id} is still running "
                   f"(pid {os.getpid()} on {socket.gethostname()}); stop it first"]  # fmt: skip
    assert runs_cli.main(["--root", str(tmp_path), "prune", "--keep", "0", "--yes"]) == 0
    assert f"keeping run {live.run_id}: still running" in capsys.readouterr().out
    assert [r.run_id for r in runs.list_runs(tmp_path)] == [live.run_id]


def test_resume_of_a_live_run_is_refused_before_anything_starts(tmp_path, capsys):
    import socket

    folder = _run(tmp_path, "20260101-000000-aaaa", step=2, config=_saved_config(tmp_path))
    record = json.loads((folder / "run.json").read_text())
    record.update(status="running", pid=os.getpid(), host=socket.gethostname())
    (folder / "run.json").write_text(json.dumps(record))
    before = sorted(p.name for p in folder.iterdir())
    assert cli.main(["--resume", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run 20260101-000000-aaaa is still running" in err[0]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_resume_keeps_the_run_folders_and_says_which_flags_it_did_not_use(tmp_path):
    folder = _run(tmp_path / "a", "20260101-000000-aaaa", step=2, config=_saved_config(tmp_path))
    other = ["--metrics.output_dir", str(tmp_path / "b"), "--checkpoint.folder", "elsewhere"]
    job, choice = resume.resolve_resume(
        load_config("debug", other + ["--checkpoint.resume"]), str(folder), other
    )
    assert job.metrics.output_dir == str(tmp_path / "a") and job.checkpoint.folder == ""
    assert choice.line() == (
        f"resuming run 20260101-000000-aaaa at step 2 ({folder}); it keeps its folders: "
        f"metrics.output_dir '{tmp_path / 'b'}' not used (the run's folder: {folder}), "
        f"checkpoint.folder 'elsewhere' not used (the run's checkpoints: {folder / 'checkpoints'})"
    )
    same = ["--metrics.output_dir", str(tmp_path / "a")]
    job, choice = resume.resolve_resume(
        load_config("debug", same + ["--checkpoint.resume"]), None, same
    )
    assert (
        choice.run.path == folder and choice.step == 2 and "keeps its folders" not in choice.line()
    )
