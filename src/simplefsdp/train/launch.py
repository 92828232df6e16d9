"""Starting the training processes when ``simplefsdp train`` is not run by torchrun.

Under ``torchrun`` (or any torchelastic agent) each process is already one rank
and runs the trainer directly. Otherwise :func:`launch` does what
``torchrun --standalone --nproc-per-node N -m simplefsdp.train ARGS`` would:
it starts a local elastic agent (``torch.distributed.run``) with a c10d
rendezvous on a free local port, which spawns ``N`` workers running
``python -m simplefsdp.train ARGS`` and restarts them up to ``max_restarts``
times on failure (restarted workers resume from the latest checkpoint).

Note: [Worker failures]
    A worker that dies (a signal, a crash) is one line from the launcher:
    which rank, of what (the signal's name or the exit code), in which step
    (each worker keeps the step it is in, ``note_step``, in the launcher's
    error folder) and, while restarts remain, ``restart n of m`` and the
    checkpoint it resumes from (``resume_point``); once none remain, an
    error line with the latest checkpoint. torchelastic's own record of the
    failure is dropped for it. The survivors' collectives then fail
    ("Connection closed by peer" under gloo): a worker of this launcher
    whose collective fails so (``peer_lost``) exits with code 1 and no
    traceback, since the launcher names the rank that died.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from simplefsdp.parallel_dims import oversubscription_warning  # noqa: F401 (re-exported for train.cli)
from simplefsdp.train.interrupts import launcher_gone

logger = logging.getLogger(__name__)


#: Folder where workers leave their one-line error reports for the launcher.
ERROR_DIR_ENV = "SIMPLEFSDP_ERROR_DIR"
#: File rank 0 leaves in that folder once it has saved and reported a clean
#: stop; it holds the signal's number.
STOPPED_MARK = "stopped"
#: Files each worker keeps in that folder: the step it is in (``step-rank<N>``).
STEP_FILE_PREFIX = "step-rank"
#: Files each worker writes there once it stops cleanly on a signal: its pid
#: (``pid-rank<N>``; Note: [Stops that save]).
PID_FILE_PREFIX = "pid-rank"

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


def launch(
    worker_argv: list[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    resume_point: Callable[[], str | None] | None = None,
    resume_command: str = "simplefsdp train --resume",
) -> int:
    """Run ``python -m simplefsdp.train *worker_argv`` on ``nproc`` local ranks.

    The workers share one run id (``SIMPLEFSDP_RUN_ID``, see
    :mod:`simplefsdp.train.runs`) and report errors the user can act on as
    one line each into a temporary folder (``SIMPLEFSDP_ERROR_DIR``); the
    launcher prints the lowest rank's line once. A worker that dies is one
    line per event (Note: [Worker failures]). On Ctrl-C or SIGTERM the
    launcher passes the signal on to the workers, which finish their step and
    save (Note: [Clean stop] in :mod:`simplefsdp.train.interrupts`), however
    long that takes (Note: [Stops that save]).

    Args:
        worker_argv: the arguments every worker gets (config and overrides).
        nproc: number of processes (ranks) on this machine.
        max_restarts: restarts of the whole worker group after a failure.
        resume_point: returns the checkpoint a restarted group resumes from
            (``None``: none, it starts over); named in the failure lines.
        resume_command: the command that continues this run, named in the
            final failure line.

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
            reporter = _FailureReporter(Path(error_dir), max_restarts, resume_point, resume_command)
            forwarder = _StopForwarder(Path(error_dir), nproc)
            with _quiet_agent(reporter), forwarder.installed():
                torchrun.run(args)
            stopped = Path(error_dir) / STOPPED_MARK
            if stopped.exists():  # workers exit 0 after a clean stop: no restart
                return 128 + _mark_signal(stopped)
        except ChildFailedError as exc:
            return _report_failure(exc, Path(error_dir), reporter)
        except (SignalException, KeyboardInterrupt) as exc:
            # The agent sent SIGTERM to the workers, which finished their step
            # and saved; rank 0 said so unless it was killed first.
            signum = int(getattr(exc, "sigval", signal.SIGINT))
            if not (Path(error_dir) / STOPPED_MARK).exists():
                name = signal.Signals(signum).name
                checkpoint = (resume_point or (lambda: None))()
                where = (
                    f"; the latest complete checkpoint is {checkpoint} ({resume_command} "
                    "continues from it)"
                    if checkpoint
                    else "; no checkpoint was saved"
                )
                print(f"simplefsdp train: stopped by {name} before saving{where}", file=sys.stderr)
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


def note_step(step: int) -> None:
    """Record that this worker is in ``step`` (in the launcher's error folder,
    read when the worker dies: Note: [Worker failures]); a no-op under any
    other launcher."""
    error_dir = launcher_error_dir()
    if error_dir is None:
        return
    path = error_dir / f"{STEP_FILE_PREFIX}{os.environ.get('RANK', '0')}"
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(str(step), encoding="utf-8")
        os.replace(tmp, path)


#: What the survivors' collectives raise once a peer is gone (gloo: the TCP
#: connection closes; NCCL: the communicator is aborted).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "NCCL Error 6",  # remote process exited or there was a network error
)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank is gone
    (Note: [Worker failures])."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _PEER_LOST)


def _cause(exitcode: int) -> str:
    """``SIGKILL`` for a negative exit code (killed by that signal), else ``exit code N``."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    if exitcode > 128:
        with contextlib.suppress(ValueError):
            return f"exit code {exitcode} ({signal.Signals(exitcode - 128).name})"
    return f"exit code {exitcode}"


class _FailureReporter:
    """Turns torchelastic's record of a failed worker into one line per event
    (Note: [Worker failures]).

    Args:
        error_dir: the launcher's error folder (step files and error reports).
        max_restarts: restarts the agent will make.
        resume_point: the checkpoint a restart resumes from, or ``None``.
        resume_command: the command that continues the run.
    """

    _FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")

    def __init__(
        self,
        error_dir: Path,
        max_restarts: int,
        resume_point: Callable[[], str | None] | None,
        resume_command: str = "simplefsdp train --resume",
    ) -> None:
        self.error_dir = error_dir
        self.resume_command = resume_command
        self.max_restarts = max_restarts
        self.resume_point = resume_point or (lambda: None)
        self.restarts = 0
        self.last: str | None = None  # the final failure, for _report_failure

    def handle(self, message: str) -> bool:
        """Report the failure ``message`` describes; whether it was one."""
        match = self._FAILED.search(message)
        if match is None:
            return False
        exitcode, rank = int(match.group(1)), int(match.group(2))
        if exitcode in (2, 130, 143):  # a reported error or a clean stop: said by the workers
            return True
        event = self._describe(rank, exitcode)
        if self.restarts < self.max_restarts:
            self.restarts += 1
            checkpoint = self.resume_point()
            where = f"resuming from {checkpoint}" if checkpoint else "starting over (no checkpoint)"
            print(
                f"simplefsdp train: {event}; restart {self.restarts} of {self.max_restarts}, "
                f"{where}",
                file=sys.stderr,
                flush=True,
            )
            self._clear()
        else:
            self.last = event
        return True

    def _describe(self, rank: int, exitcode: int) -> str:
        """``rank 1 died of SIGKILL in step 3`` (the step its file names)."""
        verb = "died of" if exitcode < 0 else "exited with"
        text = f"rank {rank} {verb} {_cause(exitcode)}"
        step_file = self.error_dir / f"{STEP_FILE_PREFIX}{rank}"
        try:
            text += f" in step {int(step_file.read_text(encoding='utf-8'))}"
        except (OSError, ValueError):
            text += " before its first step"
        report = self.error_dir / f"rank{rank}.txt"  # its own one-line error, if any
        with contextlib.suppress(OSError):
            text += ": " + report.read_text(encoding="utf-8").strip().partition(" ")[2]
        return text

    def _clear(self) -> None:
        """Forget the failed attempt's step files and reports (its workers are
        gone: the agent stops them all before it logs the failure)."""
        for path in self.error_dir.glob(f"{STEP_FILE_PREFIX}*"):
            path.unlink(missing_ok=True)
        for path in self.error_dir.glob(f"{PID_FILE_PREFIX}*"):
            path.unlink(missing_ok=True)
        for path in self.error_dir.glob("rank*.txt"):
            path.unlink(missing_ok=True)


def note_stoppable() -> None:
    """Tell the launcher that this worker now stops cleanly on SIGINT/SIGTERM
    (finishing its step and saving), so that it may pass those signals on
    (Note: [Stops that save]); a no-op under any other launcher."""
    error_dir = launcher_error_dir()
    if error_dir is None:
        return
    path = error_dir / f"{PID_FILE_PREFIX}{os.environ.get('RANK', '0')}"
    with contextlib.suppress(OSError):
        path.write_text(str(os.getpid()), encoding="utf-8")


class _StopForwarder:
    """Passes the launcher's SIGINT/SIGTERM on to its workers.

    Note: [Stops that save]
        torchrun's agent answers a signal by sending it to the workers and
        killing them ``shutdown_timeout`` (30 s) later, whatever they are
        doing: a step plus its save that take longer were cut short (the
        save lost, the run "stopped before saving"). Instead, while the
        agent runs, the launcher's handler for SIGINT and SIGTERM (the one
        torchrun's process context installs, ``_terminate_process_handler``,
        replaced for that time) sends the signal to every worker once all
        have said they stop cleanly (``note_stoppable``: the training loop
        runs) and returns: the workers finish the step, save (asynchronously
        where ``checkpoint.async_mode`` says so, waiting for it) and exit 0,
        the agent sees them finish and the launcher exits with 128 + the
        signal from rank 0's mark. No timer runs; a scheduler's own (SLURM:
        30 s from SIGTERM to SIGKILL by default) is the bound, and a save
        cut short by it leaves the previous checkpoint the latest. A second
        signal kills the workers (a save in progress never commits, see
        [Atomic publish]); it, and a signal before every worker trains
        (nothing to save yet), go to torchrun's handler, whose agent stops
        the workers, and the launcher's last line names the latest complete
        checkpoint.
    """

    def __init__(self, error_dir: Path, nproc: int) -> None:
        self.error_dir = error_dir
        self.nproc = nproc
        self.forwarded: int | None = None

    def _worker_pids(self) -> list[int]:
        pids = []
        for path in self.error_dir.glob(f"{PID_FILE_PREFIX}*"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(path.read_text(encoding="utf-8")))
        return pids

    def handle(self, signum: int, frame: Any, torch_handler: Callable[..., Any]) -> None:
        """The launcher's handler of ``signum`` while the agent runs."""
        pids = self._worker_pids()
        if self.forwarded and signum in (signal.SIGINT, signal.SIGTERM):
            for pid in pids:  # a second signal: stop now (the previous checkpoint stays)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if (
            signum not in (signal.SIGINT, signal.SIGTERM)
            or self.forwarded
            or len(pids) < self.nproc
        ):
            torch_handler(signum, frame)  # raises SignalException: the agent's teardown
            return
        self.forwarded = signum
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        print(
            f"simplefsdp train: {signal.Signals(signum).name}: the workers finish their step "
            "and save; send it again to stop them at once",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Replace torchrun's signal handler by :meth:`handle` while the block runs."""
        from torch.distributed.elastic.multiprocessing import api as elastic_api

        torch_handler = elastic_api._terminate_process_handler

        def handler(signum: int, frame: Any) -> None:
            self.handle(signum, frame, torch_handler)

        # Looked up by name when the agent starts the workers (PContext.start).
        elastic_api._terminate_process_handler = handler
        try:
            yield
        finally:
            elastic_api._terminate_process_handler = torch_handler


def _report_failure(exc: Any, error_dir: Path, reporter: _FailureReporter | None = None) -> int:
    """One line for a failed worker group; the exit code to return."""
    reports = sorted(error_dir.glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    if reports:
        code, _, message = reports[0].read_text(encoding="utf-8").strip().partition(" ")
        print(f"simplefsdp train: error: {message}", file=sys.stderr)
        return int(code)
    # A clean stop never gets here: its workers exit 0 (Note: [Clean stop]).
    logger.debug("worker failure details: %s", exc.format_msg())
    if reporter is not None and reporter.last is not None:
        restarts = ""
        if reporter.max_restarts:
            restarts = f"; no restarts left ({reporter.restarts} of {reporter.max_restarts} used)"
        checkpoint = reporter.resume_point()
        resume = (
            f"; latest checkpoint {checkpoint} ({reporter.resume_command} continues from it)"
            if checkpoint
            else ""
        )
        print(f"simplefsdp train: error: {reporter.last}{restarts}{resume}", file=sys.stderr)
        return 1
    codes = {failure.exitcode for failure in exc.failures.values()}
    failed = sorted(exc.failures)
    print(
        f"simplefsdp train: error: training failed on rank(s) {failed} (exit codes "
        f"{sorted(codes)}); the workers' output above has the details",
        file=sys.stderr,
    )
    return 1


class _AgentNoiseFilter(logging.Filter):
    """Drops torchelastic's records about exits we report ourselves: a worker that
    exited with our user-error or clean-stop code, the signals it sends while
    tearing a worker group down, and a failed worker, which ``reporter`` (Note:
    [Worker failures]) reports in one line instead. Restarts stay visible."""

    _OURS = re.compile(r"failed \(exitcode: (2|130|143)\)")
    _TEARDOWN = ("closing signal", "death signal")

    def __init__(self, reporter: _FailureReporter | None = None) -> None:
        super().__init__()
        self.reporter = reporter

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.reporter is not None and self.reporter.handle(message):
            return False
        if self._OURS.search(message):
            return False
        return not any(text in message for text in self._TEARDOWN)


@contextlib.contextmanager
def _quiet_agent(reporter: _FailureReporter | None = None) -> Iterator[None]:
    """Install :class:`_AgentNoiseFilter` on torchelastic's loggers while the agent runs."""
    prefix = "torch.distributed.elastic"
    loggers = [logging.getLogger(prefix)] + [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(prefix + ".")
    ]
    noise = _AgentNoiseFilter(reporter)
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(noise)
