"""What a benchmark worker measures: step time, state bytes, collectives, comm-only.

Peak memory is measured by ``simplefsdp.engines.MemoryProbe``.

Note: [Benchmark memory]
    On CUDA the peak is the caching allocator's ``max_memory_allocated``
    over the measured steps (reset after warm-up) minus what was allocated
    before the model was built. On CPU it is the process's peak resident set
    size over the measured steps minus the RSS at start-up (after imports,
    process-group set-up and data loading, before the model is built), with
    glibc's mmap threshold lowered at process start so freed tensors leave the
    RSS at once, except those glibc placed in free heap chunks (see Note:
    [Measuring peak memory on CPU] in
    ``simplefsdp.engines.memory``), and ``malloc_trim(0)`` run after warm-up so heap
    pages freed by the compiler go back to the OS. Every worker imports
    Inductor before the baseline. The CPU number therefore includes the
    model, optimizer state, activations, and whatever compilation leaves
    resident (compiled kernels, graphs, guards), so compiled configurations
    carry some tens of MiB that eager ones do not.

Note: [Warm-up residency]
    The worker reads the memory level (above the baseline) and the state
    bytes (``state_bytes``) just before the first warm-up step, and again
    when the measured steps start. The level's growth minus the state's
    growth (the optimizer's moments, created by the first step) is what
    warm-up left resident besides the training state: for a compiled
    configuration, what compiling left behind (Dynamo's and Inductor's
    graphs, guards, generated code and the modules they import), which on
    a GPU is host memory and not device memory; for eager ones little or
    nothing. The report gives it per configuration and the peak without it
    (``peak_mem_bytes - warmup_resident_mem_bytes`` on each rank, the
    largest rank's), so the memory a step needs can be compared apart from
    what compiling costs once. It is a difference of two whole-process
    levels, so anything else that stayed allocated (an allocator's cache, a
    buffer a library keeps) is counted in it too.

Note: [Peak by phase]
    After the measured steps one more step runs, untimed, in two phases:
    forward and backward (all accumulation batches, the gradient reduction
    included), then the optimizer step with ``zero_grad``. For each phase the
    probe is reset before it runs (on CPU: ``malloc_trim`` and a reset of the
    kernel's high-water mark) and its peak is reported above the level the
    step started at. The larger of the two is where the step's peak is: the
    compiled graphs and their collectives in the first, the optimizer's
    states and temporaries in the second (``foreach`` AdamW allocates
    parameter-sized temporaries while every gradient is still alive), so a
    difference in the step's peak between configurations can be traced to
    what each runs.

Note: [Counting collectives]
    Configurations compiled by ``simplefsdp.compile`` report their
    collectives from ``simplefsdp.comm_report`` (what the graphs issue). All
    configurations are also counted by running one extra step under
    ``torch.profiler`` and counting the ``c10d::`` dispatcher ops that every
    process-group collective goes through, whoever issues it (DDP's C++
    reducer, FSDP2's hooks, functional collectives in compiled code):
    ``_allgather_base_``/``allgather_into_tensor_coalesced_``/``allgather_``,
    ``_reduce_scatter_base_``/``reduce_scatter_tensor_coalesced_``/
    ``reduce_scatter_``, ``allreduce_``/``allreduce_coalesced_``, and
    expert parallelism's ``alltoall_base_``/``alltoall_``. The
    profiler, unlike a ``TorchDispatchMode``, does not make Dynamo fall back
    to eager, so compiled code is counted as it runs.

    The same profiled step records each collective's tensor shapes and
    dtypes, from which the worker reports the bytes each kind moved per step
    (``collective_bytes_profiled``): the unsharded buffer's bytes, i.e. an
    all-gather's output and a reduce-scatter's input, as
    ``simplefsdp.comm_report`` counts them. A float8 all-gather moves one
    byte per element whether it travels as float8 or as its ``uint8`` view.
    All-reduces and coalesced collectives take tensor lists, whose shapes the
    profiler does not record: their bytes are left out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from simplefsdp._compat import all_gather_single, reduce_scatter_single
from simplefsdp.bucket_plan import outer_modules

_C10D_OPS: dict[str, str] = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::alltoall_": "all_to_all",
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """``(seconds, fn())`` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state (local shards, each
    storage once): the persistent training state, whatever else is resident."""
    from torch.distributed.tensor import DTensor

    tensors: list[torch.Tensor] = list(module.parameters())
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for plain in _inner_tensors(local):
            storage = plain.untyped_storage()
            if plain.device.type == "meta" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data: itself, or for a wrapper
    subclass (torchao's float8 training weight) the tensors it wraps."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _inner_tensors(getattr(tensor, name))]


def phase_peaks(probe: Any, phases: dict[str, Callable[[], Any]]) -> dict[str, int | None]:
    """Run ``phases`` in order; each one's peak memory above the level at the
    start of the first (Note: [Peak by phase]).

    ``probe``: a ``simplefsdp.engines.MemoryProbe`` (``reset``,
    ``peak_bytes``, ``start_bytes``). ``None`` where the probe cannot tell.
    """
    peaks: dict[str, int | None] = {}
    start: int | None = None
    for i, (name, run) in enumerate(phases.items()):
        probe.reset()
        if i == 0:
            start = probe.start_bytes
        run()
        peak = probe.peak_bytes()
        peaks[name] = None if peak is None or start is None else peak - start
    return peaks


def count_collectives(fn: Callable[[], Any]) -> dict[str, int]:
    """Collectives issued while ``fn()`` runs, by kind (Note: [Counting
    collectives])."""
    return profile_collectives(fn)[0]


# The profiler's names of tensor dtypes (c10 scalar type names) -> bytes per element.
_PROFILER_DTYPE_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "unsigned char": 1, "signed char": 1, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1,
}  # fmt: skip


def _event_bytes(event: Any) -> int | None:
    """Bytes of the larger of a collective's first two tensors (output and
    input), ``None`` where the profiler did not record them."""
    shapes = getattr(event, "input_shapes", None) or []
    dtypes = getattr(event, "input_dtypes", None) or []
    sizes = []
    for shape, dtype in list(zip(shapes, dtypes))[:2]:
        itemsize = _PROFILER_DTYPE_BYTES.get(dtype)
        if itemsize is None or not shape:
            continue
        sizes.append(math.prod(shape) * itemsize)
    return max(sizes) if sizes else None


def profile_collectives(fn: Callable[[], Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Collectives issued while ``fn()`` runs: ``(counts, bytes)`` by kind
    (Note: [Counting collectives]); ``bytes`` sums the collectives whose
    tensors the profiler recorded."""
    from torch.profiler import ProfilerActivity, profile

    counts = dict.fromkeys(KINDS, 0)
    nbytes = dict.fromkeys(KINDS, 0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    for event in prof.events():
        kind = _C10D_OPS.get(event.name)
        if kind is not None:
            counts[kind] += 1
            nbytes[kind] += _event_bytes(event) or 0
    return counts, nbytes


def fsdp_unit_numels(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> list[tuple[int, bool]]:
    """``(numel, resharded)`` per FSDP unit in forward order, as the fsdp2
    engine wraps them (:func:`simplefsdp.bucket_plan.outer_modules`): the
    embedding (resharded after forward), each block (resharded), the final
    norm and output (kept); with tied embeddings every parameter outside
    the blocks is the root's unit, first and kept."""

    def numel(modules: list[nn.Module]) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    before, after = ([m for _, m in side] for side in outer_modules(model, blocks) or ([], []))
    grouped = {id(p) for m in [b for _, b in blocks] + before + after for p in m.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in grouped)
    return (
        ([(root, False)] if root else [])
        + ([(numel(before), True)] if before else [])
        + [(numel([block]), True) for _, block in blocks]
        + ([(numel(after), False)] if after else [])
    )


def _comm_buffers(
    units: list[tuple[int, bool]], world_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Per unit: a 1-D shard and a padded full-size buffer, float32 (no mixed precision)."""
    out = []
    for numel, resharded in units:
        shard = math.ceil(numel / world_size)
        out.append(
            (
                torch.ones(shard, device=device),  # 1-D shard
                torch.empty(shard * world_size, device=device),  # 1-D unsharded
                resharded,
            )
        )
    return out


def _comm_step(buffers: list[tuple[torch.Tensor, torch.Tensor, bool]], group) -> None:
    """One step's collectives: forward all-gathers in order; in backward, in
    reverse, the all-gather again for resharded units and a reduce-scatter."""
    for shard, full, _ in buffers:
        all_gather_single(full, shard, group=group)
    for shard, full, resharded in reversed(buffers):
        if resharded:
            all_gather_single(full, shard, group=group)
        reduce_scatter_single(shard, full, group=group)


def run_comm_only(
    units: list[tuple[int, bool]],
    *,
    steps: int,
    warmup: int,
    device: torch.device,
    group=None,
) -> dict:
    """Time the per-step collectives of ``units`` with no compute.

    Returns the per-rank measurement: ``step_times_s`` (measured steps),
    ``collectives`` per step and ``bytes_per_step`` (unsharded bytes moved
    by all-gathers and reduce-scatters together).
    """
    world_size = dist.get_world_size(group)
    buffers = _comm_buffers(units, world_size, device)
    for _ in range(warmup):
        _comm_step(buffers, group)
    dist.barrier(group)
    times = [timed(lambda: _comm_step(buffers, group), device)[0] for _ in range(steps)]
    n_resharded = sum(1 for _, _, r in buffers if r)
    full_bytes = [full.numel() * full.element_size() for _, full, _ in buffers]
    resharded_bytes = sum(b for b, (_, _, r) in zip(full_bytes, buffers) if r)
    return {
        "step_times_s": times,
        "collectives": {
            "all_gather": len(buffers) + n_resharded,
            "reduce_scatter": len(buffers),
            "all_reduce": 0,
            "broadcast": 0,
        },
        "bytes_per_step": 2 * sum(full_bytes) + resharded_bytes,
    }
