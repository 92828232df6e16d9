"""Atomic, resumable distributed checkpoints of a training run.

Layout of ``checkpoint.folder``::

    step-100/                 a complete checkpoint
        .metadata, *.distcp   torch.distributed.checkpoint (DCP) files: model,
                              optimizer state tensors, per-rank RNG states
        trainer_state.json    step, LR scheduler, data loader position, ...
        config.json           the job config and the model's ModelArgs
        manifest.json         written last: step, world size, config hash and
                              every file above with its size and sha256
    step-200.tmp/             a save in progress (or one that crashed)

Note: [Atomic checkpoints]
    Every rank writes its DCP shards into ``step-N.tmp/``; rank 0 adds the JSON
    files. After a barrier (all ranks finished writing) rank 0 writes
    ``manifest.json`` and renames the folder to ``step-N/`` with ``os.replace``,
    a single atomic rename on one filesystem. A crash at any point before the
    rename leaves only a ``*.tmp`` folder, which :func:`list_checkpoints`
    ignores (and the next save removes); a folder without a valid manifest
    (missing, unparsable, wrong step, or a listed file missing or of another
    size) is ignored too, so a damaged checkpoint is never picked as latest.
    Rank 0 hashes and renames the files, so multi-node runs need a shared
    filesystem for the checkpoint folder, as DCP itself does to resume.

Note: [No pickles]
    DCP pickles non-tensor values and unpickles them with
    ``torch.load(weights_only=False)``. We therefore hand DCP tensors only (the
    optimizer's ``state``; its ``param_groups`` hyper-parameters come from the
    config and the scheduler) and keep every other piece of state in JSON
    files, so loading a checkpoint never unpickles an arbitrary object; DCP
    reads the tensors with ``weights_only=True``. (DCP's own ``.metadata`` index
    is DCP's format.)

Note: [State dicts without all-gathers]
    ``get_state_dict``/``set_state_dict`` resolve every parameter name with
    ``getattr(module, name)``. On a ``simplefsdp.data_parallel`` model that
    read goes through the parametrization, i.e. an all-gather of the full
    parameter per name (and a hang if a peer died). Both calls therefore run
    under ``simplefsdp.disable_parametrization()``, where the read returns the
    stored shard; other engines are unaffected by it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from simplefsdp.frontend import disable_parametrization

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_NAME",
    "MANIFEST_NAME",
    "TRAINER_STATE_NAME",
    "CheckpointInfo",
    "Checkpointer",
    "build_manifest",
    "latest_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "read_manifest",
    "step_dir_name",
    "verify_checkpoint",
    "write_json_atomic",
]

MANIFEST_NAME = "manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_NAME = "config.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_SUFFIX = ".tmp"
_MANIFEST_KEYS = {"format": int, "step": int, "world_size": int, "config_hash": str, "files": list}


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step-<step>``."""
    return f"step-{step}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build_manifest(folder: Path, *, step: int, world_size: int, config_hash: str) -> dict[str, Any]:
    """The manifest of the files now in ``folder`` (every file but the manifest)."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_NAME:
            continue
        files.append({"path": rel, "size": path.stat().st_size, "sha256": _sha256(path)})
    return {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "config_hash": config_hash,
        "created": time.time(),
        "torch_version": torch.__version__,
        "files": files,
    }


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``folder`` if it exists and has the expected fields."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            return None
    return data


def verify_checkpoint(folder: Path, *, check_hashes: bool = False) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or ``None`` when it is.

    Checks the manifest (present, well formed, its step matching the folder
    name) and that every listed file exists with the listed size; with
    ``check_hashes`` also the sha256 of every file.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return f"{folder}: no valid {MANIFEST_NAME}"
    match = _STEP_DIR.match(folder.name)
    if match is None or int(match.group(1)) != manifest["step"]:
        return f"{folder}: manifest step {manifest['step']} does not match the folder name"
    if not manifest["files"]:
        return f"{folder}: manifest lists no files"
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            return f"{folder}: malformed file entry {entry!r}"
        path = folder / entry["path"]
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return f"{folder}: {entry['path']} is missing or has the wrong size"
        if check_hashes and _sha256(path) != entry.get("sha256"):
            return f"{folder}: {entry['path']} does not match its sha256"
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step, folder and manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]


def list_checkpoints(folder: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints in ``folder``, oldest step first.

    ``*.tmp`` folders (saves in progress or crashed) and folders that fail
    :func:`verify_checkpoint` are skipped (the latter with a warning).
    """
    root = Path(folder)
    if not root.is_dir():
        return []
    found: list[CheckpointInfo] = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match is None or not child.is_dir():
            continue
        problem = verify_checkpoint(child)
        if problem is not None:
            logger.warning("ignoring incomplete checkpoint: %s", problem)
            continue
        found.append(CheckpointInfo(int(match.group(1)), child, read_manifest(child) or {}))
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(folder: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step in ``folder``, or ``None``."""
    found = list_checkpoints(folder)
    return found[-1] if found else None


def prune_checkpoints(
    folder: str | os.PathLike[str], keep_last: int, *, keep: Iterable[Path] = ()
) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints and stale ``*.tmp`` folders.

    Args:
        folder: the checkpoint folder.
        keep_last: number of complete checkpoints to keep (>= 1).
        keep: folders never deleted (e.g. a save in progress).

    Returns:
        The deleted folders.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    protected = {Path(p).resolve() for p in keep}
    root = Path(folder)
    doomed = [info.path for info in list_checkpoints(root)[:-keep_last]]
    if root.is_dir():
        doomed += [p for p in root.iterdir() if p.is_dir() and p.name.endswith(_TMP_SUFFIX)]
    removed = []
    for path in doomed:
        if path.resolve() in protected:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _finalize(tmp: Path, final: Path) -> None:
    """Move a finished ``step-N.tmp`` into place, replacing an older ``step-N``."""
    if final.exists():
        # A previous run's checkpoint of the same step: move it aside first,
        # since os.replace cannot replace a non-empty folder.
        aside = final.with_name(final.name + ".replaced" + _TMP_SUFFIX)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _rng_key(rank: int) -> str:
    return f"rank{rank}"


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and loads a run's model, optimizer, RNG and JSON trainer state.

    Args:
        folder: the checkpoint folder (``checkpoint.folder``).
        model: the module whose ``state_dict`` holds the (sharded) parameters;
            pass the unwrapped module (not a ``torch.compile`` wrapper).
        optimizer: its optimizer.
        device: the training device (for CUDA RNG state).
        keep_last: complete checkpoints to keep.
        config_hash: :func:`simplefsdp.train.config.config_hash` of the job.
        config_json: JSON-ready data stored as ``config.json`` (job config,
            model args), for :mod:`simplefsdp.train.export`.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        keep_last: int,
        config_hash: str,
        config_json: dict[str, Any],
    ) -> None:
        self.folder = Path(folder)
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.config_json = config_json
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def _tensor_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(dcp_state, full_optimizer_state_dict)``; dcp_state holds tensors only."""
        with disable_parametrization():  # see [State dicts without all-gathers]
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {
            "model": model_sd,
            "optim": {"state": optim_sd["state"]},
            "rng": {_rng_key(self.rank): _rng_state(self.device)},
        }
        return state, optim_sd

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write the checkpoint of ``step`` atomically (see [Atomic checkpoints]).

        Collective: every rank must call it with the same ``step``.

        Args:
            step: the optimizer step just completed.
            trainer_state: JSON-ready state (scheduler, data loader, ...).

        Returns:
            The final checkpoint folder ``<folder>/step-<step>``.
        """
        start = time.perf_counter()
        final = self.folder / step_dir_name(step)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state, _ = self._tensor_state()
        dcp.save(state, checkpoint_id=str(tmp))
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size, "config_hash": self.config_hash}
            write_json_atomic(tmp / TRAINER_STATE_NAME, {**trainer_state, **meta})
            write_json_atomic(tmp / CONFIG_NAME, self.config_json)
        _barrier()  # every rank's shards are on disk
        if self.rank == 0:
            manifest = build_manifest(
                tmp, step=step, world_size=self.world_size, config_hash=self.config_hash
            )
            write_json_atomic(tmp / MANIFEST_NAME, manifest)
            _finalize(tmp, final)
            removed = prune_checkpoints(self.folder, self.keep_last, keep=[final])
            if removed:
                logger.info("removed old checkpoints: %s", ", ".join(p.name for p in removed))
        _barrier()
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)
        return final

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load model, optimizer and RNG state from ``path``; return its trainer state.

        Collective. The world size may differ from the saving run's (DCP
        reshards); RNG states are then restored only for ranks that existed.

        Raises:
            ValueError: ``path`` is not a complete checkpoint.
        """
        folder = Path(path)
        problem = verify_checkpoint(folder)
        if problem is not None:
            raise ValueError(f"cannot resume: {problem}")
        trainer_state = json.loads((folder / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
        if trainer_state.get("config_hash") != self.config_hash:
            logger.warning(
                "checkpoint %s was written with a different model/parallel config "
                "(hash %s, now %s); loading it anyway",
                folder,
                str(trainer_state.get("config_hash"))[:12],
                self.config_hash[:12],
            )
        state, optim_sd = self._tensor_state()
        saved_keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        if not any(k.startswith(f"rng.{_rng_key(self.rank)}.") for k in saved_keys):
            logger.warning(
                "checkpoint has no RNG state for rank %d; keeping the current one", self.rank
            )
            del state["rng"]
        dcp.load(state, checkpoint_id=str(folder))
        optim_sd["state"] = state["optim"]["state"]
        with disable_parametrization():  # see [State dicts without all-gathers]
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=optim_sd,
            )
        if "rng" in state:
            _set_rng_state(state["rng"][_rng_key(self.rank)], self.device)
        logger.info("resumed from %s (step %s)", folder, trainer_state.get("step"))
        return trainer_state
