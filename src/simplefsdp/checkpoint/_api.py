"""``save`` / ``load`` / ``verify``: atomic, verified, resharding checkpoints.

Note: [Atomic publish]
    Every rank writes its DCP shards into ``<path>.tmp/``; rank 0 adds the
    JSON files. After a barrier (all shards on disk, fsynced by DCP) the ranks
    hash the files between them, and rank 0 checks that every shard the DCP
    metadata refers to is there, writes ``manifest.json`` (step, world size,
    config hash, every file's size and SHA-256) and renames the folder to
    ``<path>`` with ``os.replace``: one atomic rename on one filesystem. A
    process killed at any point before the rename leaves only the ``.tmp``
    folder, which readers ignore; after it, the checkpoint is complete.
    Replacing an existing checkpoint of the same name needs two renames (the
    old one is moved aside first); a crash between them loses that old
    checkpoint, never any other. Rank 0 renames files written by every rank,
    so multi-node jobs need a shared filesystem, as DCP itself does to resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from simplefsdp._faults import save_fault_point
from simplefsdp.checkpoint._files import (
    MANIFEST_NAME,
    TMP_SUFFIX,
    CheckpointError,
    broadcast_from_rank0,
    build_manifest,
    check_files,
    fsync_dir,
    gather_from_all,
    hash_files,
    manifest_problem,
    payload_files,
    read_json,
    read_manifest,
    write_json_atomic,
)
from simplefsdp.checkpoint._metadata_check import (
    check_state_fits,
    check_storage_files,
    flatten_keys,
)
from simplefsdp.checkpoint._safe_reader import (
    SafeFileSystemReader,
    TensorOnlyLoadPlanner,
    read_metadata_safely,
)
from simplefsdp.checkpoint._state import (
    apply_tensor_state,
    model_device,
    rank_and_world,
    rng_key,
    set_rng_state,
    tensor_state,
)

logger = logging.getLogger(__name__)

EXTRA_STATE_NAME = "extra_state.json"


def barrier(group: Any = None) -> None:
    """``torch.distributed.barrier(group)`` when a process group is initialized, else nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _no_dist() -> bool:
    """Whether this is a single-process save/load without a process group."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: here it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(problem: str | None, group: Any = None) -> None:
    """Raise rank 0's ``problem`` (if any) on every rank, so no rank is left waiting."""
    problem = broadcast_from_rank0(problem, group)
    if problem is not None:
        raise CheckpointError(problem)


def _replace_problem(final: Path) -> str | None:
    """Why a save must not replace ``final`` (an existing non-checkpoint), or ``None``."""
    if not final.exists():
        return None
    if not final.is_dir():
        return f"refusing to replace {final}: it is a file, not a checkpoint folder"
    if read_manifest(final) is None and any(final.iterdir()):
        return f"refusing to replace {final}: it is not a checkpoint (no {MANIFEST_NAME})"
    return None


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished ``<final>.tmp`` to ``final`` (see [Atomic publish]).

    An existing ``final`` is replaced only if it is a checkpoint (has a
    manifest) or empty; anything else is refused rather than deleted.
    """
    if final.exists():
        problem = _replace_problem(final)
        if problem is not None:
            raise CheckpointError(problem)
        # os.replace cannot replace a non-empty folder: move the old one aside.
        aside = final.with_name(final.name + ".replaced" + TMP_SUFFIX)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def _check_json_names(files: Mapping[str, Any]) -> None:
    """Reject names that would leave the folder or clash with DCP's or our files."""
    for name in files:
        bad = not name.endswith(".json") or name == MANIFEST_NAME
        if bad or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(
                f"invalid checkpoint JSON file name {name!r}: use a plain '*.json' name "
                f"other than {MANIFEST_NAME!r}"
            )


def _finish_and_publish(
    tmp: Path, final: Path, manifest_fields: dict[str, Any], group: Any = None
) -> None:
    """Hash (all ranks), write the manifest, verify and publish (rank 0)."""
    rank, _ = rank_and_world()
    hashes = hash_files(tmp, payload_files(tmp), group)
    problem = None
    if rank == 0:
        try:
            manifest = build_manifest(tmp, **manifest_fields, hashes=hashes)
            metadata = read_metadata_safely(tmp / ".metadata")
            problem = check_storage_files(tmp, metadata) or check_files(tmp, manifest)
            if problem is None:
                write_json_atomic(tmp / MANIFEST_NAME, manifest)
                fsync_dir(tmp)
        except (OSError, CheckpointError) as exc:
            problem = f"could not finish {tmp}: {exc}"
    _agree(problem, group)
    save_fault_point("before_publish", rank)
    if rank == 0:
        try:
            _publish(tmp, final)
        except (OSError, CheckpointError) as exc:
            problem = f"could not publish {final}: {exc}"
    _agree(problem, group)


def prepare_save(
    path: str | os.PathLike[str],
    *,
    extra_state: Mapping[str, Any] | None = None,
    json_files: Mapping[str, Any] | None = None,
) -> tuple[Path, Path, dict[str, Any]]:
    """The first part of a save (collective): check the JSON files, make ``<path>.tmp``.

    Returns:
        ``(final folder, tmp folder, {JSON file name: data})``.
    """
    final = Path(path)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank, _ = rank_and_world()
    files = dict(json_files or {})
    if extra_state is not None:
        files[EXTRA_STATE_NAME] = dict(extra_state)
    _check_json_names(files)
    for name, data in files.items():  # on every rank, before anything is written
        try:
            json.dumps(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"checkpoint JSON file {name!r} is not JSON-serialisable: {exc}"
            ) from None
    _agree(_replace_problem(final) if rank == 0 else None)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_fault_point("before_write", rank)
    return final, tmp, files


def write_json_files(tmp: Path, files: Mapping[str, Any]) -> None:
    """Rank 0 writes the JSON files of a save into ``tmp``."""
    if rank_and_world()[0] == 0:
        for name, data in files.items():
            write_json_atomic(tmp / name, data)


def commit_save(
    tmp: Path, final: Path, manifest_fields: dict[str, Any], *, group: Any = None
) -> None:
    """The last part of a save (collective over ``group``), once every rank's
    shards are written: manifest, verification, atomic publish (see [Atomic publish])."""
    rank, _ = rank_and_world()
    barrier(group)  # every rank's shards are on disk
    save_fault_point("after_write", rank)
    _finish_and_publish(tmp, final, manifest_fields, group)
    save_fault_point("after_publish", rank)
    barrier(group)


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    extra_state: Mapping[str, Any] | None = None,
    json_files: Mapping[str, Any] | None = None,
    step: int = 0,
    config_hash: str = "",
    rng: bool = True,
) -> Path:
    """Save ``model`` (and ``optimizer``) to the folder ``path`` atomically.

    Collective: every rank calls it with the same arguments. Each rank writes
    its own shards (torch.distributed.checkpoint); the folder appears under
    its final name only once complete and verified (see [Atomic
    publish]); a process killed at any point leaves at most ``<path>.tmp``
    (and, while replacing an existing checkpoint, ``<path>.replaced.tmp``).

    Args:
        model: any module: a ``simplefsdp.data_parallel`` model, torch FSDP2,
            DDP or a plain module (pass the module, not a ``torch.compile``
            wrapper, whose names carry an ``_orig_mod.`` prefix).
        optimizer: its optimizer, or ``None`` for the model only. Only the
            per-parameter state tensors are saved, not the hyper-parameters.
        path: the checkpoint folder to create (replaced if it is a checkpoint).
        extra_state: JSON-ready data saved as ``extra_state.json`` and
            returned by :func:`load` (step counters, scheduler, data position).
        json_files: more JSON files to add, ``{file name: JSON-ready data}``.
        step: recorded in the manifest.
        config_hash: recorded in the manifest (e.g. a hash of the model config).
        rng: also save every rank's CPU (and CUDA) RNG state.

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: the checkpoint could not be finished or published.
        ValueError: a bad ``json_files`` name.
    """
    final, tmp, files = prepare_save(path, extra_state=extra_state, json_files=json_files)
    state, _ = tensor_state(model, optimizer, rng_device=model_device(model) if rng else None)
    writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
    with _single_process_ok():
        dcp.save(state, storage_writer=writer, no_dist=_no_dist())
    write_json_files(tmp, files)
    commit_save(
        tmp, final, {"step": step, "world_size": rank_and_world()[1], "config_hash": config_hash}
    )
    return final


def verify(path: str | os.PathLike[str], *, check_hashes: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete, undamaged checkpoint; return its manifest.

    Checks the manifest, that every file it lists exists with its size (and,
    with ``check_hashes``, its SHA-256), and that every shard the DCP metadata
    refers to is present and long enough. Collective under a process group
    (the hashing is split over the ranks; rank 0's verdict is used by all).

    Raises:
        CheckpointError: one line naming the file and the problem.
    """
    folder = Path(path)
    problem = manifest_problem(folder)
    manifest = read_manifest(folder) if problem is None else None
    hashes = None
    present = None
    if manifest is not None and check_hashes:
        listed = [e["path"] for e in manifest["files"] if isinstance(e, dict) and "path" in e]
        present = [rel for rel in listed if isinstance(rel, str) and (folder / rel).is_file()]
    # hash_files is collective: every rank takes part, or none, with rank 0's
    # list (a rank whose view of the filesystem lags must not hang the others).
    present = broadcast_from_rank0(present)
    if present is not None:
        hashes = hash_files(folder, present)
    if manifest is not None:
        problem = check_files(folder, manifest, hashes=hashes)
    if problem is None:
        try:
            problem = check_storage_files(folder, read_metadata_safely(folder / ".metadata"))
        except CheckpointError as exc:
            problem = str(exc)
    _agree(problem)
    if manifest is None:  # rank 0 saw a valid manifest, this rank did not
        raise CheckpointError(f"{folder / MANIFEST_NAME} is not readable on this rank")
    return manifest


def _drop_missing_rng(state: dict[str, Any], saved_keys: Any, folder: Path) -> None:
    """Keep the current RNG state on ranks the saving run did not have."""
    rank, _ = rank_and_world()
    if "rng" in state and not any(k.startswith(f"rng.{rng_key(rank)}.") for k in saved_keys):
        logger.warning("%s has no RNG state for rank %d; keeping the current one", folder, rank)
        del state["rng"]


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    rng: bool = True,
    strict: bool = True,
    check_hashes: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``).

    Collective. The model may be laid out differently from the saving run:
    another world size, another data-parallel mode (``replicate``,
    ``fully_shard``, ``hybrid_shard``), torch FSDP2, or a plain module; each
    rank reads just the pieces of its shards (DCP reshards). Nothing in the
    checkpoint is unpickled except DCP's metadata, by a restricted unpickler
    (see [Loading never runs checkpoint code]).

    Args:
        model: the module to load into (built and sharded as for training).
        optimizer: its optimizer (``None``: model only). Its hyper-parameters
            are kept; the per-parameter state (``exp_avg``, ``step``, ...) is
            replaced.
        path: the checkpoint folder.
        rng: restore this rank's RNG states if the checkpoint has them.
        strict: every model/optimizer entry of the checkpoint must be used.
        check_hashes: verify every file's SHA-256 first (reads the whole
            checkpoint once; the work is split over the ranks).

    Returns:
        The ``extra_state`` given to :func:`save` (``{}`` if none).

    Raises:
        CheckpointError: one line naming the file and the mismatch: incomplete
            or damaged checkpoint (missing or truncated file, checksum
            mismatch), or one written for another model (missing or unexpected
            key, different shape).
    """
    folder = Path(path)
    verify(folder, check_hashes=check_hashes)
    reader = SafeFileSystemReader(str(folder))
    metadata = reader.read_metadata()
    state, optim_sd = tensor_state(
        model, optimizer, rng_device=model_device(model) if rng else None
    )
    _drop_missing_rng(state, metadata.state_dict_metadata, folder)
    # Every rank's keys count as loaded (a pipeline stage holds only its own
    # blocks), and any rank's problem stops every rank.
    keys = set().union(*gather_from_all(set(flatten_keys(state))))
    problems = gather_from_all(
        check_state_fits(folder, metadata, state, strict=strict, loaded_keys=keys)
    )
    _agree(next((p for p in problems if p is not None), None))
    with _single_process_ok():
        dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner(), no_dist=_no_dist())
    apply_tensor_state(model, optimizer, state, optim_sd)
    if "rng" in state:
        set_rng_state(state["rng"][rng_key(rank_and_world()[0])], model_device(model))
    extra = folder / EXTRA_STATE_NAME
    return dict(read_json(extra)) if extra.is_file() else {}
