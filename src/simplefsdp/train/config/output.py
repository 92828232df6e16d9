"""Rendering a job config: plain dicts, TOML text (``--print-config``) and a stable hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from .schema import SECTIONS, JobConfig


def _plain(value: Any) -> Any:
    """Tuples to lists, recursively (JSON/TOML friendly)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Return ``cfg`` as ``{section: {key: value}}`` of plain JSON-friendly values.

    Tuples become lists and ``None`` stays ``None``; :func:`config_from_dict`
    is the inverse.
    """
    return {name: _plain(dataclasses.asdict(getattr(cfg, name))) for name in SECTIONS}


def _toml_value(value: Any) -> str:
    """Render a config value as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML; TOML also forbids a raw DEL character.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")  # pragma: no cover


def format_config(cfg: JobConfig) -> str:
    """Render ``cfg`` as TOML text (for ``--print-config``).

    Unset optional values (``None``) are written as comments, since TOML has no
    null. Parsing the output with ``tomllib`` and passing it to
    :func:`config_from_dict` gives back an equal configuration.
    """
    lines = [f"# simplefsdp job config (hash {config_hash(cfg)[:12]})"]
    for section, values in config_to_dict(cfg).items():
        lines.append("")
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


#: Sections that determine the model/state layout and therefore enter :func:`config_hash`.
_HASHED_SECTIONS = ("model", "parallel")


def config_hash(cfg: JobConfig) -> str:
    """Stable SHA-256 hex digest of the model- and parallelism-relevant settings.

    The hash covers the ``model`` and ``parallel`` sections and
    ``data.tokenizer`` (which fixes the vocabulary); it ignores everything that
    does not change the model or its sharding (steps, learning rate, logging,
    compile options, ...). It is meant for checkpoint manifests: a checkpoint
    written under a different hash was produced by a different model setup.
    """
    d = config_to_dict(cfg)
    payload = {name: d[name] for name in _HASHED_SECTIONS}
    payload["tokenizer"] = cfg.data.tokenizer
    payload["format"] = 1
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
