"""data_parallel on 2-4 CPU processes: parity with a single-process reference,
with torch FSDP2, and every documented edge case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import simplefsdp
from simplefsdp.testing import record_collectives, run_distributed
from toy_models import build, loss_fn, make_batch

LOCAL_BATCH = 2


def _mesh(mode: str):
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _local_slice(tensor: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return tensor[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def _global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _parity_body(model_name: str, mode: str, steps: int = 10) -> None:
    world = dist.get_world_size()
    ref = build(model_name)
    model = simplefsdp.data_parallel(copy.deepcopy(ref), _mesh(mode), mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    for step in range(steps):
        inputs, targets = make_batch(model_name, step, LOCAL_BATCH * world)
        loss = loss_fn(model_name, model(_local_slice(inputs)), _local_slice(targets))
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()

        ref_loss = loss_fn(model_name, ref(inputs), targets)
        ref_loss.backward()
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        ref_opt.step()
        ref_opt.zero_grad()

        torch.testing.assert_close(_global_mean(loss), ref_loss, rtol=1e-5, atol=1e-6)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for (name, param), (ref_name, ref_param) in zip(
        model.named_parameters(), ref.named_parameters()
    ):
        assert name == ref_name
        assert isinstance(param, DTensor)
        torch.testing.assert_close(param.full_tensor(), ref_param, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_name", ["mlp", "tied", "cnn"])
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_parity_with_single_process(model_name: str, mode: str) -> None:
    run_distributed(_parity_body, 2, args=(model_name, mode))


@pytest.mark.parametrize("model_name", ["mlp", "tied"])
def test_parity_hybrid_shard_4_ranks(model_name: str) -> None:
    run_distributed(_parity_body, 4, args=(model_name, "hybrid_shard"))


def _fsdp2_bitwise_body() -> list[float]:
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    ref = build("mlp")
    fsdp2 = copy.deepcopy(ref)
    fully_shard(fsdp2.in_proj)
    fully_shard(fsdp2.out_proj)
    fully_shard(fsdp2)
    ours = simplefsdp.data_parallel(copy.deepcopy(ref), mode="fully_shard")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (fsdp2, ours)]
    losses = []
    for step in range(10):
        inputs, targets = make_batch("mlp", step, LOCAL_BATCH * world)
        step_losses = []
        for model, opt in zip((fsdp2, ours), opts):
            loss = loss_fn("mlp", model(_local_slice(inputs)), _local_slice(targets))
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(_global_mean(loss))
        assert torch.equal(step_losses[0], step_losses[1]), (step, step_losses)
        losses.append(step_losses[1].item())
    for (name, p_fsdp2), (_, p_ours) in zip(fsdp2.named_parameters(), ours.named_parameters()):
        assert p_fsdp2.placements == p_ours.placements, name
        assert torch.equal(p_fsdp2.to_local(), p_ours.to_local()), name
    return losses


def test_fully_shard_bitwise_equal_to_fsdp2() -> None:
    losses = run_distributed(_fsdp2_bitwise_body, 2)
    assert len(losses[0]) == 10 and losses[0] == losses[1]  # the loss is rank-averaged


def _structure_body() -> None:
    rank = dist.get_rank()
    ref = build("tied")
    model = simplefsdp.data_parallel(copy.deepcopy(ref))
    # Names and keys are the unwrapped model's; values are sharded DTensors.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with record_collectives() as record:
        state = model.state_dict()
    assert record.calls == [], record.calls
    assert list(state) == list(ref.state_dict())
    embed = state["embed.weight"]
    assert isinstance(embed, DTensor) and embed.placements == (Shard(0),)
    assert embed.to_local().shape == ((10, 10) if rank == 0 else (9, 10))  # 19 rows, uneven
    assert state["temperature"].placements == (Replicate(),)  # 0-d is replicated
    assert state["norm.bias"].to_local().shape == (5,)
    assert not isinstance(state["offset"], DTensor)  # buffers stay plain
    # Tied parameters stay one object.
    assert model.embed._parameters["weight"] is model.head._parameters["weight"]
    assert isinstance(model.head, nn.Linear) and type(model.head).__name__ == "Linear"
    # Reads inside forward are the unsharded local tensors.
    assert model.embed.weight.shape == (19, 10) and not isinstance(model.embed.weight, DTensor)
    with simplefsdp.disable_parametrization():
        assert isinstance(model.embed.weight, DTensor)
    # Tied weight: one all-gather per use, and both uses contribute gradients.
    tokens, targets = make_batch("tied", 0, 4)
    with record_collectives() as record:
        loss_fn("tied", model(tokens), targets).backward()
    loss_fn("tied", ref(tokens), targets).backward()
    grad = model.embed._parameters["weight"].grad
    torch.testing.assert_close(grad.full_tensor(), ref.embed.weight.grad)
    assert record.count("reduce_scatter") >= 1
    # deepcopy of a wrapped model works and stays wrapped.
    clone = copy.deepcopy(model)
    assert type(clone.head).__name__ == "Linear"
    assert isinstance(clone.state_dict()["head.weight"], DTensor)


def test_names_state_dict_tied_and_uneven() -> None:
    run_distributed(_structure_body, 2)


def _frozen_body() -> None:
    ref = build("mlp")
    ref.in_proj.requires_grad_(False)
    model = simplefsdp.data_parallel(copy.deepcopy(ref))
    before = model.in_proj._parameters["weight"].to_local().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        inputs, targets = make_batch("mlp", step, 2 * LOCAL_BATCH)
        with record_collectives() as record:
            loss_fn("mlp", model(_local_slice(inputs)), _local_slice(targets)).backward()
        # 4 gathers (all params), 2 reductions (only out_proj's weight and bias).
        assert record.count("all_gather") == 4, record.calls
        assert record.count("reduce_scatter") == 2, record.calls
        opt.step()
        opt.zero_grad()
        loss_fn("mlp", ref(inputs), targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert model.in_proj._parameters["weight"].grad is None
    assert torch.equal(model.in_proj._parameters["weight"].to_local(), before)
    torch.testing.assert_close(
        model.out_proj._parameters["weight"].full_tensor(), ref.out_proj.weight
    )


def test_frozen_parameters_are_not_reduced() -> None:
    run_distributed(_frozen_body, 2)


def _mixed_precision_body(reduce_dtype: torch.dtype | None, output_dtype) -> None:
    world = dist.get_world_size()
    policy = simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, output_dtype=output_dtype
    )
    ref = build("mlp")
    model = simplefsdp.data_parallel(copy.deepcopy(ref), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(10):
        inputs, targets = make_batch("mlp", step, LOCAL_BATCH * world)
        with record_collectives() as record:
            out = model(_local_slice(inputs))  # fp32 inputs are cast to bf16
            loss = loss_fn("mlp", out, _local_slice(targets))
            loss.backward()
        assert out.dtype == (output_dtype or torch.bfloat16)
        assert record.dtypes("all_gather") == {torch.bfloat16}
        assert record.dtypes("reduce_scatter") == {reduce_dtype or torch.bfloat16}
        for param in model.parameters():
            assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn("mlp", ref(inputs), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(_global_mean(loss), ref_loss, rtol=3e-2, atol=3e-2)
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(
    ("reduce_dtype", "output_dtype"),
    [(torch.float32, torch.float32), (None, None)],
    ids=["reduce_fp32-out_fp32", "reduce_bf16"],
)
def test_mixed_precision_dtypes(reduce_dtype, output_dtype) -> None:
    run_distributed(_mixed_precision_body, 2, args=(reduce_dtype, output_dtype))


def _reduce_sum_body() -> None:
    world = dist.get_world_size()
    avg_model = simplefsdp.data_parallel(build("mlp"), reduce_op="avg")
    sum_model = simplefsdp.data_parallel(build("mlp"), reduce_op="sum")
    inputs, targets = make_batch("mlp", 0, LOCAL_BATCH * world)
    for model in (avg_model, sum_model):
        loss_fn("mlp", model(_local_slice(inputs)), _local_slice(targets)).backward()
    for p_avg, p_sum in zip(avg_model.parameters(), sum_model.parameters()):
        torch.testing.assert_close(p_sum.grad.to_local(), p_avg.grad.to_local() * world)


def test_reduce_op_sum() -> None:
    run_distributed(_reduce_sum_body, 2)


def _deterministic_init(module: nn.Module) -> None:
    """Shard-aware deterministic init: the same values whatever the world size."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            full = torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape)
            full = torch.sin(full + len(name)) * 0.3
            if isinstance(param, DTensor):
                full = torch.distributed.tensor.distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(full)


def _meta_init_body() -> None:
    ref = build("tied")
    _deterministic_init(ref)
    with torch.device("meta"):
        model = build("tied")
    simplefsdp.data_parallel(model)
    model.to_empty(device="cpu")
    model.offset.copy_(ref.offset)  # buffers are re-initialised by the user too
    with simplefsdp.disable_parametrization():
        _deterministic_init(model)
    assert model.embed._parameters["weight"] is model.head._parameters["weight"]
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        assert param.device.type == "cpu", name
        torch.testing.assert_close(param.full_tensor(), ref_param, rtol=0, atol=0)
    tokens, targets = make_batch("tied", 0, 2 * LOCAL_BATCH)
    loss = loss_fn("tied", model(_local_slice(tokens)), _local_slice(targets))
    ref_loss = loss_fn("tied", ref(tokens), targets)
    torch.testing.assert_close(_global_mean(loss), ref_loss)


def test_meta_device_init() -> None:
    run_distributed(_meta_init_body, 2)


def _dcp_round_trip_body(tmp_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    world = dist.get_world_size()
    model = simplefsdp.data_parallel(build("tied"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        tokens, targets = make_batch("tied", step, LOCAL_BATCH * world)
        loss_fn("tied", model(_local_slice(tokens)), _local_slice(targets)).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_dir)

    torch.manual_seed(123)  # a different init, overwritten by the load
    fresh = simplefsdp.data_parallel(build("tied"))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=tmp_dir)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
        st, fst = opt.state[p], fresh_opt.state[q]
        assert torch.equal(st["exp_avg"].to_local(), fst["exp_avg"].to_local()), name
        assert torch.equal(st["exp_avg_sq"].to_local(), fst["exp_avg_sq"].to_local()), name
    # Both continue identically.
    tokens, targets = make_batch("tied", 5, LOCAL_BATCH * world)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        loss_fn("tied", m(_local_slice(tokens)), _local_slice(targets)).backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


def test_distributed_checkpoint_round_trip(tmp_path) -> None:
    run_distributed(_dcp_round_trip_body, 2, args=(str(tmp_path / "ckpt"),))


def _bad_input_body() -> None:
    mesh_1d = init_device_mesh("cpu", (dist.get_world_size(),))
    with pytest.raises(ValueError, match="unknown mode 'zero3'"):
        simplefsdp.data_parallel(build("mlp"), mode="zero3")
    with pytest.raises(ValueError, match="needs a 2-D mesh"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, mode="hybrid_shard")
    with pytest.raises(ValueError, match="needs a 2-D mesh"):
        simplefsdp.data_parallel(build("mlp"), mode="hybrid_shard")
    with pytest.raises(ValueError, match="shard_dim=2 is out of range"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, shard_dim=2)
    with pytest.raises(ValueError, match="shard_dim=-1"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, shard_dim=-1)
    with pytest.raises(TypeError, match="shard_dim must be an int"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, shard_dim="0")
    with pytest.raises(ValueError, match="unknown reduce_op 'mean'"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, reduce_op="mean")
    with pytest.raises(TypeError, match="mp_policy"):
        simplefsdp.data_parallel(build("mlp"), mesh_1d, mp_policy={"param_dtype": "bf16"})
    with pytest.raises(TypeError, match="expects an nn.Module"):
        simplefsdp.data_parallel(lambda x: x, mesh_1d)
    model = simplefsdp.data_parallel(build("mlp"), mesh_1d)
    with pytest.raises(ValueError, match="already wrapped"):
        simplefsdp.data_parallel(model, mesh_1d)
    with pytest.raises(ValueError, match="already wrapped"):
        simplefsdp.data_parallel(nn.Sequential(model), mesh_1d)
    # shard_dim=1 is valid and shards columns.
    wide = simplefsdp.data_parallel(build("mlp"), mesh_1d, shard_dim=1)
    assert wide.in_proj._parameters["weight"].placements == (Shard(1),)
    assert wide.in_proj._parameters["bias"].placements == (Shard(0),)


def test_bad_inputs_raise_clear_errors() -> None:
    run_distributed(_bad_input_body, 2)


def _placement_fn_body() -> None:
    """One parameter sharded on dim 1 by ``placement_fn`` trains as one process does."""
    world = dist.get_world_size()
    ref = build("mlp")
    first = next(name for name, p in ref.named_parameters() if p.ndim == 2)

    def placement_fn(fqn, param):
        return Shard(1) if fqn == first else None

    model = simplefsdp.data_parallel(
        copy.deepcopy(ref), _mesh("fully_shard"), placement_fn=placement_fn
    )
    params = dict(model.named_parameters())
    assert params[first].placements == (Shard(1),)
    full = ref.get_parameter(first).shape
    rows = torch.empty(full[1]).chunk(world)[dist.get_rank()].numel()
    assert params[first].to_local().shape == (full[0], rows)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    for step in range(3):
        inputs, targets = make_batch("mlp", step, LOCAL_BATCH * world)
        loss = loss_fn("mlp", model(_local_slice(inputs)), _local_slice(targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn("mlp", ref(inputs), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(_global_mean(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), ref.get_parameter(name), rtol=1e-5, atol=1e-6
        )


def test_placement_fn_shards_one_parameter_on_dim_1() -> None:
    run_distributed(_placement_fn_body, 2)


def _bad_placement_body() -> None:
    with pytest.raises(ValueError, match=r"placement_fn gave Shard\(dim=5\)"):
        simplefsdp.data_parallel(build("mlp"), placement_fn=lambda fqn, p: Shard(5))


def test_placement_fn_refuses_a_bad_placement() -> None:
    run_distributed(_bad_placement_body, 2)
