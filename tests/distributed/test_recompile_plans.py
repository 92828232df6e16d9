"""Auto plans across recompiles on 2 CPU processes (Note: [Plans from sizes,
not guards]): new input shapes recompile once into a dynamic graph, not once
per size, and a graph recompiled on one rank only runs the collectives of
the other rank's graph."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import simplefsdp
from simplefsdp.compiler import CostModel, LinearFit
from simplefsdp.testing import run_distributed

VOCAB, DIM = 32, 16


class TinyLM(nn.Module):
    """Embedding, 3 residual MLP blocks with a causal mixing of positions
    (so activations grow with the sequence), norm and head; even shards."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)
            )
            for _ in range(3)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h.cumsum(1) / tokens.shape[1])
        return self.head(self.norm(h))


def _train(model: nn.Module, lengths: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One AdamW step per entry: this rank's batch of 2 sequences of its
    length (rank 0's, rank 1's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, losses = dist.get_rank(), []
    for step, per_rank in enumerate(lengths):
        gen = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (2, per_rank[rank] + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _collectives(report, graph: str) -> list[list[tuple]]:
    return [
        [(c.kind, c.bytes, tuple(c.params)) for c in g.collectives]
        for g in report.graphs
        if g.graph == graph
    ]


def _body(lengths: list[tuple[int, int]], compile_kwargs: dict) -> dict:
    torch.manual_seed(0)
    base = TinyLM()
    reference = simplefsdp.data_parallel(copy.deepcopy(base))
    expected = _train(reference, lengths)
    model = simplefsdp.data_parallel(copy.deepcopy(base))
    # Every collective costs a millisecond: the planner merges buckets.
    slow = CostModel(default_comm=LinearFit(1e-3, 0.0))
    torch._dynamo.reset()
    simplefsdp.compile(
        model, backend="aot_eager", bucketing="auto", cost_model=slow, **compile_kwargs
    )
    losses = _train(model, lengths)
    for step, (a, b) in enumerate(zip(expected, losses, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"step {step}")
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), dict(reference.named_parameters())[name].full_tensor()
        )
    report = simplefsdp.comm_report(model)
    report.to_json()  # plain numbers, also for symbolic graphs
    return {
        "forward": _collectives(report, "forward"),
        "backward": _collectives(report, "backward"),
        "notes": [g.notes for g in report.graphs if g.graph == "forward"],
    }


def test_new_lengths_recompile_once_not_per_length() -> None:
    lengths = [(n, n) for n in (16, 12, 8, 14, 10, 15)]
    results = run_distributed(_body, 2, args=(lengths, {"dynamic": None}), timeout_s=300)
    for result in results:
        # length 16 compiles static; 12 recompiles with a symbolic length,
        # which serves 8, 14, 10 and 15: no guard on the length was added
        assert len(result["forward"]) == 2, result["notes"]
        assert any("not planned again" in n for n in result["notes"][1]), result["notes"][1]
        assert result["forward"][1] == result["forward"][0]
        assert result["backward"][1] == result["backward"][0]


def test_a_recompile_on_one_rank_runs_the_same_collectives() -> None:
    # Step 1: rank 1 alone gets a new length and recompiles; its new graph
    # must issue what rank 0's first graph issues, or the collectives of the
    # two ranks would not match.
    lengths = [(16, 16), (16, 6), (16, 16)]
    rank0, rank1 = run_distributed(_body, 2, args=(lengths, {}), timeout_s=300)
    assert len(rank0["forward"]) == 1 and len(rank1["forward"]) == 2
    assert rank1["forward"][1] == rank0["forward"][0]
    assert rank1["backward"][1] == rank0["backward"][0]


def test_first_inputs_that_differ_between_ranks_get_a_plan_without_sizes() -> None:
    # Each rank pads to its own length on the first step: the plans made
    # from the two first graphs could differ, so neither is made from sizes
    # (Note: [Ranks' first inputs]); the later steps reuse that plan.
    lengths = [(16, 10), (12, 12), (16, 6)]
    rank0, rank1 = run_distributed(_body, 2, args=(lengths, {}), timeout_s=300)
    for result in (rank0, rank1):
        assert any("first inputs differ" in n for n in result["notes"][0]), result["notes"][0]
    assert rank0["forward"][0] == rank1["forward"][0]
    assert rank0["backward"][0] == rank1["backward"][0]
    for result in (rank0, rank1):  # later graphs: the same plan
        assert all(f == result["forward"][0] for f in result["forward"])


class BrokenLM(TinyLM):
    """TinyLM with a graph break between its blocks: two graphs per pass."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks[:2]:
            h = h + block(h.cumsum(1) / tokens.shape[1])
        torch._dynamo.graph_break()  # not inside a loop: Dynamo would skip the frame
        for block in self.blocks[2:]:
            h = h + block(h.cumsum(1) / tokens.shape[1])
        return self.head(self.norm(h))


def _broken_body() -> dict:
    torch.manual_seed(0)
    base = BrokenLM()
    lengths = [(16, 16)] * 3
    reference = simplefsdp.data_parallel(copy.deepcopy(base))
    expected = _train(reference, lengths)
    model = simplefsdp.data_parallel(copy.deepcopy(base))
    torch._dynamo.reset()
    simplefsdp.compile(model, backend="aot_eager", bucketing="auto", fullgraph=False)
    losses = _train(model, lengths)
    for a, b in zip(expected, losses, strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
    report = simplefsdp.comm_report(model)
    return {
        "gathered": [
            sorted(p for c in g.collectives for p in c.params)
            for g in report.graphs
            if g.graph == "forward"
        ],
        "names": sorted(n for n, _ in model.named_parameters()),
    }


def test_graph_breaks_with_fullgraph_false_plan_each_graph() -> None:
    result = run_distributed(_broken_body, 2, timeout_s=300)[0]
    first, second = result["gathered"]
    # each graph gathers its own parameters, together every parameter once
    assert first and second and not set(first) & set(second)
    assert sorted(first + second) == result["names"]


def _fullgraph_error_body() -> str:
    model = simplefsdp.data_parallel(BrokenLM())
    torch._dynamo.reset()
    simplefsdp.compile(model, backend="aot_eager", bucketing="per_block")
    try:
        _train(model, [(8, 8)])
    except torch._dynamo.exc.Unsupported as exc:
        return "\n".join(getattr(exc, "__notes__", []))
    return "no error"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_a_graph_break_under_fullgraph_says_how_to_compile_around_it() -> None:
    notes = run_distributed(_fullgraph_error_body, 2, timeout_s=300)[0]
    assert "simplefsdp.compile(..., fullgraph=False)" in notes, notes
