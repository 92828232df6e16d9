"""``simplefsdp train`` on mixture-of-experts models: the layout checks that run
before any process starts (one line, exit code 2), the model names, the
expert-load metrics and the export config."""

from __future__ import annotations

import pytest

from simplefsdp.layout import Layout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "4", "--parallel.ep", "3"],
         "parallel.ep 3 does not divide the 4 ranks of dp_shard 4 (expert parallelism splits "
         "them into groups of parallel.ep); valid: 1, 2, 4"),
        (["--nproc", "3", "--parallel.ep", "2"], "parallel.ep 2 does not divide the 3"),
        (["--nproc", "16", "--parallel.ep", "16"],
         "parallel.ep 16 does not divide the 8 experts of model 'moe_debug' (each rank holds "
         "num_experts / parallel.ep); valid: 1, 2, 4, 8"),
        (["--nproc", "2", "--parallel.ep", "2", "--model.name", "debug"],
         "parallel.ep 2: model 'debug' (family 'llama3') does not compose with expert "
         "parallelism; use parallel.ep 1"),
        (["--nproc", "2", "--parallel.ep", "2", "--parallel.engine", "simplefsdp_eager"],
         "parallel.engine: invalid value 'simplefsdp_eager' with parallel.ep=2 (the eager "
         "executor gathers flat buffers of data-parallel shards only)"),
        (["--nproc", "2", "--parallel.ep", "2", "--parallel.engine", "ddp",
          "--parallel.mode", "replicate"], "parallel.engine: invalid value 'ddp' with"),
        (["--nproc", "4", "--parallel.ep", "2", "--parallel.mode", "hybrid_shard"],
         "parallel.mode: invalid value 'hybrid_shard' with parallel.ep=2"),
        (["--nproc", "4", "--parallel.tp", "2"],
         "parallel.tp 2 with compile.enable true: model 'moe_debug' compiles with graph "
         "breaks"),
        (["--nproc", "4", "--parallel.tp", "2", "--parallel.ep", "2", "--compile.enable", "false"],
         "parallel.ep 2 with parallel.tp 2: expert parallelism composes with data "
         "parallelism (dp_shard, cp) and pipeline stages only"),
        (["--nproc", "2", "--parallel.ep", "0"], "parallel.ep: invalid value 0; must be >= 1"),
    ],
)  # fmt: skip
def test_bad_moe_layout_is_one_line_before_any_process(argv, message, tmp_path, capsys):
    from simplefsdp.train import cli

    out = ["--metrics.output_dir", str(tmp_path / "runs")]
    assert cli.main(["--model", "moe_debug", *out, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_layout_and_spec_check_experts():
    from simplefsdp.engines.resolve import job_errors
    from simplefsdp.models.moe import get_config
    from simplefsdp.models.registry import get_spec

    args, spec = get_config("moe_debug"), get_spec("moe")  # 8 experts
    assert job_errors(spec, args, Layout(ep=8), 8) == []
    assert job_errors(spec, args, Layout(ep=2), 4) == []
    assert Layout(ep=2).validate(4) == []  # no model: the degrees only
    (line,) = Layout(tp=2, ep=2).validate(4)
    assert "ep 2 with tp 2: expert parallelism composes" in line
    # each pipeline stage's ranks form their own EP groups
    assert Layout(pp=2, ep=2).validate(4) == []
    (line,) = Layout(pp=2, ep=4).validate(4)
    assert "ep 4 does not divide the 2 ranks of dp_shard 2" in line
    (line,) = Layout(ep=4).validate(6)
    assert "ep 4 does not divide the 6 ranks of dp_shard 6" in line


def test_schema_lists_every_moe_config():
    from simplefsdp.models.moe import MOE_CONFIGS
    from simplefsdp.train.config.schema import VALID_MODELS

    assert set(MOE_CONFIGS) <= set(VALID_MODELS)


def test_load_balance_reaches_the_model():
    from simplefsdp.train.config import load_config
    from simplefsdp.train.config.schema import config_warnings
    from simplefsdp.train.parallelism import model_config

    job = load_config("debug", ["--model.name", "moe_debug", "--model.load_balance", "none"])
    assert model_config(job).load_balance == "none"
    assert model_config(job, vocab_size=300).vocab_size == 300
    dense = load_config("debug", ["--model.load_balance", "aux_loss"])
    assert any("model.load_balance is only used" in w for w in config_warnings(dense))


def test_expert_load_metrics_and_step_line():
    from simplefsdp.models.common.load_balance import expert_load_metrics
    from simplefsdp.models.moe import ExpertLoad
    from simplefsdp.train.metrics import format_step_line

    loads = [ExpertLoad("layers.1.moe", (2.0, 2.0, 2.0, 2.0)),
             ExpertLoad("layers.2.moe", (6.0, 0.0, 1.0, 1.0))]  # fmt: skip
    metrics = expert_load_metrics(loads)
    assert metrics["moe_imbalance"] == 3.0  # the worst layer: 6 / mean 2
    assert metrics["moe_layers"]["layers.1.moe"] == {
        "tokens_per_expert": [2, 2, 2, 2],
        "imbalance": 1.0,
    }
    record = {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s_per_rank": 10.0}
    assert " | moe imb 3.00" in format_step_line(1, 10, {**record, **metrics})
    assert "moe" not in format_step_line(1, 10, record)


def test_export_config_builds_a_moe_model():
    from dataclasses import asdict

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.moe import MoEArgs, get_config

    args = get_config("moe_debug")
    assert model_args_from_config({"model_args": asdict(args)}) == args
    assert isinstance(model_args_from_config({"model_args": asdict(args)}), MoEArgs)


def test_resume_of_a_moe_run_takes_another_ep(tmp_path, monkeypatch):
    # The command line's --parallel.ep is checked against the run's model, not
    # the default (dense) one the command line alone would name.
    import json

    from simplefsdp.train import cli, resume, runs
    from simplefsdp.train.config import load_config

    monkeypatch.setattr(runs.RunInfo, "resume_step", lambda self, load_step=-1: 4)
    flags = ["--metrics.output_dir", str(tmp_path), "--model.name", "moe_debug"]
    saved = load_config("debug", [*flags, "--parallel.ep", "2"])
    run = tmp_path / "20260101-000000-aaaa"
    (run / "checkpoints").mkdir(parents=True)
    record = {"id": run.name, "started": run.name, "status": "stopped",
              "checkpoint_folder": str(run / "checkpoints")}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    (run / "config.toml").write_text(resume.run_config_text(saved))
    _, job, choice = cli._parse(["--resume", str(run), "--parallel.ep", "4"])
    assert (job.model.name, job.parallel.ep) == ("moe_debug", 4)
    assert choice.line().endswith("changed: parallel.ep 2 -> 4")


def test_engine_spec_takes_ep_with_the_engines_that_compose():
    from simplefsdp.engines import EngineSpec

    assert "fully_shard x ep 2" in EngineSpec(ep=2).describe()
    assert EngineSpec(engine="fsdp2", ep=2).ep == 2
    for engine in ("simplefsdp_eager", "ddp", "replica"):
        with pytest.raises(ValueError, match=f"invalid value '{engine}' with ep=2"):
            EngineSpec(engine=engine, ep=2)
    with pytest.raises(ValueError, match="ep must be an int >= 1, got 0"):
        EngineSpec(ep=0)
