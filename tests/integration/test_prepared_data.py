"""``simplefsdp train`` on token shards of ``simplefsdp data prepare``.

A 2-rank run of 4 steps (checkpoint every 2) on prepared shards, and a run
resumed from its step-2 checkpoint on 1 rank with the same global batch: the
resumed run's losses at steps 3 and 4 are the uninterrupted run's (the loader
position in the checkpoint gives exactly the next batch).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, train_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc


def _train(cwd: Path, name: str, nproc: int, *extra: str) -> dict[int, float]:
    _run(
        cwd, "train", "--nproc", str(nproc), "--data.path", "tokens", "--data.seq_len", "64",
        "--data.batch_size", str(4 // nproc), "--training.warmup_steps", "1",
        "--training.steps", "4", "--metrics.log_interval", "1", "--metrics.val_interval", "0",
        "--compile.enable", "false", "--checkpoint.interval", "2",
        "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck", *extra,
    )  # fmt: skip
    return losses(only_run(cwd / name) / "metrics.jsonl")


def test_resume_on_shards_at_another_world_size_continues_exactly(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted(Path(shutil.__file__).parent.glob("[a-c]*.py"))[:12]:
        shutil.copy(f, corpus / f.name)
    out = _run(tmp_path, "data", "prepare", "--input", "corpus", "--out", "tokens",
               "--workers", "2", "--no-progress")  # fmt: skip
    assert "train shards" in out.stdout
    full = _train(tmp_path, "full", 2)
    checkpoint_as_run(checkpoints(only_run(tmp_path / "full")) / "step-2", tmp_path / "resumed")
    resumed = _train(tmp_path, "resumed", 1, "--resume")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), (full, resumed)


def _run_any(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


@pytest.mark.heavy  # two 2-rank runs: about a minute on 2 CPU cores
def test_chat_data_trains_on_the_assistant_tokens_and_a_damaged_shard_is_one_line(tmp_path):
    """A run on chat data reports the tokens it trains on (step line, metrics,
    summary); a shard damaged in place (ids outside the vocabulary) stops the
    run with one line naming it, not an IndexError per rank."""
    pytest.importorskip("transformers")
    import json

    import numpy as np

    from chat_data import make_chat_tokenizer, write_conversations

    make_chat_tokenizer(tmp_path / "chat_tok")
    write_conversations(tmp_path / "chat.jsonl")
    _run(tmp_path, "data", "prepare", "--format", "chat", "--input", "chat.jsonl", "--out",
         "tokens", "--tokenizer", "chat_tok", "--val-fraction", "0", "--workers", "1")  # fmt: skip
    argv = ["train", "--nproc", "2", "--data.path", "tokens", "--data.tokenizer", "chat_tok",
            "--data.seq_len", "32", "--data.batch_size", "2", "--training.warmup_steps", "1",
            "--training.steps", "3", "--metrics.log_interval", "1", "--metrics.val_interval", "0",
            "--compile.enable", "false", "--checkpoint.enable", "false"]  # fmt: skip
    proc = _run(tmp_path, *argv, "--metrics.output_dir", "chat")
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("% of tokens" in line for line in steps), proc.stdout
    assert "trained on (" in proc.stdout  # the summary
    records = [json.loads(x) for x in (only_run(tmp_path / "chat") / "metrics.jsonl").open()]
    assert all(0 < r["trained_tokens_pct"] < 100 for r in records if "loss" in r)

    index = json.loads((tmp_path / "tokens" / "index.json").read_text())
    shard = np.memmap(tmp_path / "tokens" / "shards" / index["train"]["shards"][0]["file"],
                      dtype="<u2", mode="r+")  # fmt: skip
    shard[::7] = 60000
    shard.flush()
    del shard
    proc = _run_any(tmp_path, *argv, "--metrics.output_dir", "damaged")
    errors = [x for x in proc.stderr.splitlines() if "error" in x]
    assert proc.returncode != 0 and "IndexError" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "000000.train.bin" in errors[0], proc.stderr
    assert "simplefsdp data prepare --input" in errors[0]
