"""Every bad pipeline setting is one clear line, found before work starts."""

from __future__ import annotations

import pytest
import torch.nn as nn


def test_pipeline_spec_errors():
    from simplefsdp.engines import PipelineSpec

    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; valid: gpipe, 1f1b"):
        PipelineSpec(2, "zb")
    with pytest.raises(ValueError, match="needs stages_per_rank >= 2, got 1"):
        PipelineSpec(2, "interleaved_1f1b", stages_per_rank=1)
    with pytest.raises(ValueError, match="runs one stage per rank, got stages_per_rank 2"):
        PipelineSpec(2, "gpipe", stages_per_rank=2)
    with pytest.raises(ValueError, match="microbatches must be >= 1, got 0"):
        PipelineSpec(2, microbatches=0)
    spec = PipelineSpec(4, "interleaved_1f1b", microbatches=8)
    assert spec.stages_per_rank == 2 and spec.num_stages == 8


def test_mesh_shapes_with_pipeline():
    from simplefsdp.engines import mesh_shape_for

    assert mesh_shape_for("simplefsdp", "fully_shard", 8, pp=2) == (2, 4)
    assert mesh_shape_for("simplefsdp", "fully_shard", 8, pp=2, tp=2) == (2, 2, 2)
    assert mesh_shape_for("fsdp2", "replicate", 4, pp=2) == (2, 2, 1)
    assert mesh_shape_for("simplefsdp", "hybrid_shard", 16, pp=2, local_world_size=4) == (
        2,
        2,
        4,
    )
    with pytest.raises(ValueError, match="valid pipeline-parallel sizes for 6 ranks: 1, 2, 3, 6"):
        mesh_shape_for("simplefsdp", "fully_shard", 6, pp=4)
    with pytest.raises(
        ValueError,
        match=r"pp 2 x tp 2 does not divide world size 6; valid tensor-parallel sizes with pp 2: 1, 3",
    ):
        mesh_shape_for("simplefsdp", "fully_shard", 6, pp=2, tp=2)


def test_train_config_pipeline_rules():
    from simplefsdp.train.config import config_warnings, load_config

    with pytest.raises(
        ValueError, match=r"parallel.engine: invalid value 'ddp' with parallel.pp=2"
    ):
        load_config(
            None, ["--parallel.pp", "2", "--parallel.engine", "ddp", "--parallel.mode", "replicate"]
        )
    from simplefsdp.train.resolve import resolve

    with pytest.raises(ValueError, match=r"data.batch_size 6 is not divisible by parallel.micro"):
        resolve(load_config(None, ["--parallel.pp", "2", "--parallel.microbatches", "4",
                                   "--data.batch_size", "6"]), 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"parallel.pp_schedule: invalid value 'zb'"):
        load_config(None, ["--parallel.pp", "2", "--parallel.pp_schedule", "zb"])
    with pytest.raises(ValueError, match=r"parallel.pp_stages_per_rank: invalid value 1"):
        load_config(None, ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b",
                           "--parallel.pp_stages_per_rank", "1"])  # fmt: skip
    ok = load_config(None, ["--parallel.pp", "2", "--data.batch_size", "4"])
    assert ok.parallel.pp == 2 and ok.parallel.microbatches is None
    assert config_warnings(load_config(None, ["--parallel.microbatches", "2"])) == [
        "parallel.microbatches and parallel.pp_stages_per_rank are only used with parallel.pp > 1"
    ]


def test_train_preflight_checks_stage_count():
    from simplefsdp.train.cli import preflight
    from simplefsdp.train.config import load_config

    # the debug model has 4 layers: 2 ranks x 2 interleaved stages fit, 4 x 2 do not
    job = load_config(None, ["--parallel.pp", "4", "--parallel.pp_schedule", "interleaved_1f1b",
                             "--data.batch_size", "4"])  # fmt: skip
    with pytest.raises(ValueError, match="= 8 stages but model 'debug' has 4 layers"):
        preflight(job, world_size=4, local_world_size=4)
    job = load_config(None, ["--parallel.pp", "3", "--parallel.microbatches", "2"])
    with pytest.raises(ValueError, match="valid pipeline-parallel sizes for 4 ranks: 1, 2, 4"):
        preflight(job, world_size=4, local_world_size=4)


def test_stage_view_merges_layers_and_refuses_overlaps():
    from simplefsdp.engines import stage_view

    def part(keys, head=False):
        m = nn.Module()
        m.layers = nn.ModuleDict({k: nn.Linear(2, 2) for k in keys})
        if head:
            m.output = nn.Linear(2, 3)
        return m

    a, b = part(["0", "1"]), part(["4", "5"], head=True)
    view = stage_view([a, b])
    assert list(view.state_dict()) == [
        f"layers.{i}.{w}" for i in (0, 1, 4, 5) for w in ("weight", "bias")
    ] + ["output.weight", "output.bias"]
    assert view.layers["4"] is b.layers["4"]
    with pytest.raises(ValueError, match="two pipeline stages hold the same submodule 'output'"):
        stage_view([part([], head=True), part([], head=True)])


def test_parallelize_pipeline_refuses_other_engines_and_meshes():
    from simplefsdp.engines import EngineSpec, PipelineSpec, parallelize_pipeline

    with pytest.raises(ValueError, match=r"with pipeline parallelism: \['simplefsdp', 'fsdp2'\]"):
        parallelize_pipeline(
            nn.Linear(2, 2),
            EngineSpec("ddp", mode="replicate"),
            PipelineSpec(2),
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            split_fn=None,  # type: ignore[arg-type]
            loss_fn=None,  # type: ignore[arg-type]
        )


def test_bench_pipeline_arguments():
    from simplefsdp.bench.cli import _build_parser, build_spec
    from simplefsdp.bench.configs import resolve_configs

    def spec(*argv):
        return build_spec(_build_parser().parse_args(["--nproc", "4", *argv]))

    s = spec("--pp", "2", "--pp-schedule", "gpipe")
    assert (s.pp, s.pp_schedule, s.microbatches) == (2, "gpipe", 2)
    with pytest.raises(ValueError, match="--batch-size 4 is not divisible by --microbatches 3"):
        spec("--pp", "2", "--microbatches", "3")
    with pytest.raises(ValueError, match="= 8 stages but model 'debug' has 4 layers"):
        spec("--pp", "4", "--pp-schedule", "interleaved_1f1b")
    with pytest.raises(ValueError, match="valid pipeline-parallel sizes for 4 ranks: 1, 2, 4"):
        spec("--pp", "3", "--microbatches", "1")
    with pytest.raises(ValueError, match="does not run with --pp 2"):
        resolve_configs("ddp", pp=2)
    assert {c.engine for c in resolve_configs("all", pp=2)} == {"simplefsdp", "fsdp2"}
    assert spec("--grad-accum", "4").grad_accum == 4
    with pytest.raises(ValueError, match="--grad-accum must be >= 1, got 0"):
        spec("--grad-accum", "0")
