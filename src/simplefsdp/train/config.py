"""Typed, layered configuration for ``simplefsdp train``.

The configuration is a tree of dataclasses grouped in sections, in the spirit of
torchtitan's ``JobConfig``::

    JobConfig
    ├── model                  ModelConfig
    ├── data                   DataConfig
    ├── training               TrainingConfig
    ├── parallel               ParallelConfig
    ├── compile                CompileConfig
    ├── activation_checkpoint  ActivationCheckpointConfig
    ├── checkpoint             CheckpointConfig
    └── metrics                MetricsConfig

A job configuration is built in three layers by :func:`load_config`:

1. the dataclass defaults,
2. an optional TOML file (one ``[section]`` table per dataclass; a shipped
   example name such as ``"debug"`` may be given instead of a path),
3. CLI-style dotted overrides such as ``--training.steps 200`` or
   ``--parallel.mode=hybrid_shard``.

Values are converted to the declared field types while the layers are applied
(unknown sections or keys fail immediately, with a "did you mean" suggestion),
and the complete result is validated once at the end by
:func:`validate_config` (enumerations, numeric ranges, cross-field rules), so a
TOML file may for instance be fixed up by a later CLI override.

The dataclasses are plain (mutable) dataclasses: layers are applied in place,
and a trainer may adjust a loaded config by hand. Call :func:`validate_config`
again after such manual edits. All fields have defaults, so every section can
be built with keyword arguments only, e.g. ``TrainingConfig(steps=10)``.

``None`` cannot be written in TOML: an optional field is ``None`` when it is
absent, and the strings ``"none"``, ``"null"`` and ``""`` (any case) also mean
``None`` for optional fields, both in TOML files and on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Union

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 only
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = [
    "VALID_MODELS",
    "ENGINES",
    "PARALLEL_MODES",
    "DTYPES",
    "COMPILE_BACKENDS",
    "BUCKETING_MODES",
    "AC_MODES",
    "ModelConfig",
    "DataConfig",
    "TrainingConfig",
    "ParallelConfig",
    "CompileConfig",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "JobConfig",
    "SECTIONS",
    "builtin_configs",
    "parse_overrides",
    "apply_overrides",
    "apply_dict",
    "config_from_dict",
    "load_config",
    "validate_config",
    "config_to_dict",
    "format_config",
    "config_hash",
]

#: Names of the Llama 3 model configurations ``model.name`` may refer to.
VALID_MODELS: tuple[str, ...] = ("debug", "small", "8B", "70B", "405B")
#: Data-parallel implementations.
ENGINES: tuple[str, ...] = ("simplefsdp", "fsdp2", "ddp")
#: Data-parallel sharding modes.
PARALLEL_MODES: tuple[str, ...] = ("replicate", "fully_shard", "hybrid_shard")
#: Mixed-precision dtypes (``None`` means "keep the parameter dtype").
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: ``torch.compile`` backends.
COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager")
#: Communication bucketing strategies of the compiler passes.
BUCKETING_MODES: tuple[str, ...] = ("auto", "none", "per_block")
#: Activation checkpointing modes.
AC_MODES: tuple[str, ...] = ("none", "full", "selective")

_NONE_STRINGS = frozenset({"none", "null", ""})
_TRUE_STRINGS = frozenset({"true", "1", "yes", "y", "on"})
_FALSE_STRINGS = frozenset({"false", "0", "no", "n", "off"})


def _choices(values: tuple[str, ...], *, optional: bool = False) -> dict[str, Any]:
    """Field metadata declaring the valid values of an enumeration field."""
    return {"choices": values, "optional": optional}


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """Which Llama 3 model to train.

    Attributes:
        name: One of :data:`VALID_MODELS`.
        vocab_size: Overrides the model's vocabulary size (``None``: use the
            tokenizer's / model's own).
        max_seq_len: Overrides the model's maximum sequence length.
    """

    name: str = field(default="debug", metadata=_choices(VALID_MODELS))
    vocab_size: int | None = None
    max_seq_len: int | None = None


@dataclass
class DataConfig:
    """Training data.

    Attributes:
        path: A text file or a folder of text files (read recursively);
            ``None`` uses the embedded corpus (this Python's stdlib sources).
        seq_len: Tokens per training sequence.
        batch_size: Per-rank micro-batch size (sequences).
        val_fraction: Fraction of documents held out for validation, in [0, 1).
        tokenizer: ``"byte"`` or a path to a local ``tokenizer.json`` / Hugging
            Face tokenizer directory.
        num_workers: Loader worker processes. The token loader is in-memory and
            synchronous, so this is accepted for compatibility and unused.
        max_bytes: Cap on the bytes read from the corpus (``None``: 8 MB for
            the embedded stdlib corpus, unlimited for a user ``path``).
    """

    path: str | None = None
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.05
    tokenizer: str = "byte"
    num_workers: int = 0
    max_bytes: int | None = None


@dataclass
class TrainingConfig:
    """Optimisation.

    Attributes:
        steps: Number of optimizer steps.
        lr: Peak learning rate (AdamW).
        min_lr_ratio: Final learning rate of the cosine decay, as a fraction of ``lr``.
        warmup_steps: Linear warm-up steps.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_norm: Gradient-norm clipping threshold; ``0`` disables clipping.
        grad_accum_steps: Micro-batches accumulated per optimizer step.
        seed: Seed for model initialisation and data order.
        deterministic: Request deterministic algorithms from PyTorch.
    """

    steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_norm: float = 1.0
    grad_accum_steps: int = 1
    seed: int = 0
    deterministic: bool = False


@dataclass
class ParallelConfig:
    """Data parallelism.

    Attributes:
        engine: One of :data:`ENGINES`.
        mode: One of :data:`PARALLEL_MODES` (``ddp`` supports ``replicate`` only).
        mesh_shape: ``[replicate, shard]`` sizes for ``hybrid_shard``
            (``None``: chosen by the trainer).
        reshard_after_forward: Free gathered parameters after the forward pass.
        param_dtype: Compute dtype of parameters (``None``: unchanged).
        reduce_dtype: Gradient reduction dtype (``None``: the ``param_dtype``).
    """

    engine: str = field(default="simplefsdp", metadata=_choices(ENGINES))
    mode: str = field(default="fully_shard", metadata=_choices(PARALLEL_MODES))
    mesh_shape: list[int] | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = field(default=None, metadata=_choices(DTYPES, optional=True))
    reduce_dtype: str | None = field(default=None, metadata=_choices(DTYPES, optional=True))


@dataclass
class CompileConfig:
    """``torch.compile``.

    Attributes:
        enable: Compile the model.
        backend: One of :data:`COMPILE_BACKENDS`.
        bucketing: One of :data:`BUCKETING_MODES`.
    """

    enable: bool = True
    backend: str = field(default="inductor", metadata=_choices(COMPILE_BACKENDS))
    bucketing: str = field(default="auto", metadata=_choices(BUCKETING_MODES))


@dataclass
class ActivationCheckpointConfig:
    """Activation checkpointing.

    Attributes:
        mode: One of :data:`AC_MODES`.
    """

    mode: str = field(default="none", metadata=_choices(AC_MODES))


@dataclass
class CheckpointConfig:
    """Distributed checkpoints.

    Attributes:
        enable: Save checkpoints.
        folder: Checkpoint folder.
        interval: Save every ``interval`` steps.
        keep_last: Number of most recent checkpoints kept.
        resume: Resume from the latest checkpoint in ``folder``.
    """

    enable: bool = True
    folder: str = "outputs/checkpoints"
    interval: int = 100
    keep_last: int = 3
    resume: bool = False


@dataclass
class MetricsConfig:
    """Logging and validation.

    Attributes:
        log_interval: Log training metrics every ``log_interval`` steps.
        output_dir: Folder for logs, metrics and TensorBoard events.
        tensorboard: Write TensorBoard events.
        val_interval: Validate every ``val_interval`` steps (``0`` disables).
        val_batches: Validation batches per evaluation.
    """

    log_interval: int = 10
    output_dir: str = "outputs"
    tensorboard: bool = False
    val_interval: int = 100
    val_batches: int = 10


@dataclass
class JobConfig:
    """The complete configuration of a training job (one attribute per section)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


#: Section name -> section dataclass, in display order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]

_BUILTIN_PACKAGE = "simplefsdp.train"
_BUILTIN_DIR = "configs"


# --------------------------------------------------------------------------- helpers


def _field_types(section_cls: type) -> dict[str, Any]:
    """Resolved type hints of a section dataclass."""
    return typing.get_type_hints(section_cls)


def _section_keys(section: str) -> list[str]:
    """Field names of ``section``."""
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _suggest(name: str, candidates: list[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_section(section: str) -> None:
    """Raise ``ValueError`` if ``section`` is not a config section."""
    if section not in SECTIONS:
        valid = list(SECTIONS)
        hint = _suggest(section, valid)
        owners = [s for s in SECTIONS if section in _section_keys(s)]
        if not hint and owners:
            hint = f" {section!r} is a key of section {owners[0]!r}."
        raise ValueError(f"unknown config section {section!r}.{hint} Valid sections: {valid}")


def _check_key(section: str, key: str) -> None:
    """Raise ``ValueError`` if ``key`` is not a field of ``section``."""
    _check_section(section)
    keys = _section_keys(section)
    if key not in keys:
        hint = _suggest(key, keys)
        if not hint:
            owners = [s for s in SECTIONS if s != section and key in _section_keys(s)]
            if owners:
                hint = f" Did you mean '{owners[0]}.{key}'?"
        raise ValueError(
            f"unknown config key {key!r} in section [{section}].{hint} Valid keys of [{section}]: {keys}"
        )


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """Return ``(True, inner)`` for ``X | None`` and ``(False, tp)`` otherwise."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    """Readable name of a field type."""
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
        args = typing.get_args(tp)
        items = _parse_sequence(value, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise ValueError(f"{where}: expected {len(args)} values, got {len(items)}: {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(items, args)))
    raise TypeError(f"{where}: unsupported config field type {tp!r}")  # pragma: no cover


def _set_value(cfg: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    """Check ``section.key``, convert ``value`` to the field type and assign it."""
    _check_key(section, key)
    tp = _field_types(SECTIONS[section])[key]
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
            owners = [s for s in SECTIONS if key in _section_keys(s)]
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
        _check_key(section, key)
        tp = _field_types(SECTIONS[section])[key]
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


# --------------------------------------------------------------------------- validation


def validate_config(cfg: JobConfig) -> None:
    """Check enumerations, numeric ranges and cross-field rules of ``cfg``.

    All problems are collected and reported together.

    Raises:
        ValueError: one line per problem, each naming the field, the bad value
            and the valid choices or range.
    """
    errors: list[str] = []

    # Enumerations (declared in the field metadata).
    for section, cls in SECTIONS.items():
        sec = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            if choices is None:
                continue
            value = getattr(sec, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            if value not in choices:
                valid = list(choices) + (["none"] if f.metadata.get("optional") else [])
                hint = _suggest(str(value), list(choices))
                errors.append(
                    f"{section}.{f.name}: invalid value {value!r}; valid choices: {valid}.{hint}"
                )

    def check(ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            errors.append(f"{name}: invalid value {value!r}; must be {rule}")

    def finite(x: float) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    m, d, t, p = cfg.model, cfg.data, cfg.training, cfg.parallel
    ck, mt = cfg.checkpoint, cfg.metrics
    check(m.vocab_size is None or m.vocab_size >= 1, "model.vocab_size", m.vocab_size, ">= 1")
    check(m.max_seq_len is None or m.max_seq_len >= 1, "model.max_seq_len", m.max_seq_len, ">= 1")

    check(d.seq_len > 0, "data.seq_len", d.seq_len, "> 0")
    check(d.batch_size > 0, "data.batch_size", d.batch_size, "> 0")
    check(
        finite(d.val_fraction) and 0.0 <= d.val_fraction < 1.0,
        "data.val_fraction",
        d.val_fraction,
        "in [0, 1)",
    )
    check(bool(d.tokenizer.strip()), "data.tokenizer", d.tokenizer, "'byte' or a tokenizer path")
    check(d.num_workers >= 0, "data.num_workers", d.num_workers, ">= 0")
    check(d.max_bytes is None or d.max_bytes > 0, "data.max_bytes", d.max_bytes, "> 0 or none")
    if m.max_seq_len is not None and d.seq_len > m.max_seq_len:
        errors.append(
            f"data.seq_len: invalid value {d.seq_len!r}; must be <= model.max_seq_len ({m.max_seq_len})"
        )

    check(t.steps > 0, "training.steps", t.steps, "> 0")
    check(finite(t.lr) and t.lr > 0, "training.lr", t.lr, "> 0")
    check(
        finite(t.min_lr_ratio) and 0.0 <= t.min_lr_ratio <= 1.0,
        "training.min_lr_ratio",
        t.min_lr_ratio,
        "in [0, 1]",
    )
    check(t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, ">= 0")
    check(
        finite(t.weight_decay) and t.weight_decay >= 0,
        "training.weight_decay",
        t.weight_decay,
        ">= 0",
    )
    check(
        all(finite(b) and 0.0 <= b < 1.0 for b in t.betas),
        "training.betas",
        t.betas,
        "two values in [0, 1)",
    )
    check(finite(t.max_norm) and t.max_norm >= 0, "training.max_norm", t.max_norm, ">= 0")
    check(t.grad_accum_steps >= 1, "training.grad_accum_steps", t.grad_accum_steps, ">= 1")
    check(t.seed >= 0, "training.seed", t.seed, ">= 0")

    check(
        p.mesh_shape is None or (len(p.mesh_shape) == 2 and all(x > 0 for x in p.mesh_shape)),
        "parallel.mesh_shape",
        p.mesh_shape,
        "two positive ints, e.g. [2, 2]",
    )
    if p.engine == "ddp" and p.mode != "replicate":
        errors.append(
            f"parallel.mode: invalid value {p.mode!r} for engine 'ddp'; valid choices: ['replicate']"
        )
    if p.mesh_shape is not None and p.mode != "hybrid_shard":
        logger.warning(
            "parallel.mesh_shape=%s is only used by mode 'hybrid_shard' (mode is %r)",
            p.mesh_shape,
            p.mode,
        )

    check(ck.interval >= 1, "checkpoint.interval", ck.interval, ">= 1")
    check(ck.keep_last >= 1, "checkpoint.keep_last", ck.keep_last, ">= 1")
    check(bool(ck.folder.strip()), "checkpoint.folder", ck.folder, "a non-empty path")

    check(mt.log_interval >= 1, "metrics.log_interval", mt.log_interval, ">= 1")
    check(mt.val_interval >= 0, "metrics.val_interval", mt.val_interval, ">= 0 (0 disables)")
    check(mt.val_batches >= 0, "metrics.val_batches", mt.val_batches, ">= 0")
    check(bool(mt.output_dir.strip()), "metrics.output_dir", mt.output_dir, "a non-empty path")

    if errors:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(errors))


# --------------------------------------------------------------------------- output


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
