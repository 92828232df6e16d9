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

# Host time per eager op (Note: [Host-bound steps] in simplefsdp/plan/host.py),
# for a CUDA host; published microbenchmarks, not fitted. Forward, Python with
# autograd recording: pytorch/pytorch#41383 measures about 7 us per op with
# requires_grad (5 us without; Python, dispatcher, autograd node) on CPU
# tensors, to which a CUDA launch (cudaLaunchKernel, 1-3 us) adds: ~10 us.
# Backward, autograd's C++ engine: the same op from C++ costs about 1 us of
# dispatch (ngimel, same thread), and pytorch/pytorch#82793 measures about
# 4 us of overhead per op on CUDA: ~4 us with the launch.
HOST_FORWARD_OP_S = 10e-6
HOST_BACKWARD_OP_S = 4e-6
# Selective AC's dispatch mode (torch.utils.checkpoint's selective policy,
# a Python TorchDispatchMode called per op in forward and in the
# recomputation): what it adds per op, measured (benchmarks/host_ops.py) on
# the DeepSeek-V3 and Llama 3 block structures at minimal widths on a
# 2-core AMD EPYC VM at 2.6 GHz, torch 2.13: forward +30 and +35 us,
# recomputed +34 and +41 us over a forward op without AC (17 and 13 us
# there). Not fitted.
HOST_SELECTIVE_AC_OP_S = 35e-6
# Eager FSDP2's hooks per group and step (pre/post forward and backward,
# autograd's bookkeeping around them): 0.54 ms, measured as ``plan
# --calibrate``'s ``fsdp2_group_s`` (a one-rank group of a Llama block's nine
# parameters, so no communication is in it) on the same VM, torch 2.13. Not
# fitted.
HOST_FSDP2_GROUP_S = 0.54e-3


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type in a cluster (all bandwidths in bytes/s).

    Attributes:
        name: short name (``--hardware``).
        description: one line, shown in reports.
        peak_bf16_flops: dense bf16 tensor-core peak (FLOP/s).
        peak_fp32_flops: dense fp32 peak (FLOP/s), for fp32 matmuls.
        matmul_efficiency: achievable fraction of the peak for large matmuls.
        memory_bytes: the device memory CUDA reports
            (``torch.cuda.get_device_properties(d).total_memory``, what
            torchtitan's memory percentages are of), less than the
            marketed "80 GB": the driver and ECC keep some.
        usable_memory_fraction: part of it a job's caching allocator may
            reserve (the rest: CUDA context, communication buffers).
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
            ``matmul_efficiency``); with an ``sm_count``, at the best shape
            (as ``gemm_efficiency``).
        sm_count: streaming multiprocessors; non-zero turns on the
            per-kernel model (Note: [Kernel model] in
            ``simplefsdp/plan/kernels.py``): each GEMM priced by its shape,
            attention by its FLOPs at the FlashAttention rates below,
            ``matmul_efficiency`` then only sizing the bucket planner's
            windows.
        gemm_efficiency: the published maximum achievable fraction of the
            bf16 peak for one GEMM at its best shape.
        clock_fraction: sustained tensor clock under the part's power limit
            against the datasheet's (1 at the datasheet's power).
        flash_fwd_efficiency, flash_bwd_efficiency: fused causal attention's
            achievable fraction of the bf16 peak, forward and backward
            (published FlashAttention-2 measurements, causal FLOPs halved).
        host_forward_op_s: host time to issue one eager forward op from
            Python with autograd recording and launch its kernel (Note:
            [Host-bound steps] in ``simplefsdp/plan/host.py``); also what a
            device-to-host sync leaves the GPU idle before its next kernel.
        host_backward_op_s: host time of one op issued by autograd's C++
            engine in backward (no Python) and its launch.
        host_selective_ac_op_s: what selective AC's dispatch mode adds to
            each forward and recomputed op's host time.
        host_fsdp2_group_s: the host's time in one eager FSDP2 group's
            hooks per step, where the eager timeline places them (Note:
            [Host-bound steps]); ``fsdp2_group_s`` is the same cost taken
            as serial time by the traced plans (0 on GPU profiles, whose
            traced steps are device bound).
        caching_allocator: memory comes from PyTorch's CUDA caching
            allocator, whose reserved peak the plan reports (Note: [Caching
            allocator simulation]); ``False`` on CPU profiles.
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
    sm_count: int = 0
    gemm_efficiency: float = 0.0
    clock_fraction: float = 1.0
    flash_fwd_efficiency: float = 0.0
    flash_bwd_efficiency: float = 0.0
    host_forward_op_s: float = HOST_FORWARD_OP_S
    host_backward_op_s: float = HOST_BACKWARD_OP_S
    host_selective_ac_op_s: float = HOST_SELECTIVE_AC_OP_S
    host_fsdp2_group_s: float = HOST_FSDP2_GROUP_S
    caching_allocator: bool = True

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


# Constants fitted on published rows (``python -m simplefsdp.plan.reference
# --fit``); every other number below is a datasheet value, a published
# measurement or a marked assumption.
#
# CLOCK_500W: the sustained tensor clock of torchtitan's 500 W H100 (96 GB
# HBM2e) against the 700 W SXM datasheet part, fitted on one row only:
# llama3_h100_202412 Table 1, 8B on 8 GPUs, FSDP + torch.compile, 6,667
# TPS/GPU. FP8_EFFICIENCY: the float8 GEMM's maximum achievable fraction of
# the fp8 peak, fitted on one row only: the same table's FSDP +
# torch.compile + Float8 row, 8,532 TPS/GPU (with CLOCK_500W).
CLOCK_500W = 0.7414
FP8_EFFICIENCY = 0.8183

# Maximum achievable matmul FLOPS (bf16, best shape), Stas Bekman's
# ml-engineering "Maximum Achievable FLOPS" table (mamf-finder): A100 SXM
# 267.9 of 312 TFLOPS, H100 SXM 792.1 of 989 TFLOPS.
_MAMF_A100 = 267.9 / 312
_MAMF_H100 = 792.1 / 989
# The same table's later rows: B200 SXM bf16 1,745.0 of 2,250 TFLOPS
# (torch 2.7.1+cu128); float8 (e4m3) B200 SXM 3,432.5 of 4,500 and H100
# SXM 1,402.6 of 1,979 (torch 2.7).
_MAMF_B200 = 1745.0 / 2250
_MAMF_FP8_B200 = 3432.5 / 4500
_MAMF_FP8_H100 = 1402.6 / 1979
# FlashAttention-2 forward and backward rates, causal, head dim 128, long
# sequences, as fractions of the bf16 peak: A100 from the FlashAttention-2
# paper (Dao 2023, fig. 4-5: about 220 and 170 TFLOPS), H100 from the
# FlashAttention-3 paper's FlashAttention-2 baseline (Shah et al. 2024,
# fig. 5-6: about 360 and 300 TFLOPS). Read off the figures: +-5%.
_FA2_A100 = (220 / 312, 170 / 312)
_FA2_H100 = (360 / 989, 300 / 989)


def _hopper(**fields) -> HardwareProfile:
    """An H100-die profile: 132 SMs, NVLink 4, 400 Gb/s NIC per GPU."""
    base = dict(
        # H100 SXM datasheet (nvidia.com/en-us/data-center/h100): 989 TFLOPS
        # bf16 dense, 1,979 fp8 dense, 67 TFLOPS fp32; 132 SMs (Hopper
        # whitepaper, SXM5).
        peak_bf16_flops=989 * TFLOPS,
        peak_fp32_flops=67 * TFLOPS,
        peak_fp8_flops=1979 * TFLOPS,
        sm_count=132,
        gemm_efficiency=_MAMF_H100,
        fp8_matmul_efficiency=FP8_EFFICIENCY,
        flash_fwd_efficiency=_FA2_H100[0],
        flash_bwd_efficiency=_FA2_H100[1],
        usable_memory_fraction=0.95,  # assumption (context, NCCL buffers)
        memory_efficiency=0.7,  # assumption
        kernel_overhead_s=4e-6,  # assumption: launch + tail of a small kernel
        gpus_per_node=8,
        # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s each way; ~80%
        # achievable bus bandwidth is an assumption.
        intra_bandwidth=360 * GB,
        intra_latency_s=20e-6,  # assumption
        # ConnectX-7 400 Gb/s (50 GB/s) per GPU (DGX H100 user guide); ~85%
        # achievable is an assumption.
        inter_bandwidth=42.5 * GB,
        inter_latency_s=50e-6,  # assumption
    )
    base.update(fields)
    # The bucket planner's windows: the large-GEMM rate.
    base.setdefault("matmul_efficiency", base["gemm_efficiency"] * base.get("clock_fraction", 1.0))
    return HardwareProfile(**base)


PROFILES: dict[str, HardwareProfile] = {
    "h100": _hopper(
        name="h100",
        description="NVIDIA H100 SXM5 80GB (700 W), 8 per node, NVLink 4, 400 Gb/s NIC per GPU",
        # CUDA reports 79.18 GiB on an H100 80GB HBM3 (torchtitan's "CUDA
        # capacity" log line; its DeepSeek-V3 readings in torchtitan#1789,
        # 73.32 GiB = 92.70%, put it at 79.1).
        memory_bytes=79.18 * GiB,
        memory_bandwidth=3.35e12,  # datasheet: 80 GB HBM3 at 3.35 TB/s
        source="NVIDIA H100 datasheet, DGX H100 user guide, mamf-finder; efficiencies noted",
    ),
    "h100-96gb-500w": _hopper(
        name="h100-96gb-500w",
        description="torchtitan's 2024-12 benchmark H100 (Grand Teton): 96 GB HBM2e, 500 W",
        # torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e,
        # 2.4 TB/s, 500 W power limit, NVLink within a host of 8, 400 Gb/s
        # RDMA per GPU; peak FLOPs "between SXM and NVL", unknown: the SXM
        # datasheet's and the fitted sustained clock (CLOCK_500W).
        clock_fraction=CLOCK_500W,
        # CUDA's total on these parts: torchtitan#2080's readings on them,
        # 59.54 GiB = 62.68% and 51.11 GiB = 53.80%, put it at 95.0 GiB.
        memory_bytes=95.0 * GiB,
        memory_bandwidth=2.4e12,
        source="torchtitan llama3_h100_202412 benchmark hardware section; H100 datasheet; "
        "clock_fraction fitted (CLOCK_500W)",
    ),
    "h200": _hopper(
        name="h200",
        description="NVIDIA H200 SXM 141GB (700 W), 8 per node, NVLink 4, 400 Gb/s NIC per GPU",
        # H200 datasheet (nvidia.com/en-us/data-center/h200): the H100's
        # compute (989 TFLOPS bf16 dense), 141 GB HBM3e at 4.8 TB/s,
        # NVLink 900 GB/s; HGX H200: ConnectX-7 400 Gb/s per GPU.
        memory_bytes=139.81 * GiB,  # CUDA's total (torchtitan's "CUDA capacity" log)
        memory_bandwidth=4.8e12,
        source="NVIDIA H200 datasheet; rates as the H100 die's (mamf-finder, FlashAttention)",
    ),
    "a100": HardwareProfile(
        name="a100",
        description="NVIDIA A100 SXM4 80GB, 8 per node, NVLink 3, 200 Gb/s InfiniBand per GPU",
        # A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOPS bf16
        # dense, 19.5 TFLOPS fp32, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s
        # bidirectional (300 each way); 108 SMs (Ampere whitepaper). DGX
        # A100: 8x 200 Gb/s HDR per node. No float8 tensor cores
        # (peak_fp8_flops 0: --float8 is refused).
        peak_bf16_flops=312 * TFLOPS,
        peak_fp32_flops=19.5 * TFLOPS,
        sm_count=108,
        gemm_efficiency=_MAMF_A100,
        matmul_efficiency=_MAMF_A100,
        flash_fwd_efficiency=_FA2_A100[0],
        flash_bwd_efficiency=_FA2_A100[1],
        memory_bytes=79.15 * GiB,  # CUDA's total (its out-of-memory messages)
        usable_memory_fraction=0.95,
        memory_bandwidth=2.039e12,
        memory_efficiency=0.7,
        kernel_overhead_s=4e-6,
        gpus_per_node=8,
        intra_bandwidth=240 * GB,  # 80% of 300 GB/s, assumption
        intra_latency_s=20e-6,
        inter_bandwidth=21 * GB,  # 85% of 25 GB/s, assumption
        inter_latency_s=50e-6,
        source="NVIDIA A100 datasheet, DGX A100 user guide, mamf-finder, FlashAttention-2",
    ),
    "a100-40gb": HardwareProfile(
        name="a100-40gb",
        description="NVIDIA A100 SXM4 40GB, 8 per node, NVLink 3, 200 Gb/s InfiniBand per GPU",
        # A100 datasheet: the 80 GB part's compute; 40 GB HBM2 at 1,555 GB/s.
        peak_bf16_flops=312 * TFLOPS,
        peak_fp32_flops=19.5 * TFLOPS,
        sm_count=108,
        gemm_efficiency=_MAMF_A100,
        matmul_efficiency=_MAMF_A100,
        flash_fwd_efficiency=_FA2_A100[0],
        flash_bwd_efficiency=_FA2_A100[1],
        memory_bytes=39.39 * GiB,  # CUDA's total (its out-of-memory messages)
        usable_memory_fraction=0.95,
        memory_bandwidth=1.555e12,
        memory_efficiency=0.7,
        kernel_overhead_s=4e-6,
        gpus_per_node=8,
        intra_bandwidth=240 * GB,
        intra_latency_s=20e-6,
        inter_bandwidth=21 * GB,
        inter_latency_s=50e-6,
        source="NVIDIA A100 datasheet, DGX A100 user guide, mamf-finder, FlashAttention-2",
    ),
    "b200": HardwareProfile(
        name="b200",
        description="NVIDIA B200 180GB (1000 W), 8 per node, NVLink 5, 400 Gb/s NIC per GPU",
        # DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 72
        # PFLOPS fp8 training and 1,440 GB HBM3e at 64 TB/s for 8 GPUs, i.e.
        # per GPU 4.5 PFLOPS fp8 dense, 2.25 PFLOPS bf16 dense, 180 GB at
        # 8 TB/s; NVLink 5 1.8 TB/s bidirectional per GPU; 8x ConnectX-7
        # 400 Gb/s. 148 SMs (Blackwell whitepaper). GEMMs at the part's
        # published mamf-finder rates: bf16 its own; float8 the H100's
        # fitted fraction (FP8_EFFICIENCY) times the two parts' published
        # float8 ratio. FlashAttention's rates are the H100's (none
        # published for this part here).
        peak_bf16_flops=2250 * TFLOPS,
        peak_fp32_flops=80 * TFLOPS,
        peak_fp8_flops=4500 * TFLOPS,
        sm_count=148,
        gemm_efficiency=_MAMF_B200,
        matmul_efficiency=_MAMF_B200,
        fp8_matmul_efficiency=FP8_EFFICIENCY * _MAMF_FP8_B200 / _MAMF_FP8_H100,
        flash_fwd_efficiency=_FA2_H100[0],  # assumption: as H100
        flash_bwd_efficiency=_FA2_H100[1],
        memory_bytes=178.35 * GiB,  # CUDA's total (its out-of-memory messages)
        usable_memory_fraction=0.95,
        memory_bandwidth=8.0e12,
        memory_efficiency=0.7,
        kernel_overhead_s=4e-6,
        gpus_per_node=8,
        intra_bandwidth=720 * GB,  # 80% of 900 GB/s each way, assumption
        intra_latency_s=20e-6,
        inter_bandwidth=42.5 * GB,
        inter_latency_s=50e-6,
        source="NVIDIA DGX B200 datasheet, mamf-finder; FlashAttention rates assumed as the H100's",
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
        caching_allocator=False,
    ),
}


def check_float8(hw: HardwareProfile) -> None:
    """One-line ``ValueError`` where ``hw`` has no float8 peak (``--float8``)."""
    if hw.peak_fp8_flops <= 0:
        with_fp8 = ", ".join(n for n, p in PROFILES.items() if p.peak_fp8_flops > 0)
        raise ValueError(
            f"--float8 needs float8 tensor cores; hardware {hw.name!r} has no float8 peak "
            f"(peak_fp8_flops; built-in profiles with one: {with_fp8})"
        )


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
