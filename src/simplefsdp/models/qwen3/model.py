"""Qwen3 (dense and mixture-of-experts) as a plain ``nn.Module``.

The shared decoder (:mod:`simplefsdp.models.common`) with Qwen3's attention:
grouped-query attention whose query and key heads are each normalised by an
RMSNorm over ``head_dim`` (``q_norm``, ``k_norm``) before the rotary
embedding, with a head size independent of ``dim / n_heads``. A MoE model
replaces the feed-forward network of its sparse blocks by the shared
:class:`~simplefsdp.models.common.moe.MoE` layer (softmax router over all
experts, top-k, no shared expert). No parallelism code here.

Parameter FQNs follow torchtitan's Qwen3: ``layers.0.attention.q_norm.weight``,
``layers.0.feed_forward.w1.weight``, ``layers.0.moe.router.gate.weight``,
``layers.0.moe.experts.w1`` (3-D, ``(num_experts, hidden, dim)``).
"""

from __future__ import annotations

from typing import Any

import torch

from simplefsdp.models.common.attention import Attention, attend, rotate_qk
from simplefsdp.models.common.decoder import Decoder, DecoderBlock
from simplefsdp.models.common.norms import RMSNorm

from .args import Qwen3Args


class Qwen3Attention(Attention):
    """Grouped-query attention with per-head RMSNorm on queries and keys.

    Parameters: those of :class:`~simplefsdp.models.common.attention.Attention`
    (``wq``, ``wk``, ``wv``, ``wo``; no biases) plus ``q_norm`` and
    ``k_norm``, each a ``(head_dim,)`` RMSNorm weight shared by all heads.

    Args:
        args: the model's configuration.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def init_weights(self, init_std: float) -> None:
        """Initialise the projections (see the base class) and set the norms to ones."""
        super().init_weights(init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, context: Any = None
    ) -> torch.Tensor:
        """Attend over ``x`` of shape ``(B, T, D)``; returns ``(B, T, D)``.

        Args:
            x: the block's normalised input.
            freqs_cis: rotary table (see :func:`~simplefsdp.models.common.attention.rotate_qk`).
            context: the batch's sequence context (document masks, context
                parallelism), passed to ``attend``.
        """
        bs, seqlen, _ = x.shape
        # ``-1`` head counts keep this usable when heads are split across devices.
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # (B, T, H, hd)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))  # (B, T, H_kv, hd)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xq, xk = rotate_qk(xq, xk, freqs_cis)
        out = attend(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), context=context
        )  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (B, T, H * hd)
        return self.wo(out)  # (B, T, D)


class TransformerBlock(DecoderBlock):
    """Pre-norm block: Qwen3 attention, then a dense SwiGLU network of width
    ``hidden_dim`` or (``args.moe_layer(layer_id)``) a MoE layer."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__(
            layer_id, args, ffn_hidden_dim=args.hidden_dim, moe=args.moe_layer(layer_id)
        )
        # Replaces the base block's attention under the same name (and place
        # in the module order).
        self.attention = Qwen3Attention(args)


class Transformer(Decoder):
    """Qwen3 decoder-only language model (the shared
    :class:`~simplefsdp.models.common.Decoder` over :class:`TransformerBlock`
    layers, with an output projection of its own).

    Builds on the meta device like the other families (``to_empty`` then
    :meth:`init_weights`).

    Args:
        args: a :class:`~.args.Qwen3Args` or :class:`~.args.Qwen3MoEArgs`.
    """

    block_type = TransformerBlock
