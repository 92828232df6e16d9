"""The :class:`~simplefsdp.layout.Layout` object: degrees, errors, and the meshes by role."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from simplefsdp.layout import Layout


def test_resolve_fills_dp_shard():
    assert Layout(tp=2).resolve(8) == Layout(dp_shard=4, tp=2)
    assert Layout(dp_replicate=2, cp=2).resolve(8).dp_shard == 2
    assert Layout(dp_shard=4).resolve(4).dp_shard == 4


@pytest.mark.parametrize(
    "layout, world, expected",
    [
        (Layout(tp=3), 4, ["tp 3 does not divide world size 4; valid tensor-parallel sizes"]),
        (Layout(tp=0, pp=-2), 4, ["tp must be >= 1, got 0", "pp must be >= 1, got -2"]),
        (Layout(dp_shard=3, tp=2), 4, ["tp 2 x dp_shard 3 = 6 ranks but world size is 4"]),
        (Layout(ep=3), 4, ["ep 3 does not divide the 4 ranks of dp_shard 4"]),
        (
            Layout(ep=2, tp=2),
            8,
            ["ep 2 with tp 2: expert parallelism composes with data parallelism"],
        ),
        (Layout(cp=2, ep=3), 12, ["ep 3 does not divide the 12 ranks of dp_shard 6 x cp 2"]),
    ],
)
def test_validate_names_every_error(layout, world, expected):
    errors = layout.validate(world)
    assert len(errors) == len(expected), errors
    for line, want in zip(errors, expected, strict=True):
        assert want in line and "\n" not in line
    with pytest.raises(ValueError):
        layout.resolve(world)


def test_validate_accepts_good_layouts():
    for layout in (Layout(), Layout(tp=2, pp=2), Layout(cp=2, ep=4), Layout(dp_replicate=2)):
        assert layout.validate(8) == []


def test_flag_names_in_messages():
    (line,) = Layout(tp=3).validate(4, names={"tp": "--parallel.tp"})
    assert line.startswith("--parallel.tp 3 does not divide")


def test_mesh_dims_in_torchtitan_order():
    assert Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2).mesh_dims() == (
        ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        (2, 2, 2, 2, 2),
    )
    assert Layout(dp_shard=1, tp=2).mesh_dims() == (("dp_shard", "tp"), (1, 2))
    assert Layout(dp_shard=4, ep=2).mesh_dims() == (("dp_shard_mod_ep", "ep"), (2, 2))
    assert Layout(dp_shard=2, cp=2, ep=4).mesh_dims() == (
        ("dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
        (1, 2, 2),
    )


def test_for_data_parallel_modes():
    assert Layout.for_data_parallel("fully_shard", 8, tp=2) == Layout(tp=2)
    assert Layout.for_data_parallel("replicate", 4, replicate_on_2d=True) == Layout(
        dp_replicate=4, dp_shard=1
    )
    assert Layout.for_data_parallel("hybrid_shard", 8, local_world_size=4) == Layout(
        dp_replicate=2, dp_shard=4, hybrid=True
    )
    # one replica still gets its dim: hybrid sharding runs on a 2-D mesh
    one = Layout.for_data_parallel("hybrid_shard", 2, mesh_shape=[1, 2])
    assert one.mesh_dims() == (("dp_replicate", "dp_shard"), (1, 2))
    with pytest.raises(ValueError, match=r"mesh_shape \[2, 2\] needs 4 ranks"):
        Layout.for_data_parallel("hybrid_shard", 8, mesh_shape=[2, 2])


@pytest.fixture
def fake_world():
    """A fake 4-rank process group (rank 0 or 3), torn down after the test."""

    def init(rank: int, world: int = 4) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 3])
def test_cp_is_in_fsdp_and_loss_not_in_batch(fake_world, rank):
    fake_world(rank)
    meshes = Layout(cp=2).build("cpu")
    assert meshes.world.mesh_dim_names == ("dp_shard", "cp")
    assert meshes.fsdp.size() == 4 and meshes.loss.size() == 4
    assert meshes.batch.size() == 2 and meshes.batch_size == 2
    assert meshes.cp.size() == 2 and meshes.tp is None and meshes.ep is None
    # ranks (0, 1) split one sequence: they read the same batch
    assert meshes.batch_rank == rank // 2
    assert sorted(dist.get_process_group_ranks(meshes.batch.get_group())) == (
        [0, 2] if rank % 2 == 0 else [1, 3]
    )


@pytest.mark.parametrize("rank", [0, 3])
def test_roles_with_tp_pp_and_replicas(fake_world, rank):
    fake_world(rank, 8)
    meshes = Layout(dp_replicate=2, pp=2, tp=2).build("cpu")
    assert meshes.world.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert meshes.fsdp.ndim == 2 and meshes.fsdp.size() == 2
    assert meshes.batch.size() == 2 and meshes.tp.size() == 2 and meshes.pp.size() == 2
    assert meshes.batch_rank == (rank // 2) % 2
    assert meshes.stage_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")


def test_experts_borrow_from_dp_shard_and_cp(fake_world):
    fake_world(3, 8)
    meshes = Layout(cp=2, ep=4).build("cpu")
    assert meshes.ep.size() == 4 and meshes.expert_dp.size() == 2
    assert meshes.fsdp.size() == 8 and meshes.batch.size() == 4
    assert sorted(dist.get_process_group_ranks(meshes.ep.get_group())) == [0, 1, 2, 3]


def test_train_resolve_returns_every_error_at_once():
    """``--parallel.tp 3`` on 3 ranks of the debug model: the heads and the sequence."""
    from simplefsdp.train.config import load_config
    from simplefsdp.train.resolve import job_errors, resolve

    job = load_config(None, ["--parallel.tp", "3"])
    errors, resolved = job_errors(job, 3)
    assert resolved is None and len(errors) == 2, errors
    assert errors[0].startswith("parallel.tp 3 does not divide the n_heads 8")
    assert errors[1].startswith("data.seq_len 128 is not divisible by parallel.tp 3")
    ok = resolve(load_config(None, ["--parallel.tp", "2"]), 4)
    assert ok.layout == Layout(dp_shard=2, tp=2) and ok.engine.name == "simplefsdp"
    assert ok.spec.family == "llama3" and ok.config.n_heads == 8


def test_train_refuses_cp_in_one_line(tmp_path, capsys):
    """A sequence the context-parallel split cannot cut: one line, nothing started."""
    from simplefsdp.train import cli

    out = ["--metrics.output_dir", str(tmp_path / "runs"), "--data.seq_len", "130"]
    assert cli.main(["--nproc", "4", "--parallel.cp", "2", *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "simplefsdp train: error: data.seq_len 130 is not divisible by 2 x parallel.cp = 4 "
        "(the head-tail split); use a multiple of 4, or parallel.cp 1"
    )
    assert not (tmp_path / "runs").exists()


def test_engines_declare_what_composes():
    from simplefsdp.engines.kinds import composition_errors, engines_with, get_engine

    assert engines_with("tp") == engines_with("pp") == ("simplefsdp", "fsdp2")
    assert get_engine("fsdp2").fsdp2_runtime and get_engine("simplefsdp").fused_buckets
    assert not get_engine("comm", bench=True).trains
    with pytest.raises(ValueError, match="unknown engine 'comm'"):
        get_engine("comm")
    errors = composition_errors("ddp", mode="fully_shard", tp=2, float8=True)
    assert len(errors) == 3 and errors[0].startswith("mode: invalid value 'fully_shard'")
    assert composition_errors("fsdp2", mode="replicate", ep=2) == [
        "mode: invalid value 'replicate' with ep=2 and engine 'fsdp2'; valid choices with "
        "expert parallelism: ['fully_shard']"
    ]
