"""DeepSeek-V3 as a plain ``nn.Module``: multi-head latent attention and the
shared mixture-of-experts decoder.

The shared decoder (:mod:`simplefsdp.models.common`) whose blocks attend with
:class:`MultiHeadLatentAttention` and whose blocks ``n_dense_layers ..`` use a
:class:`~simplefsdp.models.common.moe.MoE` layer with group-limited routing.
The rotary table covers the ``qk_rope_head_dim`` channels only. There is no
parallelism code here.

Parameter FQNs follow torchtitan: ``layers.0.attention.wq_a.weight``
(``wq`` without query compression), ``attention.q_norm``, ``attention.wq_b``,
``attention.wkv_a``, ``attention.kv_norm``, ``attention.wkv_b``,
``attention.wo``; ``layers.3.moe.router.gate.weight``, ``moe.experts.w1``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from simplefsdp.models.common.attention import attend, rotate_qk
from simplefsdp.models.common.config import YarnScaling
from simplefsdp.models.common.decoder import Decoder, DecoderBlock
from simplefsdp.models.common.feed_forward import FeedForward
from simplefsdp.models.common.moe import MoE
from simplefsdp.models.common.norms import RMSNorm, trunc_normal_
from simplefsdp.models.common.rotary import precompute_freqs_cis

from .args import DeepSeekV3Args


def softmax_scale(args: DeepSeekV3Args) -> float:
    """The attention softmax scale: ``qk_head_dim ** -0.5``, times
    ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` with YaRN rotary scaling
    (``factor > 1``, DeepSeek's correction for the longer context)."""
    scale = args.qk_head_dim**-0.5
    yarn = args.rope_scaling
    if isinstance(yarn, YarnScaling) and yarn.mscale_all_dim and yarn.factor > 1:
        scale *= (0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA).

    Queries: ``wq`` (``q_lora_rank == 0``) or ``wq_b(q_norm(wq_a(x)))``, per
    head ``qk_nope_head_dim`` channels without and ``qk_rope_head_dim`` with
    rotary embedding. Keys and values: ``wkv_a(x)`` gives a latent of
    ``kv_lora_rank`` channels and one rotary key part shared by every head;
    ``wkv_b(kv_norm(latent))`` gives each head's key (without rotary) and
    value. The attention itself is :func:`~simplefsdp.models.common.attention.attend`.

    Under tensor parallelism the heads are split (``wq``/``wq_b``/``wkv_b``
    colwise, ``wo`` rowwise); ``wq_a``, ``wkv_a`` and the norms are replicated
    (the ``-1`` head counts below read the local heads).

    Args:
        args: the model's configuration.
    """

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = softmax_scale(args)
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: norms to ones, ``wo`` with ``init_std``, the
        other projections with std 0.02 (torchtitan's scheme)."""
        if self.q_lora_rank == 0:
            trunc_normal_(self.wq.weight, 0.02)
        else:
            trunc_normal_(self.wq_a.weight, 0.02)
            trunc_normal_(self.wq_b.weight, 0.02)
            self.q_norm.reset_parameters()
        trunc_normal_(self.wkv_a.weight, 0.02)
        trunc_normal_(self.wkv_b.weight, 0.02)
        self.kv_norm.reset_parameters()
        trunc_normal_(self.wo.weight, init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, context: Any = None
    ) -> torch.Tensor:
        """Attend over ``x``.

        Args:
            x: input ``(B, T, D)``.
            freqs_cis: rotary table of the rotary part, ``(>= T,
                qk_rope_head_dim // 2, 2)`` or a table per row (see
                :func:`~simplefsdp.models.common.attention.rotate_qk`).
            context: the batch's sequence context (document masks, context
                parallelism), passed to ``attend``.

        Returns:
            ``(B, T, D)``.
        """
        bs, seqlen, _ = x.shape
        if self.q_lora_rank == 0:
            q = self.wq(x)  # (B, T, H * qk)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))  # (B, T, H * qk)
        q = q.view(bs, seqlen, -1, self.qk_head_dim)  # (B, T, H, qk)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)  # (B, T, kv_lora + rope)
        latent, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = rotate_qk(q_pe, k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(latent))  # (B, T, H * (nope + v))
        kv = kv.view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, qk)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)  # (B, T, H, qk)
        out = attend(
            q.transpose(1, 2),  # (B, H, T, qk)
            k.transpose(1, 2),  # (B, H, T, qk)
            v.transpose(1, 2),  # (B, H, T, v)
            scale=self.softmax_scale,
            context=context,
        )  # (B, H, T, v)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (B, T, H * v)
        return self.wo(out)  # (B, T, D)


class TransformerBlock(DecoderBlock):
    """Pre-norm block: multi-head latent attention, then a dense SwiGLU
    network of width ``dense_hidden_dim`` (``layer_id < n_dense_layers``) or a
    MoE layer (routed experts with group-limited routing, shared experts).

    The shared :class:`~simplefsdp.models.common.DecoderBlock` with another
    attention module: its ``init_weights`` and ``forward`` apply unchanged.
    """

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        # DecoderBlock builds grouped-query attention; build the same block
        # (same names and construction order) with latent attention instead.
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MultiHeadLatentAttention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden_dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5


class Transformer(Decoder):
    """DeepSeek-V3 decoder-only language model (the shared
    :class:`~simplefsdp.models.common.Decoder` over :class:`TransformerBlock`
    layers; no multi-token-prediction module).

    Builds on the meta device like the other families (``to_empty`` then
    :meth:`init_weights`).

    Args:
        args: model arguments.
    """

    block_type = TransformerBlock

    def _precompute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        """Rotary table of the ``qk_rope_head_dim`` channels on ``device``."""
        return precompute_freqs_cis(
            self.args.qk_rope_head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )
