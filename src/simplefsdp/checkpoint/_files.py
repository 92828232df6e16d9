"""Checkpoint files on disk: atomic JSON, the manifest, sizes and checksums.

See [Checkpoint folder] in :mod:`simplefsdp.checkpoint` for the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
TMP_SUFFIX = ".tmp"
_MANIFEST_KEYS = {"format": int, "step": int, "world_size": int, "config_hash": str, "files": list}


class CheckpointError(ValueError):
    """A checkpoint is incomplete, damaged or does not fit the model.

    The message is one line naming the offending file and the mismatch.
    """


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new files, renames) to disk where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not supported for folders on some platforms/filesystems
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """Parse the JSON file ``path``.

    Raises:
        CheckpointError: the file is missing or not valid JSON.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({reason})") from None


def payload_files(folder: Path) -> list[str]:
    """Relative paths of every file in ``folder`` but the manifest, sorted."""
    rels = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(rel for rel in rels if rel != MANIFEST_NAME)


def hash_files(folder: Path, rel_paths: list[str], group: Any = None) -> dict[str, str]:
    """SHA-256 of each file, the work split over the ranks when a process group is up.

    Collective when ``torch.distributed`` is initialised (every rank must call it
    with the same list); rank ``r`` hashes files ``r, r + W, ...`` and the
    digests are exchanged with ``all_gather_object``, so every rank returns all.
    Assumes every rank sees ``folder`` (a shared filesystem, as DCP needs).
    ``group``: the process group to use (default: the default group).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return {rel: sha256_file(folder / rel) for rel in rel_paths}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {rel: sha256_file(folder / rel) for rel in rel_paths[rank::world]}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return {rel: digest for part in gathered for rel, digest in part.items()}


def build_manifest(
    folder: Path,
    *,
    step: int,
    world_size: int,
    config_hash: str,
    hashes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest of the files now in ``folder`` (every file but the manifest).

    Args:
        folder: the checkpoint folder.
        step: training step recorded in the manifest.
        world_size: number of ranks that wrote the checkpoint.
        config_hash: hash of the model/parallel configuration ("" if none).
        hashes: precomputed ``{relative path: sha256}`` (see :func:`hash_files`);
            files missing from it are hashed here.
    """
    hashes = hashes or {}
    files = []
    for rel in payload_files(folder):
        path = folder / rel
        digest = hashes.get(rel) or sha256_file(path)
        files.append({"path": rel, "size": path.stat().st_size, "sha256": digest})
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
        data = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            return None
    return data


def manifest_problem(folder: Path) -> str | None:
    """Why ``folder``'s manifest is unusable (missing, unparsable, malformed), or ``None``."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return f"{path} is missing (not a complete checkpoint)"
    if read_manifest(folder) is None:
        return f"{path} is not a valid manifest (unparsable or missing fields)"
    return None


def check_files(
    folder: Path, manifest: dict[str, Any], *, hashes: dict[str, str] | None = None
) -> str | None:
    """Check ``folder`` against ``manifest``; the first problem as one line, or ``None``.

    Every listed file must exist with the listed size; with ``hashes`` (actual
    SHA-256 by relative path) also with the listed checksum.
    """
    if not manifest["files"]:
        return f"{folder / MANIFEST_NAME} lists no files"
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            return f"{folder / MANIFEST_NAME} has a malformed file entry {entry!r}"
        path = folder / entry["path"]
        if not path.is_file():
            return f"{path} is missing (listed in {MANIFEST_NAME}; missing shard?)"
        size = path.stat().st_size
        if size != entry.get("size"):
            return (
                f"{path} has {size} bytes but {MANIFEST_NAME} lists {entry.get('size')} "
                "(truncated or overwritten)"
            )
        if hashes is not None and hashes.get(entry["path"]) != entry.get("sha256"):
            return f"{path} does not match its sha256 in {MANIFEST_NAME} (corrupted)"
    return None


def gather_from_all(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def broadcast_from_rank0(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group).

    Used so that every rank takes the same decision about shared files, even
    if the ranks' views of the filesystem differ for a moment.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
