"""A run's checkpoints: one ``step-N`` folder per save, latest selection, pruning.

Used by the trainer (``checkpoint.folder``); usable without it.

Layout of ``checkpoint.folder``::

    step-100/                 a complete checkpoint (see simplefsdp.checkpoint)
        .metadata, *.distcp   torch.distributed.checkpoint (DCP) files: model,
                              optimizer state tensors, per-rank RNG states
        trainer_state.json    step, LR scheduler, data loader position, ...
        config.json           the job config and the model's ModelArgs
        manifest.json         written last: step, world size, config hash and
                              every file above with its size and sha256
    step-200.tmp/             a save in progress (or one that crashed)

Note: [Atomic checkpoints]
    Each save is :func:`simplefsdp.checkpoint.save` into ``step-N``: written
    as ``step-N.tmp/``, verified, given its manifest and renamed into place in
    one atomic rename (see [Atomic publish] in ``simplefsdp.checkpoint._api``).
    A crash at any point before the rename leaves only a ``*.tmp`` folder,
    which :func:`list_checkpoints` ignores (and the next save removes). Old
    checkpoints are pruned only after the new one is published, each first
    renamed to ``*.tmp`` (unpublished atomically) and then deleted. Loading
    checks every file's sha256 and that the checkpoint fits the model, and
    refuses with a one-line error naming the file and the mismatch.
    An asynchronous save (``async_mode``) is published the same way, from
    a background thread once every rank's files are written (Note:
    [Asynchronous checkpoints] in ``simplefsdp.checkpoint._async``): until
    then its folder is ``step-N.tmp`` and the previous checkpoint is the
    latest.

Note: [Damaged checkpoints]
    One rule: a ``step-N`` folder was committed (its save finished: the
    rename publishes it together with its manifest), so it is complete. If
    anything in it is later missing, truncated or changed (manifest gone or
    unparsable, a listed file missing, of another size, or, when loading,
    with another sha256), resuming from it or exporting it stops with one
    line naming the file, the newest earlier checkpoint whose files are all
    there with their sizes, and the flag that accepts falling back to it
    (``--checkpoint.load_step N``); it is never skipped silently, as that
    would redo the steps since the earlier checkpoint without saying so.
    Only a save that never committed (``step-N.tmp``) is skipped, with one
    line (:func:`resume_checkpoint`). Selecting a checkpoint checks sizes
    only (cheap); the sha256 of every file is checked when it is loaded.

Note: [No pickles]
    DCP pickles non-tensor values and unpickles them with
    ``torch.load(weights_only=False)``; its ``.metadata`` index is a pickle.
    We hand DCP tensors only (the optimizer's ``state``; its ``param_groups``
    hyper-parameters come from the config and the scheduler), keep every
    other piece of state in JSON files, and read ``.metadata`` with a
    restricted unpickler (see [Loading never runs checkpoint code] in
    ``simplefsdp.checkpoint._safe_reader``).

The state dicts are read without all-gathers, see [State dicts without
all-gathers] in :mod:`simplefsdp.checkpoint._state`.
"""

from __future__ import annotations

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
import torch.nn as nn

from simplefsdp.checkpoint import _api
from simplefsdp.checkpoint._async import ASYNC_MODES, AsyncCheckpointWriter
from simplefsdp.checkpoint._files import (
    TMP_SUFFIX,
    CheckpointError,
    check_files,
    manifest_problem,
    read_json,
    read_manifest,
    sha256_file,
)
from simplefsdp.checkpoint._state import model_device, rank_and_world, tensor_state

logger = logging.getLogger(__name__)


TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_NAME = "config.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_UNCOMMITTED_DIR = re.compile(r"^step-(\d+)\.tmp$")
#: The flag that names the checkpoint to resume from (``-1``: the latest).
LOAD_STEP_FLAG = "--checkpoint.load_step"


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step-<step>``."""
    return f"step-{step}"


def verify_checkpoint(folder: Path, *, check_hashes: bool = False) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or ``None`` when it is.

    Checks the manifest (present, well formed, its step matching the folder
    name) and that every listed file exists with the listed size; with
    ``check_hashes`` also the sha256 of every file. Local (not collective).
    """
    folder = Path(folder)
    problem = manifest_problem(folder)
    if problem is not None:
        return problem
    manifest = read_manifest(folder)
    assert manifest is not None
    match = _STEP_DIR.match(folder.name)
    if match is None or int(match.group(1)) != manifest["step"]:
        return f"{folder}: manifest step {manifest['step']} does not match the folder name"
    hashes = None
    if check_hashes:
        listed = (e.get("path") for e in manifest["files"] if isinstance(e, dict))
        hashes = {
            rel: sha256_file(folder / rel)
            for rel in listed
            if isinstance(rel, str) and (folder / rel).is_file()
        }
    return check_files(folder, manifest, hashes=hashes)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step, folder and manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint whose files were later lost or changed (see [Damaged checkpoints]).

    Attributes:
        step: the damaged checkpoint's step.
        previous: the newest earlier checkpoint whose files check out, or ``None``.
        problem: what is wrong, one line naming the file.
    """

    def __init__(self, message: str, *, step: int, previous: int | None, problem: str) -> None:
        super().__init__(message)
        self.step = step
        self.previous = previous
        self.problem = problem


@dataclass(frozen=True)
class CheckpointScan:
    """The ``step-N`` folders of a checkpoint folder, by state.

    Attributes:
        complete: committed checkpoints whose files are all there with their
            listed sizes, oldest step first.
        damaged: ``{step: problem}`` of committed checkpoints that are not
            (``problem`` is one line naming the file).
        uncommitted: steps of saves that never committed (``step-N.tmp``).
    """

    complete: list[CheckpointInfo]
    damaged: dict[int, str]
    uncommitted: list[int]

    def previous_good(self, step: int) -> int | None:
        """The newest complete step before ``step``, or ``None``."""
        earlier = [info.step for info in self.complete if info.step < step]
        return earlier[-1] if earlier else None


def scan_checkpoints(folder: str | os.PathLike[str]) -> CheckpointScan:
    """Sort the ``step-N`` folders of ``folder`` into complete, damaged and uncommitted.

    Checks manifests and file sizes (no hashing); nothing is logged.
    """
    root = Path(folder)
    complete: list[CheckpointInfo] = []
    damaged: dict[int, str] = {}
    uncommitted: list[int] = []
    children = sorted(root.iterdir()) if root.is_dir() else []
    for child in children:
        if not child.is_dir():
            continue
        match = _STEP_DIR.match(child.name)
        if match is None:
            tmp = _UNCOMMITTED_DIR.match(child.name)
            if tmp is not None:
                uncommitted.append(int(tmp.group(1)))
            continue
        step = int(match.group(1))
        problem = verify_checkpoint(child)
        if problem is not None:
            damaged[step] = problem
            continue
        complete.append(CheckpointInfo(step, child, read_manifest(child) or {}))
    complete.sort(key=lambda info: info.step)
    return CheckpointScan(complete, damaged, sorted(uncommitted))


def damaged_checkpoint_error(
    folder: str | os.PathLike[str], step: int, problem: str, *, scan: CheckpointScan | None = None
) -> DamagedCheckpointError:
    """The one-line error for the damaged checkpoint ``step`` of ``folder``.

    Names ``problem`` (the file and what is wrong), the previous good
    checkpoint and ``--checkpoint.load_step`` to fall back to it.
    """
    scan = scan_checkpoints(folder) if scan is None else scan
    previous = scan.previous_good(step)
    where = Path(folder) / step_dir_name(step)
    if previous is None:
        fallback = "there is no earlier complete checkpoint to fall back to"
    else:
        fallback = (
            f"the previous good checkpoint is step {previous}: pass {LOAD_STEP_FLAG} "
            f"{previous} to resume from it (the steps after it are trained again)"
        )
    return DamagedCheckpointError(
        f"checkpoint {where} is damaged: {problem}; {fallback}",
        step=step,
        previous=previous,
        problem=problem,
    )


def list_checkpoints(folder: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints in ``folder``, oldest step first.

    ``*.tmp`` folders (saves in progress or crashed) and damaged checkpoints
    (see :func:`scan_checkpoints`) are left out; to resume, use
    :func:`resume_checkpoint`, which refuses a damaged latest checkpoint.
    """
    return scan_checkpoints(folder).complete


def latest_checkpoint(folder: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step in ``folder``, or ``None``.

    A query: a newer damaged checkpoint is passed over without a word. To
    choose the checkpoint to resume from, use :func:`resume_checkpoint`.
    """
    found = list_checkpoints(folder)
    return found[-1] if found else None


def resume_checkpoint(
    folder: str | os.PathLike[str], step: int = -1, *, report: bool = False
) -> CheckpointInfo | None:
    """The checkpoint to resume from: the newest committed one, or ``step``.

    See [Damaged checkpoints]. With ``report``, a save that never committed
    and is newer than the chosen checkpoint is named in one logged warning.

    Args:
        folder: the checkpoint folder.
        step: the step to resume from (``checkpoint.load_step``); ``-1``: the newest.
        report: log the skipped uncommitted save (rank 0 of the run only).

    Returns:
        The checkpoint, or ``None`` when ``step`` is ``-1`` and no save in
        ``folder`` ever committed.

    Raises:
        DamagedCheckpointError: the chosen checkpoint is damaged (one line:
            file, previous good checkpoint, flag).
        CheckpointError: ``step`` has no checkpoint in ``folder``.
    """
    scan = scan_checkpoints(folder)
    committed = sorted({info.step for info in scan.complete} | set(scan.damaged))
    if step >= 0:
        if step not in committed:
            have = ", ".join(map(str, [i.step for i in scan.complete])) or "none"
            raise CheckpointError(
                f"checkpoint.load_step {step}: {Path(folder)} has no checkpoint "
                f"{step_dir_name(step)}; complete checkpoints there: steps {have}"
            )
        chosen = step
    elif not committed:
        chosen = None
    else:
        chosen = committed[-1]
    if chosen is not None and chosen in scan.damaged:
        raise damaged_checkpoint_error(folder, chosen, scan.damaged[chosen], scan=scan)
    if report and step < 0:
        newer = [s for s in scan.uncommitted if chosen is None or s > chosen]
        if newer:
            start = "starting without it" if chosen is None else f"using step {chosen}"
            logger.warning(
                "skipping %s: that save never committed (the run stopped while writing it); %s",
                Path(folder) / (step_dir_name(newer[-1]) + TMP_SUFFIX),
                start,
            )
    if chosen is None:
        return None
    return next(info for info in scan.complete if info.step == chosen)


def prune_checkpoints(
    folder: str | os.PathLike[str], keep_last: int, *, keep: Iterable[Path] = ()
) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints and stale ``*.tmp`` folders.

    A complete checkpoint is first renamed to ``<name>.deleted.tmp`` (so a
    crash while deleting never leaves a half-deleted folder that looks
    complete), then deleted.

    Args:
        folder: the checkpoint folder.
        keep_last: number of complete checkpoints to keep (>= 1).
        keep: folders never deleted (e.g. a save in progress).

    Returns:
        The deleted folders (under their original names).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    protected = {Path(p).resolve() for p in keep}
    root = Path(folder)
    doomed = [info.path for info in list_checkpoints(root)[:-keep_last]]
    if root.is_dir():
        doomed += [p for p in root.iterdir() if p.is_dir() and p.name.endswith(TMP_SUFFIX)]
    removed = []
    for path in doomed:
        if path.resolve() in protected:
            continue
        target = path
        if not path.name.endswith(TMP_SUFFIX):
            target = path.with_name(path.name + ".deleted" + TMP_SUFFIX)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
        shutil.rmtree(target, ignore_errors=True)
        removed.append(path)
    return removed


class Checkpointer:
    """Saves and loads a run's model, optimizer, RNG and JSON trainer state.

    Args:
        folder: the checkpoint folder (``checkpoint.folder``).
        model: the module whose ``state_dict`` holds the (sharded) parameters;
            pass the unwrapped module (not a ``torch.compile`` wrapper).
        optimizer: its optimizer.
        device: the training device (kept for callers; RNG states follow the
            model's device).
        keep_last: complete checkpoints to keep.
        config_hash: :func:`simplefsdp.train.config.config_hash` of the job.
        config_json: JSON-ready data stored as ``config.json`` (job config,
            model args), for :mod:`simplefsdp.checkpoint.export`.
        async_mode: ``"none"`` (saves block until published), ``"async"`` or
            ``"staged"`` (saves finish in the background, see Note:
            [Asynchronous checkpoints] in ``simplefsdp.checkpoint._async``).
            Collective to construct when not ``"none"``.

    Attributes:
        last_blocking_s: seconds the latest :meth:`save` blocked its caller.
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
        async_mode: str = "none",
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(
                f"checkpoint.async_mode {async_mode!r} is not one of {', '.join(ASYNC_MODES)}"
            )
        self.folder = Path(folder)
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.config_json = config_json
        self.rank, self.world_size = rank_and_world()
        self.async_mode = async_mode
        self.last_blocking_s = 0.0
        self._writer = None if async_mode == "none" else AsyncCheckpointWriter(async_mode)  # type: ignore[arg-type]

    def _tensor_state(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(dcp_state, full_optimizer_state_dict)`` as saved; ``dcp_state`` holds tensors only."""
        return tensor_state(self.model, self.optimizer, rng_device=model_device(self.model))

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
        meta = {"step": step, "world_size": self.world_size, "config_hash": self.config_hash}
        json_files = {TRAINER_STATE_NAME: {**trainer_state, **meta}, CONFIG_NAME: self.config_json}
        if self._writer is not None:
            pending = self._writer.save(
                self.model,
                self.optimizer,
                final,
                json_files=json_files,
                step=step,
                config_hash=self.config_hash,
                after_commit=self._after_commit,
            )
            self.last_blocking_s = pending.blocking_s
            return final
        _api.save(
            self.model,
            self.optimizer,
            final,
            json_files=json_files,
            step=step,
            config_hash=self.config_hash,
        )
        self._prune(final)
        _api.barrier()
        self.last_blocking_s = time.perf_counter() - start
        logger.info("saved checkpoint %s in %.2fs", final, self.last_blocking_s)
        return final

    def _prune(self, final: Path) -> None:
        if self.rank == 0:
            removed = prune_checkpoints(self.folder, self.keep_last, keep=[final])
            if removed:
                logger.info("removed old checkpoints: %s", ", ".join(p.name for p in removed))

    def _after_commit(self, final: Path) -> None:
        """In the background thread of an asynchronous save, once ``final`` is published."""
        self._prune(final)
        assert self._writer is not None
        _api.barrier(self._writer.group)
        logger.info("saved checkpoint %s (written in the background)", final)

    def wait_staged(self) -> float:
        """Before the optimizer changes the parameters: wait until the pending
        asynchronous save has copied them; the seconds waited (0 when none)."""
        return 0.0 if self._writer is None else self._writer.wait_staged()

    @property
    def pending(self) -> Path | None:
        """The folder of a save still being written in the background, or ``None``."""
        if self._writer is None or self._writer.pending is None:
            return None
        return None if self._writer.pending.done() else self._writer.pending.path

    def finish(self) -> Path | None:
        """Wait for the pending asynchronous save to commit (collective); its
        folder, or ``None`` when none was pending.

        Raises:
            CheckpointError: that save failed.
        """
        return None if self._writer is None else self._writer.wait()

    def close(self) -> None:
        """Wait for a pending save and release the background threads."""
        if self._writer is not None:
            self._writer.close()

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load model, optimizer and RNG state from ``path``; return its trainer state.

        Collective. The world size and data-parallel mode may differ from the
        saving run's (DCP reshards); RNG states are then restored only for
        ranks that existed. Every file's sha256 is checked first.

        Raises:
            DamagedCheckpointError: a file of ``path`` is missing, truncated or
                changed; one line naming it and the previous good checkpoint
                (see [Damaged checkpoints]).
            CheckpointError: (a ``ValueError``) ``path`` is written for another
                model; one line naming file and mismatch.
        """
        folder = Path(path)
        try:
            _api.verify(folder, check_hashes=True)
        except CheckpointError as exc:
            match = _STEP_DIR.match(folder.name)
            if match is None:
                raise
            raise damaged_checkpoint_error(folder.parent, int(match.group(1)), str(exc)) from None
        _api.load(self.model, self.optimizer, folder, check_hashes=False)  # verified above
        trainer_state = read_json(folder / TRAINER_STATE_NAME)
        if not isinstance(trainer_state, dict):
            raise CheckpointError(f"{folder / TRAINER_STATE_NAME} does not hold a JSON object")
        if self.rank == 0 and trainer_state.get("config_hash") != self.config_hash:
            logger.warning(
                "checkpoint %s was written with another model/parallel config (hash %s, now "
                "%s); its tensors fit this model, so it was loaded",
                folder,
                str(trainer_state.get("config_hash"))[:12],
                self.config_hash[:12],
            )
        logger.info("resumed from %s (step %s)", folder, trainer_state.get("step"))
        return trainer_state
