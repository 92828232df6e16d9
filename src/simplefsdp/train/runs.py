"""Run identity: every run of ``simplefsdp train`` has an id, and runs never share files.

Note: [One run per folder]
    A run writes ``metrics.jsonl``, ``config.toml`` and ``tensorboard/`` in
    ``metrics.output_dir`` and ``step-N`` folders in ``checkpoint.folder``;
    every metrics record, and the trainer state of every checkpoint, carries
    the run's id. A run that resumes (``--resume``, or a restart after a
    failure) continues the id of the checkpoint it loads. A *new* run that
    finds another run's files there first moves them, unchanged, into
    ``<folder>/previous_runs/<that run's id>/`` (metrics and config under the
    output folder, checkpoints under the checkpoint folder) and says so in one
    line. So the ``step-N`` folders in ``checkpoint.folder`` are always this
    run's: "latest" (``--resume``, ``simplefsdp export --checkpoint FOLDER``)
    is this run's latest, ``keep_last`` counts this run's checkpoints, and a
    new run's ``step-100`` never replaces an older run's. Nothing is deleted.

This module only moves files and reads JSON; it does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ARCHIVE_DIR",
    "RUN_ID_ENV",
    "PreviousRun",
    "archive_previous_run",
    "find_previous_run",
    "new_run_id",
]

#: Environment variable through which the launcher hands its run id to the workers.
RUN_ID_ENV = "SIMPLEFSDP_RUN_ID"
#: Sub-folder (of the output and checkpoint folders) that holds earlier runs.
ARCHIVE_DIR = "previous_runs"
_OUTPUT_FILES = ("metrics.jsonl", "config.toml", "tensorboard")
_STEP_DIR = re.compile(r"^step-\d+(\.[\w.]+)?$")  # step-N and step-N.*.tmp


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxx``: sortable by start time, unique in practice."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class PreviousRun:
    """Another run's files in this run's folders."""

    run_id: str
    output_files: tuple[Path, ...]
    checkpoint_dirs: tuple[Path, ...]

    def describe(self) -> str:
        steps = sorted(
            int(m.group(1))
            for p in self.checkpoint_dirs
            if (m := re.match(r"^step-(\d+)$", p.name))
        )
        what = f"checkpoints up to step {steps[-1]}" if steps else "logs"
        return f"run {self.run_id} ({what})"


def _run_id_in_metrics(path: Path) -> str | None:
    """The ``run_id`` of the last record of ``metrics.jsonl`` that has one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            run_id = json.loads(line).get("run_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


def _run_id_in_checkpoints(dirs: list[Path]) -> str | None:
    for folder in sorted(dirs, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            run_id = json.loads((folder / "trainer_state.json").read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


def _safe_name(run_id: str) -> str:
    return re.sub(r"[^\w.-]", "_", run_id) or "run"


def find_previous_run(
    output_dir: str | os.PathLike[str], checkpoint_folder: str | os.PathLike[str] | None
) -> PreviousRun | None:
    """Files of an earlier run in ``output_dir`` / ``checkpoint_folder``, or ``None``."""
    out = Path(output_dir)
    outputs = [out / name for name in _OUTPUT_FILES if (out / name).exists()]
    ckpts: list[Path] = []
    if checkpoint_folder is not None and Path(checkpoint_folder).is_dir():
        ckpts = [
            p for p in Path(checkpoint_folder).iterdir() if p.is_dir() and _STEP_DIR.match(p.name)
        ]
    if not outputs and not ckpts:
        return None
    run_id = _run_id_in_checkpoints(ckpts) or _run_id_in_metrics(out / "metrics.jsonl")
    if run_id is None:  # written before runs had ids: name it by its last change
        newest = max(p.stat().st_mtime for p in [*outputs, *ckpts])
        run_id = "run-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))
    return PreviousRun(_safe_name(run_id), tuple(outputs), tuple(ckpts))


def _unique(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def archive_previous_run(
    previous: PreviousRun,
    output_dir: str | os.PathLike[str],
    checkpoint_folder: str | os.PathLike[str] | None,
) -> list[Path]:
    """Move ``previous``'s files into ``previous_runs/<id>/`` folders; return those folders.

    Each file or folder is moved with one ``os.replace`` (same file system),
    so a crash leaves every file either where it was or archived.
    """
    targets: list[Path] = []
    groups = [(Path(output_dir), previous.output_files)]
    if checkpoint_folder is not None:
        groups.append((Path(checkpoint_folder), previous.checkpoint_dirs))
    for root, paths in groups:
        if not paths:
            continue
        target = _unique(root / ARCHIVE_DIR / previous.run_id)
        target.mkdir(parents=True)
        for path in paths:
            os.replace(path, target / path.name)
        targets.append(target)
    return targets
