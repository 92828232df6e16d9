"""simplefsdp composed with tensor parallelism (dp2 x tp2 on 4 CPU processes).

Each rank trains the 2-D model on its data-parallel slice of a global batch;
the reference is the plain model trained in the same process on the whole
batch. Parameters are compared through ``full_tensor()`` after the steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

STEPS, BATCH, SEQ = 6, 4, 16


def _llama():
    from simplefsdp.models.llama3 import Transformer, get_config

    torch.manual_seed(0)
    return Transformer(get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2))


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_llama(model, forward, batches, rows, loss_parallel: bool) -> list[float]:
    from simplefsdp.engines import clip_grad_norm_
    from simplefsdp.models.llama3 import loss_parallel_context

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for tokens in batches:
        tokens = tokens[rows]
        with loss_parallel_context(loss_parallel):
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(_full(loss.detach())))
    return losses


def _llama_2d(mesh, sequence_parallel, loss_parallel, backend):
    import simplefsdp
    from simplefsdp.models.llama3 import apply_tensor_parallel

    model = _llama()
    apply_tensor_parallel(
        model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    simplefsdp.data_parallel(model, mesh["dp"])
    forward = model
    if backend is not None:
        forward = simplefsdp.compile(model, backend=backend, bucketing="auto")
    return model, forward


def _llama_parity_body(sequence_parallel: bool, loss_parallel: bool, backends: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    ref = _llama()
    batches = _batches(ref.vocab_size)
    ref_losses = _train_llama(ref, ref, batches, slice(None), False)
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    results = {}
    for backend in (None, *backends):
        torch._dynamo.reset()
        model, forward = _llama_2d(mesh, sequence_parallel, loss_parallel, backend)
        losses = _train_llama(model, forward, batches, rows, loss_parallel)
        params = {k: _full(v.detach()) for k, v in model.named_parameters()}
        results[backend or "eager"] = (losses, params)
    # the data-parallel mean of the per-rank losses is the global-batch loss
    out = {}
    for name, (losses, params) in results.items():
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for fqn, value in params.items():
            torch.testing.assert_close(
                value, ref_params[fqn], rtol=1e-4, atol=1e-5, msg=lambda m, fqn=fqn: f"{fqn}: {m}"
            )
        out[name] = max(
            (value - ref_params[fqn]).abs().max().item() for fqn, value in params.items()
        )
    if "aot_eager" in results:  # the compiled 2-D step does exactly what eager 2-D does
        eager, compiled = results["eager"][1], results["aot_eager"][1]
        for fqn in eager:
            assert torch.equal(eager[fqn], compiled[fqn]), fqn
    return out


def _llama_cases_body(cases):
    return [_llama_parity_body(*case) for case in cases]


def test_llama_2d_matches_single_process():
    # One launch for both cases (4 ranks start slowly on 2 cores). Inductor is
    # covered on the smaller model below.
    cases = [(True, False, ("aot_eager",)), (False, True, ())]
    results = run_distributed(_llama_cases_body, world_size=4, args=(cases,), timeout_s=600)
    assert [set(r) for r in results[0]] == [{"eager", "aot_eager"}, {"eager"}]


class UnevenMLP(nn.Module):
    """Not a transformer: a norm, an uneven column-wise linear and a row-wise one."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 10)  # 10 rows: 5 per TP rank, 3 + 2 per DP rank
        self.down = nn.Linear(10, 6)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


def _mlp_hybrid_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import simplefsdp

    # (replicate 2, shard 1, tp 2): the cross-replica all-reduce plus TP
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
    replica = mesh["rep"].get_local_rank()
    torch.manual_seed(0)
    ref = UnevenMLP()
    x_all = torch.randn(STEPS, 4, 8, generator=torch.Generator().manual_seed(3))
    finals = {}
    for backend in (None, "aot_eager", "inductor"):
        torch._dynamo.reset()
        model = UnevenMLP()
        model.load_state_dict(ref.state_dict())
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        simplefsdp.data_parallel(model, mesh["rep", "shard"], mode="hybrid_shard")
        forward = model if backend is None else simplefsdp.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in x_all:
            forward(x[replica * 2 : replica * 2 + 2]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        finals[backend or "eager"] = {k: _full(v.detach()) for k, v in model.named_parameters()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in x_all:
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # mixed precision composes: bf16 gathers and compute, fp32 shards and reduction
    model = UnevenMLP()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    policy = simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    simplefsdp.data_parallel(model, mesh["rep", "shard"], mode="hybrid_shard", mp_policy=policy)
    x = x_all[0][replica * 2 : replica * 2 + 2]
    out = model(x)
    out.pow(2).mean().backward()
    assert out.dtype == torch.float32
    for fqn, param in model.named_parameters():
        assert param.dtype == param.grad.dtype == torch.float32, fqn
        assert param.grad.placements == param.placements, fqn
    ref_out = ref(x_all[0])[replica * 2 : replica * 2 + 2]
    torch.testing.assert_close(_full(out), ref_out, rtol=2e-2, atol=2e-2)

    for fqn, value in finals["eager"].items():
        expected = dict(ref.named_parameters())[fqn].detach()
        torch.testing.assert_close(value, expected, msg=fqn)
        torch.testing.assert_close(finals["inductor"][fqn], expected, msg=fqn)
        assert torch.equal(value, finals["aot_eager"][fqn]), fqn  # compiled 2-D == eager 2-D
    return sorted(finals["eager"])


def test_hybrid_and_tp_on_a_model_that_is_not_a_transformer():
    results = run_distributed(_mlp_hybrid_body, world_size=4, timeout_s=600)
    assert results[0] == [
        "down.bias",
        "down.weight",
        "norm.bias",
        "norm.weight",
        "up.bias",
        "up.weight",
    ]
