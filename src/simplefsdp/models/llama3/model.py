"""Llama 3 / 3.1 decoder-only transformer as a plain ``nn.Module``.

The architecture follows Meta's reference implementation and torchtitan:
pre-norm blocks with hand-written RMSNorm, grouped-query attention with rotary
position embeddings (optionally with the Llama 3.1 frequency scaling), and a
SwiGLU feed-forward network. The output projection is not tied to the token
embedding.

There is deliberately no parallelism code here (no ``torch.distributed``
imports). Parallelism libraries wrap the parameters from the outside, so
:meth:`Transformer.init_weights` only ever modifies parameters in place.

Rotary embeddings are stored as real-valued cos/sin tables rather than complex
tensors, so ``torch.compile`` and DTensor-based code paths never see a complex
dtype. The rotation pairs adjacent channels ``(2i, 2i + 1)``, exactly like the
``torch.view_as_complex`` formulation of the reference implementation, so
weights converted from Meta checkpoints behave identically.

Parameter FQNs match torchtitan, e.g. ``layers.0.attention.wq.weight``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs, RopeScaling

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "apply_rope_scaling",
    "precompute_freqs_cis",
    "repeat_kv",
    "rope_frequencies",
]


# --------------------------------------------------------------------------- #
# Rotary position embeddings
# --------------------------------------------------------------------------- #


def apply_rope_scaling(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply the Llama 3.1 frequency scaling to rotary frequencies.

    With ``L = original_max_position_embeddings`` and wavelength
    ``w = 2 * pi / f``:

    * ``w < L / high_freq_factor`` (high frequencies): ``f`` unchanged;
    * ``w > L / low_freq_factor`` (low frequencies): ``f / factor``;
    * otherwise, with ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
      ``(1 - s) * f / factor + s * f``.

    Args:
        freqs: Rotary frequencies, any shape.
        scaling: Scaling parameters.

    Returns:
        The scaled frequencies, same shape and dtype as ``freqs``.
    """
    old_len = float(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotary frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``.

    Args:
        head_dim: Attention head dimension (even).
        theta: Rotary base.
        scaling: Optional Llama 3.1 scaling applied to the frequencies.
        device: Device to create the result on (default: current default device).

    Returns:
        Float64 tensor of shape ``(head_dim // 2,)``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    freqs = 1.0 / (theta**exponents)  # (head_dim // 2,)
    if scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    return freqs


def precompute_freqs_cis(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Precompute the real-valued rotary table.

    Angles are computed in float64 for accuracy and stored as float32.

    Args:
        head_dim: Attention head dimension (even).
        max_seq_len: Number of positions.
        theta: Rotary base.
        scaling: Optional Llama 3.1 frequency scaling.
        device: Device to create the table on (default: current default device).

    Returns:
        Float32 tensor of shape ``(max_seq_len, head_dim // 2, 2)`` where
        ``[..., 0]`` is ``cos(pos * freq)`` and ``[..., 1]`` is ``sin(pos * freq)``.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)  # (hd/2,)
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)  # (S,)
    angles = torch.outer(positions, freqs)  # (S, hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()  # (S, hd/2, 2)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by position.

    Channel pairs ``(2i, 2i + 1)`` are rotated by angle ``pos * freq_i``, which
    is the real-valued equivalent of Meta's complex multiplication. The math is
    done in float32 and the results are cast back to the input dtypes.

    Args:
        xq: Queries of shape ``(B, T, H, head_dim)``.
        xk: Keys of shape ``(B, T, H_kv, head_dim)``.
        freqs_cis: Table of shape ``(T, head_dim // 2, 2)`` from
            :func:`precompute_freqs_cis`, already sliced to ``T`` positions.

    Returns:
        The rotated ``(xq, xk)`` with unchanged shapes and dtypes.
    """
    seqlen = xq.shape[1]
    freqs = freqs_cis.float().view(1, seqlen, 1, -1, 2)  # (1, T, 1, hd/2, 2)
    cos = freqs[..., 0]  # (1, T, 1, hd/2)
    sin = freqs[..., 1]  # (1, T, 1, hd/2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, hd/2, 2)
        x0, x1 = pairs.unbind(-1)  # (B, T, H, hd/2) each
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).type_as(x)  # (B, T, H, hd)

    return rotate(xq), rotate(xk)


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


# --------------------------------------------------------------------------- #
# Modules
# --------------------------------------------------------------------------- #


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
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


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Args:
        args: Model hyper-parameters.
    """

    def __init__(self, args: ModelArgs) -> None:
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
            _trunc_normal_(linear.weight, 0.02)
        _trunc_normal_(self.wo.weight, init_std)

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


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1(x)) * w3(x))``.

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
        _trunc_normal_(self.w1.weight, 0.02)
        for linear in (self.w2, self.w3):
            _trunc_normal_(linear.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network to ``x`` of shape ``(B, T, D)``; returns ``(B, T, D)``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, D)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention then SwiGLU, each with a residual.

    Args:
        layer_id: Index of the block, used for depth-scaled initialisation.
        args: Model hyper-parameters.
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        """Initialise all parameters of the block in place.

        Norms get ones; ``wo``, ``w2`` and ``w3`` use the depth-scaled std
        ``0.02 / sqrt(2 * (layer_id + 1))``; other projections use 0.02.
        """
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(B, T, D)``.
            freqs_cis: Rotary table of shape ``(>= T, head_dim // 2, 2)``.

        Returns:
            Output of shape ``(B, T, D)``.
        """
        h = x + self.attention(self.attention_norm(x), freqs_cis)  # (B, T, D)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, D)


class Transformer(nn.Module):
    """Llama 3 decoder-only language model.

    The module can be built on the meta device and materialised later::

        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device="cpu")
        model.init_weights()

    Args:
        args: Model hyper-parameters.

    Attributes:
        freqs_cis: Non-persistent float32 buffer of shape
            ``(max_seq_len, head_dim // 2, 2)`` holding rotary cos/sin.
    """

    freqs_cis: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index: a pipeline stage keeps a subset of the
        # layers under their original names (``layers.7.…`` stays ``layers.7.…``),
        # so checkpoints move between pipeline layouts (see ``pipeline.py``).
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(None), persistent=False)
        self.init_weights()

    def _precompute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        """Rotary table for this model's configuration on ``device``."""
        return precompute_freqs_cis(
            self.args.head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter in place and recompute the rotary buffer.

        torchtitan-style initialisation:

        * ``tok_embeddings``: normal, std 1.0;
        * ``wq``/``wk``/``wv``/``w1``: truncated normal, std 0.02;
        * ``wo``/``w2``/``w3`` of block ``i``: truncated normal,
          std ``0.02 / sqrt(2 * (i + 1))``;
        * ``output``: truncated normal, std ``dim ** -0.5`` (as in torchtitan);
        * all RMSNorm weights: ones.

        Truncation is at three standard deviations. Parameters are only
        modified in place (never replaced), so this works on parameters that
        another library has wrapped, e.g. as DTensors. The rotary buffer is
        recomputed (and re-registered in float32) because a model materialised
        with :meth:`~torch.nn.Module.to_empty` holds uninitialised memory there.

        Args:
            buffer_device: Device for the rotary buffer; defaults to the
                device the buffer is currently on.
        """
        device = self.freqs_cis.device if buffer_device is None else buffer_device
        self.freqs_cis = self._precompute_freqs_cis(device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        A pipeline stage (see :mod:`.pipeline`) may lack ``tok_embeddings``
        (it then takes hidden states ``(B, T, D)``) or ``norm``/``output`` (it
        then returns hidden states).

        Args:
            tokens: Token ids of shape ``(B, T)`` with ``T <= max_seq_len``.

        Returns:
            Logits of shape ``(B, T, vocab_size)`` in the dtype of the
            computation (the dtype of the output projection).

        Raises:
            ValueError: If ``T`` exceeds ``max_seq_len``.
        """
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds max_seq_len={self.args.max_seq_len}"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)
        # The whole table: a pipeline stage's input may be a sequence shard
        # (sequence parallelism); attention slices it to the sequence it sees.
        freqs_cis = self.freqs_cis  # (max_seq_len, hd/2, 2)
        for layer in self.layers.values():
            h = layer(h, freqs_cis)  # (B, T, D)
        h = self.norm(h) if self.norm is not None else h  # (B, T, D)
        return self.output(h) if self.output is not None else h  # (B, T, V)
