"""The plan model's costs beyond the traced graph's nodes (Note: [Plan
model] in ``simplefsdp/plan/predict.py``): the copies around the
collectives, eager FSDP2's copies at their measured rate, the gathered
buffers of a bucket plan, and the compiler's ``CostModel`` for a hardware
profile and a layout."""

from __future__ import annotations

import itertools
from collections.abc import Collection

from simplefsdp.compiler.planning import CostModel, GatherUnit, LinearFit, gathers_per_step
from simplefsdp.plan.hardware import HardwareProfile
from simplefsdp.plan.layout import Layout

#: The fused AdamW step per fp32 parameter shard: it reads the parameter, its
#: gradient and both moments and writes the parameter and both moments.
ADAMW_BYTES_PER_PARAM = 28
#: Gradient-norm clipping (the trainer's and torchtitan's default max_norm of
#: 1.0) per fp32 gradient shard: the norm reads it, the scaling reads and
#: writes it again.
CLIP_BYTES_PER_PARAM = 12


def copy_written_bytes(
    buckets: list[list[GatherUnit]], reshard_after_forward: bool, kept: Collection[str] = ()
) -> tuple[float, int]:
    """(bytes written, kernels) of the copies around a step's collectives
    (Note: [Plan model]): per all-gather the copy-in of the shards and the
    copy-out of the gathered bucket, per reduce-scatter the copy-in of the
    gradients, one kernel per parameter copied. A bucket whose parameters
    are all ``kept`` gathered from forward to backward is gathered once."""
    written, kernels = 0.0, 0
    for bucket in buckets:
        gathers = gathers_per_step(bucket, reshard_after_forward, kept)
        size = sum(u.gathered_bytes for u in bucket)
        shards = sum(u.gathered_bytes / u.group_size for u in bucket)
        written += gathers * (size + shards) + size
        kernels += (2 * gathers + 1) * len(bucket)
    return written, kernels


def copy_seconds(
    buckets: list[list[GatherUnit]],
    cost_model: CostModel,
    reshard_after_forward: bool,
    bytes_per_byte: float = 2.0,
    kept: Collection[str] = (),
) -> float:
    """Seconds of the copies around a step's collectives (Note: [Plan
    model]; what they write: ``copy_written_bytes``). Each copy writes a
    new buffer and moves ``bytes_per_byte`` bytes per byte written at the
    elementwise rate (the profile's ``copy_bytes_per_byte``: 2, a read and
    a write, where allocations are cached; about 3 measured on a CPU whose
    new buffers' pages fault in, where a copy into an existing buffer is
    about 4x faster than into a new one), plus the per-kernel cost."""
    written, kernels = copy_written_bytes(buckets, reshard_after_forward, kept)
    return (
        bytes_per_byte * written / cost_model.bytes_per_s + kernels * cost_model.kernel_overhead_s
    )


def fsdp2_copy_seconds(
    buckets: list[list[GatherUnit]],
    hw: HardwareProfile,
    reshard_after_forward: bool,
    gathered_bytes: float,
) -> float:
    """Seconds of eager FSDP2's copies at the profile's measured
    ``fsdp2_copy_s_per_byte`` (Note: [Plan model]): what
    ``copy_written_bytes`` counts for its groups (``buckets``), and at world
    size 1 (no buckets: nothing is sharded, yet FSDP2 still copies in and
    out around its one-rank all-gathers and copies its reduce-scatter's
    input) the same count for ``gathered_bytes`` of parameters as one group.
    Per-kernel costs are in the profile's ``fsdp2_group_s``, measured with
    the same tiny copies."""
    if buckets:
        written, _ = copy_written_bytes(buckets, reshard_after_forward)
    else:
        gathers = 2 if reshard_after_forward else 1
        written = (2 * gathers + 1) * gathered_bytes
    return written * hw.fsdp2_copy_s_per_byte


def prefetch_extra_bytes(buckets: list[list[GatherUnit]], kept: Collection[str] = ()) -> float:
    """Gathered parameters beyond the unbucketed graph at their worst, without
    positions (Note: [Plan model]): in forward, bucket i gathered and copied
    out beside the next one prefetched, ``2 * B_i + B_{i+1}``, plus the
    ``kept`` parameters of the buckets before it (gathered once, held until
    their backward); when backward starts, all the kept ones beside the
    first bucket it gathers again, copied out (``2 * B_r``)."""
    sizes = [sum(u.gathered_bytes for u in b) for b in buckets]
    held = [sum(u.gathered_bytes for u in b if u.fqn in kept) for b in buckets]
    before = list(itertools.accumulate(held, initial=0))
    forward = (
        before[i] + 2 * s + (sizes[i + 1] if i + 1 < len(sizes) else 0) for i, s in enumerate(sizes)
    )
    regathered = [s for s, h in zip(sizes, held) if h < s]
    backward = before[-1] + 2 * (regathered[-1] if regathered else 0)
    return float(max(max(forward, default=0), backward))


def ring_attention_bytes(
    out_elements: float,
    kv_elements: float,
    itemsize: int,
    cp: int,
    fused: bool,
    contiguous: bool = True,
) -> tuple[float, float]:
    """Bytes torch's ring attention (``context_parallel``, the ``torch`` CP
    backend) moves outside its attention kernels in one forward and in one
    backward call, on the rank that merges the most (the last: every step
    whole), for an attention whose output has ``out_elements`` and whose
    keys and values ``kv_elements`` together, in ``itemsize``-byte elements,
    over ``cp`` ranks (Note: [Context parallelism in the plan] in
    ``plan/predict.py``). ``(0, 0)`` for ``cp`` 1.

    Forward: the keys and values made contiguous (unless ``contiguous``) and
    concatenated for the next step before each step but the last; each
    step's output cast to fp32 and merged into the fp32 result by its
    log-sum-exp (three passes over fp32 unfused, one reading both and
    writing the result ``fused``); the result cast back. Backward: fp32
    zeros for the three gradients, the keys and values concatenated as in
    forward, each step's query gradient added into its fp32 sum and the key
    and value gradients added into the sums the ring passes on (half of
    them from the second step, whose partial update concatenates the whole
    sum again unfused), the key and value sums concatenated to be sent each
    step (unfused), and the three sums cast back."""
    if cp <= 1:
        return 0.0, 0.0
    s, f = itemsize, 4
    e, a = out_elements, kv_elements
    cast = (f + s) if s < f else 0  # to fp32 (read s, write 4) or nothing
    copy_kv = 0.0 if contiguous else 2 * s * a
    cats = (cp - 1) * 2 * s * a
    if fused:
        merge = (2 * f + s) * e  # read the sum and the step's output, write the sum
        forward = cast * e + (cp - 1) * merge + cast * e
    else:
        merge = 8 * f * e  # out - block, times the weights, out - that
        forward = cast * e + (cp - 1) * (cast * e + merge) + cast * e
    forward += copy_kv + cats
    add = 2 * f + s  # read the sum and the step's gradient, write the sum
    backward = f * (e + a) + copy_kv + cats + cp * add * e
    if fused:
        backward += cp * add * a
    else:
        backward += add * a + (cp - 1) * (add * a / 2 + 2 * f * a) + cp * 2 * f * a
    backward += cast * (e + a)
    return forward, backward


def cost_model_for(hw: HardwareProfile, layout: Layout, rs_to_ag_ratio: float = 2.0) -> CostModel:
    """The compiler's ``CostModel`` for ``hw`` and the layout's groups.

    Data-parallel groups are strided by ``tp`` (TP is the inner mesh dim), so
    an FSDP group of ``dp * cp`` ranks spans ``dp * cp * tp`` GPUs. The reduce-scatter fit is
    scaled by ``rs_to_ag_ratio`` because the planner sizes it by the gathered
    (bf16) bytes while the gradients are reduced in fp32.
    """
    comm: dict[str, LinearFit] = {}
    fsdp = getattr(layout, "fsdp", layout.dp)  # FSDP shards over dp x cp
    span_dp = fsdp * layout.tp
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        one = hw.comm_seconds(kind, fsdp, 0.0, span_dp)
        per_byte = hw.comm_seconds(kind, fsdp, 1e9, span_dp) - one
        scale = rs_to_ag_ratio if kind == "reduce_scatter" else 1.0
        comm[f"{kind}/{fsdp}"] = LinearFit(one, scale * per_byte / 1e9)
        if layout.tp > 1:
            one = hw.comm_seconds(kind, layout.tp, 0.0, layout.tp)
            per_byte = hw.comm_seconds(kind, layout.tp, 1e9, layout.tp) - one
            comm[f"tp:{kind}/{layout.tp}"] = LinearFit(one, per_byte / 1e9)
    return CostModel(
        comm=comm,
        default_comm=LinearFit(hw.inter_latency_s, 1 / hw.inter_bandwidth),
        flops_per_s=(hw.peak_bf16_flops if layout.dtype == "bf16" else hw.peak_fp32_flops)
        * hw.matmul_efficiency,
        bytes_per_s=hw.memory_bandwidth * hw.memory_efficiency,
        kernel_overhead_s=hw.kernel_overhead_s,
        comm_overlap=hw.comm_overlap,
        attention_efficiency=hw.attention_efficiency,
        alloc_s_per_byte=hw.alloc_s_per_byte,
    )
