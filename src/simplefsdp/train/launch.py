"""Starting the training processes when ``simplefsdp train`` is not run by torchrun.

Under ``torchrun`` (or any torchelastic agent) each process is already one rank
and runs the trainer directly. Otherwise :func:`launch` does what
``torchrun --standalone --nproc-per-node N -m simplefsdp.train ARGS`` would:
it starts a local elastic agent (``torch.distributed.run``) with a c10d
rendezvous on a free local port, which spawns ``N`` workers running
``python -m simplefsdp.train ARGS`` and restarts them up to ``max_restarts``
times on failure (restarted workers resume from the latest checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from simplefsdp.train.interrupts import launcher_gone

logger = logging.getLogger(__name__)

__all__ = ["ERROR_DIR_ENV", "STOPPED_MARK", "launch", "launcher_error_dir", "under_torchrun"]

#: Folder where workers leave their one-line error reports for the launcher.
ERROR_DIR_ENV = "SIMPLEFSDP_ERROR_DIR"
#: File rank 0 leaves in that folder once it has saved and reported a clean
#: stop; it holds the signal's number.
STOPPED_MARK = "stopped"

WORKER_MODULE = "simplefsdp.train"


def under_torchrun() -> bool:
    """Whether this process was started by torchrun / a torchelastic agent.

    Detected by ``TORCHELASTIC_RUN_ID`` (set by torchelastic) or ``LOCAL_RANK``
    (set by torchrun and by most other launchers).
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _set_worker_threads(nproc: int) -> None:
    """Share the CPU cores between the workers unless ``OMP_NUM_THREADS`` is set."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def launch(worker_argv: list[str], *, nproc: int, max_restarts: int = 0) -> int:
    """Run ``python -m simplefsdp.train *worker_argv`` on ``nproc`` local ranks.

    The workers share one run id (``SIMPLEFSDP_RUN_ID``, see
    :mod:`simplefsdp.train.runs`) and report errors the user can act on as
    one line each into a temporary folder (``SIMPLEFSDP_ERROR_DIR``); the
    launcher prints the lowest rank's line once. On Ctrl-C or SIGTERM
    torchrun's agent sends SIGTERM to the workers, which finish their step and
    save (Note: [Clean stop] in :mod:`simplefsdp.train.interrupts`) within the
    agent's grace period.

    Args:
        worker_argv: the arguments every worker gets (config and overrides).
        nproc: number of processes (ranks) on this machine.
        max_restarts: restarts of the whole worker group after a failure.

    Returns:
        0 when every worker succeeded; otherwise the workers' exit code (2
        for a reported user error, 128 + signal after a clean stop) or 1.

    Raises:
        ValueError: ``nproc < 1`` or ``max_restarts < 0``.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from simplefsdp.train.interrupts import LAUNCHER_PID_ENV
    from simplefsdp.train.runs import RUN_ID_ENV, new_run_id

    _set_worker_threads(nproc)
    if max_restarts > 0:
        # Restarted workers would otherwise find the previous attempt's
        # process-group keys in the agent's shared TCPStore and connect to dead
        # peers (pytorch/pytorch#135712); a fresh store per attempt avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault(RUN_ID_ENV, new_run_id())
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # Note: [Orphaned workers]
    args = torchrun.parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--module",
            WORKER_MODULE,
            *worker_argv,
        ]
    )
    logger.info("starting %d local processes (max restarts %d)", nproc, max_restarts)
    with tempfile.TemporaryDirectory(prefix="simplefsdp-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        try:
            with _quiet_agent():
                torchrun.run(args)
            stopped = Path(error_dir) / STOPPED_MARK
            if stopped.exists():  # workers exit 0 after a clean stop: no restart
                return 128 + _mark_signal(stopped)
        except ChildFailedError as exc:
            return _report_failure(exc, Path(error_dir))
        except (SignalException, KeyboardInterrupt) as exc:
            # The agent sent SIGTERM to the workers, which finished their step
            # and saved; rank 0 said so unless it was killed first.
            signum = int(getattr(exc, "sigval", signal.SIGINT))
            if not (Path(error_dir) / STOPPED_MARK).exists():
                name = signal.Signals(signum).name
                print(f"simplefsdp train: stopped by {name} before saving", file=sys.stderr)
            return 128 + signum
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0


def launcher_error_dir() -> Path | None:
    """The folder where this worker's ``simplefsdp train`` launcher reads the
    workers' error reports and rank 0's stop mark; ``None`` under any other
    launcher, and once that launcher is gone, when nothing would read (or
    remove) what is written there (Note: [Orphaned workers])."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    return Path(error_dir) if error_dir and not launcher_gone() else None


def _mark_signal(mark: Path) -> int:
    """The signal number in rank 0's stop mark (SIGTERM where it holds none)."""
    text = mark.read_text(encoding="utf-8").strip()
    return int(text) if text.isdigit() else int(signal.SIGTERM)


def _report_failure(exc: Any, error_dir: Path) -> int:
    """One line for a failed worker group; the exit code to return."""
    reports = sorted(error_dir.glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    if reports:
        code, _, message = reports[0].read_text(encoding="utf-8").strip().partition(" ")
        print(f"simplefsdp train: error: {message}", file=sys.stderr)
        return int(code)
    # A clean stop never gets here: its workers exit 0 (Note: [Clean stop]).
    codes = {failure.exitcode for failure in exc.failures.values()}
    logger.debug("worker failure details: %s", exc.format_msg())
    failed = sorted(exc.failures)
    print(
        f"simplefsdp train: error: training failed on rank(s) {failed} (exit codes "
        f"{sorted(codes)}); the workers' output above has the details",
        file=sys.stderr,
    )
    return 1


class _AgentNoiseFilter(logging.Filter):
    """Drops torchelastic's records about exits we report ourselves: a worker that
    exited with our user-error or clean-stop code, and the signals it sends while
    tearing a worker group down. Crashes and restarts stay visible."""

    _OURS = re.compile(r"failed \(exitcode: (2|130|143)\)")
    _TEARDOWN = ("closing signal", "death signal")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._OURS.search(message):
            return False
        return not any(text in message for text in self._TEARDOWN)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Install :class:`_AgentNoiseFilter` on torchelastic's loggers while the agent runs."""
    prefix = "torch.distributed.elastic"
    loggers = [logging.getLogger(prefix)] + [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(prefix + ".")
    ]
    noise = _AgentNoiseFilter()
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(noise)
