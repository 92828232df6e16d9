"""Every bad 2-D mesh, plan or engine choice is one clear line, found before work starts.

A fake 4-rank process group (no communication) stands in for the ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import simplefsdp


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 12)
        self.w2 = nn.Linear(12, 8)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(self.norm(x))))


def _tp(model, tp_mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_tp_model_without_mesh(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp(MLP(), mesh["tp"])
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model)
    assert "mesh=mesh['dp']" in _one_line(exc)


def test_dp_mesh_is_the_tp_mesh(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp(MLP(), mesh["tp"])
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model, mesh["tp"])
    assert "['tp']" in _one_line(exc)


def test_meshes_from_different_roots(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    one = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    model = _tp(MLP(), one["tp"])
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model, other["data"])
    assert "not slices of one mesh" in _one_line(exc)


def test_unnamed_meshes(fake_world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp(MLP(), mesh["tp"])
    unnamed = DeviceMesh("cpu", [0, 2])
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model, unnamed)
    assert "mesh_dim_names" in _one_line(exc)


def test_tp_dims_before_dp_dims(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    model = _tp(MLP(), mesh["tp"])
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model, mesh["dp"])
    assert "must come before" in _one_line(exc)


def test_fully_sharded_model(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = fully_shard(MLP(), mesh=mesh)
    with pytest.raises(ValueError) as exc:
        simplefsdp.data_parallel(model, mesh)
    assert "fully_shard" in _one_line(exc)


def test_eager_executor_refuses_tp(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = simplefsdp.data_parallel(_tp(MLP(), mesh["tp"]), mesh["dp"])
    with pytest.raises(ValueError) as exc:
        simplefsdp.eager(model)
    assert "tensor-parallel" in _one_line(exc)


def test_two_d_layout_is_recorded(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = simplefsdp.data_parallel(_tp(MLP(), mesh["tp"]), mesh["dp"])
    params = dict(model.named_parameters())
    # Colwise: TP and DP both shard dim 0, so the DP placement is strided.
    assert params["w1.weight"].placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert params["w2.weight"].placements == (Shard(0), Shard(1))
    assert params["w2.bias"].placements == (Shard(0), Replicate())
    assert params["norm.weight"].placements == (Shard(0),)  # plain: data parallel only
    assert params["w1.weight"].device_mesh.mesh_dim_names == ("dp", "tp")
    state = get_data_parallel_state(model)
    assert state.tp_mesh == mesh["tp"]
    spec = state.param_specs["w1.weight"]
    assert spec.tp is not None and spec.tp.local_shape == (6, 8)
    assert spec.dp_placements == (Shard(0),)
    assert state.param_specs["norm.weight"].tp is None


def test_engine_spec_and_mesh_shape_errors():
    from simplefsdp.engines import EngineSpec, mesh_shape_for

    for engine in ("ddp", "replica", "simplefsdp_eager"):
        with pytest.raises(ValueError, match=r"with tensor parallelism: \['simplefsdp', 'fsdp2'\]"):
            EngineSpec(engine, mode="replicate", tp=2)
    with pytest.raises(ValueError, match=r"valid tensor-parallel sizes for 6 ranks: 1, 2, 3, 6"):
        mesh_shape_for("simplefsdp", "fully_shard", 6, tp=4)
    assert mesh_shape_for("simplefsdp", "fully_shard", 8, tp=2) == (4, 2)
    assert mesh_shape_for("simplefsdp", "hybrid_shard", 8, tp=2, local_world_size=4) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"valid shapes for 4 ranks: \[1, 4\], \[2, 2\], \[4, 1\]"):
        mesh_shape_for("simplefsdp", "hybrid_shard", 8, tp=2, mesh_shape=[2, 4])


def test_train_config_tp_rules():
    from simplefsdp.train.config import config_warnings, load_config

    with pytest.raises(
        ValueError, match=r"parallel.engine: invalid value 'ddp' with parallel.tp=2"
    ):
        load_config(
            None, ["--parallel.tp", "2", "--parallel.engine", "ddp", "--parallel.mode", "replicate"]
        )
    from simplefsdp.train.resolve import resolve

    with pytest.raises(ValueError, match=r"data.seq_len 255 is not divisible by parallel.tp 2"):
        resolve(load_config(None, ["--parallel.tp", "2", "--data.seq_len", "255"]), 2)
    ok = load_config(
        None,
        ["--parallel.tp", "2", "--data.seq_len", "255", "--parallel.sequence_parallel", "false"],
    )
    assert ok.parallel.tp == 2 and not ok.parallel.sequence_parallel
    assert config_warnings(load_config(None, ["--parallel.loss_parallel", "true"])) == [
        "parallel.loss_parallel is only used with parallel.tp > 1"
    ]


def test_train_preflight_checks_the_model_splits():
    from simplefsdp.train.cli import preflight
    from simplefsdp.train.config import load_config

    # the debug model has 8 heads, 4 KV heads, feed-forward 768
    job = load_config(None, ["--parallel.tp", "8", "--data.seq_len", "256"])
    with pytest.raises(ValueError) as exc:
        preflight(job, world_size=8, local_world_size=8)
    assert "n_kv_heads 4" in _one_line(exc) and "[1, 2, 4]" in str(exc.value)
    job = load_config(None, ["--parallel.tp", "3", "--parallel.sequence_parallel", "false"])
    with pytest.raises(ValueError, match="valid tensor-parallel sizes for 4 ranks: 1, 2, 4"):
        preflight(job, world_size=4, local_world_size=4)
