"""Test utilities: run a function in N local processes, record collectives.

These are used by simplefsdp's own test-suite and are usable in users' tests.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecord", "find_free_port", "record_collectives", "run_distributed"]


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
) -> None:
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
    faulthandler.enable()  # a segfaulting rank prints its Python stack to stderr
    import torch.distributed as dist

    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` fresh processes and return
    each rank's return value (index = rank).

    Each process has the default process group initialised (``backend``, on a
    free localhost port; ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
    set) and ``OMP_NUM_THREADS=1``. ``fn`` must be importable (a module-level
    function) and its return value picklable.

    Raises:
        RuntimeError: a rank raised; the message holds every failing rank's
            traceback. The other ranks are terminated.
        TimeoutError: not every rank finished within ``timeout_s`` (a hang, e.g.
            mismatched collectives); all processes are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, timeout_s, fn, args, kwargs or {}, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                if dead:
                    # Give the queue a moment: a rank may have exited right after putting.
                    time.sleep(0.5)
                    if results.empty():
                        for r in dead:
                            outcomes.setdefault(
                                r, ("error", f"rank {r} died with exit code {procs[r].exitcode}")
                            )
                continue
            outcomes[rank] = (status, value)
            if status == "error":
                # Peers are likely blocked in a collective with the failed rank.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
    errors = {r: v for r, (s, v) in sorted(outcomes.items()) if s == "error"}
    if errors:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items())
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{details}")
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise TimeoutError(
            f"ranks {missing} did not finish within {timeout_s:.0f}s (hang or deadlock?)"
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
