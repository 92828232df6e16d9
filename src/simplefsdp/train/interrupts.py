"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (schedulers, torchrun).

Note: [Clean stop]
    A SIGINT or SIGTERM only sets a flag; the step in progress finishes.
    After every step each rank posts the signal it received (0: none) in an
    asynchronous all-reduce (MAX) and reads the result of the *previous*
    step's (``StopAgreement``), so all ranks stop after the same step, one
    step after the signal, without a per-step device synchronisation (on
    CUDA the result is copied to pinned host memory on a side stream and
    only that copy is waited for). They save a checkpoint of that step (when
    checkpoints are on), rank 0 prints one line, and the run exits with 128
    + the signal number: under ``simplefsdp train`` the launcher does, from
    rank 0's mark, while the workers exit 0, so that torchrun's agent does
    not restart them (``--max-restarts``) and train on after the stop.
    Under ``simplefsdp train`` the launcher passes SIGINT/SIGTERM on to the
    workers and waits for them, however long the step and its save take
    (Note: [Stops that save] in ``simplefsdp.train.launch``); under a plain
    torchrun, the agent sends its workers the signal and kills them after its
    ``--shutdown-timeout`` (30 s), which bounds how long the final save may
    take (a save cut short leaves the previous checkpoint intact: saves are
    atomic). With ``checkpoint.async_mode`` the save is written in the
    background and waited for before the process exits. A rank that received nothing itself
    (one worker signalled by a scheduler, or its launcher watcher firing a
    moment after another rank's) reports the agreed signal "received by
    another rank". Under plain torchrun the first rank to exit makes the
    agent SIGTERM the rest, which by then have saved: a stopped worker
    ignores further signals while it tears down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

logger = logging.getLogger(__name__)

# Set by ``simplefsdp train``'s launcher for its workers: its process id.
LAUNCHER_PID_ENV = "SIMPLEFSDP_LAUNCHER_PID"


_watched_launcher: int | None = None  # the launcher's pid, once watch_launcher watches it


def watch_launcher(interval_s: float = 1.0) -> threading.Thread | None:
    """Stop this worker cleanly if the ``simplefsdp train`` launcher dies.

    Note: [Orphaned workers]
        torchrun's agent (our launcher runs it in-process) starts each worker
        detached from the launcher's process group (``setsid``), so a launcher killed by SIGKILL (the OOM
        killer, ``kill -9``) takes no worker with it: the workers, adopted by
        init, went on training and writing checkpoints, and a ``--resume``
        started meanwhile would share their checkpoint folder. A worker whose
        parent is the launcher (``SIMPLEFSDP_LAUNCHER_PID``, checked at start)
        polls its parent id; once it changes, it sends itself SIGTERM: the
        clean stop of Note: [Clean stop] (all ranks stop after the same step
        and save it) or, before that handler is installed, the default exit.
        Workers of a plain ``torchrun`` (no such variable) keep torch's
        behaviour. The dead launcher cannot remove its error folder (a
        temporary directory), so orphaned workers write nothing into it
        (errors go to their stderr, as under torchrun) and rank 0 removes it
        when it exits.

    Returns:
        The daemon thread watching, or ``None`` when not under our launcher.
    """
    global _watched_launcher
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    parent = os.getppid()
    if not expected.isdigit() or int(expected) != parent:
        return None
    _watched_launcher = parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.warning(
            "the simplefsdp train launcher (pid %d) is gone; stopping this worker cleanly", parent
        )
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="simplefsdp-launcher-watch", daemon=True)
    thread.start()
    return thread


def launcher_gone() -> bool:
    """Whether the ``simplefsdp train`` launcher that :func:`watch_launcher`
    watches has died (this process's parent is no longer it); ``False`` where
    none is watched (workers of another launcher). Nothing reads the
    launcher's error folder then, and nothing would remove it: see Note:
    [Orphaned workers]."""
    return _watched_launcher is not None and os.getppid() != _watched_launcher


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Records SIGINT/SIGTERM while installed (a context manager, main thread only).

    Attributes:
        signum: the first signal received, or ``None``.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:  # later signals (e.g. the agent's SIGTERM after
            self.signum = signum  # the terminal's SIGINT) change nothing

    def settle(self, agreed: int) -> str:
        """Take the ``agreed`` signal (``StopAgreement``) where this rank received
        none (its launcher watcher or handler may fire a moment after another
        rank's); the signal's name as reported."""
        if self.signum is not None:
            return self.name
        self.signum = agreed
        return f"{self.name} (received by another rank)"

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0


class StopAgreement:
    """Whether any rank was asked to stop, agreed one step late (Note: [Clean stop]).

    Every rank calls :meth:`after_step` once per step, in the same order as
    its other collectives; the result for step N is known after step N + 1.
    What is agreed is a signal number (the largest any rank received), so a
    rank whose own watcher or handler has not fired yet still reports which
    signal stopped the run.

    Args:
        device: where the default process group's collectives run (``cuda``
            for NCCL, else ``cpu``).
        world_size: ranks in the default process group (1: no communication).
    """

    def __init__(self, device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size
        self._pending = None  # (flag, work, host copy, event) of the previous step

    def after_step(self, signum: int | None) -> int:
        """Post this step's signal (``None``: none received); return the
        previous step's agreed signal number, 0 when no rank had one."""
        if signum is not None and (
            isinstance(signum, bool) or not isinstance(signum, int) or signum <= 0
        ):
            raise ValueError(f"signum must be a positive signal number or None, got {signum!r}")
        signum = int(signum or 0)  # a signal.Signals is an int too
        if self.world_size == 1:
            return signum
        previous, self._pending = self._pending, self._post(signum)
        return 0 if previous is None else self._read(previous)

    def _post(self, signum: int):
        import torch
        import torch.distributed as dist

        flag = torch.tensor([signum], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if self.device.type != "cuda":
            return flag, work, None, None
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for the all-reduce, the CPU does not
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return flag, work, host, event

    @staticmethod
    def _read(pending) -> int:
        flag, work, host, event = pending
        if event is None:
            work.wait()
            return int(flag.item())
        event.synchronize()  # the previous step's flag only, not this step's work
        return int(host.item())
