"""The SwiGLU feed-forward network and the Llama rule for its hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import trunc_normal_


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Hidden size of the SwiGLU feed-forward network, computed the Llama way.

    ``int(2 * 4 * dim / 3)``, then multiplied by ``ffn_dim_multiplier`` (if set)
    and truncated, then rounded up to a multiple of ``multiple_of``.

    Args:
        dim: Model width.
        multiple_of: Rounding granularity for the hidden size.
        ffn_dim_multiplier: Optional extra multiplier (1.3 for Llama 3 8B/70B).

    Returns:
        The hidden size, e.g. 14336 for Llama 3 8B.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1(x)) * w3(x))``.

    Its tensor-parallel plan is
    :func:`simplefsdp.models.common.tensor_parallel.feed_forward_plan`.

    Args:
        dim: Model width.
        hidden_dim: Hidden size (see :func:`ffn_hidden_dim`).
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: ``w1`` with std 0.02, ``w2``/``w3`` with ``init_std``.

        Args:
            init_std: Depth-scaled standard deviation.
        """
        trunc_normal_(self.w1.weight, 0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network to ``x`` of shape ``(B, T, D)``; returns ``(B, T, D)``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, D)
