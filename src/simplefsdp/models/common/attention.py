"""Causal self-attention: grouped-query attention with rotary embeddings.

One class serves every family; variants are options read from the
configuration, so a family that needs QK-norm, multi-head latent attention,
attention sinks or a sliding window adds a field to its
:class:`~simplefsdp.models.common.config.DecoderArgs` subclass and a branch
here (keeping the existing parameter names), never a copy of the class. The
tensor-parallel plan of this module is
:func:`simplefsdp.models.common.tensor_parallel.attention_plan`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderArgs
from .norms import trunc_normal_
from .rotary import apply_rotary_emb


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat key/value heads for grouped-query attention.

    Query head ``h`` attends with key/value head ``h // n_rep``.

    Args:
        x: Keys or values of shape ``(B, T, H_kv, head_dim)``.
        n_rep: Number of query heads per key/value head.

    Returns:
        Tensor of shape ``(B, T, H_kv * n_rep, head_dim)``.
    """
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]  # (B, T, H_kv, 1, hd)
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)  # (B, T, H_kv, n_rep, hd)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)  # (B, T, H, hd)
    )


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Parameters: ``wq`` ``(n_heads * head_dim, dim)``, ``wk``/``wv``
    ``(n_kv_heads * head_dim, dim)``, ``wo`` ``(dim, n_heads * head_dim)``,
    no biases.

    Args:
        args: the decoder's configuration (``dim``, ``n_heads``,
            ``n_kv_heads``, ``head_dim``, ``n_rep``).
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_rep
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: ``wq``/``wk``/``wv`` with std 0.02, ``wo`` with ``init_std``.

        Args:
            init_std: Depth-scaled standard deviation for the output projection.
        """
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, 0.02)
        trunc_normal_(self.wo.weight, init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """Attend over ``x``.

        Args:
            x: Input of shape ``(B, T, D)``.
            freqs_cis: Rotary table of shape ``(>= T, head_dim // 2, 2)``; its
                first ``T`` positions are used (``T`` is read here, where the
                sequence is whole even under sequence parallelism).

        Returns:
            Output of shape ``(B, T, D)``.
        """
        bs, seqlen, _ = x.shape
        # ``-1`` head counts keep this usable when heads are split across devices.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H, hd)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis[:seqlen])
        keys = repeat_kv(xk, self.n_rep)  # (B, T, H, hd)
        values = repeat_kv(xv, self.n_rep)  # (B, T, H, hd)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2),  # (B, H, T, hd)
            keys.transpose(1, 2),  # (B, H, T, hd)
            values.transpose(1, 2),  # (B, H, T, hd)
            is_causal=True,
        )  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (B, T, H * hd)
        return self.wo(out)  # (B, T, D)
