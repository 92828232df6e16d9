"""One parameter's unreduced gradient sum and the read that feeds it.

The autograd side of Note: [Accumulating unreduced gradients] in
``accumulation.py``: the parametrization's read calls
:func:`accumulating_read`; ``no_sync`` and ``reduce_accumulated`` there
install the accumulators and reduce their sums.
"""

from __future__ import annotations

import torch

# The attribute of a swapped module holding {param_name: GradAccumulator};
# absent until the wrapped root first enters ``no_sync``.
ACCUMULATORS_ATTR = "_simplefsdp_grad_accumulators"


class AccumulationState:
    """The gradient-sync mode of one wrapped model and its accumulators."""

    def __init__(self) -> None:
        self.no_sync = False
        self.accumulators: dict[str, GradAccumulator] = {}  # by FQN
        self.handles: list = []

    def pending(self) -> dict[str, torch.Tensor]:
        """The accumulated, not yet reduced gradients by parameter FQN."""
        return {
            fqn: acc.leaf.grad
            for fqn, acc in self.accumulators.items()
            if acc.leaf.grad is not None
        }


class GradAccumulator:
    """One parameter's unreduced gradient sum (see Note: [Accumulating
    unreduced gradients]); ``leaf.grad`` holds the sum."""

    def __init__(self, state: AccumulationState, fqn: str, leaf: torch.Tensor) -> None:
        self.state = state
        self.fqn = fqn
        self.leaf = leaf
        # Set by the sync read that added ``leaf.grad`` to its reduction;
        # cleared (with ``leaf.grad``) once that reduction reached param.grad.
        self.consumed = False

    def after_reduction(self, _param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of the parameter."""
        if self.consumed:
            self.leaf.grad = None
            self.consumed = False


class _RouteToAccumulator(torch.autograd.Function):
    """Forward: ``gathered`` (no gradient path to the shard). Backward: the
    gradient goes to the accumulator leaf, cast to its dtype."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf_dtype = leaf.dtype
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.to(ctx.leaf_dtype)


class _AddPending(torch.autograd.Function):
    """Forward: ``gathered``. Backward: the gradient plus ``pending`` (summed
    in ``pending``'s dtype, then cast to the gradient's)."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        # Not save_for_backward: under (uncompiled) activation checkpointing
        # the recomputed read adds nothing (``consumed``), so it must not
        # change the sequence of saved tensors the recomputation checks.
        ctx.pending = pending
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        pending = ctx.pending
        return (grad.to(pending.dtype) + pending).to(grad.dtype), None


def accumulating_read(gathered: torch.Tensor, accumulator: GradAccumulator) -> torch.Tensor:
    """What a read of ``accumulator``'s parameter returns, given its gathered
    local tensor (whose backward reduces): routed to the accumulator inside
    ``no_sync``, else carrying the pending sum into the reduction (if any)."""
    if accumulator.state.no_sync:
        return _RouteToAccumulator.apply(gathered.detach(), accumulator.leaf)
    pending = accumulator.leaf.grad
    if pending is None or accumulator.consumed or not torch.is_grad_enabled():
        return gathered
    accumulator.consumed = True
    return _AddPending.apply(gathered, pending)
