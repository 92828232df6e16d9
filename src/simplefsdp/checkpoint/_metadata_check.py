"""Checks that a checkpoint's DCP metadata fits the state being loaded into.

DCP's own errors for a wrong model (a missing key, a shape mismatch deep in a
load plan, a truncated shard) are long multi-rank tracebacks. These checks run
before any data is read and name the file and the first mismatch in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from simplefsdp.checkpoint._safe_reader import METADATA_NAME

# Top-level sections whose keys must match exactly under ``strict``; per-rank
# RNG states ("rng") legitimately differ when the world size changes.
STRICT_SECTIONS = ("model", "optim")


def flatten_keys(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": t}}`` -> ``{"a.b": t}``: the keys DCP stores nested dicts under."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_keys(value, name + "."))
        else:
            flat[name] = value
    return flat


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


_SECTION_NAMES = {"model": "model tensor", "optim": "optimizer state", "rng": "RNG state"}


def _describe(key: str) -> str:
    section, _, rest = key.partition(".")
    if section == "optim":
        rest = rest.removeprefix("state.")
    return f"{_SECTION_NAMES.get(section, 'entry')} {rest or key!r}"


def _missing_sections(saved: Any, flat: dict[str, Any]) -> list[str]:
    """Top-level sections of ``flat`` of which the checkpoint holds nothing at all."""
    have = {key.split(".", 1)[0] for key in saved}
    want = sorted({key.split(".", 1)[0] for key in flat})
    return [section for section in want if section not in have]


def state_mismatches(
    metadata: Metadata,
    state: dict[str, Any],
    *,
    strict: bool = True,
    loaded_keys: set[str] | None = None,
) -> list[str]:
    """Every way ``state`` (nested, as given to ``dcp.load``) does not fit ``metadata``.

    A key missing from the checkpoint, a non-tensor entry where a tensor is
    expected, a different global shape, and (``strict``) a model or optimizer
    entry in the checkpoint that no rank loads: ``loaded_keys``, the
    flattened keys of every rank's state (a pipeline stage holds only its
    own blocks), default ``state``'s.
    """
    saved = metadata.state_dict_metadata
    flat = flatten_keys(state)
    absent = _missing_sections(saved, flat)
    problems = [
        f"the checkpoint holds no {_SECTION_NAMES.get(section, section)} at all"
        for section in absent
    ]
    for key, value in flat.items():
        if key.split(".", 1)[0] in absent:
            continue
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{_describe(key)} is not in the checkpoint")
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{_describe(key)} is a pickled object, not a tensor")
        elif _shape(value) is not None and list(meta.size) != _shape(value):
            problems.append(
                f"{_describe(key)} has shape {list(meta.size)} in the checkpoint "
                f"but {_shape(value)} here"
            )
    if strict:
        loaded = flat.keys() if loaded_keys is None else loaded_keys
        extra = sorted(
            k for k in saved if k.split(".", 1)[0] in STRICT_SECTIONS and k not in loaded
        )
        problems += [f"{_describe(k)} is in the checkpoint but not here" for k in extra]
    return problems


def check_state_fits(
    folder: Path,
    metadata: Metadata,
    state: dict[str, Any],
    *,
    strict: bool = True,
    loaded_keys: set[str] | None = None,
) -> str | None:
    """One line naming ``folder``'s metadata and the first mismatch, or ``None``
    (``loaded_keys``: as :func:`state_mismatches`)."""
    problems = state_mismatches(metadata, state, strict=strict, loaded_keys=loaded_keys)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (
        f"{Path(folder) / METADATA_NAME}: {problems[0]}{more}; "
        "was it written for another model config?"
    )


def check_storage_files(folder: Path, metadata: Metadata) -> str | None:
    """Every data file the metadata points to exists and is long enough; else one line."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(info.offset) + int(info.length)
        needed[rel] = max(needed.get(rel, 0), end)
    for rel, end in sorted(needed.items()):
        path = Path(folder) / rel
        if not path.is_file():
            return f"{path} is missing (a shard referenced by {METADATA_NAME})"
        size = path.stat().st_size
        if size < end:
            return f"{path} has {size} bytes but {METADATA_NAME} needs {end} (truncated shard)"
    return None
