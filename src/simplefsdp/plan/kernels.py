"""Per-kernel time on a GPU from first principles (``simplefsdp plan``).

Note: [Kernel model]
    A profile with an ``sm_count`` (the GPU profiles) prices each matmul
    from its own shape instead of one efficiency for all of them:

      GEMM         ``2 * M * N * K`` FLOPs at ``peak(dtype) *
                   gemm_efficiency * clock_fraction * shape``, where
                   ``gemm_efficiency`` is the published maximum achievable
                   matmul rate of that GPU generation (the best shape, no
                   quantisation losses) and ``shape`` what this shape loses
                   against it: output tiles (``tile_m x tile_n``, the
                   tensor-core kernels' CTA tile, or a smaller one where
                   that loses less, at the rate its lower operand reuse
                   allows) padded at the edges and run in whole waves over
                   the SMs (``M * N / (waves * sm_count * tile_m *
                   tile_n)``; a grid smaller than the SMs splits K), and the
                   pipeline's fill and drain per tile against its K loop
                   (``K / (K + k_fill)`` relative to the same at the
                   reference K of the published measurement); never faster
                   than its bytes (``M*K + K*N`` inputs, ``M*N`` output) at
                   the achievable HBM bandwidth.
      attention    fused (FlashAttention-style) by its own FLOPs: ``4 * B * H
                   * Sq * Skv * D`` forward, 2.5 times that backward, halved
                   for the causal mask, at the profile's published
                   FlashAttention rate (``flash_fwd_efficiency``,
                   ``flash_bwd_efficiency`` of the bf16 peak, times
                   ``clock_fraction``); where the value head dim differs
                   from the query's, SDPA's memory-efficient kernel runs
                   instead, at ``MEMORY_EFFICIENT_FRACTION`` of that rate;
                   never faster than its bytes.
      other ops    memory bound (the caller's byte count at
                   ``memory_bandwidth * memory_efficiency``).
    ``clock_fraction`` is the sustained tensor clock of a power-limited part
    against the datasheet's (1 where the datasheet's power applies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Bytes per element of a matmul operand by dtype name.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}
#: K at which published maximum-achievable matmul rates were measured (the
#: best shapes of the mamf-finder tables have K of 2048-2816).
REFERENCE_K = 2048
#: Smaller CTA tiles a kernel library picks for small or skinny outputs.
TILES = ((128, 128), (64, 128))
#: What SDPA's memory-efficient kernel keeps of the flash kernel's rate, which
#: it falls back to where the value head dim differs from the query/key one
#: (multi-head latent attention): 35.5 of 81.4 TFLOPS forward and 37.7 of
#: 84.8 backward, causal, head dim 128, 4,096 tokens, both through torch's
#: SDPA on one GPU (NVIDIA/TileGym#49's benchmark tables).
MEMORY_EFFICIENT_FRACTION = 0.44


@dataclass(frozen=True)
class KernelModel:
    """Kernel times for one GPU profile (Note: [Kernel model]).

    Attributes:
        peak_flops: dense tensor-core peak by dtype name (``bfloat16``,
            ``float32``, ``float8``), FLOP/s.
        gemm_efficiency: maximum achievable fraction of each peak at the
            best shape, by dtype name.
        clock_fraction: sustained clock against the datasheet's.
        sm_count: streaming multiprocessors.
        tile_m, tile_n: the output tile one CTA computes.
        k_fill: K-equivalent of a tile's pipeline fill and drain.
        bytes_per_s: achievable HBM bandwidth.
        flash_fwd_efficiency, flash_bwd_efficiency: fused attention's
            achievable fraction of the bf16 peak (causal FLOPs halved).
        kernel_overhead_s: fixed cost per kernel.
    """

    peak_flops: dict[str, float]
    gemm_efficiency: dict[str, float]
    clock_fraction: float
    sm_count: int
    bytes_per_s: float
    flash_fwd_efficiency: float
    flash_bwd_efficiency: float
    kernel_overhead_s: float
    tile_m: int = 128
    tile_n: int = 256
    k_fill: int = 128

    def shape_efficiency(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """What a ``(batch x) M x N x K`` GEMM keeps of the best shape's rate:
        tile padding and wave quantisation for the best of the kernel
        library's tiles (``TILES``, the largest first; a grid of fewer
        tiles than SMs splits K over the idle ones), and the K loop's fill
        and drain per tile."""
        if m <= 0 or n <= 0 or k <= 0:
            return 1.0
        best = 0.0
        for tm, tn in ((self.tile_m, self.tile_n), *TILES):
            tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            split = max(1, min(self.sm_count // tiles, k // (4 * self.k_fill)))
            waves = math.ceil(tiles * split / self.sm_count)
            quant = batch * m * n * split / (waves * self.sm_count * tm * tn)
            k_part = k / split
            ramp = (k_part / (k_part + self.k_fill)) / (REFERENCE_K / (REFERENCE_K + self.k_fill))
            # a smaller tile reuses each operand less: its rate scales with its
            # arithmetic intensity against the large tile's
            reuse = (tm * tn / (tm + tn)) / (
                self.tile_m * self.tile_n / (self.tile_m + self.tile_n)
            )
            best = max(best, min(quant, 1.0) * min(ramp, 1.0) * min(reuse, 1.0))
        return best

    def gemm_seconds(self, m: int, n: int, k: int, dtype: str, batch: int = 1) -> float:
        """Seconds of one GEMM (Note: [Kernel model]); ``dtype`` names the
        operands' type (``bfloat16``, ``float32``, ``float8``)."""
        peak = self.peak_flops.get(dtype) or self.peak_flops["bfloat16"]
        eff = self.gemm_efficiency.get(dtype) or self.gemm_efficiency["bfloat16"]
        rate = peak * eff * self.clock_fraction * self.shape_efficiency(m, n, k, batch)
        size = DTYPE_BYTES.get(dtype, 2)
        out = 4 if dtype == "float32" else 2
        moved = batch * ((m * k + k * n) * size + m * n * out)
        flops = 2.0 * batch * m * n * k
        return max(flops / rate, moved / self.bytes_per_s) + self.kernel_overhead_s

    def attention_seconds(
        self, flops: float, moved_bytes: float, backward: bool, flash: bool = True
    ) -> float:
        """Seconds of one fused causal attention kernel of ``flops`` (the
        unmasked count: ``4 * B * H * Sq * Skv * D``, 2.5x backward);
        ``flash`` false: SDPA's memory-efficient kernel (value head dim
        other than the query's), at ``MEMORY_EFFICIENT_FRACTION`` of it."""
        eff = self.flash_bwd_efficiency if backward else self.flash_fwd_efficiency
        if not flash:
            eff *= MEMORY_EFFICIENT_FRACTION
        rate = self.peak_flops["bfloat16"] * eff * self.clock_fraction
        return max(flops / 2 / rate, moved_bytes / self.bytes_per_s) + self.kernel_overhead_s


def kernel_model(hw, bytes_per_s: float) -> KernelModel | None:
    """The profile's kernel model, or ``None`` where it has no ``sm_count``
    (CPU profiles keep one measured matmul rate)."""
    if not getattr(hw, "sm_count", 0):
        return None
    peaks = {"bfloat16": hw.peak_bf16_flops, "float32": hw.peak_fp32_flops}
    effs = {"bfloat16": hw.gemm_efficiency, "float32": hw.gemm_efficiency}
    if hw.peak_fp8_flops:
        peaks["float8"] = hw.peak_fp8_flops
        effs["float8"] = hw.fp8_matmul_efficiency or hw.gemm_efficiency
    return KernelModel(
        peak_flops=peaks,
        gemm_efficiency=effs,
        clock_fraction=hw.clock_fraction,
        sm_count=hw.sm_count,
        bytes_per_s=bytes_per_s,
        flash_fwd_efficiency=hw.flash_fwd_efficiency,
        flash_bwd_efficiency=hw.flash_bwd_efficiency,
        kernel_overhead_s=hw.kernel_overhead_s,
    )
