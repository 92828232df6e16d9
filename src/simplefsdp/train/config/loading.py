"""Building a job config in layers: defaults, a TOML file, then CLI-style overrides.

Note: [What a TOML file builds on]
    A TOML file names what it builds on with a top-level ``extends`` key: a
    shipped config name (``extends = "debug"``) or another TOML file (a path
    relative to the extending file), which may itself extend another. Without
    ``extends`` (or with ``extends = "defaults"``) a file builds on the
    built-in defaults of the dataclasses, not on any shipped config:
    ``[model] name = "debug"`` picks the debug *model* only, and a file that
    sets a shipped config's model name without ``extends`` gets a one-line
    note saying so (:func:`load_config`'s ``notes``).

Values are converted to the declared field types while the layers are applied
(unknown sections or keys fail immediately, with a "did you mean" suggestion);
:func:`load_config` validates the complete result once at the end, so a TOML
file may be fixed up by a later override.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Union

from .output import config_to_dict
from .schema import SECTIONS, JobConfig, suggest, validate_config

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 only
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


_BUILTIN_PACKAGE = "simplefsdp.train"
_BUILTIN_DIR = "presets"
#: The top-level TOML key naming what a file builds on (see [What a TOML file builds on]).
EXTENDS_KEY = "extends"
_DEFAULTS_NAME = "defaults"

#: Names other trainers (torchtitan, Hugging Face) use -> this config's ``section.key``.
_KEY_ALIASES: dict[str, str] = {
    "learning_rate": "training.lr",
    "max_lr": "training.lr",
    "warmup": "training.warmup_steps",
    "num_warmup_steps": "training.warmup_steps",
    "max_steps": "training.steps",
    "num_steps": "training.steps",
    "total_steps": "training.steps",
    "train_steps": "training.steps",
    "max_grad_norm": "training.max_norm",
    "grad_clip": "training.max_norm",
    "clip_grad_norm": "training.max_norm",
    "gradient_accumulation_steps": "training.grad_accum_steps",
    "local_batch_size": "data.batch_size",
    "micro_batch_size": "data.batch_size",
    "per_device_train_batch_size": "data.batch_size",
    "seq_length": "data.seq_len",
    "sequence_length": "data.seq_len",
    "max_seq_length": "data.seq_len",
    "dataset": "data.path",
    "dataset_path": "data.path",
    "data_path": "data.path",
    "tensor_parallel_degree": "parallel.tp",
    "pipeline_parallel_degree": "parallel.pp",
    "flavor": "model.name",
    "save_interval": "checkpoint.interval",
    "keep_latest_k": "checkpoint.keep_last",
    "enable_tensorboard": "metrics.tensorboard",
    "save_tb_folder": "metrics.output_dir",
}
#: Section names of other trainers -> this config's section.
_SECTION_ALIASES: dict[str, str] = {
    "optimizer": "training",
    "lr_scheduler": "training",
    "parallelism": "parallel",
    "job": "metrics",
    "activation_checkpointing": "activation_checkpoint",
    "dataset": "data",
}

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


def closest_key(name: str) -> str | None:
    """The ``section.key`` a bare key ``name`` most likely means, or ``None``.

    A field of that name in some section, a name other trainers use (e.g.
    ``learning_rate`` -> ``training.lr``), or the closest field name.
    """
    name = name.replace("-", "_")
    owners = _sections_with_key(name)
    if owners:
        return f"{owners[0]}.{name}"
    if name in _KEY_ALIASES:
        return _KEY_ALIASES[name]
    dotted = {f"{s}.{k}": k for s in SECTIONS for k in _section_keys(s)}
    close = difflib.get_close_matches(name, list(dotted.values()), n=1, cutoff=0.75)
    return next((d for d, k in dotted.items() if close and k == close[0]), None)


def _check_section(section: str) -> None:
    """Raise ``ValueError`` if ``section`` is not a config section."""
    if section not in SECTIONS:
        valid = list(SECTIONS)
        hint = suggest(section, valid)
        owners = _sections_with_key(section)
        if not hint and owners:
            hint = f" {section!r} is a key of section {owners[0]!r}."
        if not hint and section in _SECTION_ALIASES:
            hint = f" Did you mean {_SECTION_ALIASES[section]!r}?"
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
        hint = ""
        if key in _KEY_ALIASES:  # another trainer's name for a field
            alias_section, alias_key = _KEY_ALIASES[key].split(".")
            target = alias_key if alias_section == section else f"{alias_section}.{alias_key}"
            hint = f" Did you mean {target!r}?"
        hint = hint or suggest(key, keys)
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
            close = closest_key(key) if "." not in key else None
            hint = f" Did you mean '--{close}'?" if close else ""
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


def _read_config_text(path: str, relative_to: Path | None = None) -> tuple[str, str, Path | None]:
    """``(toml_text, source_label, file)`` for a file path or a built-in config name.

    ``file`` is ``None`` for a built-in config; a relative path is looked up
    in ``relative_to`` first (the folder of an extending file).
    """
    raw = Path(path).expanduser()
    candidates = [raw] if relative_to is None or raw.is_absolute() else [relative_to / raw, raw]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8"), str(candidate), candidate
    name = path[: -len(".toml")] if path.endswith(".toml") else path
    if "/" not in name and name in builtin_configs():
        res = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_DIR, f"{name}.toml")
        return res.read_text(encoding="utf-8"), f"<builtin {name}.toml>", None
    raise FileNotFoundError(
        f"config file {path!r} not found (and it is not a built-in config; "
        f"built-in configs: {builtin_configs()})"
    )


def _config_layers(
    path: str, notes: list[str], *, relative_to: Path | None = None, chain: tuple[str, ...] = ()
) -> list[tuple[dict[str, Any], str]]:
    """The TOML tables of ``path`` and of what it extends, base first, with their labels.

    See [What a TOML file builds on].
    """
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise ValueError(
            f"cannot read config {path!r}: reading TOML needs Python >= 3.11 "
            "(tomllib) or the 'tomli' package (pip install tomli)"
        )
    text, label, file = _read_config_text(path, relative_to)
    if label in chain:
        raise ValueError(f"{label}: 'extends' loops back to itself: {' -> '.join([*chain, label])}")
    try:
        data = _toml.loads(text)
    except _toml.TOMLDecodeError as exc:
        raise ValueError(f"{label}: invalid TOML: {exc}") from exc
    base = data.pop(EXTENDS_KEY, None)
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise ValueError(
            f"{label}: {EXTENDS_KEY} = {base!r} must be a shipped config name "
            f"({', '.join(builtin_configs())}), a TOML path or {_DEFAULTS_NAME!r}"
        )
    if base is None or base == _DEFAULTS_NAME:
        if base is None and file is not None:
            note = _preset_note(data, label)
            if note is not None:
                notes.append(note)
        return [(data, label)]
    parent = _config_layers(
        base, notes, relative_to=None if file is None else file.parent, chain=(*chain, label)
    )
    return [*parent, (data, label)]


def _preset_note(data: dict[str, Any], label: str) -> str | None:
    """The note for a file without ``extends`` that names a shipped config's model
    and would differ from that config where it leaves values out, else ``None``."""
    model = data.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if name not in builtin_configs():
        return None
    try:
        on_defaults = config_to_dict(apply_dict(JobConfig(), data))
        on_preset = config_to_dict(apply_dict(load_config(name), data))
    except ValueError:  # reported when the file is applied
        return None
    differ = [
        f"{section}.{key}"
        for section, values in on_defaults.items()
        for key, value in values.items()
        if on_preset[section][key] != value
    ]
    if not differ:  # the file sets everything the preset would
        return None
    shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    return (
        f"{label} sets model.name = {name!r} but has no '{EXTENDS_KEY}': it builds on the "
        f"built-in defaults, which differ from the {name!r} config in {shown}; add "
        f'{EXTENDS_KEY} = "{name}" at its top to build on that config (or '
        f'{EXTENDS_KEY} = "{_DEFAULTS_NAME}" to keep the defaults without this note)'
    )


def load_config(
    path: str | None = None,
    overrides: list[str] | None = None,
    *,
    notes: list[str] | None = None,
) -> JobConfig:
    """Build a job configuration: defaults, then a TOML file, then CLI overrides.

    Args:
        path: A TOML file, the name of a shipped example (see
            :func:`builtin_configs`; an existing file of the same name takes
            precedence), or ``None`` for defaults only. A file may build on
            another with ``extends`` (see [What a TOML file builds on]).
        overrides: CLI-style tokens, e.g.
            ``["--training.steps", "200", "--parallel.mode=hybrid_shard", "--compile.enable", "false"]``.
        notes: If given, one-line notes about the file are appended (e.g. a
            file naming a shipped config's model without extending it).

    Returns:
        The validated configuration.

    Raises:
        FileNotFoundError: ``path`` (or what it extends) is neither a file nor
            a built-in config.
        ValueError: invalid TOML, unknown section/key, unconvertible value, a
            bad or circular ``extends``, or a value rejected by
            :func:`validate_config`.
    """
    cfg = JobConfig()
    if path is not None:
        for data, label in _config_layers(path, [] if notes is None else notes):
            apply_dict(cfg, data, source=f"{label}: ")
            logger.debug("applied config file %s", label)
    if overrides:
        apply_overrides(cfg, list(overrides))
    validate_config(cfg)
    return cfg
