"""Expert parallelism (``ExpertParallel``) on 2 CPU processes against one process.

Each rank routes its own tokens, some experts receive no tokens at all; the
reference runs the unsharded experts on every rank's tokens in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

DIM, HIDDEN, EXPERTS = 8, 12, 4
# Tokens per expert on each rank: expert 1 gets none from anyone, expert 3
# none from rank 0, so one rank receives nothing for one of its experts.
COUNTS = {0: [3, 0, 5, 0], 1: [2, 0, 1, 4]}


class LoopExperts(nn.Module):
    """A user's experts module following the convention: 3-D weights, forward
    on ``(tokens sorted by expert, num_tokens_per_expert)``, local weights."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        up = self.up.to_local() if hasattr(self.up, "to_local") else self.up
        down = self.down.to_local() if hasattr(self.down, "to_local") else self.down
        chunks = torch.split(x, num_tokens_per_expert.tolist())
        return torch.cat([F.gelu(c @ up[e]) @ down[e] for e, c in enumerate(chunks)])


def _experts(kind: str) -> nn.Module:
    from simplefsdp.models.moe import GroupedExperts

    torch.manual_seed(0)
    if kind == "user":
        return LoopExperts()
    module = GroupedExperts(DIM, HIDDEN, EXPERTS)
    module.init_weights(0.2)
    return module


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(sum(COUNTS[rank]), DIM, generator=torch.Generator().manual_seed(rank + 1))


def _body(kinds):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from simplefsdp.frontend.expert_parallel import ExpertParallel

    rank, ep = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    worst = {}
    for kind in kinds:
        ref = _experts(kind)
        ref_out, ref_in_grads = [], []
        for r in range(ep):
            x = _tokens(r).requires_grad_()
            out = ref(x, torch.tensor(COUNTS[r]))
            (out * out.detach().cos()).sum().backward()
            ref_out.append(out.detach())
            ref_in_grads.append(x.grad)
        model = parallelize_module(_experts(kind), mesh["ep"], ExpertParallel())
        local = model.up if kind == "user" else model.w1
        assert local.to_local().shape[0] == EXPERTS // ep
        x = _tokens(rank).requires_grad_()
        out = model(x, torch.tensor(COUNTS[rank]))
        (out * out.detach().cos()).sum().backward()
        torch.testing.assert_close(out, ref_out[rank])
        torch.testing.assert_close(x.grad, ref_in_grads[rank])
        diffs = [(out - ref_out[rank]).abs().max().item()]
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            # "avg": the expert gradient is averaged over the EP ranks' tokens.
            full = p.grad.full_tensor()
            torch.testing.assert_close(full, q.grad / ep, msg=lambda m, n=name: f"{n}: {m}")
            diffs.append((full - q.grad / ep).abs().max().item())
        worst[kind] = max(diffs)
    return worst


def test_expert_parallel_matches_one_process():
    results = run_distributed(_body, world_size=2, args=(("grouped", "user"),), timeout_s=180)
    print("max |ep2 - 1 process|:", results)


def _bad_layout_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from simplefsdp.frontend.expert_parallel import ExpertParallel
    from simplefsdp.models.moe import GroupedExperts

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    with pytest.raises(ValueError, match=r"num_experts=3\) is not divisible by ep=2"):
        parallelize_module(GroupedExperts(4, 4, 3), mesh, ExpertParallel())


def test_bad_layout_is_one_line():
    run_distributed(_bad_layout_body, world_size=2, timeout_s=120)


def test_check_expert_parallel_layout():
    from simplefsdp.frontend.expert_parallel import check_expert_parallel_layout

    check_expert_parallel_layout(8, 2, dp=4)
    with pytest.raises(
        ValueError, match="num_experts=6 is not divisible by ep=4; valid ep: 1, 2, 3, 6"
    ):
        check_expert_parallel_layout(6, 4)
    with pytest.raises(ValueError, match="ep=4 does not divide the 6 data-parallel ranks"):
        check_expert_parallel_layout(8, 4, dp=6)
    with pytest.raises(ValueError, match="ep must be an int >= 1"):
        check_expert_parallel_layout(8, 0)
