"""``simplefsdp train``'s launcher: one line per worker failure, no traceback
from the survivors, and the ``--nproc`` oversubscription warning (Note:
[Worker failures] in ``simplefsdp.train.launch``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from simplefsdp import parallel_dims
from simplefsdp.train import cli, interrupts
from simplefsdp.train.launch import (
    ERROR_DIR_ENV,
    _AgentNoiseFilter,
    _FailureReporter,
    _report_failure,
    note_step,
    oversubscription_warning,
    peer_lost,
)

GLOO_PEER_GONE = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:29622. This is typically caused by a remote worker crashing."
)


def _failed_record(exitcode: int, local_rank: int) -> logging.LogRecord:
    """torchelastic's record of a failed worker group (its first failure)."""
    return logging.LogRecord(
        "torch.distributed.elastic.multiprocessing.api",
        logging.ERROR,
        __file__,
        1,
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        (exitcode, local_rank, 4242, "/usr/bin/python"),
        None,
    )


class _Failures:
    """What ``_report_failure`` reads of torchelastic's ``ChildFailedError``."""

    def __init__(self, codes: dict[int, int]) -> None:
        self.failures = {rank: SimpleNamespace(exitcode=c) for rank, c in codes.items()}

    def format_msg(self) -> str:
        return "details"


@pytest.fixture
def our_worker(monkeypatch, tmp_path):
    """This process as a worker of ``simplefsdp train`` with a live launcher."""
    monkeypatch.setattr(interrupts, "_watched_launcher", None)
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    return tmp_path


def test_a_dead_worker_is_one_line_naming_rank_signal_step_and_restart(our_worker, capsys):
    checkpoints = iter(["ck/step-2", "ck/step-4", "ck/step-4"])
    reporter = _FailureReporter(our_worker, 1, lambda: next(checkpoints))
    noise = _AgentNoiseFilter(reporter)
    note_step(3)  # rank 1 is in step 3
    assert noise.filter(_failed_record(-9, 1)) is False  # torchelastic's record is dropped
    err = capsys.readouterr().err
    assert err == (
        "simplefsdp train: rank 1 died of SIGKILL in step 3; restart 1 of 1, resuming from "
        "ck/step-2\n"
    )
    assert not list(our_worker.glob("step-rank*"))  # the failed attempt's steps are gone
    # The restarted group fails again: no restarts left, the launcher's error says it all.
    note_step(5)
    assert noise.filter(_failed_record(-9, 1)) is False
    assert capsys.readouterr().err == ""
    assert _report_failure(_Failures({0: -15, 1: -9}), our_worker, reporter) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "simplefsdp train: error: rank 1 died of SIGKILL in step 5; no restarts left (1 of 1 "
        "used); latest checkpoint ck/step-4 (simplefsdp train --resume continues from it)"
    )


def test_exit_codes_and_deaths_before_the_first_step(tmp_path, capsys):
    reporter = _FailureReporter(tmp_path, 2, lambda: None)
    (tmp_path / "rank0.txt").write_text("1 the loss is not finite (nan) at step 4\n")
    assert reporter.handle("failed (exitcode: 1) local_rank: 0 (pid: 1) of binary: x")
    assert reporter.handle("failed (exitcode: -6) local_rank: 1 (pid: 1) of binary: x")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "simplefsdp train: rank 0 exited with exit code 1 before its first step: the loss is "
        "not finite (nan) at step 4; restart 1 of 2, starting over (no checkpoint)",
        "simplefsdp train: rank 1 died of SIGABRT before its first step; restart 2 of 2, "
        "starting over (no checkpoint)",
    ]
    assert not reporter.handle("worker group stopped")  # other records pass untouched


def test_a_survivor_of_a_dead_peer_exits_without_a_traceback(our_worker, monkeypatch, capsys):
    from simplefsdp.train import trainer as trainer_module

    class PeerGone:
        rank = 1

        def __init__(self, job) -> None:
            self.closed = None

        def setup(self) -> None:
            pass

        def train(self):
            raise RuntimeError(GLOO_PEER_GONE)

        def close(self, *, clean: bool) -> None:
            assert not clean

    monkeypatch.setattr(trainer_module, "Trainer", PeerGone)
    assert cli._run_worker(None) == 1
    assert capsys.readouterr().err == ""
    assert not list(our_worker.glob("rank*.txt"))  # the dead rank is the error, not this one
    # Under another launcher (plain torchrun) the error is raised as before.
    monkeypatch.delenv(ERROR_DIR_ENV)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        cli._run_worker(None)


def test_peer_lost_is_a_collective_failing_for_a_peer_only():
    assert peer_lost(RuntimeError(GLOO_PEER_GONE))
    assert not peer_lost(RuntimeError("CUDA out of memory"))
    assert not peer_lost(ValueError(GLOO_PEER_GONE))


def test_note_step_writes_only_for_our_launcher(our_worker, monkeypatch):
    note_step(7)
    assert (our_worker / "step-rank1").read_text() == "7"
    monkeypatch.delenv(ERROR_DIR_ENV)
    note_step(8)  # under another launcher: nothing to write to
    assert (our_worker / "step-rank1").read_text() == "7"


def test_nproc_above_the_cpu_cores_is_one_warning(monkeypatch, capsys):
    assert oversubscription_warning(2, cuda=False, cores=2) is None
    assert oversubscription_warning(16, cuda=True, cores=2) is None
    text = oversubscription_warning(12, cuda=False, cores=2)
    assert "--nproc 12" in text and "2 CPU cores" in text and "oversubscription" in text
    # Through the command line: one warning line, then the run starts.
    monkeypatch.setattr(parallel_dims, "cpu_cores", lambda: 2)
    monkeypatch.setattr(cli, "launch", lambda *args, **kwargs: 0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["--config", "debug", "--nproc", "4"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--nproc 4 is more than the 2 CPU cores" in warnings[0]
