"""A MoE model with expert parallelism composed with ``data_parallel`` on two
meshes: ep 2 x dp_shard_mod_ep 2 on 4 CPU processes against one process
training the same model on the global batch (router bias update included).

Dense parameters are sharded over the 4 data-parallel ranks, expert
parameters over the 2 ranks that hold the same experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

STEPS, BATCH, SEQ = 6, 4, 8


def _args():
    from simplefsdp.models.moe import MoEArgs

    return MoEArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=37,
        max_seq_len=32,
        n_dense_layers=1,
        num_experts=4,
        top_k=2,
        moe_hidden_dim=16,
        bias_update_rate=1e-2,
    )


def _model():
    from simplefsdp.models.moe import Transformer

    torch.manual_seed(0)
    return Transformer(_args())


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, forward, batches, rows, opt=None):
    from simplefsdp.engines import clip_grad_norm_
    from simplefsdp.models.moe import update_expert_bias

    opt = opt or torch.optim.SGD(model.parameters(), lr=0.2)
    losses, loads = [], []
    for tokens in batches:
        tokens = tokens[rows]
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        loads.append(update_expert_bias(model)[0].tokens_per_expert)
        losses.append(float(loss.detach()))
    return losses, loads


def _moe_2d(mesh, dp_mesh, backend):
    import simplefsdp
    from simplefsdp.frontend.data_parallel import parallelize_experts_and_data

    model = parallelize_experts_and_data(_model(), mesh, dp_mesh)
    forward = model
    if backend is not None:
        forward = simplefsdp.compile(model, backend=backend, fullgraph=False)
    return model, forward


def _parity_body(backends, ep):

    from simplefsdp.frontend.expert_parallel import build_expert_parallel_mesh

    world = dist.get_world_size()
    mesh, dp_mesh = build_expert_parallel_mesh("cpu", world, ep, _args().num_experts)
    rank = dist.get_rank()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ref = _model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 37, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    ref_losses, ref_loads = _train(ref, ref, batches, slice(None))
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    ref_bias = ref.layers["1"].moe.expert_bias.clone()
    assert ref_bias.abs().sum() > 0  # the bias moved
    worst = {}
    for backend in (None, *backends):
        torch._dynamo.reset()
        model, forward = _moe_2d(mesh, dp_mesh, backend)
        stored = dict(model.named_parameters())
        w1 = stored["layers.1.moe.experts.w1"]
        assert w1.to_local().shape[0] == 4 // world  # 4 experts / ep / dp_shard_mod_ep
        assert w1.device_mesh.mesh_dim_names == ("dp_shard_mod_ep", "ep")
        assert stored["layers.0.attention.wq.weight"].to_local().shape[0] == 32 // world
        losses, loads = _train(model, forward, batches, rows)
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        # Global token counts per expert, each step (every rank's reference
        # counted the whole batch and update_expert_bias summed the copies).
        assert loads == [tuple(c / world for c in load) for load in ref_loads]
        torch.testing.assert_close(model.layers["1"].moe.expert_bias, ref_bias)
        diffs = []
        for fqn, param in model.named_parameters():
            full = _full(param.detach())
            torch.testing.assert_close(
                full, ref_params[fqn], rtol=1e-4, atol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}"
            )
            diffs.append((full - ref_params[fqn]).abs().max().item())
        worst[backend or "eager"] = max(diffs)
    return worst


def test_moe_ep2_dp2_matches_one_process():
    results = run_distributed(_parity_body, world_size=4, args=((), 2), timeout_s=600)
    print("ep2 x dp2, max |param - reference| after 6 steps:", results[0])


@pytest.mark.heavy
def test_moe_ep_world_compiled_matches_one_process():
    # ep = world size (dp_shard_mod_ep = 1), compiled with aot_eager: 2
    # processes keep the compile time down.
    results = run_distributed(_parity_body, world_size=2, args=(("aot_eager",), 2), timeout_s=600)
    print("ep2 x dp1, max |param - reference| after 6 steps:", results[0])


def _checkpoint_body(folder):
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.checkpoint import load, save

    def build(ep):
        mesh = init_device_mesh("cpu", (2 // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
        dp_mesh = mesh[("dp_shard_mod_ep", "ep")]._flatten("dp")
        model, _ = _moe_2d(mesh, dp_mesh, None)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def moments(model, opt):
        return {k: _full(opt.state[p]["exp_avg"]).clone() for k, p in model.named_parameters()}

    model, opt = build(2)
    import simplefsdp

    with pytest.raises(ValueError, match="has expert-parallel parameters; the eager executor"):
        simplefsdp.eager(model)
    tokens = torch.randint(0, 37, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    rows = slice(dist.get_rank(), dist.get_rank() + 1)
    _train(model, model, [tokens], rows, opt)
    saved = {k: _full(v.detach()).clone() for k, v in model.state_dict().items()}
    saved_moments = moments(model, opt)
    assert saved["layers.1.moe.expert_bias"].abs().sum() > 0
    save(model, opt, f"{folder}/ep2")
    for ep, src, dst in ((1, "ep2", "ep1"), (2, "ep1", None)):
        model, opt = build(ep)
        load(model, opt, f"{folder}/{src}")
        for key, value in model.state_dict().items():
            assert torch.equal(_full(value.detach()), saved[key]), (ep, key)
        for key, value in moments(model, opt).items():
            assert torch.equal(value, saved_moments[key]), (ep, key)
        if dst is not None:
            save(model, opt, f"{folder}/{dst}")
    return True


def test_checkpoint_moves_between_ep_degrees(tmp_path):
    # ep 2 -> ep 1 -> ep 2 on 2 processes, model and optimizer state, bitwise.
    assert run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),), timeout_s=300)


def _meta_bf16_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import simplefsdp
    from simplefsdp.frontend.expert_parallel import ExpertParallel, build_expert_parallel_mesh
    from simplefsdp.models.moe import Transformer

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dp_mesh = mesh[("dp_shard_mod_ep", "ep")]._flatten("dp")
    with torch.device("meta"):
        model = Transformer(_args().replace(dim=64, moe_hidden_dim=32))
        dense = Transformer(_args())
    with pytest.raises(ValueError, match="has no experts sharded by ExpertParallel"):
        simplefsdp.data_parallel(dense, dp_mesh, expert_mesh=mesh["dp_shard_mod_ep"])
    parallelize_module(model.layers["1"].moe.experts, mesh["ep"], ExpertParallel())
    with pytest.raises(ValueError, match=r"pass expert_mesh=mesh\['dp_shard_mod_ep'\]"):
        simplefsdp.data_parallel(model, dp_mesh)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=3"):
        build_expert_parallel_mesh("cpu", 2, 3, 4)
    with pytest.raises(ValueError, match="ep=2 does not divide the 3 data-parallel ranks"):
        build_expert_parallel_mesh("cpu", 3, 2, 4)
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    simplefsdp.data_parallel(model, dp_mesh, expert_mesh=mesh["dp_shard_mod_ep"], mp_policy=policy)
    model.to_empty(device="cpu")
    with simplefsdp.disable_parametrization():
        torch.manual_seed(0)
        model.init_weights()
    w1 = dict(model.named_parameters())["layers.1.moe.experts.w1"]
    assert w1.dtype == torch.float32 and w1.to_local().abs().sum() > 0
    tokens = torch.randint(
        0, 37, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().mean().backward()
    grad = w1.grad
    assert grad.dtype == torch.float32 and grad.to_local().abs().sum() > 0
    return True


@pytest.mark.heavy
def test_meta_init_and_bf16_with_experts():
    assert run_distributed(_meta_bf16_body, world_size=2, timeout_s=300)


def _tp_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import simplefsdp
    from simplefsdp.frontend.expert_parallel import apply_expert_parallel

    # dp 2 x tp 2; the 2 data-parallel ranks form one EP group (ep 2).
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep", "tp"))
    dp_mesh = mesh[("dp_shard_mod_ep", "ep")]._flatten("dp")
    dp_rank = dp_mesh.get_local_rank()
    ref = _model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 37, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    ref_losses, _ = _train(ref, ref, batches, slice(None))
    model = _model()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, mesh["tp"], plan)
    assert apply_expert_parallel(model, mesh["ep"]) == ["layers.1.moe.experts"]
    simplefsdp.data_parallel(model, dp_mesh, expert_mesh=mesh["dp_shard_mod_ep"])
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    losses, _ = _train(model, model, batches, rows)
    mean = torch.tensor(losses)
    dist.all_reduce(mean)  # each loss counted once per TP rank
    torch.testing.assert_close(mean / 4, torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    worst = 0.0
    for fqn, param in model.named_parameters():
        full = _full(param.detach())
        torch.testing.assert_close(full, ref_params[fqn], rtol=1e-4, atol=1e-5)
        worst = max(worst, (full - ref_params[fqn]).abs().max().item())
    return worst


@pytest.mark.heavy
def test_moe_with_tensor_parallel_attention():
    results = run_distributed(_tp_body, world_size=4, timeout_s=600)
    print("dp2 x tp2 (attention) x ep2, max |param - reference|:", results[0])
