"""Causal self-attention: grouped-query attention with rotary embeddings.

One class serves every family; variants are options read from the
configuration. Every attention module (this one, and a family's own variant
such as multi-head latent attention) calls :func:`attend` for the attention
itself, so kernels, document masks and context parallelism live in one
place. The
tensor-parallel plan of this module is
:func:`simplefsdp.models.common.tensor_parallel.attention_plan`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from simplefsdp.context_parallel.attention import (
    SINK_COLUMNS,
    allowed_keys,
    masked_attention,
    masked_keys,
    runs_in_chunks,
    window_chunk,
    window_reach,
    windowed_attention,
)

from .config import DecoderArgs
from .norms import trunc_normal_
from .rotary import apply_rotary_emb


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    context: Any = None,
) -> torch.Tensor:
    """Causal scaled dot-product attention: the one kernel every family calls.

    Attention modules compute their queries, keys and values (and apply
    rotary embeddings) and call this function for the attention itself, so
    that how attention is computed (the kernel, document masks, context
    parallelism) is decided in one place.

    Args:
        q: queries ``(B, H, T, d_qk)``.
        k: keys ``(B, H_kv, T, d_qk)``; ``H`` must be a multiple of ``H_kv``
            (grouped-query attention: query head ``h`` reads key head
            ``h // (H / H_kv)``).
        v: values ``(B, H_kv, T, d_v)``.
        scale: the softmax scale (default ``d_qk ** -0.5``).
        sliding_window: each query sees at most this many keys, itself
            included (Hugging Face's convention): query ``i`` attends to keys
            ``i - sliding_window + 1 .. i``. ``None``: every earlier key.
        sinks: per-head logits ``(H,)`` of a learned "sink" that takes part
            in the softmax normalisation but contributes no value.
        context: the batch's sequence context (a
            :class:`simplefsdp.context_parallel.SequenceContext`, which the
            decoder passes down to its layers): packed documents attend only
            within themselves, and under context parallelism ``T`` is this
            rank's share of the sequence and the keys of the other ranks are
            reached through the context's backend. ``None``: plain causal
            attention over ``T``.

    Returns:
        ``(B, H, T, d_v)``.
    """
    if context is not None:
        return context.attend(q, k, v, scale=scale, sliding_window=sliding_window, sinks=sinks)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if sliding_window is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # a sliding window or sinks: SDPA over a boolean mask, sinks as one more
    # key (Note: [Sinks as one more key]), no (B, H, T, T) scores in memory
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if runs_in_chunks(sliding_window, q.shape[2]):
        # chunks of the window against the two chunks it reaches
        return windowed_attention(q, k, v, sliding_window, scale, sinks)
    pos = torch.arange(q.shape[2], device=q.device)
    allowed = allowed_keys(pos, pos, sliding_window=sliding_window)
    return masked_attention(q, k, v, allowed, scale, sinks)


def attention_keys(
    args: Any, seq: int, cp: int = 1, backend: str = "allgather"
) -> tuple[list[int | None], int]:
    """How :func:`attend` runs a configuration's attentions over ``seq``
    tokens: per layer, the keys each query meets in SDPA's calls over a
    boolean mask, ``None`` where the layer runs SDPA's causal kernel; and
    the head-dim columns the masked calls add for sinks (0 without them;
    Note: [Sinks as one more key]).

    Without context parallelism a sliding window runs in chunks of it
    against two chunks where that is under ``seq``, other masked layers
    (sinks) over every key. Under simplefsdp's ``allgather`` and
    ``ulysses`` backends (``cp > 1``) every layer is masked: over all
    ``seq`` keys, a window in chunks of its reach across the head-tail runs
    of each rank (``allgather``, Note: [Sliding windows across ranks]) or
    of the whole sequence on the rank's heads (``ulysses``), its padded
    queries counted. Sinks add one key and padding. ``backend`` ``torch``
    (a ring of flash attention) is causal everywhere."""
    sinks = getattr(args, "attention_sinks", False)
    window_of = getattr(args, "sliding_window_of", lambda _: None)
    masked = cp > 1 and backend != "torch"
    keys: list[int | None] = []
    for layer in range(args.n_layers):
        window = window_of(layer)
        if cp > 1 and backend == "torch":
            keys.append(None)
            continue
        if window is None and not sinks and not masked:
            keys.append(None)
            continue
        run = seq // (2 * cp) if cp > 1 and backend == "allgather" else seq
        chunk = window_chunk(window, seq, run)
        if chunk:
            padded = -(-run // chunk) * chunk
            reach = -(-(window_reach(window, chunk) + chunk) * padded // run)
        else:
            reach = seq
        keys.append(masked_keys(reach, sinks))
    return keys, SINK_COLUMNS if sinks else 0


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


def rotate_qk(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings of queries ``(B, T, H, d)`` and keys ``(B, T, H_k, d)``.

    Args:
        xq: queries.
        xk: keys (any number of heads, e.g. one shared rotary key head).
        freqs_cis: the table the decoder hands a layer: ``(>= T, d // 2, 2)``
            (the first ``T`` positions are used), or ``(B, T, d // 2, 2)``, a
            table per row (positions that restart per document, or a
            context-parallel rank's share of the positions).
    """
    bs, seqlen = xq.shape[:2]
    if freqs_cis.dim() == 4:  # a table per row: rotate the rows as one sequence
        rows = freqs_cis[:, :seqlen].reshape(bs * seqlen, *freqs_cis.shape[2:])
        xq, xk = apply_rotary_emb(xq.flatten(0, 1)[None], xk.flatten(0, 1)[None], rows)
        return xq.view(bs, seqlen, *xq.shape[2:]), xk.view(bs, seqlen, *xk.shape[2:])
    return apply_rotary_emb(xq, xk, freqs_cis[:seqlen])


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

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, context: Any = None
    ) -> torch.Tensor:
        """Attend over ``x``.

        Args:
            x: Input of shape ``(B, T, D)``.
            freqs_cis: Rotary table of shape ``(>= T, head_dim // 2, 2)``; its
                first ``T`` positions are used (``T`` is read here, where the
                sequence is whole even under sequence parallelism). With
                positions that restart per document, ``(B, T, head_dim // 2,
                2)``: a table per row.
            context: the batch's sequence context, passed to :func:`attend`.

        Returns:
            Output of shape ``(B, T, D)``.
        """
        bs, seqlen, _ = x.shape
        # ``-1`` head counts keep this usable when heads are split across devices.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H, hd)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        xq, xk = rotate_qk(xq, xk, freqs_cis)
        if context is None:
            keys = repeat_kv(xk, self.n_rep)  # (B, T, H, hd)
            values = repeat_kv(xv, self.n_rep)  # (B, T, H, hd)
        else:  # the context moves H_kv heads between ranks and repeats them after
            keys, values = xk, xv  # (B, T, H_kv, hd)
        out = attend(
            xq.transpose(1, 2),  # (B, H, T, hd)
            keys.transpose(1, 2),  # (B, H or H_kv, T, hd)
            values.transpose(1, 2),  # (B, H or H_kv, T, hd)
            context=context,
        )  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (B, T, H * hd)
        return self.wo(out)  # (B, T, D)
