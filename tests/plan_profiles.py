"""A round-number hardware profile for the planner's hand-computed checks."""

from __future__ import annotations

from simplefsdp.plan.hardware import HardwareProfile

GiB = 2**30

FIXED = HardwareProfile(
    name="fixed",
    description="test",
    peak_bf16_flops=1e12,
    peak_fp32_flops=1e11,
    matmul_efficiency=0.5,
    memory_bytes=64 * GiB,
    usable_memory_fraction=1.0,
    memory_bandwidth=1e11,
    memory_efficiency=0.5,
    kernel_overhead_s=0.0,
    gpus_per_node=4,
    intra_bandwidth=1e10,
    intra_latency_s=1e-5,
    inter_bandwidth=1e9,
    inter_latency_s=1e-4,
)
