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

import logging
import os
import sys

logger = logging.getLogger(__name__)

__all__ = ["launch", "under_torchrun"]

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

    Args:
        worker_argv: the arguments every worker gets (config and overrides).
        nproc: number of processes (ranks) on this machine.
        max_restarts: restarts of the whole worker group after a failure.

    Returns:
        0 when every worker succeeded, 1 otherwise (the agent has printed
        which rank failed and its error).

    Raises:
        ValueError: ``nproc < 1`` or ``max_restarts < 0``.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _set_worker_threads(nproc)
    if max_restarts > 0:
        # Restarted workers would otherwise find the previous attempt's
        # process-group keys in the agent's shared TCPStore and connect to dead
        # peers (pytorch/pytorch#135712); a fresh store per attempt avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
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
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        failed = sorted(exc.failures)
        logger.debug("worker failure details: %s", exc.format_msg())
        print(f"simplefsdp train: error: training failed on rank(s) {failed}", file=sys.stderr)
        return 1
    return 0
