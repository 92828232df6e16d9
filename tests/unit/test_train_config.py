"""Tests for simplefsdp.train.config: defaults, layering, conversion, validation, output."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simplefsdp.train import config as C
from simplefsdp.train.config import (
    JobConfig,
    apply_overrides,
    builtin_configs,
    config_from_dict,
    config_hash,
    config_to_dict,
    format_config,
    load_config,
    parse_overrides,
    validate_config,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: config.py reads TOML with tomli
    tomllib = pytest.importorskip("tomli")


def _write(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- defaults


def test_defaults():
    cfg = load_config(None, [])
    assert cfg == JobConfig()
    assert cfg.model.name == "debug"
    assert cfg.model.vocab_size is None and cfg.model.max_seq_len is None
    assert cfg.data.path is None
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.data.val_fraction) == (128, 8, 0.05)
    assert cfg.data.tokenizer == "byte"
    assert cfg.training.steps == 200 and cfg.training.max_norm == 1.0
    assert cfg.training.grad_accum_steps == 1 and cfg.training.seed == 0
    assert cfg.training.betas == (0.9, 0.95)
    assert cfg.parallel.engine == "simplefsdp" and cfg.parallel.mode == "fully_shard"
    assert cfg.parallel.reshard_after_forward is True and cfg.parallel.mesh_shape is None
    assert cfg.compile.enable is True and cfg.compile.backend == "inductor"
    assert cfg.compile.bucketing == "auto"
    assert cfg.activation_checkpoint.mode == "none"
    assert cfg.checkpoint.enable and cfg.checkpoint.folder == ""  # the run folder's
    assert cfg.checkpoint.resume is False
    assert cfg.metrics.output_dir == "outputs"
    assert {"llama3_debug", "moe_debug", "debug", "8B"} <= set(C.VALID_MODELS)
    assert cfg.parallel.ep == 1 and cfg.model.load_balance == "auto"
    validate_config(cfg)


def test_sections_are_keyword_friendly():
    cfg = JobConfig(
        training=C.TrainingConfig(steps=7),
        parallel=C.ParallelConfig(engine="ddp", mode="replicate"),
    )
    validate_config(cfg)
    assert cfg.training.steps == 7 and cfg.training.lr == C.TrainingConfig().lr


@pytest.mark.parametrize("name", ["debug", "small", "llama3_8b"])
def test_builtin_configs_load(name):
    assert name in builtin_configs()
    cfg = load_config(name)
    assert cfg.model.name in C.VALID_MODELS
    assert load_config(f"{name}.toml") == cfg


def test_builtin_model_names():
    assert load_config("small").model.name == "small"
    assert load_config("llama3_8b").model.name == "8B"


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="nope.toml.*debug"):
        load_config("nope.toml")


# --------------------------------------------------------------------------- layering


def test_toml_then_overrides_precedence(tmp_path):
    path = _write(
        tmp_path,
        """
[training]
steps = 50
lr = 0.01
[parallel]
mode = "hybrid_shard"
mesh_shape = [2, 2]
[compile]
enable = false
""",
    )
    cfg = load_config(path, [])
    assert cfg.training.steps == 50 and cfg.training.lr == 0.01
    assert cfg.parallel.mode == "hybrid_shard" and cfg.parallel.mesh_shape == [2, 2]
    assert cfg.compile.enable is False
    assert cfg.training.warmup_steps == C.TrainingConfig().warmup_steps  # default kept

    cfg = load_config(path, ["--training.steps", "7", "--compile.enable", "--training.lr=0.5"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.compile.enable is True
    assert cfg.training.lr == 0.5
    assert cfg.parallel.mesh_shape == [2, 2]  # TOML beats defaults


def test_extends_builds_on_a_shipped_config_then_a_file(tmp_path):
    (tmp_path / "sub").mkdir()
    base = _write(tmp_path, 'extends = "debug"\n[training]\nsteps = 12\nwarmup_steps = 2\n')
    child = _write(tmp_path, 'extends = "../base.toml"\n[data]\nbatch_size = 2\n', "sub/c.toml")
    assert base.endswith("job.toml")
    (tmp_path / "base.toml").write_text(Path(base).read_text())
    debug = load_config("debug")
    notes: list[str] = []
    cfg = load_config(child, ["--training.steps", "14"], notes=notes)
    assert cfg.compile.backend == debug.compile.backend == "aot_eager"  # from debug
    assert cfg.checkpoint.interval == debug.checkpoint.interval
    assert cfg.training.warmup_steps == 2 and cfg.data.batch_size == 2  # the files
    assert cfg.training.steps == 14  # the command line last
    assert notes == []


def test_file_without_extends_builds_on_defaults_and_says_so(tmp_path):
    path = _write(tmp_path, '[model]\nname = "debug"\n[training]\nsteps = 12\n')
    notes: list[str] = []
    cfg = load_config(path, notes=notes)
    assert cfg.compile.backend == JobConfig().compile.backend  # the defaults, not debug.toml
    assert len(notes) == 1 and "no 'extends'" in notes[0] and 'extends = "debug"' in notes[0]
    assert "differ from the 'debug' config in " in notes[0] and "compile.backend" in notes[0]
    explicit = _write(tmp_path, 'extends = "defaults"\n[model]\nname = "debug"\n', "d.toml")
    notes = []
    assert load_config(explicit, notes=notes).compile.backend == JobConfig().compile.backend
    assert notes == []
    # a complete file (e.g. a run's saved config.toml) takes nothing from the defaults
    complete = _write(tmp_path, format_config(load_config("debug")), "complete.toml")
    assert load_config(complete, notes=notes) == load_config("debug") and notes == []


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('extends = "nope"\n', "config file 'nope' not found"),
        ("extends = 3\n", "extends = 3 must be a shipped config name"),
        ('extends = "job.toml"\n', "'extends' loops back to itself"),
    ],
)
def test_bad_extends(tmp_path, text, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--training.steps", "12", "--training.warmup_steps", "20"],
         "training.warmup_steps 20 is not below training.steps 12: .* --training.warmup_steps 1"),
        (["--data.val_fraction", "0"], "holds out no validation data.*--data.val_fraction 0.05"),
        (["--data.val_fraction", "0.001", "--data.max_bytes", "300000"],
         "about 300 tokens, less than one validation batch .*--data.val_fraction 0.01"),
        (["--checkpoint.load_step", "4"], "load_step 4 is only used when resuming; add --resume"),
    ],
)  # fmt: skip
def test_contradictions_warn_one_line_each_with_the_fix(overrides, expected):
    warnings = C.config_warnings(load_config("debug", overrides))
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert re.search(expected, warnings[0]), warnings[0]


@pytest.mark.parametrize("name", builtin_configs())
def test_shipped_configs_warn_about_nothing(name):
    assert C.config_warnings(load_config(name)) == []


def test_validation_happens_after_all_layers(tmp_path):
    # The TOML alone is invalid (ddp + fully_shard); the override fixes it.
    path = _write(tmp_path, '[parallel]\nengine = "ddp"\nmode = "fully_shard"\n')
    with pytest.raises(ValueError, match="ddp"):
        load_config(path)
    assert load_config(path, ["--parallel.mode", "replicate"]).parallel.engine == "ddp"


def test_parse_overrides_forms():
    pairs = parse_overrides(
        ["--training.steps", "200", "--parallel.mode=hybrid_shard", "--compile.enable", "false",
         "--training.deterministic", "--metrics.tensorboard", "--training.lr", "-1e-3",
         "--training.grad-accum-steps=4"]
    )  # fmt: skip
    assert pairs == [
        ("training.steps", "200"),
        ("parallel.mode", "hybrid_shard"),
        ("compile.enable", "false"),
        ("training.deterministic", None),
        ("metrics.tensorboard", None),
        ("training.lr", "-1e-3"),
        ("training.grad_accum_steps", "4"),
    ]


@pytest.mark.parametrize(
    "tokens",
    [["steps", "3"], ["--training"], ["--a.b.c", "1"], ["--", "x"]],
)
def test_parse_overrides_rejects_malformed(tokens):
    with pytest.raises(ValueError):
        parse_overrides(tokens)


def test_key_without_section_suggests_section():
    with pytest.raises(ValueError, match="--training.lr"):
        parse_overrides(["--lr", "1"])


def test_bare_flag_needs_bool_field():
    with pytest.raises(ValueError, match="training.steps needs a value"):
        load_config(None, ["--training.steps"])
    with pytest.raises(ValueError, match="training.steps needs a value"):
        load_config(None, ["--training.steps", "--compile.enable"])


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize(
    ("override", "attr", "expected"),
    [
        (["--training.steps", "300"], "training.steps", 300),
        (["--training.steps=1_000"], "training.steps", 1000),
        (["--training.lr", "3e-4"], "training.lr", 3e-4),
        (["--training.max_norm", "0"], "training.max_norm", 0.0),
        (["--model.name", "8B"], "model.name", "8B"),
        (["--data.path", "/tmp/x.txt"], "data.path", "/tmp/x.txt"),
        (["--data.path", "none"], "data.path", None),
        (["--model.vocab_size", "512"], "model.vocab_size", 512),
        (["--model.vocab_size", "null"], "model.vocab_size", None),
        (["--parallel.param_dtype", "bfloat16"], "parallel.param_dtype", "bfloat16"),
        (["--parallel.reduce_dtype=None"], "parallel.reduce_dtype", None),
        (["--parallel.mesh_shape", "2,2"], "parallel.mesh_shape", [2, 2]),
        (["--parallel.mesh_shape", "[1, 4]"], "parallel.mesh_shape", [1, 4]),
        (["--parallel.mesh_shape="], "parallel.mesh_shape", None),
        (["--training.betas", "0.8,0.99"], "training.betas", (0.8, 0.99)),
        (["--training.betas", "(0.5, 0.9)"], "training.betas", (0.5, 0.9)),
        (["--training.betas", "[0, 0.9]"], "training.betas", (0.0, 0.9)),
    ],
)
def test_type_conversion(override, attr, expected):
    cfg = load_config(None, override)
    section, key = attr.split(".")
    value = getattr(getattr(cfg, section), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("True", True), ("1", True), ("yes", True), ("on", True),
     ("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False)],
)  # fmt: skip
def test_bool_conversion(raw, expected):
    assert load_config(None, ["--compile.enable", raw]).compile.enable is expected
    assert load_config(None, [f"--checkpoint.resume={raw}"]).checkpoint.resume is expected


@pytest.mark.parametrize(
    ("raw", "expected"), [("true", True), ("off", False), ("1", True), ("2", 2), ("8", 8)]
)
def test_reshard_after_forward_is_a_bool_or_a_group_size(raw, expected):
    value = load_config(
        None, ["--parallel.reshard_after_forward", raw]
    ).parallel.reshard_after_forward
    assert value == expected and type(value) is type(expected)
    # the TOML round trip keeps the type
    again = config_from_dict(
        config_to_dict(load_config(None, [f"--parallel.reshard_after_forward={raw}"]))
    )
    assert type(again.parallel.reshard_after_forward) is type(expected)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (["--parallel.reshard_after_forward", "x"], "'x' as a bool or an int"),
        (["--parallel.reshard_after_forward", "-2"], "true, false or a group size >= 2"),
        (["--parallel.reshard_after_forward", "2", "--parallel.engine", "ddp",
          "--parallel.mode", "replicate"], "valid choices with a reshard group size: \\['simplefsdp', 'fsdp2'\\]"),
    ],
)  # fmt: skip
def test_reshard_after_forward_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, override)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (["--training.steps", "abc"], "'abc' as int"),
        (["--training.steps", "1.5"], "'1.5' as int"),
        (["--training.lr", "fast"], "'fast' as float"),
        (["--compile.enable", "maybe"], "'maybe' as bool"),
        (["--parallel.mesh_shape", "2,x"], r"mesh_shape\[1\]"),
        (["--parallel.mesh_shape", "2,,2"], "comma-separated"),
        (["--training.betas", "0.9"], "expected 2 values"),
        (["--model.name", "none"], None),  # not optional: 'none' is a string, then a bad enum
    ],
)
def test_conversion_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, override)


def test_toml_types_are_checked(tmp_path):
    with pytest.raises(ValueError, match="expected int, got bool"):
        load_config(_write(tmp_path, "[training]\nsteps = true\n"))
    with pytest.raises(ValueError, match="expected a string"):
        load_config(_write(tmp_path, "[model]\nname = 8\n"))
    with pytest.raises(ValueError, match="cannot parse 2.5 as int"):
        load_config(_write(tmp_path, "[training]\nsteps = 2.5\n"))
    # ints are fine for float fields, strings are converted like on the CLI
    cfg = load_config(_write(tmp_path, '[training]\nlr = 1\nsteps = "12"\n'))
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.training.steps == 12


def test_invalid_toml(tmp_path):
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(_write(tmp_path, "[training\nsteps = 1\n"))


# --------------------------------------------------------------------------- unknown keys


def test_unknown_key_suggests_and_lists_valid_keys():
    with pytest.raises(ValueError) as info:
        load_config(None, ["--training.stpes", "3"])
    msg = str(info.value)
    assert "'stpes'" in msg and "Did you mean 'steps'" in msg
    assert "grad_accum_steps" in msg and "warmup_steps" in msg  # lists the section's keys


def test_unknown_key_in_toml(tmp_path):
    with pytest.raises(ValueError, match=r"'batchsize'.*Did you mean 'batch_size'"):
        load_config(_write(tmp_path, "[data]\nbatchsize = 4\n"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[training]\nlearning_rate = 1e-3\n", "'learning_rate' in section \\[training\\]. Did you mean 'lr'"),
        ("[data]\nmax_steps = 3\n", "Did you mean 'training.steps'"),
        ("[optimizer]\nlr = 1e-3\n", "'optimizer'. Did you mean 'training'"),
    ],
)  # fmt: skip
def test_names_of_other_trainers_are_suggested(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_config(_write(tmp_path, text))


def test_num_workers_is_not_a_key(tmp_path):
    """The token loader is in-memory: a worker count would be accepted and ignored."""
    with pytest.raises(ValueError, match=r"unknown config key 'num_workers' in section \[data\]"):
        load_config(None, ["--data.num_workers", "2"])
    with pytest.raises(ValueError, match=r"unknown config key 'num_workers'"):
        load_config(_write(tmp_path, "[data]\nnum_workers = 2\n"))


def test_key_of_other_section_is_suggested():
    with pytest.raises(ValueError, match="Did you mean 'training.seed'"):
        load_config(None, ["--data.seed", "3"])


def test_unknown_section():
    with pytest.raises(ValueError, match=r"'trainig'.*Did you mean 'training'.*Valid sections"):
        load_config(None, ["--trainig.steps", "3"])
    with pytest.raises(ValueError, match="unknown config section 'optimizer'"):
        config_from_dict({"optimizer": {"lr": 1.0}})


def test_top_level_value_in_toml_rejected(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        load_config(_write(tmp_path, "steps = 3\n"))


# --------------------------------------------------------------------------- enums and numbers


@pytest.mark.parametrize(
    ("override", "value", "choice"),
    [
        (["--model.name", "7B"], "'7B'", "'8B'"),
        (["--parallel.engine", "fsdp1"], "'fsdp1'", "'fsdp2'"),
        (["--parallel.mode", "shard"], "'shard'", "'fully_shard'"),
        (["--parallel.param_dtype", "bf16"], "'bf16'", "'bfloat16'"),
        (["--compile.backend", "eager"], "'eager'", "'aot_eager'"),
        (["--compile.bucketing", "all"], "'all'", "'per_block'"),
        (["--activation_checkpoint.mode", "partial"], "'partial'", "'selective'"),
    ],
)
def test_bad_enum(override, value, choice):
    with pytest.raises(ValueError) as info:
        load_config(None, override)
    msg = str(info.value)
    assert value in msg and "valid choices" in msg and choice in msg


def test_engine_vocabulary():
    assert C.ENGINES == ("simplefsdp", "simplefsdp_eager", "fsdp2", "ddp", "replica")
    from simplefsdp.engines.kinds import get_engine

    assert {e for e in C.ENGINES if get_engine(e).modes == ("replicate",)} == {"ddp", "replica"}


@pytest.mark.parametrize("engine", ["simplefsdp", "simplefsdp_eager", "fsdp2", "ddp", "replica"])
def test_engines_accepted(engine):
    modes = ["replicate"] if engine in ("ddp", "replica") else list(C.PARALLEL_MODES)
    for mode in modes:
        cfg = load_config(None, ["--parallel.engine", engine, f"--parallel.mode={mode}"])
        assert (cfg.parallel.engine, cfg.parallel.mode) == (engine, mode)
    # also from TOML, and the eager engine keeps compile.* as given (it ignores them)
    cfg = config_from_dict({"parallel": {"engine": engine, "mode": modes[0]}})
    assert cfg.parallel.engine == engine and cfg.compile.enable is True


def test_unknown_engine_is_one_line_listing_valid_engines():
    with pytest.raises(ValueError) as info:
        load_config(None, ["--parallel.engine", "eager"])
    header, *problems = str(info.value).splitlines()
    assert header == "invalid configuration:"
    assert len(problems) == 1
    line = problems[0].strip()
    assert line.startswith("parallel.engine: invalid value 'eager'; valid choices: ")
    assert str(list(C.ENGINES)) in line


@pytest.mark.parametrize("engine", ["ddp", "replica"])
def test_replicate_only_engines_reject_sharding(engine):
    for mode in ("fully_shard", "hybrid_shard"):
        with pytest.raises(ValueError) as info:
            load_config(None, ["--parallel.engine", engine, "--parallel.mode", mode])
        assert (
            f"parallel.mode: invalid value {mode!r} for engine {engine!r}; "
            "valid choices: ['replicate']"
        ) in str(info.value)


def test_config_imports_no_torch():
    code = "import sys, simplefsdp.train.config; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (["--training.steps", "0"], "training.steps"),
        (["--training.steps", "-5"], "training.steps"),
        (["--data.seq_len", "0"], "data.seq_len"),
        (["--data.batch_size", "0"], "data.batch_size"),
        (["--training.lr", "0"], "training.lr"),
        (["--training.lr", "-1e-3"], "training.lr"),
        (["--training.lr", "nan"], "training.lr"),
        (["--data.val_fraction", "1.0"], "data.val_fraction"),
        (["--data.val_fraction", "-0.1"], "data.val_fraction"),
        (["--training.grad_accum_steps", "0"], "training.grad_accum_steps"),
        (["--checkpoint.keep_last", "0"], "checkpoint.keep_last"),
        (["--checkpoint.interval", "0"], "checkpoint.interval"),
        (["--parallel.mesh_shape", "2"], "parallel.mesh_shape"),
        (["--parallel.mesh_shape", "2,2,2"], "parallel.mesh_shape"),
        (["--parallel.mesh_shape", "0,4"], "parallel.mesh_shape"),
        (["--training.max_norm", "-1"], "training.max_norm"),
        (["--training.betas", "0.9,1.0"], "training.betas"),
        (["--training.min_lr_ratio", "2"], "training.min_lr_ratio"),
        (["--metrics.log_interval", "0"], "metrics.log_interval"),
        (["--model.max_seq_len", "64"], "data.seq_len"),  # seq_len 128 > max_seq_len 64
    ],
)
def test_bad_numbers(override, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, override)


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as info:
        load_config(
            None, ["--training.steps", "0", "--data.seq_len", "-1", "--compile.backend", "x"]
        )
    msg = str(info.value)
    assert "training.steps" in msg and "data.seq_len" in msg and "compile.backend" in msg


def test_edge_values_accepted():
    cfg = load_config(
        None,
        ["--data.val_fraction", "0", "--training.max_norm", "0", "--metrics.val_interval", "0",
         "--parallel.mode", "hybrid_shard", "--parallel.mesh_shape", "1,1"],
    )  # fmt: skip
    assert cfg.data.val_fraction == 0.0 and cfg.training.max_norm == 0.0


# --------------------------------------------------------------------------- output


def _non_default_config() -> JobConfig:
    return load_config(
        "debug",
        ["--model.name", "8B", "--model.vocab_size", "128256", "--data.path", 'C:\\data "x"/é',
         "--training.lr", "3e-5", "--training.betas", "0.85,0.975", "--parallel.mode",
         "hybrid_shard", "--parallel.mesh_shape", "2,4", "--parallel.param_dtype", "bfloat16",
         "--compile.enable", "false", "--activation_checkpoint.mode", "selective"],
    )  # fmt: skip


@pytest.mark.parametrize("make", [JobConfig, _non_default_config])
def test_format_round_trip(make, tmp_path):
    cfg = make()
    text = format_config(cfg)
    assert "[training]" in text and "[activation_checkpoint]" in text
    parsed = tomllib.loads(text)
    assert config_from_dict(parsed) == cfg
    # and via a file
    assert load_config(_write(tmp_path, text)) == cfg


def test_config_to_dict_plain_values():
    cfg = _non_default_config()
    d = config_to_dict(cfg)
    assert list(d) == list(C.SECTIONS)
    assert d["training"]["betas"] == [0.85, 0.975]
    assert d["parallel"]["mesh_shape"] == [2, 4]
    assert d["model"]["max_seq_len"] is None
    assert config_from_dict(d) == cfg


def test_config_hash_stable_and_sensitive():
    base = JobConfig()
    h = config_hash(base)
    assert len(h) == 64 and int(h, 16) >= 0
    assert config_hash(JobConfig()) == h
    assert config_hash(load_config(None, [])) == h
    # Irrelevant to the model / sharding: unchanged.
    assert (
        config_hash(load_config(None, ["--training.steps", "5", "--metrics.log_interval", "1"]))
        == h
    )
    # Model and parallel changes: different.
    others = {
        config_hash(load_config(None, ["--model.name", "small"])),
        config_hash(load_config(None, ["--model.vocab_size", "300"])),
        config_hash(load_config(None, ["--parallel.mode", "replicate"])),
        config_hash(load_config(None, ["--data.tokenizer", "/tok"])),
    }
    assert h not in others and len(others) == 4
    # Depends on values only, not on object identity.
    assert config_hash(dataclasses.replace(base, model=C.ModelConfig())) == h


def test_manual_edit_then_validate():
    cfg = JobConfig()
    cfg.training.steps = 0
    with pytest.raises(ValueError, match="training.steps"):
        validate_config(cfg)
    cfg.training.steps = 1
    apply_overrides(cfg, ["--training.steps", "9"])
    assert cfg.training.steps == 9


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (["--float8.recipe", "blockwise"], "float8.recipe"),
        (["--float8.enable", "true", "--parallel.engine", "simplefsdp_eager"],
         "valid choices with float8"),
        (["--float8.enable", "true", "--parallel.pp", "2"], "data and tensor parallelism"),
    ],
)  # fmt: skip
def test_float8_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, override)


def test_float8_with_tensor_parallel(monkeypatch):
    from simplefsdp.train.cli import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU check

    job = load_config(None, ["--float8.enable", "true", "--parallel.tp", "2"])
    assert job.parallel.tp == 2
    # gloo has no float8 all-gather for the sequence-parallel activations
    with pytest.raises(ValueError, match="--parallel.sequence_parallel false"):
        preflight(job, world_size=2, local_world_size=2)
    ok = ["--parallel.sequence_parallel", "false"]
    preflight(
        load_config(None, ["--float8.enable", "true", "--parallel.tp", "2", *ok]),
        world_size=2,
        local_world_size=2,
    )
    rowwise = ["--float8.enable", "true", "--float8.recipe", "rowwise", "--parallel.tp", "2"]
    preflight(load_config(None, rowwise), world_size=2, local_world_size=2)


def test_float8_tensor_parallel_plan_uses_torchao_styles():
    pytest.importorskip("torchao.float8")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from simplefsdp.frontend.float8 import convert_linears_to_float8
    from simplefsdp.models.llama3 import Transformer, get_config
    from simplefsdp.models.llama3.tensor_parallel import llama3_tp_plan

    def plan(recipe):
        with torch.device("meta"):
            model = Transformer(get_config("debug", n_layers=1))
        if recipe:
            convert_linears_to_float8(model, recipe)
        styles = llama3_tp_plan(model)
        return {k.removeprefix("layers.0."): type(v).__name__ for k, v in styles.items()}

    float8 = plan("tensorwise")
    assert float8["attention"] == float8["feed_forward"] == "PrepareFloat8ModuleInput"
    assert float8["attention.wq"] == float8["feed_forward.w1"] == "Float8ColwiseParallel"
    assert float8["attention.wo"] == float8["feed_forward.w2"] == "Float8RowwiseParallel"
    # the output layer is not converted (float8.filter_fqns): torch's style
    assert float8["output"] == "ColwiseParallel"
    # rowwise scaling is not served by torchao's float8 styles: torch's own
    assert plan("rowwise") == plan(None)
    assert plan(None)["attention.wq"] == ColwiseParallel.__name__
    assert plan(None)["attention.wo"] == RowwiseParallel.__name__


def test_float8_section_defaults():
    cfg = load_config(None, ["--float8.enable", "true", "--float8.recipe", "rowwise"])
    assert (cfg.float8.enable, cfg.float8.recipe, cfg.float8.filter_fqns) == (
        True,
        "rowwise",
        "output",
    )
