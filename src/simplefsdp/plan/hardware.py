"""Hardware profiles for ``simplefsdp plan``: the numbers a prediction uses.

A profile is plain data (:class:`HardwareProfile`). The built-in ones are in
``PROFILES`` below, each number with its public source or marked as an
assumption; ``simplefsdp plan --calibrate`` measures this machine and writes
one as JSON, which ``--hardware PATH.json`` reads back (``cpu-gloo``, a
2-core CPU machine, is such a measurement copied into ``PROFILES``).

Collectives are modelled as rings: an all-gather or reduce-scatter of ``S``
bytes (the unsharded buffer) over ``n`` ranks moves ``(n - 1) / n * S`` bytes
through each rank's slowest link, so it takes ``latency + (n - 1) / n * S /
bus_bandwidth`` (nccl-tests' "bus bandwidth" convention); an all-reduce moves
twice that. A group whose ranks all sit in one node uses the intra-node link
(NVLink), any other the inter-node one (one NIC per GPU, so each of the node's
rings crosses one NIC).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type in a cluster (all bandwidths in bytes/s).

    Attributes:
        name: short name (``--hardware``).
        description: one line, shown in reports.
        peak_bf16_flops: dense bf16 tensor-core peak (FLOP/s).
        peak_fp32_flops: dense fp32 peak (FLOP/s), for fp32 matmuls.
        matmul_efficiency: achievable fraction of the peak for large matmuls.
        memory_bytes: HBM capacity.
        usable_memory_fraction: part of the HBM a job may fill (the rest:
            CUDA context, communication buffers, allocator fragmentation).
        memory_bandwidth: HBM bandwidth.
        memory_efficiency: achievable fraction of it for elementwise kernels.
        kernel_overhead_s: fixed cost per compute op (launch, tails).
        gpus_per_node: accelerators per node sharing the intra-node link.
        intra_bandwidth / intra_latency_s: per-GPU bus bandwidth and
            per-collective latency inside a node.
        inter_bandwidth / inter_latency_s: the same across nodes.
        comm_overlap: fraction of the communication that can run concurrently
            with compute when the schedule allows it (1 on GPUs, where copy
            engines and SMs are separate; below 1 where both compete for the
            same CPU cores).
        source: where the numbers come from.
        attention_efficiency: the rate of fused attention (forward and
            backward) as a fraction of the achievable matmul rate (1: as
            fast as a matmul; measured by ``--calibrate``).
        copy_bytes_per_byte: what a copy into a new buffer costs per byte
            it writes, in bytes moved at the elementwise rate: 2 (read and
            write) where allocations are cached (GPUs); more where a new
            buffer's pages fault in (measured by ``--calibrate``).
        adamw_s_per_param: seconds of the optimizer step (foreach AdamW,
            fp32 state) per parameter, measured by ``--calibrate``; 0 (the
            built-in GPU profiles) derives it from the memory bandwidth at
            28 bytes moved per parameter.
        alloc_s_per_byte: what a matmul's output costs per byte beyond the
            matmul rate because it is a new buffer whose pages fault in
            (measured by ``--calibrate`` as a fill of a new buffer against
            one of a touched buffer); 0 on GPUs, whose caching
            allocator reuses touched memory. With it, the FLOP/s fields
            are the rate into a touched buffer.
        fsdp2_group_s: seconds per step that one eager FSDP2 group
            (``fully_shard`` unit) costs on the host beyond its ops: its
            hooks and autograd's bookkeeping (measured by ``--calibrate``;
            0 in the built-in GPU profiles, where the host runs ahead of
            the GPU and this is hidden unless the step is host bound).
            Measured on a one-rank mesh: the cost at world size 1.
        fsdp2_sharded_group_s: the same cost per group where the group
            shards over the calibration's ranks, beyond its collectives
            alone: the hooks then also wait on each collective, and the
            ranks meet at every one of them (measured by ``--calibrate``
            with ``fsdp2_copy_s_per_byte``; 0 uses ``fsdp2_group_s``).
        fsdp2_copy_s_per_byte: seconds per byte that eager FSDP2's copies
            around its collectives write (the count of
            ``copy_written_bytes``), measured by ``--calibrate`` beyond FSDP2's
            compute, hooks and collectives; 0 (the built-in GPU profiles)
            prices them as the compiled engine's, by
            ``copy_bytes_per_byte``.
        peak_fp8_flops: dense float8 (e4m3/e5m2) tensor-core peak (FLOP/s);
            0 where the accelerator has no float8 matmul (``--float8`` is
            then refused).
        fp8_matmul_efficiency: achievable fraction of ``peak_fp8_flops``
            for the float8 matmuls of converted linears (0: as
            ``matmul_efficiency``).
    """

    name: str
    description: str
    peak_bf16_flops: float
    peak_fp32_flops: float
    matmul_efficiency: float
    memory_bytes: float
    usable_memory_fraction: float
    memory_bandwidth: float
    memory_efficiency: float
    kernel_overhead_s: float
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency_s: float
    inter_bandwidth: float
    inter_latency_s: float
    comm_overlap: float = 1.0
    source: str = ""
    attention_efficiency: float = 1.0
    copy_bytes_per_byte: float = 2.0
    adamw_s_per_param: float = 0.0
    alloc_s_per_byte: float = 0.0
    fsdp2_group_s: float = 0.0
    fsdp2_copy_s_per_byte: float = 0.0
    fsdp2_sharded_group_s: float = 0.0
    peak_fp8_flops: float = 0.0
    fp8_matmul_efficiency: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> HardwareProfile:
        names = {f.name for f in fields(HardwareProfile)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown hardware profile field(s) {unknown}; valid: {sorted(names)}")
        return HardwareProfile(**data)

    def comm_seconds(self, kind: str, group_size: int, num_bytes: float, span: int) -> float:
        """Seconds of one collective of ``num_bytes`` (unsharded buffer) over
        ``group_size`` ranks whose ranks lie ``span`` GPUs apart at most."""
        if group_size <= 1:
            return 0.0
        intra = span <= self.gpus_per_node
        bandwidth = self.intra_bandwidth if intra else self.inter_bandwidth
        latency = self.intra_latency_s if intra else self.inter_latency_s
        factor = (group_size - 1) / group_size * (2 if kind == "all_reduce" else 1)
        return latency + factor * num_bytes / bandwidth


# The float8 matmuls' achievable fraction of the fp8 peak: one number fitted
# on one published row (torchtitan's 8B on 8 H100s with Float8, see
# ``simplefsdp.plan.reference``); the casts to float8 are priced apart, by
# the bytes they move (Note: [Plan model]).
FP8_EFFICIENCY = 0.4882

# Numbers: NVIDIA's datasheets (dense, i.e. without 2:4 sparsity). Where no
# public number exists (achievable fractions, latencies) the value is an
# assumption, marked so; ``--calibrate`` replaces all of them with
# measurements on a real machine.
PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        description="NVIDIA H100 SXM5 80GB, 8 per node, NVLink 4, 400 Gb/s InfiniBand per GPU",
        # H100 SXM datasheet (nvidia.com/en-us/data-center/h100): 989 TFLOPS
        # bf16 dense (1979 with sparsity), 67 TFLOPS fp32, 80 GB HBM3 at 3.35 TB/s.
        peak_bf16_flops=989 * TFLOPS,
        peak_fp32_flops=67 * TFLOPS,
        # Same datasheet: 1,979 TFLOPS fp8 dense (3,958 with sparsity).
        peak_fp8_flops=1979 * TFLOPS,
        fp8_matmul_efficiency=FP8_EFFICIENCY,
        # torchtitan's 500 W H100 fitted value (see h100-96gb-500w); a 700 W
        # SXM part likely sustains more: a conservative assumption.
        matmul_efficiency=0.5021,
        memory_bytes=80 * GB,
        usable_memory_fraction=0.95,  # assumption (context, NCCL buffers)
        memory_bandwidth=3.35e12,
        memory_efficiency=0.7,  # assumption
        kernel_overhead_s=4e-6,  # assumption: launch + tail of a small kernel
        gpus_per_node=8,
        # NVLink 4: 900 GB/s bidirectional per GPU (same datasheet) = 450 GB/s
        # each way; ~80% achievable bus bandwidth is an assumption.
        intra_bandwidth=360 * GB,
        intra_latency_s=20e-6,  # assumption
        # ConnectX-7 400 Gb/s (50 GB/s) per GPU (DGX H100 user guide);
        # ~85% achievable is an assumption.
        inter_bandwidth=42.5 * GB,
        inter_latency_s=50e-6,  # assumption
        source="NVIDIA H100 datasheet, DGX H100 user guide; efficiencies assumed",
    ),
    "h100-96gb-500w": HardwareProfile(
        name="h100-96gb-500w",
        description="torchtitan's 2024-12 benchmark H100 (Grand Teton): 96 GB HBM2e, 500 W",
        # torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e,
        # 2.4 TB/s, 500 W power limit, NVLink within a host of 8, 400 Gb/s
        # RDMA per GPU; peak FLOPs "between SXM and NVL", unknown, so the SXM
        # peak (what torchtitan's MFU uses) and a calibrated efficiency.
        peak_bf16_flops=989 * TFLOPS,
        peak_fp32_flops=67 * TFLOPS,
        peak_fp8_flops=1979 * TFLOPS,  # SXM datasheet, as the bf16 peak
        # Fitted (python -m simplefsdp.plan.reference --fit-float8) on one
        # row only: 8B, 8 GPUs, FSDP + torch.compile + Float8, 8,532 TPS/GPU.
        fp8_matmul_efficiency=FP8_EFFICIENCY,
        # Fitted (python -m simplefsdp.plan.reference --fit) on one row only:
        # 8B, 8 GPUs, FSDP + torch.compile, 6,667 TPS/GPU; docs/scale.md.
        matmul_efficiency=0.5021,
        memory_bytes=96 * GiB,  # "96GB" HBM2e; torchtitan reports GiB readings
        usable_memory_fraction=0.95,
        memory_bandwidth=2.4e12,
        memory_efficiency=0.7,  # assumption
        kernel_overhead_s=4e-6,  # assumption
        gpus_per_node=8,
        intra_bandwidth=360 * GB,  # as h100 (NVLink 4), assumption on efficiency
        intra_latency_s=20e-6,
        inter_bandwidth=42.5 * GB,  # 400 Gb/s per GPU, 85% assumed
        inter_latency_s=50e-6,
        source="torchtitan llama3_h100_202412 benchmark hardware section; H100 datasheet",
    ),
    "h200": HardwareProfile(
        name="h200",
        description="NVIDIA H200 SXM 141GB, 8 per node, NVLink 4, 400 Gb/s InfiniBand per GPU",
        # H200 datasheet (nvidia.com/en-us/data-center/h200): 989 TFLOPS bf16
        # dense, 67 TFLOPS fp32, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s;
        # 1,979 TFLOPS fp8 dense.
        peak_bf16_flops=989 * TFLOPS,
        peak_fp32_flops=67 * TFLOPS,
        peak_fp8_flops=1979 * TFLOPS,
        fp8_matmul_efficiency=FP8_EFFICIENCY,  # assumption: as h100
        matmul_efficiency=0.5021,  # assumption: as h100
        memory_bytes=141 * GB,
        usable_memory_fraction=0.95,
        memory_bandwidth=4.8e12,
        memory_efficiency=0.7,
        kernel_overhead_s=4e-6,
        gpus_per_node=8,
        intra_bandwidth=360 * GB,
        intra_latency_s=20e-6,
        inter_bandwidth=42.5 * GB,  # ConnectX-7 400 Gb/s per GPU (HGX H200), 85% assumed
        inter_latency_s=50e-6,
        source="NVIDIA H200 datasheet; efficiencies assumed as for h100",
    ),
    "a100": HardwareProfile(
        name="a100",
        description="NVIDIA A100 SXM4 80GB, 8 per node, NVLink 3, 200 Gb/s InfiniBand per GPU",
        # A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOPS bf16
        # dense, 19.5 TFLOPS fp32, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s
        # bidirectional (300 each way). DGX A100: 8x 200 Gb/s HDR per node.
        # No float8 tensor cores (peak_fp8_flops 0: --float8 is refused).
        peak_bf16_flops=312 * TFLOPS,
        peak_fp32_flops=19.5 * TFLOPS,
        matmul_efficiency=0.6,  # assumption
        memory_bytes=80 * GB,
        usable_memory_fraction=0.95,
        memory_bandwidth=2.039e12,
        memory_efficiency=0.7,
        kernel_overhead_s=4e-6,
        gpus_per_node=8,
        intra_bandwidth=240 * GB,  # 80% of 300 GB/s, assumption
        intra_latency_s=20e-6,
        inter_bandwidth=21 * GB,  # 85% of 25 GB/s, assumption
        inter_latency_s=50e-6,
        source="NVIDIA A100 datasheet, DGX A100 user guide; efficiencies assumed",
    ),
    # Measured on a 2-core, 24 GB CPU machine (gloo) by
    # ``simplefsdp plan --calibrate`` at a 1-minute load
    # average of about 5.6 (other jobs ran concurrently): medians, so that
    # load is in the numbers. Rerun --calibrate on a machine of your own.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo",
        description="2-core CPU machine, 2 gloo ranks (measured, loaded)",
        peak_bf16_flops=27.64e9,  # fp32 1024^2 matmul per rank (no bf16 path measured)
        peak_fp32_flops=27.64e9,
        matmul_efficiency=1.0,  # measured rate, not a peak
        memory_bytes=25.28e9,  # physical RAM (shared by the ranks)
        usable_memory_fraction=0.9,
        memory_bandwidth=1.10e9,  # 16M-float add, per rank, under load
        memory_efficiency=1.0,
        kernel_overhead_s=12.6e-6,  # per op of a tiny autograd chain
        gpus_per_node=1 << 20,  # all ranks on this machine
        intra_bandwidth=105.5e6,  # ring bus bandwidth, mean of all-gather/reduce-scatter
        intra_latency_s=0.0,  # fit intercept clamped at 0 over 1-64 MiB buffers
        inter_bandwidth=105.5e6,
        inter_latency_s=0.0,
        comm_overlap=0.0,  # an all-reduce and matmuls took turns (no overlap measured)
        source="measured by simplefsdp plan --calibrate on a 2-core, 24 GB CPU machine",
    ),
}


def profile_names() -> list[str]:
    return sorted(PROFILES)


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile from a JSON file (``simplefsdp plan --calibrate`` writes one)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read hardware profile {str(path)!r}: {exc}") from None
    return HardwareProfile.from_dict(data.get("profile", data))


def get_profile(name: str) -> HardwareProfile:
    """A built-in profile by name, or one from a ``.json`` path.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        return load_profile(name)
    raise ValueError(
        f"unknown hardware {name!r}; valid: {', '.join(profile_names())} or a .json profile path"
    )
