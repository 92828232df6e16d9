"""Ranks that read different parameters in one forward (Note: [Same gathers
on every rank]), on 2 CPU processes.

The model is a mixture-of-experts layer that runs only the experts its
tokens are routed to, as Hugging Face Mixtral does. The routing reads the
first input feature, so each rank's data decides its experts. Rank 0 uses
expert 0 and rank 1 uses expert 3: both experts have the same shape, so
their collectives pair up without any backend error. Every executor must
raise ``RankDivergenceError`` before backward, leaving the parameters as
they were. Without the check, the losses differ from one process's
(``check_ranks=False``: the silent failure the check exists for). Ranks
that route alike, and the eager executor gathering the whole MoE layer as
one bucket, train as one process does.

A layer that runs every expert on every rank, each with the rows routed to
it (none, on some ranks), is SPMD and must train as one process does, also
compiled around its graph breaks with more experts than Dynamo's recompile
limit (Note: [One swapped class per original class]).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.compiler import CostModel
from simplefsdp.frontend import rank_check
from simplefsdp.testing import run_distributed

DIM, EXPERTS = 8, 4


class MoE(nn.Module):
    """Top-1 routing by the first feature; runs only the experts it picked."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = x[:, 0].round().long().clamp(0, EXPERTS - 1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = pick == i
            if mask.any():
                out[mask] = expert(x[mask])
        return x + out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def _inputs(expert: int) -> torch.Tensor:
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(7 + expert))
    x[:, 0] = float(expert)
    return x


def _wrap(model: nn.Module, executor: str, check_ranks: bool = True) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = simplefsdp.data_parallel(model, mesh, check_ranks=check_ranks)
    if executor == "eager":
        simplefsdp.eager(model, bucketing="per_block")
    elif executor == "eager_moe_bucket":
        simplefsdp.eager(model, bucketing=MoE)
    elif executor == "compile_breaks":
        torch._dynamo.reset()
        simplefsdp.compile(model, backend="aot_eager", cost_model=CostModel(), fullgraph=False)
    return model


def _step(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Forward, backward and one SGD step (no momentum: an unused expert's
    zero gradient and a missing one update alike); the loss (times ``scale``)."""
    loss = model(x).square().mean() * scale
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None
    return loss.detach()


def _reference(experts: list[int]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two steps of one process on the ranks' inputs together, and the
    final parameters. Each rank's loss is the mean over its own rows, so
    the global loss is the mean of theirs."""
    torch.manual_seed(0)
    model = Net()
    x = torch.cat([_inputs(e) for e in experts])
    losses = [_step(model, x) for _ in range(2)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _divergent_body(executor: str) -> str:
    torch.manual_seed(0)
    model = _wrap(Net(), executor)
    before = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    x = _inputs(expert=3 * dist.get_rank())  # rank 0: expert 0, rank 1: expert 3
    try:
        _step(model, x)
    except simplefsdp.RankDivergenceError as exc:
        message = str(exc)
    else:
        return "no error"
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before), "parameters changed"
    assert all(p.grad is None for p in model.parameters()), "gradients were reduced"
    return message


@pytest.mark.parametrize("executor", ["uncompiled", "eager", "compile_breaks"])
def test_divergent_experts_raise_before_backward(executor: str) -> None:
    messages = run_distributed(_divergent_body, 2, args=(executor,))
    for message in messages:
        assert "gathered different parameters" in message, message
        assert "mixture-of-experts" in message and "simplefsdp.eager" in message


def _parity_body(executor: str, experts: list[int], check_ranks: bool) -> list[float]:
    torch.manual_seed(0)
    model = _wrap(Net(), executor, check_ranks)
    x = _inputs(experts[dist.get_rank()])
    losses = []
    for _ in range(2):
        loss = _step(model, x)
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
    ref_losses, ref_params = _reference(experts)
    torch.testing.assert_close(torch.tensor(losses), torch.stack(ref_losses))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach().full_tensor(), ref_params[name], msg=name)
    return losses


@pytest.mark.parametrize("executor", ["uncompiled", "eager", "compile_breaks"])
def test_same_experts_on_every_rank_train_as_one_process(executor: str) -> None:
    run_distributed(_parity_body, 2, args=(executor, [1, 1], True))


def _leftover_body() -> list[float]:
    # Reads no check covered (another model's forward, a pipeline stage's)
    # on one rank only must not count against the next forward.
    if dist.get_rank() == 1:
        rank_check.record("another model's parameter")
    return _parity_body("uncompiled", [1, 1], True)


def test_reads_before_the_forward_are_not_its_own() -> None:
    run_distributed(_leftover_body, 2)


def test_eager_executor_gathers_the_moe_layer_whole() -> None:
    """The remedy the error names: one bucket per MoE layer is gathered and
    reduced whole, so ranks routing to different experts still agree."""
    run_distributed(_parity_body, 2, args=("eager_moe_bucket", [0, 3], True))


def test_without_the_check_divergent_experts_train_wrong() -> None:
    with pytest.raises(RuntimeError, match="Tensor-likes are not close"):
        run_distributed(_parity_body, 2, args=("uncompiled", [0, 3], False))


def _fullgraph_body() -> str:
    model = _wrap(Net(), "uncompiled")
    torch._dynamo.reset()
    simplefsdp.compile(model, backend="aot_eager", cost_model=CostModel())
    try:
        model(_inputs(1))
    except Exception as exc:  # noqa: BLE001 - the note is what is tested
        return "\n".join(getattr(exc, "__notes__", []))
    return "no error"


def test_fullgraph_names_the_data_dependent_cause() -> None:
    for notes in run_distributed(_fullgraph_body, 2):
        assert "fullgraph=False" in notes and "every rank to read the same" in notes, notes


WIDE_EXPERTS = 12  # more than torch._dynamo.config.recompile_limit (8)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class EveryExpertMoE(nn.Module):
    """Runs every expert on the rows routed to it, as Hugging Face OLMoE and
    Qwen2-MoE do: the ``torch.where`` in the loop is a graph break, so each
    expert's ``forward`` is compiled as a frame of its own, on as many rows
    as the rank's data routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(WIDE_EXPERTS))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = x[:, 0].round().long().clamp(0, WIDE_EXPERTS - 1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (rows,) = torch.where(pick == i)
            out = out.index_add(0, rows, expert(x[rows]))
        return self.head(x + out)


def _routed_inputs(rank: int, step: int) -> torch.Tensor:
    """Rows routed by a draw per rank and step: each expert gets 0 to 3 rows,
    a different number on each rank and step."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    counts = torch.randint(0, 4, (WIDE_EXPERTS,), generator=generator).tolist()
    picks = [e for e, n in enumerate(counts) for _ in range(n)]
    x = torch.randn(len(picks), DIM, generator=generator)
    x[:, 0] = torch.tensor(picks, dtype=x.dtype)
    return x


def _every_expert_body() -> None:
    torch.manual_seed(0)
    reference = EveryExpertMoE()
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(
        EveryExpertMoE(), init_device_mesh("cpu", (dist.get_world_size(),))
    )
    experts = model.experts
    assert type(experts[0].up) is type(experts[1].up) is type(experts[0].down)
    torch._dynamo.reset()
    simplefsdp.compile(model, backend="aot_eager", cost_model=CostModel(), fullgraph=False)
    for step in range(3):
        inputs = [_routed_inputs(r, step) for r in range(dist.get_world_size())]
        expected = _step(reference, torch.cat(inputs))
        # Each rank's mean over its own rows, weighted by its share of all
        # rows (times the ranks, as the gradients are averaged over them).
        x = inputs[dist.get_rank()]
        share = len(x) / sum(len(i) for i in inputs)
        loss = _step(model, x, scale=share * dist.get_world_size()) / dist.get_world_size()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, expected, msg=f"step {step}")
    references = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach().full_tensor(), references[name], msg=name)
    # The experts share compiled graphs; each run records its own expert's
    # parameters (rank_check.recorded), not those it was compiled for.
    keys: list[str] = []
    record = rank_check.record
    rank_check.record = keys.append
    try:
        model(inputs[dist.get_rank()])
    finally:
        rank_check.record = record
    for i in range(WIDE_EXPERTS):
        assert any(f"experts.{i}.up.weight" in key for key in keys), (i, keys)


def test_every_expert_on_every_rank_compiled_around_breaks_trains_as_one_process() -> None:
    """Ranks route different numbers of rows to each of 12 experts. With a
    swapped class per module, every expert recompiled, and past Dynamo's
    limit of 8 one rank ran an expert uncompiled (one gather per parameter)
    while the other ran it compiled (one bucket): gloo aborted."""
    run_distributed(_every_expert_body, 2)
