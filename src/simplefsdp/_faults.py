"""Test-only fault-injection hooks, driven by environment variables.

Called by :func:`simplefsdp.checkpoint.save` and the trainer. A leaf module:
it imports only the standard library (nothing of simplefsdp's, no torch).

These exist so that tests can kill a process at a chosen point, the way a lost
node or a preemption would, and check that nothing trained is lost. They do
nothing unless their variable is set; never set them in a real job.

``SIMPLEFSDP_TEST_FAIL_SAVE=<stage>``
    The rank named by ``SIMPLEFSDP_TEST_FAIL_RANK`` (default 0, the rank that
    publishes) kills itself with ``SIGKILL`` when a save reaches ``<stage>``,
    one of :data:`SAVE_STAGES`:

    * ``before_write``: the ``*.tmp`` folder exists, nothing written yet;
    * ``after_write``: every rank's shards and the JSON files are on disk, the
      manifest is not;
    * ``before_publish``: the manifest is written, the folder not yet renamed;
    * ``after_publish``: the checkpoint is published, older ones not yet pruned.

``SIMPLEFSDP_TEST_KILL_AT_STEP=<N>``
    The trainer's rank ``SIMPLEFSDP_TEST_KILL_RANK`` (default 1, or 0 in a
    single-process run) kills itself with ``SIGKILL`` right after optimizer
    step ``N`` (before that step's checkpoint), once: it first creates the
    marker file ``SIMPLEFSDP_TEST_KILL_MARKER`` (default
    ``<metrics.output_dir>/.simplefsdp-test-killed``) and does nothing if the
    marker exists, so the restarted job runs through.

``SIMPLEFSDP_TEST_STEP_SLEEP_S=<seconds>``
    Every rank of the trainer sleeps that long after each optimizer step: a
    slow step, e.g. to check that a stop waits for it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger(__name__)


FAIL_SAVE_ENV = "SIMPLEFSDP_TEST_FAIL_SAVE"
FAIL_RANK_ENV = "SIMPLEFSDP_TEST_FAIL_RANK"
KILL_AT_STEP_ENV = "SIMPLEFSDP_TEST_KILL_AT_STEP"
KILL_RANK_ENV = "SIMPLEFSDP_TEST_KILL_RANK"
KILL_MARKER_ENV = "SIMPLEFSDP_TEST_KILL_MARKER"
STEP_SLEEP_ENV = "SIMPLEFSDP_TEST_STEP_SLEEP_S"
DEFAULT_KILL_MARKER = ".simplefsdp-test-killed"
SAVE_STAGES = ("before_write", "after_write", "before_publish", "after_publish")


def _sigkill_self(reason: str) -> None:
    logger.warning("fault injection: SIGKILL of pid %d (%s)", os.getpid(), reason)
    logging.shutdown()  # flush handlers; SIGKILL skips every cleanup
    os.kill(os.getpid(), signal.SIGKILL)


def save_fault_point(stage: str, rank: int) -> None:
    """Kill this process if ``SIMPLEFSDP_TEST_FAIL_SAVE`` names ``stage`` for ``rank``."""
    assert stage in SAVE_STAGES, stage
    wanted = os.environ.get(FAIL_SAVE_ENV)
    if not wanted:
        return
    if wanted not in SAVE_STAGES:
        raise ValueError(f"{FAIL_SAVE_ENV}={wanted!r} is not one of {', '.join(SAVE_STAGES)}")
    if wanted == stage and rank == int(os.environ.get(FAIL_RANK_ENV, "0")):
        _sigkill_self(f"{FAIL_SAVE_ENV}={stage}")


def maybe_kill_at_step(step: int, rank: int, world_size: int, output_dir: str) -> None:
    """Kill this rank after ``step`` once, per ``SIMPLEFSDP_TEST_KILL_AT_STEP`` (see module doc)."""
    wanted = os.environ.get(KILL_AT_STEP_ENV)
    if not wanted or int(wanted) != step:
        return
    default_rank = 1 if world_size > 1 else 0
    if rank != int(os.environ.get(KILL_RANK_ENV, str(default_rank))):
        return
    marker = Path(os.environ.get(KILL_MARKER_ENV) or Path(output_dir) / DEFAULT_KILL_MARKER)
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} killed at step {step}\n", encoding="utf-8")
    _sigkill_self(f"{KILL_AT_STEP_ENV}={step}, rank {rank}")


def maybe_sleep_after_step() -> None:
    """Sleep ``SIMPLEFSDP_TEST_STEP_SLEEP_S`` seconds (see module doc); a no-op when unset."""
    wanted = os.environ.get(STEP_SLEEP_ENV)
    if wanted:
        time.sleep(float(wanted))
