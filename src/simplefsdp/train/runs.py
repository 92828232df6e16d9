"""Runs of ``simplefsdp train``: one folder per run, found again by id or path.

Note: [One run per folder]
    Every run of ``simplefsdp train`` has an id (``YYYYmmdd-HHMMSS-xxxx``) and
    a folder ``<metrics.output_dir>/<run id>/`` holding::

        run.json        id, start time, command line, status (running,
                        finished, stopped, failed), checkpoint folder and
                        the pid and host of its launcher
        config.toml     the resolved configuration the run trains with
        metrics.jsonl   every record carries the run id
        tensorboard/    with metrics.tensorboard
        checkpoints/    step-N folders (checkpoint.folder empty, the default)

    With ``checkpoint.folder DIR`` the checkpoints go to ``DIR/<run id>/``
    instead (``run.json`` records where). A new run never moves, replaces or
    deletes another run's files; ``keep_last`` counts this run's checkpoints.
    ``--resume RUN`` (an id under ``metrics.output_dir``, or a run folder)
    continues that run under its id with its saved ``config.toml`` (flags on
    top override it); ``--resume`` alone picks the newest run that has a
    complete checkpoint. ``simplefsdp runs`` lists runs and removes them on
    request.

This module reads and writes small JSON/TOML files; it imports torch only to
find a run's complete checkpoints (:func:`RunInfo.latest_step`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Environment variable through which the launcher hands its run id to the workers.
RUN_ID_ENV = "SIMPLEFSDP_RUN_ID"
RUN_FILE = "run.json"
CONFIG_FILE = "config.toml"
CHECKPOINTS_DIR = "checkpoints"
_SAFE = re.compile(r"[^\w.-]")


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxx``: sortable by start time, unique in practice."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def output_dir_for_model(output_dir: str, model: str, presets: tuple[str, ...]) -> str:
    """``output_dir`` with a preset's folder name (``outputs/<preset model>``)
    replaced by ``model``'s (``outputs/<model>``) when ``--model`` trains another model
    than the preset's, so that runs are filed under the model they train; any
    other folder is kept."""
    path = Path(output_dir)
    if path.name in presets and path.name != model:
        return str(path.with_name(model))
    return output_dir


def run_folder(output_dir: str | os.PathLike[str], run_id: str) -> Path:
    """``<output_dir>/<run id>`` (an id with unsafe characters has them replaced by ``_``)."""
    return Path(output_dir) / (_SAFE.sub("_", run_id) or "run")


def run_checkpoint_folder(checkpoint_folder: str, run_dir: Path) -> Path:
    """The checkpoint folder of the run in ``run_dir``.

    Args:
        checkpoint_folder: ``checkpoint.folder``; empty means ``<run_dir>/checkpoints``,
            else ``<checkpoint_folder>/<run id>``.
        run_dir: the run's folder (its name is the run id).
    """
    if not checkpoint_folder:
        return run_dir / CHECKPOINTS_DIR
    return Path(checkpoint_folder) / run_dir.name


@dataclass(frozen=True)
class RunInfo:
    """A run folder and what its ``run.json`` says."""

    run_id: str
    path: Path
    status: str
    checkpoint_folder: Path
    started: str = ""
    command: str = ""
    pid: int | None = None
    host: str = ""

    def is_running(self) -> bool:
        """Whether the run's process is still going: Note: [Live runs]."""
        if self.status != "running":
            return False
        if self.pid is not None and self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except OSError:
                return True  # alive, owned by another user
            return True
        newest = max((_mtime(self.path / name) for name in (RUN_FILE, "metrics.jsonl")), default=0)
        return time.time() - newest < LIVE_WITHOUT_PID_S

    def shown_status(self) -> str:
        """``status``, or ``killed`` for a ``running`` run whose process is gone."""
        return "killed" if self.status == "running" and not self.is_running() else self.status

    def latest_step(self) -> int | None:
        """The step of the run's newest complete checkpoint, or ``None``."""
        from simplefsdp.checkpoint import latest_checkpoint

        info = latest_checkpoint(self.checkpoint_folder)
        return None if info is None else info.step

    def resume_step(self, load_step: int = -1) -> int | None:
        """The step this run resumes from: ``load_step`` or its newest committed
        checkpoint; ``None`` when none committed.

        Raises:
            ValueError: the chosen checkpoint is damaged or ``load_step`` has no
                checkpoint (see [Damaged checkpoints] in :mod:`simplefsdp.checkpoint.steps`).
        """
        from simplefsdp.checkpoint import resume_checkpoint

        info = resume_checkpoint(self.checkpoint_folder, load_step)
        return None if info is None else info.step

    def model(self) -> str:
        """The ``model.name`` in the run's ``config.toml`` (``"?"`` where unreadable)."""
        text = _read_text(self.path / CONFIG_FILE)
        section = ""
        for line in (text or "").splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[] ")
            elif section == "model" and re.match(r"name\s*=", line):
                return line.split("=", 1)[1].strip().strip("\"'") or "?"
        return "?"

    def last_step(self) -> int | None:
        """The last step the run reached: its last logged step or, when newer
        (a stop between two log steps saves its step), its newest checkpoint."""
        known = [s for s in (self.last_logged_step(), self.latest_step()) if s is not None]
        return max(known) if known else None

    def last_logged_step(self) -> int | None:
        """The step of the last record in ``metrics.jsonl``, or ``None``."""
        path = self.path / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                return step
        return None

    def size_bytes(self) -> int:
        """Bytes on disk of the run folder and (when elsewhere) its checkpoint folder."""
        roots = [self.path]
        if not _is_inside(self.checkpoint_folder, self.path):
            roots.append(self.checkpoint_folder)
        total = 0
        for root in roots:
            for dirpath, _, files in os.walk(root):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(dirpath, name)).st_size
                    except OSError:
                        pass
        return total


def _is_inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


# Note: [Live runs]
#     A run's ``run.json`` says ``running`` from its start until the launcher
#     (or rank 0 under torchrun) records how it ended; a process killed by
#     SIGKILL, the OOM killer or a lost node never does. ``run.json`` therefore
#     also holds the pid and host of the process that records the end: on that
#     host a ``running`` run is live while the pid is; elsewhere (a shared
#     file system) it counts as live while its ``run.json`` or
#     ``metrics.jsonl`` changed in the last ``LIVE_WITHOUT_PID_S`` seconds.
#     ``simplefsdp runs`` never removes a live run and shows a dead one as
#     ``killed``.
LIVE_WITHOUT_PID_S = 900.0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_run(path: str | os.PathLike[str]) -> RunInfo | None:
    """The run in folder ``path``, or ``None`` when it is not a run folder (no ``run.json``)."""
    folder = Path(path)
    record = _read_json(folder / RUN_FILE)
    if record is None:
        return None
    ckpt = record.get("checkpoint_folder")
    ckpt_path = Path(ckpt) if isinstance(ckpt, str) and ckpt else folder / CHECKPOINTS_DIR
    if not ckpt_path.is_dir() and (folder / CHECKPOINTS_DIR).is_dir():
        ckpt_path = folder / CHECKPOINTS_DIR  # the tree was moved: the run's own folder
    return RunInfo(
        run_id=str(record.get("id") or folder.name),
        path=folder,
        status=str(record.get("status", "unknown")),
        checkpoint_folder=ckpt_path,
        started=str(record.get("started", "")),
        command=str(record.get("command", "")),
        pid=record["pid"] if isinstance(record.get("pid"), int) else None,
        host=str(record.get("host", "")),
    )


def list_runs(root: str | os.PathLike[str]) -> list[RunInfo]:
    """The runs in ``root`` (a ``metrics.output_dir``), oldest first (ids sort by start time)."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    runs = [read_run(child) for child in folder.iterdir() if child.is_dir()]
    return sorted((r for r in runs if r is not None), key=lambda r: (r.started, r.path.name))


def newest_resumable_run(root: str | os.PathLike[str]) -> tuple[RunInfo, int] | None:
    """``(run, step)``: the newest run in ``root`` with a complete checkpoint, or ``None``."""
    for run in reversed(list_runs(root)):
        step = run.latest_step()
        if step is not None:
            return run, step
    return None


def describe_runs(root: str | os.PathLike[str]) -> str:
    """One phrase naming the runs in ``root`` and their last complete checkpoints."""
    runs = list_runs(root)
    if not runs:
        return f"there are no runs in {root}"
    parts = []
    for run in runs:
        step = run.latest_step()
        parts.append(f"{run.run_id} ({'no checkpoint' if step is None else f'step {step}'})")
    return f"runs in {root}: " + ", ".join(parts)


def find_run(spec: str, root: str | os.PathLike[str]) -> RunInfo:
    """The run ``spec`` names: a run folder, or a run id under ``root``.

    Raises:
        ValueError: no such run; the message lists the runs in ``root``.
    """
    for candidate in (Path(spec), Path(root) / spec):
        run = read_run(candidate)
        if run is not None:
            return run
    raise ValueError(
        f"no run folder {spec!r} and no run with that id in {root} ({describe_runs(root)})"
    )


def write_run_files(
    run_dir: Path,
    *,
    run_id: str,
    checkpoint_folder: Path,
    config_text: str,
    status: str,
    resumed: bool = False,
) -> None:
    """Create ``run_dir`` and write its ``config.toml`` and ``run.json``.

    A run keeps its start time and first command line; with ``resumed`` the
    command that continues it is recorded as ``resumed_with``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    old = _read_json(run_dir / RUN_FILE) or {}
    command = " ".join(["simplefsdp train", *_argv()])
    record = {
        "id": run_id,
        "started": old.get("started") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": old.get("command") or command,
        "status": status,
        "checkpoint_folder": os.path.abspath(checkpoint_folder),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if resumed:
        record["resumed_with"] = command
    _write_json(run_dir / RUN_FILE, record)


def _argv() -> list[str]:
    import sys

    return sys.argv[2:] if sys.argv[1:2] == ["train"] else sys.argv[1:]


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def set_run_status(run_dir: Path, status: str) -> None:
    """Set ``status`` in ``run_dir/run.json`` (nothing when the file is missing)."""
    record = _read_json(run_dir / RUN_FILE)
    if record is not None:
        record["status"] = status
        try:
            _write_json(run_dir / RUN_FILE, record)
        except OSError:
            pass


def check_output_folders(folders: dict[str, Path]) -> None:
    """Create each folder, write and remove a probe file; then remove what was created.

    Args:
        folders: ``{what: folder}``, e.g. ``{"metrics.output_dir": run_dir}``.

    Raises:
        ValueError: naming the setting and the folder that cannot be written;
            everything created so far is removed first.
    """
    created: list[Path] = []
    try:
        for what, folder in folders.items():
            try:
                missing = [p for p in (folder, *folder.parents) if not p.exists()]
                folder.mkdir(parents=True, exist_ok=True)
                created.extend(reversed(missing))
                probe = folder / f".simplefsdp-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                raise ValueError(
                    f"{what}: cannot write to {exc.filename or folder} ({reason}); "
                    "give a folder that can be created and written"
                ) from exc
    finally:
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass


def remove_run(run: RunInfo) -> None:
    """Delete the run's folder and (when elsewhere) its checkpoint folder."""
    if not _is_inside(run.checkpoint_folder, run.path):
        shutil.rmtree(run.checkpoint_folder, ignore_errors=True)
    shutil.rmtree(run.path)
