"""One process (a 1-rank gloo group): a compiled MoE model with
``ExpertParallel`` compiles once, whatever its routing (Note: [Expert
parallelism under torch.compile]); a frame past Dynamo's recompile limit
raises one line instead of running uncompiled (Note: [No silent fallback at
the recompile limit]). The 2-rank run is
``tests/distributed/test_moe_compile_recompiles.py`` (heavy)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import simplefsdp

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 5, 2, 8, 37, 4


def moe_args():
    """A tiny MoE decoder: one dense block, one MoE block of 4 experts, top 2."""
    from simplefsdp.models.moe import MoEArgs

    return MoEArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32,
        n_dense_layers=1, num_experts=EXPERTS, top_k=2, moe_hidden_dim=16,
    )  # fmt: skip


def train_compiled_moe(ep: int | None, steps: int) -> dict:
    """Train the compiled model (``ExpertParallel`` over ``ep`` ranks; ``None``:
    plain ``data_parallel``) on batches whose routing differs per step (and
    rank); Dynamo's graph count after each step and this rank's tokens per
    expert of each step."""
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.frontend.data_parallel import parallelize_experts_and_data
    from simplefsdp.models.moe import Transformer

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch.manual_seed(0)
    model = Transformer(moe_args())
    if ep is None:
        simplefsdp.data_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        # one rank: ExpertParallel over a 1-rank "ep" dim (its all-to-all path still runs)
        mesh = init_device_mesh("cpu", (1, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
        dp_mesh = mesh._flatten("dp")
        parallelize_experts_and_data(model, mesh, dp_mesh)
    simplefsdp.compile(model, backend="aot_eager", bucketing="none", fullgraph=False)
    moe = model.layers["1"].moe
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    graphs, seen = [], []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
        seen.append(tuple(int(c) for c in moe.tokens_per_expert))
        moe.tokens_per_expert.zero_()
    train_graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # validation: the inference graphs, compiled once
        for _ in range(3):
            model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
    from torch._C._distributed_c10d import _get_work_registry_size

    return {
        "unwaited_collectives": _get_work_registry_size(),
        "graphs": graphs,
        "inference_graphs": counters["stats"]["unique_graphs"] - train_graphs,
        "seen": seen,
        "loss": float(loss.detach()),
    }


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# About 8 s of CPU each; the loop variant (no ExpertParallel) is left to -m heavy.
@pytest.mark.parametrize(
    "ep",
    [1, pytest.param(None, marks=pytest.mark.heavy)],
    ids=["expert_parallel", "experts_loop"],
)
def test_compiled_moe_compiles_once_whatever_the_routing(one_rank, ep) -> None:
    res = train_compiled_moe(ep=ep, steps=STEPS)
    assert len(set(res["seen"])) == STEPS, res["seen"]  # other counts every step
    assert res["graphs"] == [res["graphs"][0]] * STEPS, res["graphs"]
    assert res["inference_graphs"] <= res["graphs"][0]
    assert res["unwaited_collectives"] == 0  # nothing left in flight


class _Switched(nn.Module):
    """Specialises on a string attribute after a graph break: each new value
    recompiles the frame after the break."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return getattr(F, self.act)(self.lin(x))


def test_recompile_limit_raises_one_line(one_rank) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.compiler.entry_points import RecompileLimitError

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), _Switched())
    simplefsdp.data_parallel(model, init_device_mesh("cpu", (1,)))
    simplefsdp.compile(model, backend="aot_eager", bucketing="none", fullgraph=False)
    x = torch.randn(2, 4)
    with torch._dynamo.config.patch(recompile_limit=2):
        model(x)
        model[1].act = "gelu"
        model(x)
        assert not torch._dynamo.config.fail_on_recompile_limit_hit  # scoped to the calls
        model[1].act = "silu"
        with pytest.raises(RecompileLimitError) as info:
            model(x)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("simplefsdp: rank 0: a frame of Sequential's compiled forward")
    assert "recompile_limit=2" in message
    assert isinstance(info.value.__cause__, torch._dynamo.exc.FailOnRecompileLimitHit)
