"""Shared pieces of the tests that run ``simplefsdp train`` as a subprocess.

A small run: 300 kB of the stdlib corpus, the debug model, eager, every step
logged, no validation, a checkpoint every 2 steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def small_args(steps: int) -> list[str]:
    """Arguments of a small run of ``steps`` steps."""
    return [
        "--data.max_bytes", "300000", "--data.seq_len", "64", "--data.batch_size", "2",
        "--training.warmup_steps", "2", "--training.lr", "3e-3", "--training.steps", str(steps),
        "--metrics.log_interval", "1", "--metrics.val_interval", "0", "--compile.enable", "false",
        "--checkpoint.interval", "2",
    ]  # fmt: skip


def train_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # restarts must work without it
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def losses(path: Path, key: str = "loss") -> dict[int, float]:
    """``key`` per step of a metrics file; a step logged twice (before and after a
    restart) keeps the last. Event records (``run_started``, ...) are skipped."""
    records = map(json.loads, Path(path).read_text().splitlines())
    return {r["step"]: r[key] for r in records if "event" not in r and key in r}


def parent_pids() -> dict[int, int]:
    """Every process id and its parent's (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the command may hold ")": the fields follow the last one
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return parents


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    return [child for child, parent in parent_pids().items() if parent == pid]


def descendants(pid: int) -> set[int]:
    """Process ids below ``pid``, at any depth."""
    parents = parent_pids()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def run_dirs(root: Path) -> list[Path]:
    """The run folders (those with a ``run.json``) in ``root``, oldest first."""
    runs = [p for p in Path(root).iterdir() if (p / "run.json").is_file()]
    return sorted(runs, key=lambda p: json.loads((p / "run.json").read_text())["started"])


def only_run(root: Path) -> Path:
    """The one run folder in ``root``."""
    (run,) = run_dirs(root)
    return run


def checkpoints(run: Path) -> Path:
    """The checkpoint folder of the run in folder ``run`` (as its ``run.json`` says)."""
    return Path(json.loads((Path(run) / "run.json").read_text())["checkpoint_folder"])


def checkpoint_as_run(step_dir: Path, root: Path, run_id: str = "20000101-000000-copy") -> Path:
    """A new run folder in ``root`` whose only checkpoint is a copy of ``step_dir``
    (no ``config.toml``: ``--resume`` then trains with the command's configuration)."""
    run = Path(root) / run_id
    shutil.copytree(step_dir, run / "checkpoints" / Path(step_dir).name)
    record = {"id": run_id, "started": "2000-01-01T00:00:00", "status": "stopped",
              "checkpoint_folder": str((run / "checkpoints").resolve())}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    return run
