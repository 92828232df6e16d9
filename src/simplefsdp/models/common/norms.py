"""RMSNorm and the truncated-normal initialiser every component uses."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """In-place truncated normal init with mean 0, cut off at three standard deviations."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32.

    ``y = x / sqrt(mean(x ** 2, -1) + eps) * weight``, cast back to the dtype of
    ``x``.

    Args:
        dim: Size of the normalised (last) dimension.
        eps: Added to the mean square for numerical stability.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the scale to ones, in place."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` of shape ``(..., dim)``; returns the same shape and dtype."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        """Summary shown by ``repr``."""
        return f"{self.dim}, eps={self.eps}"
