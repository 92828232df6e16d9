"""GPT-OSS as a plain ``nn.Module``: the shared decoder with GPT-OSS's
attention (biases, learned sinks, sliding windows on alternate layers) and
mixture-of-experts layer (biased router, experts with biases and a clamped
SwiGLU).

There is no parallelism code here. Parameter FQNs follow torchtitan's
GPT-OSS: ``layers.0.attention.wq.weight``/``.bias``,
``layers.0.attention.sinks``, ``layers.0.moe.router.gate.weight``/``.bias``,
``layers.0.moe.experts.mlp1_weight`` (``(num_experts, 2 * hidden, dim)``,
rows alternating gate and up), ``mlp1_bias``, ``mlp2_weight``
(``(num_experts, dim, hidden)``), ``mlp2_bias``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.models.common.attention import Attention, attend, rotate_qk
from simplefsdp.models.common.decoder import Decoder, DecoderBlock
from simplefsdp.models.common.moe import (
    MoE,
    _ContiguousGrad,
    grouped_mm_supported,
    partial_output_bias,
)
from simplefsdp.models.common.norms import RMSNorm, trunc_normal_

from .args import GptOssArgs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GptOssAttention(Attention):
    """Grouped-query attention with biased projections, a learned per-head
    sink logit (``sinks``, ``(n_heads,)``) and, on sliding layers, a window.

    Args:
        args: the model's configuration.
        layer_id: the block's index (selects its ``layer_types`` entry).
    """

    def __init__(self, args: GptOssArgs, layer_id: int) -> None:
        nn.Module.__init__(self)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_rep
        self.head_dim = args.head_dim
        self.sliding_window = args.sliding_window_of(layer_id)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: weights as :class:`Attention`, biases zero, sinks std 0.02."""
        super().init_weights(init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        trunc_normal_(self.sinks, 0.02)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, context: Any = None
    ) -> torch.Tensor:
        """Attend over ``x`` ``(B, T, D)``; returns ``(B, T, D)``. ``context``:
        the batch's sequence context (document masks, context parallelism),
        passed to ``attend``."""
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H, hd)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xq, xk = rotate_qk(xq, xk, freqs_cis)
        # Under tensor parallelism ``sinks`` is sharded over heads like ``wq``.
        out = attend(
            xq.transpose(1, 2),  # (B, H, T, hd)
            xk.transpose(1, 2),  # (B, H_kv, T, hd)
            xv.transpose(1, 2),  # (B, H_kv, T, hd)
            sliding_window=self.sliding_window,
            sinks=_local(self.sinks),
            context=context,
        )  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (B, T, H * hd)
        return self.wo(out)  # (B, T, D)


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation of the interleaved gate/up projection
    ``h`` ``(..., 2F)``: with ``g = h[..., 0::2].clamp(max=limit)`` and
    ``u = h[..., 1::2].clamp(-limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``
    ``(..., F)``."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class GptOssExperts(nn.Module):
    """``num_experts`` GPT-OSS experts stored as stacked parameters (dim 0:
    the expert, so expert parallelism shards them all).

    ``mlp1_weight`` ``(E, 2F, D)`` and ``mlp1_bias`` ``(E, 2F)`` (rows
    alternating gate, up), ``mlp2_weight`` ``(E, D, F)``, ``mlp2_bias``
    ``(E, D)``. Runs as grouped matmuls where supported
    (:func:`~simplefsdp.models.common.moe.grouped_mm_supported`), else as a
    loop over experts.

    Args:
        args: the model's configuration.
        use_grouped_mm: ``None`` picks automatically; ``False`` forces the loop.
    """

    def __init__(self, args: GptOssArgs, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        e, f, d = args.num_experts, args.moe_hidden_dim, args.dim
        self.num_experts = e
        self.alpha = args.swiglu_alpha
        self.limit = args.swiglu_limit
        self.use_grouped_mm = use_grouped_mm
        self.mlp1_weight = nn.Parameter(torch.empty(e, 2 * f, d))
        self.mlp1_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.mlp2_weight = nn.Parameter(torch.empty(e, d, f))
        self.mlp2_bias = nn.Parameter(torch.empty(e, d))
        # Expert tensor parallelism splits the hidden dim: mlp1's rows are
        # (gate, up) pairs, so an even split keeps the pairs whole; the output
        # bias is added once (partial_output_bias).
        self.tp_shard_dims = {"mlp1_weight": 1, "mlp1_bias": 1, "mlp2_weight": 2, "mlp2_bias": None}

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: ``mlp1_weight`` std 0.02, ``mlp2_weight``
        ``init_std``, biases zero."""
        trunc_normal_(self.mlp1_weight, 0.02)
        trunc_normal_(self.mlp2_weight, init_std)
        nn.init.zeros_(self.mlp1_bias)
        nn.init.zeros_(self.mlp2_bias)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous run of tokens.

        Args:
            x: tokens sorted by expert, ``(R, D)``.
            num_tokens_per_expert: ``(num_local_experts,)`` counts summing to ``R``.

        Returns:
            ``(R, D)``.
        """
        w1, b1 = _local(self.mlp1_weight), _local(self.mlp1_bias)
        w2, b2 = _local(self.mlp2_weight), partial_output_bias(self.mlp2_bias, self.mlp2_weight, -1)
        use_grouped = self.use_grouped_mm
        if use_grouped is None:
            use_grouped = grouped_mm_supported(x, w1, w2)
        if not use_grouped:
            return _expert_loop(x, num_tokens_per_expert, w1, b1, w2, b2, self.alpha, self.limit)
        counts = num_tokens_per_expert
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = x.shape[0]
        x = _ContiguousGrad.apply(x)
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)  # (R, 2F)
        h = h + b1.repeat_interleave(counts, dim=0, output_size=rows).to(h.dtype)
        h = clamped_swiglu(h, self.alpha, self.limit)  # (R, F)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)  # (R, D)
        out = out + b2.repeat_interleave(counts, dim=0, output_size=rows).to(out.dtype)
        return _ContiguousGrad.apply(out)


@torch.compiler.disable
def _expert_loop(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """:class:`GptOssExperts` as a loop over experts: ``(R, D) -> (R, D)``."""
    outputs = []
    for expert, chunk in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
        h = clamped_swiglu(chunk @ w1[expert].T + b1[expert], alpha, limit)  # (r, F)
        outputs.append(h @ w2[expert].T + b2[expert])  # (r, D)
    return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, x.shape[-1])


class GptOssRouter(nn.Module):
    """Top-k router with a biased gate: each token takes the experts of its
    ``top_k`` largest logits, weighted by the softmax over those ``top_k``
    logits (in float32), as Hugging Face's ``GptOssTopKRouter``.

    With ``load_balance="bias"`` the layer's routing bias is added to the
    logits for the choice only (auxiliary-loss-free balancing); the weights
    stay the softmax of the chosen experts' own logits.

    Args:
        dim: model width.
        num_experts: routed experts.
        top_k: experts per token.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=True)
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``(N, D)``.

        Returns:
            ``(top_scores (N, K), top_experts (N, K), scores (N, E))``; the
            scores (softmax over every expert, float32) feed the auxiliary loss.
        """
        logits = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())  # (N, E)
        if expert_bias is None:
            top_logits, top_experts = torch.topk(logits, k=self.top_k, dim=-1)  # (N, K)
        else:
            _, top_experts = torch.topk(logits + expert_bias, k=self.top_k, dim=-1)  # (N, K)
            top_logits = logits.gather(-1, top_experts)  # (N, K)
        return F.softmax(top_logits, dim=-1), top_experts, F.softmax(logits, dim=-1)


class GptOssMoE(MoE):
    """GPT-OSS's mixture-of-experts layer: :class:`GptOssRouter` and
    :class:`GptOssExperts`, no shared experts; the forward (sort by expert,
    run, weight, combine) and the token counts are :class:`MoE`'s.

    Args:
        args: the model's configuration.
    """

    def __init__(self, args: GptOssArgs) -> None:
        nn.Module.__init__(self)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.load_balance = args.load_balance
        self.bias_update_rate = args.bias_update_rate
        self.aux_loss_coeff = args.aux_loss_coeff
        self.router = GptOssRouter(args.dim, args.num_experts, args.top_k)
        self.experts = GptOssExperts(args)
        self.shared_experts = None
        bias = torch.zeros(args.num_experts) if args.load_balance == "bias" else None
        self.register_buffer("expert_bias", bias, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def init_weights(self, init_std: float, buffer_device: torch.device | str | None) -> None:
        """Initialise parameters in place (router bias zero) and zero the token counts."""
        super().init_weights(init_std, buffer_device)
        nn.init.zeros_(self.router.gate.bias)


class GptOssBlock(DecoderBlock):
    """Pre-norm block: :class:`GptOssAttention` then :class:`GptOssMoE`.

    Args:
        layer_id: the block's index.
        args: the model's configuration.
    """

    def __init__(self, layer_id: int, args: GptOssArgs) -> None:
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GptOssAttention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = True
        self.moe = GptOssMoE(args)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5


class Transformer(Decoder):
    """GPT-OSS decoder-only language model (the shared
    :class:`~simplefsdp.models.common.Decoder` over :class:`GptOssBlock`
    layers; builds on the meta device, then ``to_empty`` and
    :meth:`init_weights`).

    Args:
        args: model arguments.
    """

    block_type = GptOssBlock
