"""ParallelModel steps like PipelinedModel: one interface, no pipeline branch in the loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simplefsdp.engines import ParallelModel, PipelinedModel
from simplefsdp.models.llama3.parallelize import cross_entropy


def _replica(loss_fn=cross_entropy) -> ParallelModel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    return ParallelModel(module, module, "replica", None, loss_fn=loss_fn)  # type: ignore[arg-type]


def test_step_is_forward_backward_of_the_scaled_loss():
    parallel = _replica()
    reference = _replica()
    tokens = torch.randint(0, 11, (2, 5))
    targets = torch.randint(0, 11, (2, 5))
    loss = parallel.step(tokens, targets, scale=0.5, sync=False)
    expected = cross_entropy(reference.module(tokens), targets) * 0.5
    expected.backward()
    assert not loss.requires_grad and torch.equal(loss, expected.detach())
    for got, want in zip(parallel.module.parameters(), reference.module.parameters()):
        assert torch.equal(got.grad, want.grad)
    assert torch.equal(parallel.eval_loss(tokens, targets), expected.detach() * 2)
    assert parallel.has_loss and parallel.can_evaluate


def test_a_step_needs_a_loss_fn():
    with pytest.raises(ValueError, match="no loss_fn; pass one to parallelize"):
        _replica(loss_fn=None).step(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))


def test_both_models_share_the_step_interface():
    for name in ("step", "eval_loss", "has_loss", "can_evaluate", "compile_context"):
        assert hasattr(ParallelModel, name) and hasattr(PipelinedModel, name), name
