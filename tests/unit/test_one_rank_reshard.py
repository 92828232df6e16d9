"""Note: [Resharding a one-rank gather]: on a mesh of one rank, reading a
parameter casts it and gathers nothing; ``reshard_after_forward=True`` must
still free the cast copy after forward (recomputed in backward), as eager
FSDP2 frees its unsharded parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import simplefsdp

DIM = 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.out = nn.Linear(DIM, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _step(mesh, reshard_after_forward, keep_gathered=None, bucketing="none", cost_model=None):
    """Saved tensors (shape, dtype) of one compiled step, the gradients and the report."""
    torch.manual_seed(0)
    model = _Model()
    simplefsdp.data_parallel(
        model,
        mesh,
        mp_policy=simplefsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
        reshard_after_forward=reshard_after_forward,
    )
    simplefsdp.compile(
        model,
        backend="aot_eager",
        bucketing=bucketing,
        keep_gathered=keep_gathered,
        cost_model=cost_model,
    )
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().sum()
    loss.backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return saved, grads, simplefsdp.comm_report(model)


def _one_rank_note(report) -> str:
    (forward,) = [g for g in report.graphs if g.graph == "forward"]
    return "\n".join(n for n in forward.notes if "one rank" in n)


def _bf16_weights(saved):
    weights = {(4 * DIM, DIM), (DIM, 4 * DIM), (8, DIM)}
    transposed = {s[::-1] for s in weights}
    return [s for s, dtype in saved if dtype == torch.bfloat16 and s in weights | transposed]


def test_one_rank_reshard_recomputes_the_parameter_casts(one_rank) -> None:
    saved, grads, report = _step(one_rank, reshard_after_forward=True)
    kept_saved, kept_grads, _ = _step(one_rank, reshard_after_forward=False)
    # Resharding: no bf16 copy of a weight is held for backward; without it
    # the partitioner saves those backward needs (4: the first layer's is
    # not, as the input needs no gradient).
    assert _bf16_weights(saved) == []
    assert len(_bf16_weights(kept_saved)) == 4
    # The same gradients, bitwise: the recomputed cast is the same cast.
    for name in grads:
        assert torch.equal(grads[name], kept_grads[name]), name
    assert "5 parameter casts recomputed" in _one_rank_note(report)


def test_one_rank_keep_gathered_list_saves_the_named_casts(one_rank) -> None:
    saved, _, report = _step(one_rank, reshard_after_forward=True, keep_gathered=["out"])
    assert _bf16_weights(saved) in ([(8, DIM)], [(DIM, 8)])  # only the output projection
    assert "4 parameter casts recomputed" in _one_rank_note(report)


def test_one_rank_keeps_the_last_buckets_casts_as_keep_gathered_counts(one_rank) -> None:
    # Per block: blocks.0, blocks.1, then the root (the output projection),
    # in forward order; keeping the last 2 saves blocks.1's and the root's casts.
    saved, grads, report = _step(
        one_rank, reshard_after_forward=True, keep_gathered=2, bucketing="per_block"
    )
    _, ref_grads, _ = _step(one_rank, reshard_after_forward=False, bucketing="per_block")
    kept = _bf16_weights(saved)
    assert len(kept) == 3 and sum(8 in shape for shape in kept) == 1, kept
    note = _one_rank_note(report)
    assert "2 parameter casts recomputed" in note and "casts kept for backward" in note, note
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_one_rank_auto_keeps_the_free_buckets_without_a_keep_search(one_rank) -> None:
    # "auto" on a one-rank mesh: the last prefetch_distance + 1 = 2 buckets'
    # casts are kept; there is no gathered bucket, so the budgeted keep
    # search (a trial partition per graph) does not run.
    from simplefsdp.compiler import CostModel

    saved, _, report = _step(
        one_rank, reshard_after_forward=True, bucketing="auto", cost_model=CostModel()
    )
    assert len(_bf16_weights(saved)) == 3
    (forward,) = [g for g in report.graphs if g.graph == "forward"]
    assert not any("keep search" in n for n in forward.notes), forward.notes
    assert "2 parameter casts recomputed" in _one_rank_note(report)
