"""Expert tensor parallelism: one mixture-of-experts layer split over 2 TP
ranks (routed experts on their hidden dim, shared experts like a dense
feed-forward network, the router replicated) gives the output and every
gradient one process gives: the input's, the router gate's (whose routing
weights scale the experts' partial outputs), the experts' slices and the
output bias GPT-OSS adds once.

The layer is tested alone, so both runs route every token alike (a whole
model's rounding differences could flip near-tied choices), with the gate
at its initial scale, so the routing weights' gradient is not saturated
away (the model-level tests scale the gate up for decisive routing, which
leaves the router nearly untrained).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simplefsdp.testing import run_distributed

WORLD, BATCH, SEQ = 2, 2, 8
_KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class _Holder(nn.Module):
    """A decoder's view of one layer: the TP plan's FQNs start at ``moe``."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _layer(family: str) -> nn.Module:
    from simplefsdp.models.registry import resolve_flavor

    torch.manual_seed(0)
    if family == "gpt_oss":
        from simplefsdp.models.gpt_oss.model import GptOssMoE

        _, config = resolve_flavor(
            "gpt_oss_debug", dim=32, num_experts=4, top_k=2, moe_hidden_dim=16, load_balance="bias"
        )
        moe = GptOssMoE(config)
        moe.init_weights(0.02, "cpu")
        with torch.no_grad():
            moe.experts.mlp1_bias.normal_(0, 0.5)
            moe.experts.mlp2_bias.normal_(0, 0.5)
            moe.router.gate.bias.normal_(0, 0.5)
    else:
        from simplefsdp.models.common.moe import MoE

        _, config = resolve_flavor(
            "moe_debug",
            dim=32,
            num_experts=4,
            top_k=2,
            moe_hidden_dim=16,
            num_shared_experts=1,
            score_func="softmax",
            load_balance="aux_loss",
        )
        moe = MoE(config)
        moe.init_weights(0.02, "cpu")
    return _Holder(moe)


def _run(holder: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_(True)
    out = holder(x)
    out.backward(grad)
    return out.detach(), x.grad


class _Collectives:
    """Records each functional collective's op name and input size."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        sizes = self.sizes = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__
                if func.namespace == "_c10d_functional" and name.split(".")[0] in _KINDS:
                    sizes.append((name.split(".")[0], args[0].numel()))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _body(families: tuple[str, ...]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from simplefsdp.models.common.tensor_parallel import _styles_for, moe_plan

    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, 32, generator=g)
    grad = torch.randn(BATCH, SEQ, 32, generator=g)
    worst: dict[str, float] = {}
    for family in families:
        for sequence_parallel in (True, False):
            reference = _layer(family)
            want_out, want_dx = _run(reference, x, grad)
            holder = _layer(family)
            seq = Shard(1) if sequence_parallel else Replicate()
            parallelize_module(holder, mesh, moe_plan("moe", holder.moe, seq, _styles_for(holder)))
            experts = dict(holder.moe.experts.named_parameters())
            assert all(isinstance(p, DTensor) for p in experts.values()), experts
            assert not isinstance(holder.moe.router.gate.weight, DTensor)
            rows = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)
            local_x = x[:, rows] if sequence_parallel else x
            local_grad = grad[:, rows] if sequence_parallel else grad
            recorder = _Collectives()
            with recorder.mode:
                out, dx = _run(holder, local_x, local_grad)
            want_out, want_dx = (
                (want_out[:, rows], want_dx[:, rows]) if sequence_parallel else (want_out, want_dx)
            )
            diffs = {
                "output": (out - want_out).abs().max(),
                "input grad": (dx - want_dx).abs().max(),
            }
            params = dict(reference.named_parameters())
            for name, param in holder.named_parameters():
                assert param.grad is not None, name
                want = params[name].grad
                assert want.abs().max() > 0, name  # a gradient the test can see
                diffs[name] = (_full(param.grad) - want).abs().max() / want.abs().max()
            key = f"{family}, sequence_parallel={sequence_parallel}"
            worst[key] = {name: float(d) for name, d in diffs.items()}
            worst[key + ", collectives"] = recorder.sizes
    return worst


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_body, world_size=WORLD, args=(("moe", "gpt_oss"),), timeout_s=300)


@pytest.mark.parametrize("family", ["moe", "gpt_oss"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_expert_tp_layer_matches_one_process(results, family: str, sequence_parallel: bool) -> None:
    for rank_result in results:
        diffs = rank_result[f"{family}, sequence_parallel={sequence_parallel}"]
        # Same math, the hidden dim's sum split over two ranks: fp32 rounding.
        bad = {name: d for name, d in diffs.items() if d > 1e-5}
        assert not bad, bad


@pytest.mark.parametrize("family", ["moe", "gpt_oss"])
def test_expert_tp_moves_the_layer_input_not_the_routed_tokens(results, family: str) -> None:
    # Forward: the input gathered, the output reduced; backward the same
    # pair, the shared experts' input gradient all-reduced (moe) and the
    # routing weights' (BATCH x SEQ x top_k floats). None carries the
    # routed tokens (top_k times the input: what torchtitan's expert TP
    # all-reduces in backward).
    whole = BATCH * SEQ * 32  # the layer's input, gathered
    for rank_result in results:
        sizes = rank_result[f"{family}, sequence_parallel=True, collectives"]
        names = sorted(name for name, _ in sizes)
        shared = ["all_reduce"] if family == "moe" else []
        assert names == sorted(
            ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"] * 2 + ["all_reduce"] + shared
        ), sizes
        assert max(size for _, size in sizes) <= whole, sizes
        assert sum(size for _, size in sizes) <= (4 + len(shared)) * whole + BATCH * SEQ * 2, sizes
