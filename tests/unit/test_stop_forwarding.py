"""Note: [Stops that save]: the launcher passes SIGINT/SIGTERM on to workers that
stop cleanly, instead of torchrun's agent killing them 30 s later."""

from __future__ import annotations

import signal
import subprocess

from simplefsdp.train import launch


class _TorchHandler:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.calls.append(signum)


def test_a_signal_goes_to_the_workers_once_all_stop_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.ERROR_DIR_ENV, str(tmp_path))
    workers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        forwarder, torch_handler = launch._StopForwarder(tmp_path, 2), _TorchHandler()
        for rank, worker in enumerate(workers[:1]):
            monkeypatch.setenv("RANK", str(rank))
            (tmp_path / f"{launch.PID_FILE_PREFIX}{rank}").write_text(str(worker.pid))
        forwarder.handle(signal.SIGINT, None, torch_handler)  # rank 1 not training yet
        assert torch_handler.calls == [signal.SIGINT] and workers[0].poll() is None
        (tmp_path / f"{launch.PID_FILE_PREFIX}1").write_text(str(workers[1].pid))
        forwarder.handle(signal.SIGINT, None, torch_handler)
        assert [w.wait(timeout=10) for w in workers] == [-signal.SIGINT, -signal.SIGINT]
        assert torch_handler.calls == [signal.SIGINT]  # passed on, no agent teardown
        forwarder.handle(signal.SIGINT, None, torch_handler)  # again: stop at once
        assert torch_handler.calls == [signal.SIGINT, signal.SIGINT]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def test_workers_say_when_they_stop_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    launch.note_stoppable()
    assert (tmp_path / f"{launch.PID_FILE_PREFIX}3").read_text().isdigit()


def test_torchruns_handler_is_replaced_only_while_the_agent_runs(tmp_path):
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    with launch._StopForwarder(tmp_path, 1).installed():
        assert api._terminate_process_handler is not original
    assert api._terminate_process_handler is original
