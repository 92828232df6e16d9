"""Test utilities: run a function in N local processes, record collectives.

These are used by simplefsdp's own test-suite and are usable in users' tests.
The test-only fault-injection hooks (kill a rank mid-save or after a step) are
in :mod:`simplefsdp._faults`.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import queue as queue_module
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CRASH_RETRIES_ENV_VAR = "SIMPLEFSDP_CRASH_RETRIES"
CPP_STACKTRACES_ENV_VAR = "SIMPLEFSDP_CPP_STACKTRACES"
# Signals of a native crash (not of a kill): the ones ``crash_retries`` retries.
_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
_SUMMARY_LINES = 40
_HANG_DUMP_WAIT_S = 1.0


#: Imported once by the process the ranks are forked from (Note: [Rank processes]).
PRELOAD = ("torch", "torch.distributed.tensor", "simplefsdp")
#: ``spawn``: start every rank as a fresh interpreter instead.
RANK_START_ENV_VAR = "SIMPLEFSDP_RANK_START"


def _process_context() -> Any:
    """How :func:`run_distributed` starts ranks; see the Note."""
    # Note: [Rank processes]
    # Ranks are forked from multiprocessing's fork server, a process that
    # imported PRELOAD once, rather than spawned as fresh interpreters:
    # importing torch and simplefsdp costs 3-5 s of CPU per rank, most of a
    # small distributed test on 2 cores. The server runs no torch op, starts
    # no thread and never touches CUDA, so a fork of it is as clean as a
    # spawn; each rank still unpickles ``fn`` by reference (importing its
    # module) and sets the caller's current environment (the server's is the
    # one it started with). SIMPLEFSDP_RANK_START=spawn spawns, as before.
    if os.environ.get(RANK_START_ENV_VAR) == "spawn" or sys.platform == "win32":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: multiprocessing.Queue,
    stderr_path: str,
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, not the fork server's
    # Everything this rank writes to fd 2 (Python tracebacks, faulthandler's
    # stacks, C++ abort messages) goes to a file the parent reads back.
    log = open(stderr_path, "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    # A crashing rank prints every thread's Python stack; SIGUSR1 (sent by the
    # parent to a rank that hangs) prints them too.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get(CPP_STACKTRACES_ENV_VAR) == "1":
        # c10's handler also prints every thread's C++ stack. Opt-in: it
        # allocates inside the signal handler, which can hang a rank whose
        # heap is corrupt.
        torch._C._set_print_stack_traces_on_fatal_signal(True)
    import torch.distributed as dist

    if backend == "gloo":
        # Also for tests that use DTensor collectives without data_parallel
        # (which installs it): Note: [Gloo all-gather workaround].
        from simplefsdp._compat import install_gloo_all_gather_workaround

        install_gloo_all_gather_workaround()
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value, time.time()))
    except BaseException:  # report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc(), time.time()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _crash_summary(text: str) -> str:
    """The telling part of a dead rank's stderr: the lines it printed just
    before the crash (a C++ ``terminate called ... what(): ...`` among them),
    the first C++ stack that c10's handler dumped (when enabled), and
    faulthandler's Python stacks (the crashing thread first)."""
    lines = text.splitlines()
    c10 = next((i for i, ln in enumerate(lines) if re.match(r"SIG[A-Z0-9]+\(\d+\), PID", ln)), None)
    fatal = next((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")), None)
    first = min(i for i in (c10, fatal, len(lines)) if i is not None)
    picked = lines[max(first - 5, 0) : first]
    if c10 is not None:
        end = c10
        while end < min(len(lines), c10 + _SUMMARY_LINES) and lines[end].strip():
            end += 1
        picked.extend(lines[c10:end])
    if fatal is not None:
        picked.extend(lines[fatal : fatal + _SUMMARY_LINES])
    elif c10 is None:
        picked = lines[-_SUMMARY_LINES:]
    return "\n".join(picked)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _collect(
    procs: list, results: multiprocessing.Queue, timeout_s: float
) -> dict[int, tuple[str, Any, float | None]]:
    """Start ``procs`` and gather ``(status, value, wall time)`` per rank; a
    rank that died without reporting gets ``("died", None, None)``. Ranks
    still running at the deadline get SIGUSR1 (faulthandler dumps their
    stacks), then are killed. Always reaps them."""
    world_size = len(procs)
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any, float | None]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value, when = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (status, value, when)
                if status == "error":
                    # Peers are likely blocked in a collective with the failed rank.
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                # Give the queue a moment: a rank may have exited right after putting.
                time.sleep(0.5)
                if results.empty():
                    for r in dead:
                        outcomes.setdefault(r, ("died", None, None))
                    deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        hung = [p for r, p in enumerate(procs) if r not in outcomes and p.is_alive()]
        for proc in hung:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)
        if hung:
            time.sleep(_HANG_DUMP_WAIT_S)
        for proc in procs:
            proc.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
    return outcomes


class RankCrashed(RuntimeError):
    """A rank died of a native crash (SIGSEGV, SIGABRT, ...) before any rank
    raised; see ``run_distributed``."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    crash_retries: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` fresh processes and return
    each rank's return value (index = rank).

    Each process has the default process group initialised (``backend``, on a
    free localhost port; ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
    set) and ``OMP_NUM_THREADS=1``. ``fn`` must be importable (a module-level
    function) and its return value picklable.

    Each rank's standard error goes to a file that is passed on to this
    process's ``sys.stderr`` when the ranks are done, a header naming the rank
    before each (so it is not live; standard output is). A rank that crashes
    prints faulthandler's Python stacks of every thread there; with
    ``SIMPLEFSDP_CPP_STACKTRACES=1`` also c10's C++ stacks.

    ``crash_retries`` (default: the ``SIMPLEFSDP_CRASH_RETRIES`` environment
    variable, else 0) reruns everything, up to that many times, when a rank
    died of a native crash signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL)
    before any rank raised. Each retry is reported with ``warnings.warn``
    (``RuntimeWarning``) holding the crash report. Exceptions (and crashes
    that follow one), hangs and kills are never retried. ``fn`` must be safe
    to run again, e.g. on files the crashed attempt left behind.

    Raises:
        RuntimeError: a rank raised or died; the message holds every failing
            rank's traceback, ranks that died first (with the signal that
            killed them and the telling part of their standard error).
            The other ranks are terminated. ``RankCrashed`` (a subclass) when
            a rank died of a crash signal before any rank raised.
        TimeoutError: not every rank finished within ``timeout_s`` (a hang, e.g.
            mismatched collectives); the message holds the hung ranks' stacks
            (faulthandler, on SIGUSR1); all processes are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if crash_retries is None:
        raw = os.environ.get(CRASH_RETRIES_ENV_VAR, "0")
        try:
            crash_retries = int(raw)
        except ValueError:
            raise ValueError(f"{CRASH_RETRIES_ENV_VAR} must be an int >= 0, got {raw!r}") from None
    if isinstance(crash_retries, bool) or not isinstance(crash_retries, int) or crash_retries < 0:
        raise ValueError(f"crash_retries must be an int >= 0, got {crash_retries!r}")
    for attempt in range(crash_retries + 1):
        try:
            return _run_once(fn, world_size, args, kwargs or {}, timeout_s, backend)
        except RankCrashed as crash:
            if attempt == crash_retries:
                raise
            warnings.warn(
                f"run_distributed({getattr(fn, '__qualname__', fn)}): a rank crashed; "
                f"retrying ({attempt + 1} of {crash_retries}):\n{crash}",
                RuntimeWarning,
                stacklevel=2,
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout_s: float,
    backend: str,
) -> list[Any]:
    ctx = _process_context()
    results: multiprocessing.Queue = ctx.Queue()
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="simplefsdp-ranks-") as log_dir:
        logs = [os.path.join(log_dir, f"rank{rank}.stderr") for rank in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    rank,
                    world_size,
                    port,
                    backend,
                    timeout_s,
                    fn,
                    args,
                    kwargs,
                    results,
                    logs[rank],
                    dict(os.environ),
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            outcomes = _collect(procs, results, timeout_s)
        finally:
            stderr = [_read_text(path) for path in logs]
            # The last write of a crashed rank's file is its crash dump.
            written = [os.path.getmtime(p) if os.path.exists(p) else 0.0 for p in logs]
            for rank, text in enumerate(stderr):
                if text:  # pass each rank's stderr on (pytest shows it on failure)
                    sys.stderr.write(f"--- rank {rank} stderr ---\n{text}")
                    if not text.endswith("\n"):
                        sys.stderr.write("\n")
            sys.stderr.flush()
    died = [r for r in sorted(outcomes) if outcomes[r][0] == "died"]
    raised = [r for r in sorted(outcomes) if outcomes[r][0] == "error"]
    if died or raised:
        details = [
            f"--- rank {r} ---\nrank {r} died with {_describe_exit(procs[r].exitcode)}\n"
            + _crash_summary(stderr[r])
            for r in died
        ]
        details.extend(f"--- rank {r} ---\n{outcomes[r][1]}" for r in raised)
        message = f"{len(died) + len(raised)} of {world_size} ranks failed:\n" + "\n".join(details)
        crash_times = [
            written[r]
            for r in died
            if procs[r].exitcode is not None and -procs[r].exitcode in _CRASH_SIGNALS
        ]
        first_raise = min((outcomes[r][2] for r in raised), default=float("inf"))
        crashed_first = bool(crash_times) and min(crash_times) <= first_raise
        raise (RankCrashed if crashed_first else RuntimeError)(message)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        stacks = "\n".join(
            f"--- rank {r} ---\n" + "\n".join(stderr[r].splitlines()[-_SUMMARY_LINES:])
            for r in missing
        )
        raise TimeoutError(
            f"ranks {missing} did not finish within {timeout_s:.0f}s (hang or deadlock?); "
            f"their stacks:\n{stacks}"
        )
    return [outcomes[r][1] for r in range(world_size)]


@dataclass
class CollectiveRecord:
    """Collectives seen by ``record_collectives``: (op name, dtype, numel) each."""

    calls: list[tuple[str, torch.dtype, int]] = field(default_factory=list)

    def count(self, kind: str) -> int:
        """Number of calls whose op name contains ``kind`` (e.g. ``"all_gather"``)."""
        return sum(1 for name, _, _ in self.calls if kind in name)

    def dtypes(self, kind: str) -> set[torch.dtype]:
        return {dtype for name, dtype, _ in self.calls if kind in name}


_COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


class _RecordCollectivesMode(TorchDispatchMode):
    def __init__(self, record: CollectiveRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(c in name for c in _COLLECTIVE_NAMES) and "wait" not in name:
            first = args[0]
            if isinstance(first, (list, tuple)):
                first = first[0]
            if isinstance(first, torch.Tensor):
                self.record.calls.append((name, first.dtype, first.numel()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveRecord]:
    """Record the functional collectives dispatched inside the block (eager).

    DTensor redistribution runs on functional collectives
    (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``all_reduce``); each call's op name, input dtype and numel are recorded.
    """
    record = CollectiveRecord()
    with _RecordCollectivesMode(record):
        yield record
