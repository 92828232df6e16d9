"""Building a job config in layers: defaults, a TOML file, then CLI-style overrides.

Values are converted to the declared field types while the layers are applied
(unknown sections or keys fail immediately, with a "did you mean" suggestion);
:func:`load_config` validates the complete result once at the end, so a TOML
file may be fixed up by a later override.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Union

from .schema import SECTIONS, JobConfig, suggest, validate_config

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 only
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = [
    "builtin_configs",
    "parse_overrides",
    "apply_overrides",
    "apply_dict",
    "config_from_dict",
    "load_config",
]

_BUILTIN_PACKAGE = "simplefsdp.train"
_BUILTIN_DIR = "presets"

_NONE_STRINGS = frozenset({"none", "null", ""})
_TRUE_STRINGS = frozenset({"true", "1", "yes", "y", "on"})
_FALSE_STRINGS = frozenset({"false", "0", "no", "n", "off"})


# --------------------------------------------------------------------------- keys


@functools.cache
def _field_types(section: str) -> dict[str, Any]:
    """Field name -> resolved type of the dataclass of ``section``."""
    return typing.get_type_hints(SECTIONS[section])


def _section_keys(section: str) -> list[str]:
    """Field names of ``section``."""
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _sections_with_key(key: str, exclude: str | None = None) -> list[str]:
    """Sections (other than ``exclude``) that have a field named ``key``."""
    return [s for s in SECTIONS if s != exclude and key in _section_keys(s)]


def _check_section(section: str) -> None:
    """Raise ``ValueError`` if ``section`` is not a config section."""
    if section not in SECTIONS:
        valid = list(SECTIONS)
        hint = suggest(section, valid)
        owners = _sections_with_key(section)
        if not hint and owners:
            hint = f" {section!r} is a key of section {owners[0]!r}."
        raise ValueError(f"unknown config section {section!r}.{hint} Valid sections: {valid}")


def _field_type(section: str, key: str) -> Any:
    """The declared type of ``section.key``.

    Raises:
        ValueError: unknown section or key, with a suggestion and the valid names.
    """
    _check_section(section)
    field_types = _field_types(section)
    if key not in field_types:
        keys = _section_keys(section)
        hint = suggest(key, keys)
        if not hint:
            owners = _sections_with_key(key, exclude=section)
            if owners:
                hint = f" Did you mean '{owners[0]}.{key}'?"
        raise ValueError(
            f"unknown config key {key!r} in section [{section}].{hint} Valid keys of [{section}]: {keys}"
        )
    return field_types[key]


# --------------------------------------------------------------------------- conversion


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """Return ``(True, inner)`` for ``X | None`` and ``(False, tp)`` otherwise."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    """Readable name of a field type (a ``Literal`` of choices is a ``str``)."""
    if typing.get_origin(tp) is typing.Literal:
        return "str"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _parse_sequence(value: Any, where: str) -> list[Any]:
    """Turn a list/tuple or a string like ``"2,2"``, ``"[2, 2]"`` or ``"(0.9, 0.95)"`` into a list."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if len(text) >= 2 and (text[0], text[-1]) in {("[", "]"), ("(", ")")}:
            text = text[1:-1]
        parts = [p.strip() for p in text.split(",")]
        if parts and parts[-1] == "":  # tolerate a trailing comma
            parts = parts[:-1]
        if any(p == "" for p in parts):
            raise ValueError(f"{where}: cannot parse {value!r} as a comma-separated list")
        return parts
    raise ValueError(f"{where}: expected a list, got {type(value).__name__} {value!r}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (a CLI string or a TOML-native value) to the field type ``tp``.

    Raises:
        ValueError: naming ``where`` and the bad value when it cannot be converted.
    """
    optional, inner = _is_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS):
            return None
        return _coerce(value, inner, where)
    if value is None:
        raise ValueError(f"{where}: None is not allowed (expected {_type_name(tp)})")

    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # a choice: a string here, its value checked by validate_config
        tp = origin = str
    if (origin is Union or origin is types.UnionType) and set(typing.get_args(tp)) == {bool, int}:
        # bool | int (parallel.reshard_after_forward): true/false, else a number
        if isinstance(value, (bool, int)):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS | _FALSE_STRINGS:
            return _coerce(value, bool, where)
        try:
            return _coerce(value, int, where)
        except ValueError:
            raise ValueError(
                f"{where}: cannot parse {value!r} as a bool or an int (true/false, or a group size)"
            ) from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE_STRINGS:
                return True
            if low in _FALSE_STRINGS:
                return False
        raise ValueError(
            f"{where}: cannot parse {value!r} as bool (use one of true/false, 1/0, yes/no)"
        )
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected int, got bool {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where}: cannot parse {value!r} as int")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected float, got bool {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where}: cannot parse {value!r} as float")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    if origin is list:
        (elem,) = typing.get_args(tp)
        items = _parse_sequence(value, where)
        return [_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(items)]
    if origin is tuple:
        args = typing.get_args(tp)  # fixed-length tuples only, e.g. tuple[float, float]
        items = _parse_sequence(value, where)
        if len(items) != len(args):
            raise ValueError(f"{where}: expected {len(args)} values, got {len(items)}: {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(items, args)))
    raise TypeError(f"{where}: unsupported config field type {tp!r}")  # pragma: no cover


def _set_value(cfg: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    """Check ``section.key``, convert ``value`` to the field type and assign it."""
    tp = _field_type(section, key)
    setattr(getattr(cfg, section), key, _coerce(value, tp, f"{source}{section}.{key}"))


# --------------------------------------------------------------------------- layers


def parse_overrides(argv: list[str]) -> list[tuple[str, str | None]]:
    """Split CLI-style override tokens into ``(dotted_key, raw_value)`` pairs.

    Accepted forms are ``--section.key value`` and ``--section.key=value``. A
    flag followed by another ``--`` token (or by nothing) is a bare flag and
    gets ``raw_value=None`` (meaning ``true`` for a boolean field). Dashes in
    key names are read as underscores (``--training.grad-accum-steps``).

    Args:
        argv: The tokens, e.g. ``["--training.steps", "200", "--compile.enable"]``.

    Returns:
        ``[("training.steps", "200"), ("compile.enable", None)]`` for that example.

    Raises:
        ValueError: for a token that does not start with ``--`` or a key that is
            not of the form ``section.key``.
    """
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(
                f"unexpected argument {token!r}: overrides look like "
                "'--section.key value' or '--section.key=value'"
            )
        body = token[2:]
        raw: str | None
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, raw = body, argv[i + 1]
            i += 2
        else:
            key, raw = body, None
            i += 1
        key = key.replace("-", "_")
        if key.count(".") != 1 or not all(key.split(".")):
            owners = _sections_with_key(key)
            hint = f" Did you mean '--{owners[0]}.{key}'?" if owners else ""
            raise ValueError(
                f"bad override key {token!r}: expected '--section.key' "
                f"with a section among {list(SECTIONS)}.{hint}"
            )
        pairs.append((key, raw))
    return pairs


def apply_overrides(cfg: JobConfig, argv: list[str]) -> JobConfig:
    """Apply CLI-style dotted overrides to ``cfg`` in place (no range validation).

    Args:
        cfg: The configuration to update.
        argv: Override tokens, see :func:`parse_overrides`.

    Returns:
        ``cfg``, for chaining.

    Raises:
        ValueError: unknown section/key (with a suggestion), a value that cannot
            be converted to the field type, or a bare flag for a non-boolean field.
    """
    for dotted, raw in parse_overrides(argv):
        section, key = dotted.split(".")
        tp = _field_type(section, key)
        if raw is None:
            if tp is not bool:
                raise ValueError(
                    f"--{dotted} needs a value (field type {_type_name(tp)}; "
                    "only boolean flags may be given without a value)"
                )
            raw = "true"
        _set_value(cfg, section, key, raw, "--")
    return cfg


def apply_dict(cfg: JobConfig, data: dict[str, Any], source: str = "") -> JobConfig:
    """Apply a ``{section: {key: value}}`` mapping (e.g. parsed TOML) to ``cfg`` in place.

    Args:
        cfg: The configuration to update.
        data: Section tables; values may be native (TOML) values or strings.
        source: Prefix for error messages, e.g. ``"config.toml: "``.

    Returns:
        ``cfg``, for chaining.

    Raises:
        ValueError: unknown section/key (with a suggestion), a top-level value
            that is not a table, or a value of the wrong type.
    """
    for section, table in data.items():
        _check_section(section)
        if not isinstance(table, dict):
            raise ValueError(
                f"{source}{section!r} must be a table ([{section}]), got {type(table).__name__}"
            )
        for key, value in table.items():
            _set_value(cfg, section, key, value, source)
    return cfg


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build and validate a :class:`JobConfig` from defaults plus a section mapping.

    This is the inverse of :func:`config_to_dict`.

    Args:
        data: ``{section: {key: value}}``; missing sections/keys keep their defaults.

    Returns:
        The validated configuration.
    """
    cfg = apply_dict(JobConfig(), data)
    validate_config(cfg)
    return cfg


def builtin_configs() -> list[str]:
    """Names of the example configs shipped with the package (e.g. ``"debug"``)."""
    folder = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_DIR)
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def _read_config_text(path: str) -> tuple[str, str]:
    """Return ``(toml_text, source_label)`` for a file path or a built-in config name."""
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return candidate.read_text(encoding="utf-8"), str(candidate)
    name = path[: -len(".toml")] if path.endswith(".toml") else path
    if "/" not in name and name in builtin_configs():
        res = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_DIR, f"{name}.toml")
        return res.read_text(encoding="utf-8"), f"<builtin {name}.toml>"
    raise FileNotFoundError(
        f"config file {path!r} not found (and it is not a built-in config; "
        f"built-in configs: {builtin_configs()})"
    )


def load_config(path: str | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build a job configuration: defaults, then a TOML file, then CLI overrides.

    Args:
        path: A TOML file, the name of a shipped example (see
            :func:`builtin_configs`; an existing file of the same name takes
            precedence), or ``None`` for defaults only.
        overrides: CLI-style tokens, e.g.
            ``["--training.steps", "200", "--parallel.mode=hybrid_shard", "--compile.enable", "false"]``.

    Returns:
        The validated configuration.

    Raises:
        FileNotFoundError: ``path`` is neither a file nor a built-in config.
        ValueError: invalid TOML, unknown section/key, unconvertible value, or a
            value rejected by :func:`validate_config`.
    """
    cfg = JobConfig()
    if path is not None:
        if _toml is None:  # pragma: no cover - Python 3.10 without tomli
            raise ValueError(
                f"cannot read config {path!r}: reading TOML needs Python >= 3.11 "
                "(tomllib) or the 'tomli' package (pip install tomli)"
            )
        text, label = _read_config_text(path)
        try:
            data = _toml.loads(text)
        except _toml.TOMLDecodeError as exc:
            raise ValueError(f"{label}: invalid TOML: {exc}") from exc
        apply_dict(cfg, data, source=f"{label}: ")
        logger.debug("applied config file %s", label)
    if overrides:
        apply_overrides(cfg, list(overrides))
    validate_config(cfg)
    return cfg
