"""Rotary position embeddings (RoPE), with the Llama 3.1 and YaRN frequency scalings.

Rotary embeddings are stored as real-valued cos/sin tables rather than complex
tensors, so ``torch.compile`` and DTensor-based code paths never see a complex
dtype. The rotation pairs adjacent channels ``(2i, 2i + 1)``, exactly like the
``torch.view_as_complex`` formulation of Meta's reference implementation, so
weights converted from Meta checkpoints behave identically.
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling, YarnScaling


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


def apply_yarn_scaling(
    freqs: torch.Tensor, head_dim: int, theta: float, scaling: YarnScaling
) -> torch.Tensor:
    """Apply the YaRN frequency scaling to the rotary frequencies of one head.

    With ``L = original_max_position_embeddings``, channel pair ``i`` is kept
    below ``low = d * ln(L / (2 pi beta_fast)) / (2 ln theta)`` and divided by
    ``factor`` above ``high`` (the same with ``beta_slow``), with a linear ramp
    between (``low``/``high`` rounded outwards when ``truncate``, clamped to
    ``[0, d - 1]``). This is the YaRN formulation Hugging Face transformers
    uses; the attention factor is applied by :func:`precompute_freqs_cis`.

    Args:
        freqs: The unscaled frequencies ``theta ** (-2i / head_dim)``, shape
            ``(head_dim // 2,)``.
        head_dim: Attention head dimension.
        theta: Rotary base.
        scaling: YaRN parameters.

    Returns:
        The scaled frequencies, same shape and dtype as ``freqs``.
    """

    def correction_dim(turns: float) -> float:
        length = scaling.original_max_position_embeddings
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.beta_fast)
    high = correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp becomes a step
    channels = torch.arange(freqs.shape[0], dtype=freqs.dtype, device=freqs.device)
    interpolate = ((channels - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: divide
    return freqs / scaling.factor * interpolate + freqs * (1 - interpolate)


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotary frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``.

    Args:
        head_dim: Attention head dimension (even).
        theta: Rotary base.
        scaling: Optional Llama 3.1 or YaRN scaling applied to the frequencies.
        device: Device to create the result on (default: current default device).

    Returns:
        Float64 tensor of shape ``(head_dim // 2,)``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    freqs = 1.0 / (theta**exponents)  # (head_dim // 2,)
    if isinstance(scaling, YarnScaling):
        freqs = apply_yarn_scaling(freqs, head_dim, theta, scaling)
    elif scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    return freqs


def precompute_freqs_cis(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Precompute the real-valued rotary table.

    Angles are computed in float64 for accuracy and stored as float32. With
    YaRN scaling, cos and sin are multiplied by its attention factor
    (:attr:`YarnScaling.scale`), which scales queries and keys alike.

    Args:
        head_dim: Attention head dimension (even).
        max_seq_len: Number of positions.
        theta: Rotary base.
        scaling: Optional Llama 3.1 or YaRN frequency scaling.
        device: Device to create the table on (default: current default device).

    Returns:
        Float32 tensor of shape ``(max_seq_len, head_dim // 2, 2)`` where
        ``[..., 0]`` is ``cos(pos * freq)`` and ``[..., 1]`` is ``sin(pos * freq)``.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)  # (hd/2,)
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)  # (S,)
    angles = torch.outer(positions, freqs)  # (S, hd/2)
    table = torch.stack((angles.cos(), angles.sin()), dim=-1)  # (S, hd/2, 2)
    if isinstance(scaling, YarnScaling):
        table = table * scaling.scale
    return table.float()


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
