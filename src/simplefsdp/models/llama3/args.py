"""Llama 3 / 3.1 model arguments, and parameter and FLOP counts from them.

No tensors are built here; :mod:`.model` builds the module from a
:class:`ModelArgs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelArgs", "RopeScaling", "ffn_hidden_dim", "flops_per_token", "num_params"]

# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def _check_positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive ``int`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_positive_number(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number greater than zero."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 rotary-frequency scaling parameters.

    The defaults are the published Llama 3.1 values. See
    :func:`apply_rope_scaling` for the formula.

    Attributes:
        factor: Divisor applied to the lowest frequencies (longest wavelengths).
        low_freq_factor: Wavelengths longer than
            ``original_max_position_embeddings / low_freq_factor`` are divided
            by ``factor``.
        high_freq_factor: Wavelengths shorter than
            ``original_max_position_embeddings / high_freq_factor`` are kept.
            Wavelengths in between are smoothly interpolated.
        original_max_position_embeddings: Context length the base model was
            pre-trained with.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        """Validate the scaling parameters.

        Raises:
            ValueError: If a value is non-positive or
                ``low_freq_factor >= high_freq_factor``.
        """
        _check_positive_number("rope_scaling.factor", self.factor)
        _check_positive_number("rope_scaling.low_freq_factor", self.low_freq_factor)
        _check_positive_number("rope_scaling.high_freq_factor", self.high_freq_factor)
        _check_positive_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        if self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                "rope_scaling.low_freq_factor must be smaller than high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}"
            )


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


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama 3 model.

    The dataclass is frozen; derive variants with :func:`dataclasses.replace`
    (or :func:`simplefsdp.models.llama3.get_config` with keyword overrides).

    Attributes:
        dim: Model width (embedding size).
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads. Must divide ``dim``.
        n_kv_heads: Number of key/value heads for grouped-query attention.
            ``None`` means ``n_heads`` (plain multi-head attention); it is
            resolved in ``__post_init__`` so the attribute is always an int.
        vocab_size: Vocabulary size.
        multiple_of: The SwiGLU hidden size is rounded up to a multiple of this.
        ffn_dim_multiplier: Optional multiplier on the SwiGLU hidden size.
        norm_eps: Epsilon of the RMSNorm layers.
        rope_theta: Rotary embedding base (500000 for Llama 3).
        rope_scaling: Llama 3.1 frequency scaling; a :class:`RopeScaling`, a
            mapping with its field names (converted on construction), or
            ``None`` for no scaling.
        max_seq_len: Longest sequence the rotary tables are precomputed for.

    Raises:
        ValueError: From ``__post_init__`` if a size is not positive, ``dim``
            is not divisible by ``n_heads``, ``n_heads`` is not divisible by
            ``n_kv_heads``, or the head dimension is odd. The message names the
            offending value.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.ffn_dim_multiplier is not None:
            _check_positive_number("ffn_dim_multiplier", self.ffn_dim_multiplier)
        _check_positive_number("norm_eps", self.norm_eps)
        _check_positive_number("rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            try:
                scaling = RopeScaling(**self.rope_scaling)
            except TypeError as exc:
                raise ValueError(f"invalid rope_scaling {self.rope_scaling!r}: {exc}") from exc
            object.__setattr__(self, "rope_scaling", scaling)
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be None, a RopeScaling or a mapping, got {self.rope_scaling!r}"
            )
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim=dim/n_heads={self.head_dim} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        """Per-head dimension, ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """How many query heads share each key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the SwiGLU feed-forward network (see :func:`ffn_hidden_dim`)."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def replace(self, **overrides: Any) -> ModelArgs:
        """Return a copy with ``overrides`` applied (validated again).

        Args:
            **overrides: Field names and their new values.

        Returns:
            A new :class:`ModelArgs`.
        """
        return dataclasses.replace(self, **overrides)


# --------------------------------------------------------------------------- #
# Parameter and FLOP accounting
# --------------------------------------------------------------------------- #


def _num_params_from_args(args: ModelArgs, exclude_embeddings: bool) -> int:
    """Parameter count of ``Transformer(args)`` computed from the shapes."""
    kv_dim = args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim  # wq, wo, wk, wv
    feed_forward = 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    norms = 2 * args.dim  # attention_norm, ffn_norm
    per_layer = attention + feed_forward + norms
    total = args.n_layers * per_layer + args.dim + args.vocab_size * args.dim  # + norm, output
    if not exclude_embeddings:
        total += args.vocab_size * args.dim  # tok_embeddings
    return total


def num_params(model_or_args: nn.Module | ModelArgs, exclude_embeddings: bool = False) -> int:
    """Count parameters of a model or of the model a :class:`ModelArgs` describes.

    For a module, the (global) ``numel`` of each distinct parameter is summed,
    so meta-device and DTensor-wrapped models are counted correctly. For a
    :class:`ModelArgs` the count is computed from the shapes without building
    anything.

    Args:
        model_or_args: A module (typically a :class:`Transformer`) or a
            :class:`ModelArgs`.
        exclude_embeddings: If true, leave out the input token embedding
            (``tok_embeddings.weight``). The untied ``output`` projection is
            always counted, since it costs matmul FLOPs.

    Returns:
        The number of parameters.
    """
    if isinstance(model_or_args, ModelArgs):
        return _num_params_from_args(model_or_args, exclude_embeddings)
    seen: set[int] = set()
    total = 0
    for param in model_or_args.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    if exclude_embeddings:
        embedding = getattr(model_or_args, "tok_embeddings", None)
        if isinstance(embedding, nn.Module):
            total -= sum(p.numel() for p in embedding.parameters())
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM / torchtitan formula.

    ``6 * N + 12 * n_layers * dim * seq_len`` where ``N`` is the number of
    parameters excluding the input embedding but including the output
    projection (see :func:`num_params` with ``exclude_embeddings=True``).

    The ``6 * N`` term counts the dense matmuls (2 FLOPs per multiply-add,
    times three for forward, input-gradient and weight-gradient). The second
    term is the attention score and value matmuls ``2 * 2 * n_layers * seq_len
    * dim`` forward, times three; it is *not* halved for causal masking, which
    matches PaLM's appendix and torchtitan's MFU accounting.

    Args:
        args: Model hyper-parameters.
        seq_len: Training sequence length.

    Returns:
        FLOPs per trained token.

    Raises:
        ValueError: If ``seq_len`` is not a positive int.
    """
    _check_positive_int("seq_len", seq_len)
    n = num_params(args, exclude_embeddings=True)
    return 6 * n + 12 * args.n_layers * args.dim * seq_len
