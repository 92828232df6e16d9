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

Modules: :mod:`.schema` (sections, choices, validation), :mod:`.loading`
(TOML layering, overrides, type conversion), :mod:`.output` (dicts, TOML text,
hash). None of them imports torch.
"""

from . import loading, output, schema
from .loading import (
    EXTENDS_KEY,
    apply_dict,
    apply_overrides,
    builtin_configs,
    closest_key,
    config_from_dict,
    load_config,
    parse_overrides,
)
from .output import (
    config_hash,
    config_to_dict,
    format_config,
)
from .schema import (
    AC_MODES,
    BUCKETING_MODES,
    CHECKPOINT_ASYNC_MODES,
    COMPILE_BACKENDS,
    DTYPES,
    ENGINES,
    FLOAT8_RECIPES,
    LOAD_BALANCE_MODES,
    PARALLEL_MODES,
    PP_SCHEDULES,
    SECTIONS,
    VALID_MODELS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    Float8Config,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    config_warnings,
    validate_config,
)
