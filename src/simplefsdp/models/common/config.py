"""The configuration every decoder shares: :class:`DecoderArgs`.

A family's configuration subclasses :class:`DecoderArgs` and adds its own
fields (Llama 3: the feed-forward sizing; MoE: the experts), so the
attention, rotary and decoder components read one set of names. No tensors
are built here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn


def check_positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive ``int`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_positive_number(name: str, value: Any) -> None:
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
    :func:`~simplefsdp.models.common.rotary.apply_rope_scaling` for the formula.

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
        check_positive_number("rope_scaling.factor", self.factor)
        check_positive_number("rope_scaling.low_freq_factor", self.low_freq_factor)
        check_positive_number("rope_scaling.high_freq_factor", self.high_freq_factor)
        check_positive_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        if self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                "rope_scaling.low_freq_factor must be smaller than high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}"
            )


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling parameters (``rope_scaling`` type ``"yarn"``).

    YaRN divides the low rotary frequencies by ``factor``, keeps the high
    ones, and ramps linearly between the two over the channel range whose
    wavelengths make between ``beta_slow`` and ``beta_fast`` turns in
    ``original_max_position_embeddings`` positions. The rotary table (cos and
    sin) is multiplied by :attr:`attention_factor`. See
    :func:`~simplefsdp.models.common.rotary.apply_yarn_scaling`.

    Attributes:
        factor: Context extension factor (divisor of the low frequencies).
        original_max_position_embeddings: Context length the base model was
            pre-trained with.
        beta_fast: Turns that bound the kept (extrapolated) high frequencies.
        beta_slow: Turns that bound the divided (interpolated) low frequencies.
        mscale: Numerator scale of the derived attention factor.
        mscale_all_dim: Denominator scale of the derived attention factor;
            ``0`` derives the factor from ``factor`` alone.
        truncate: Round the ramp's channel bounds to whole channels.
        attention_factor: Scale of cos and sin; ``None`` derives it from
            ``factor``, ``mscale`` and ``mscale_all_dim``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        """Validate the scaling parameters.

        Raises:
            ValueError: If a value is out of range; the message names it.
        """
        check_positive_number("rope_scaling.factor", self.factor)
        check_positive_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        check_positive_number("rope_scaling.beta_fast", self.beta_fast)
        check_positive_number("rope_scaling.beta_slow", self.beta_slow)
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"rope_scaling.{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate must be a bool, got {self.truncate!r}")
        if self.attention_factor is not None:
            check_positive_number("rope_scaling.attention_factor", self.attention_factor)

    @property
    def scale(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's ``mscale``)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(weight: float) -> float:
            if self.factor <= 1:
                return 1.0
            return 0.1 * weight * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.mscale) / get_mscale(self.mscale_all_dim)
        return get_mscale(1.0)


def rope_scaling_from_mapping(mapping: Mapping[str, Any]) -> RopeScaling | YarnScaling:
    """Build the scaling a mapping describes.

    A ``"type"`` (or ``"rope_type"``) key of ``"yarn"`` selects
    :class:`YarnScaling` and ``"llama3"`` :class:`RopeScaling`; without such
    a key (e.g. ``dataclasses.asdict`` of either) the class whose fields hold
    every key is chosen, :class:`RopeScaling` first. The other keys are the
    dataclass's field names.

    Raises:
        ValueError: For another type or an unknown/invalid field.
    """
    fields = dict(mapping)
    kind = fields.pop("type", None)
    kind = fields.pop("rope_type", None) or kind
    classes = {"llama3": RopeScaling, "yarn": YarnScaling}
    if kind is None:
        names = set(fields)
        kind = next(
            (k for k, c in classes.items() if names <= {f.name for f in dataclasses.fields(c)}),
            "llama3",
        )
    if kind not in classes:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; valid: llama3, yarn")
    try:
        return classes[kind](**fields)
    except TypeError as exc:
        raise ValueError(f"invalid rope_scaling {dict(mapping)!r}: {exc}") from exc


@dataclass(frozen=True)
class DecoderArgs:
    """Hyper-parameters every decoder has: embeddings, attention, rotary, norms.

    Frozen; derive variants with :meth:`replace`. Families subclass it and
    add their fields (all with defaults).

    Attributes:
        dim: Model width (embedding size).
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads. Must divide ``dim``.
        n_kv_heads: Number of key/value heads for grouped-query attention.
            ``None`` means ``n_heads`` (plain multi-head attention); it is
            resolved in ``__post_init__`` so the attribute is always an int.
        vocab_size: Vocabulary size.
        norm_eps: Epsilon of the RMSNorm layers.
        rope_theta: Rotary embedding base (500000 for Llama 3).
        rope_scaling: Rotary frequency scaling: a :class:`RopeScaling`
            (Llama 3.1), a :class:`YarnScaling`, a mapping read by
            :func:`rope_scaling_from_mapping` (converted on construction), or
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
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        """Resolve defaults and validate the shared fields."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        check_positive_int("n_kv_heads", self.n_kv_heads)
        check_positive_number("norm_eps", self.norm_eps)
        check_positive_number("rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", rope_scaling_from_mapping(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(
            self.rope_scaling, (RopeScaling, YarnScaling)
        ):
            raise ValueError(
                "rope_scaling must be None, a RopeScaling, a YarnScaling or a mapping, "
                f"got {self.rope_scaling!r}"
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

    #: The attentions have a learned sink logit per head (Note: [Sinks as
    #: one more key] in ``context_parallel/attention.py``).
    attention_sinks: ClassVar[bool] = False

    def sliding_window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (``None``: every earlier key)."""
        return None

    def replace(self, **overrides: Any) -> Any:
        """Return a copy with ``overrides`` applied (validated again).

        Args:
            **overrides: Field names and their new values.

        Returns:
            A new configuration of the same type.
        """
        return dataclasses.replace(self, **overrides)


def attention_params(args: DecoderArgs) -> int:
    """Parameters of one grouped-query attention (``wq``, ``wk``, ``wv``, ``wo``)."""
    kv_dim = args.n_kv_heads * args.head_dim
    return 2 * args.dim * args.dim + 2 * args.dim * kv_dim


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameters of a built model: the global ``numel`` of each distinct one.

    Meta-device and DTensor-wrapped models count correctly.

    Args:
        model: a module (typically a decoder).
        exclude_embeddings: leave out the input token embedding
            (``tok_embeddings``). An untied output projection is always
            counted, since it costs matmul FLOPs.
    """
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    if exclude_embeddings:
        embedding = getattr(model, "tok_embeddings", None)
        if isinstance(embedding, nn.Module):
            total -= sum(p.numel() for p in embedding.parameters())
    return total
