"""Cost model: communication time by bytes, compute time by FLOPs and bytes.

Note: [Cost model calibration]
    Communication: for each (collective kind, process group size) we time a
    few buffer sizes on the real process group and fit ``t = latency +
    bytes * seconds_per_byte`` (least squares, clamped at >= 0). Compute: we
    time a square matmul (FLOP/s) and a large elementwise add (bytes/s); a
    node costs ``max(flops / flop_rate, bytes / byte_rate)`` plus a fixed
    per-kernel overhead. Every rank must plan identically, so rank 0's
    measurements are broadcast to all ranks before use. Results are cached on
    disk (``$XDG_CACHE_HOME/simplefsdp`` or ``~/.cache/simplefsdp``) keyed by
    backend, world size, device type, torch and simplefsdp versions; ranks
    agree on using the cache only if every rank has it. Each timing is the
    minimum of 5 runs (load from other processes only slows a run down);
    ``SIMPLEFSDP_RECALIBRATE=1`` ignores the cache.
    Tensor-parallel groups (a 2-D model's TP mesh) are calibrated too, under
    ``"tp:kind/group_size"`` keys: TP and data-parallel groups of one size
    may run over different links (e.g. NVLink within a host, the network
    across hosts). Collectives of a role fall back to the role-less
    ``"kind/group_size"`` fit, then to the defaults.

Note: [Communication competing with compute]
    On a GPU a collective runs on its own engines and hides under compute; on
    a CPU (gloo) it needs the same cores as compute, and the two take turns.
    ``comm_overlap`` is the fraction of a collective's time that can run
    concurrently with compute: calibration times an all-reduce, an equally
    long run of matmuls, and both together (``measure_comm_overlap``), and
    takes ``hidden / min(t_comm, t_compute)``, the median of
    ``OVERLAP_ROUNDS`` such measurements (single ones vary by several times
    on a busy machine, and the cached value decides every later auto plan
    there). The rest, ``(1 - comm_overlap)``
    of every collective, also occupies the compute stream in ``simulate`` and
    in the auto planner's replay, so that on a machine with no overlap fewer,
    larger collectives win (each saves a latency) and splitting a bucket to
    hide its transfer gains nothing.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx

from simplefsdp._compat import all_gather_single, reduce_scatter_single
from simplefsdp._version import __version__
from simplefsdp.compiler.patterns import (
    ALL_DATA_PARALLEL,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    TENSOR_PARALLEL,
    CollectiveGroups,
    collective_group,
    collective_group_size,
    collective_kind,
    concrete,
    is_compute,
    node_bytes,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten

CALIBRATION_SIZES_BYTES = (4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
CALIBRATION_REPEATS = 5


@dataclass(frozen=True)
class LinearFit:
    """``seconds = latency_s + bytes * seconds_per_byte``."""

    latency_s: float
    seconds_per_byte: float

    def __call__(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes * self.seconds_per_byte


@dataclass
class CostModel:
    """Time estimates for planning. Inject a fixed one in tests.

    Attributes:
        comm: ``"kind/group_size"`` -> fit (kind: all_gather, reduce_scatter,
            all_reduce), ``"tp:kind/group_size"`` for tensor-parallel
            groups, ``"ep:all_to_all/group_size"`` for expert parallelism's
            all-to-alls (else priced as an all-gather of their bytes).
            Missing keys fall back to ``default_comm``.
        flops_per_s: sustained matmul throughput in float32 (and for any
            dtype ``flops_per_s_by_dtype`` does not name).
        flops_per_s_by_dtype: sustained matmul throughput by the matmul's
            dtype name (``"bfloat16"``, ``"float16"``); calibrated where the
            device has them (Note: [Matmul rates by dtype]).
        bytes_per_s: sustained memory bandwidth of elementwise kernels.
        kernel_overhead_s: fixed cost per compute node.
        comm_overlap: fraction of communication that runs concurrently with
            compute, 0-1 (Note: [Communication competing with compute]).
        attention_efficiency: fused attention's rate as a fraction of
            ``flops_per_s`` (``simplefsdp plan``'s profiles; 1 otherwise).
        alloc_s_per_byte: what a matmul's output costs per byte on top of
            ``flops_per_s`` because it is a new buffer whose pages fault in
            when first written (CPU with fresh mappings; 0 where the
            allocator hands out memory already touched, as on GPUs).
            ``flops_per_s`` is then the rate into a touched buffer.
    """

    comm: dict[str, LinearFit] = field(default_factory=dict)
    default_comm: LinearFit = LinearFit(50e-6, 1e-9)
    flops_per_s: float = 5e10
    flops_per_s_by_dtype: dict[str, float] = field(default_factory=dict)
    bytes_per_s: float = 5e9
    kernel_overhead_s: float = 2e-6
    comm_overlap: float = 1.0
    attention_efficiency: float = 1.0
    alloc_s_per_byte: float = 0.0

    def comm_time(
        self, kind: str, group_size: int, num_bytes: int, role: str | None = None
    ) -> float:
        """Seconds of one collective; ``role`` (e.g. ``"tp"``) prefers that
        role's calibrated fit."""
        key = f"{kind}/{group_size}"
        fit = None
        if role is not None and role != DATA_PARALLEL:
            fit = self.comm.get(f"{role}:{key}")
        if fit is None:
            fit = self.comm.get(key)
        if fit is None and kind == "all_to_all":
            # Note: [All-to-alls of expert parallelism]: an all-gather of the
            # same bytes moves as much per rank over the same link.
            return self.comm_time("all_gather", group_size, num_bytes, role)
        return (fit or self.default_comm)(num_bytes)

    def collective_time(self, node: fx.Node, role: str | None = None) -> float:
        """Seconds of a collective node of the graph (0 for other nodes)."""
        kind = collective_kind(node)
        if kind is None:
            return 0.0
        # The bytes an all-gather outputs, a reduction or all-to-all takes in
        # (an all-to-all's: what this rank sends).
        group_size = collective_group_size(node) or _group_size(node)
        size = node_bytes(node) if kind == "all_gather" else node_bytes(node.args[0])
        return self.comm_time(kind, group_size, size, role)

    def node_time(self, node: fx.Node) -> float:
        """Estimated seconds of one compute node (0 for non-compute nodes)."""
        if not is_compute(node):
            return 0.0
        flops = node_flops(node)
        rate = self.matmul_rate(node) if flops else self.flops_per_s
        out_bytes = node_bytes(node)
        fresh_s = 0.0
        if "scaled_dot_product" in str(node.target):
            # Its measured rate (attention_efficiency) includes its buffers.
            rate *= self.attention_efficiency
        elif flops:
            fresh_s = out_bytes * self.alloc_s_per_byte
        moved = out_bytes + sum(node_bytes(i) for i in node.all_input_nodes)
        return max(flops / rate, moved / self.bytes_per_s) + fresh_s + self.kernel_overhead_s

    def matmul_rate(self, node: fx.Node) -> float:
        """FLOP/s of a matmul-like node at its output's dtype (Note: [Matmul
        rates by dtype])."""
        val = node.meta.get("val")
        dtype = getattr(val, "dtype", None)
        if dtype is None and isinstance(val, (tuple, list)) and val:
            dtype = getattr(val[0], "dtype", None)
        if dtype is None or dtype == torch.float32:
            return self.flops_per_s
        return self.flops_per_s_by_dtype.get(str(dtype).removeprefix("torch."), self.flops_per_s)

    def to_dict(self) -> dict:
        data = asdict(self)
        return data

    @staticmethod
    def from_dict(data: dict) -> CostModel:
        return CostModel(
            comm={k: LinearFit(**v) for k, v in data["comm"].items()},
            default_comm=LinearFit(**data["default_comm"]),
            flops_per_s=data["flops_per_s"],
            flops_per_s_by_dtype=dict(data.get("flops_per_s_by_dtype", {})),
            bytes_per_s=data["bytes_per_s"],
            kernel_overhead_s=data["kernel_overhead_s"],
            comm_overlap=data.get("comm_overlap", 1.0),
            attention_efficiency=data.get("attention_efficiency", 1.0),
            alloc_s_per_byte=data.get("alloc_s_per_byte", 0.0),
        )


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(concrete(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= int(v)
    return result


def node_flops(node: fx.Node) -> float:
    """FLOPs of matmul-like nodes (2 per multiply-add); 0 for the rest."""
    target, args = node.target, node.args
    if target is aten.mm.default:
        (m, k), (_, n) = _shape(args[0]), _shape(args[1])
        return 2.0 * m * k * n
    if target is aten.addmm.default:
        (m, k), (_, n) = _shape(args[1]), _shape(args[2])
        return 2.0 * m * k * n
    if target in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if target is aten.bmm.default else (args[1], args[2])
        (bs, m, k), (_, _, n) = _shape(a), _shape(b)
        return 2.0 * bs * m * k * n
    name = str(target)
    if "scaled_dot_product" in name and args:
        q, k = _shape(args[0]), _shape(args[1])
        if len(q) == 4 and len(k) == 4:
            flops = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3]
            return flops * (2.5 if "backward" in name else 1.0)
    if target is aten.convolution.default:
        out = _shape(node)
        weight = _shape(args[1])
        return 2.0 * _prod(out) * _prod(weight[1:])
    return 0.0


def simulate(
    gm: fx.GraphModule, cost_model: CostModel, groups: CollectiveGroups = ALL_DATA_PARALLEL
) -> dict[str, float]:
    """Predicted time of a graph with one compute stream and one comm stream.

    Compute nodes run in graph order; a collective starts when issued and the
    link is free, and delays compute by its non-overlapping part (Note:
    [Communication competing with compute]); a wait blocks compute until its
    collective is done. All
    collectives share the link, tensor-parallel ones included (timed with
    their role's fit); ``comm_s`` covers them all and, when there are any,
    ``tp_comm_s`` (``other_comm_s``) the tensor-parallel (other groups') part.
    """
    compute_clock = comm_clock = compute_total = comm_total = 0.0
    by_role: dict[str, float] = {}
    done: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            role = groups.role(node)
            duration = cost_model.collective_time(node, role)
            start = max(compute_clock, comm_clock)
            comm_clock = done[node] = start + duration
            comm_total += duration
            # The part that cannot overlap takes the compute stream's time too.
            compute_clock += (1.0 - cost_model.comm_overlap) * duration
            if role != DATA_PARALLEL:
                by_role[role] = by_role.get(role, 0.0) + duration
        elif node.op == "call_function" and node.args and node.args[0] in done:
            compute_clock = max(compute_clock, done.pop(node.args[0]))
        else:
            duration = cost_model.node_time(node)
            compute_clock += duration
            compute_total += duration
    total = max(compute_clock, comm_clock)
    return {
        "time_s": total,
        "compute_s": compute_total,
        "comm_s": comm_total,
        "exposed_comm_s": max(total - compute_total, 0.0),
        **{f"{role}_comm_s": seconds for role, seconds in by_role.items()},
    }


def _group_size(node: fx.Node) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return dist.get_world_size(_resolve_process_group(collective_group(node)))
    except Exception:  # unknown group (e.g. a test graph): assume 2 ranks
        return 2


# ---------------------------------------------------------------- calibration


def _time_it(fn, repeats: int = CALIBRATION_REPEATS) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # The minimum: other processes only ever make a run slower.
    return min(times)


def _fit(points: list[tuple[int, float]]) -> LinearFit:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    slope = max(slope, 0.0)
    return LinearFit(max(mean_y - slope * mean_x, 0.0), slope)


def calibrate_comm(
    group,
    device: torch.device,
    prefix: str = "",
    *,
    sizes: tuple[int, ...] = CALIBRATION_SIZES_BYTES,
    timer: Callable[[Callable[[], None]], float] | None = None,
    kinds: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce"),
) -> dict[str, LinearFit]:
    """Linear fits of each collective's time over ``sizes`` (bytes) on ``group``.

    Args:
        group: the process group to time (every rank of it calls this).
        device: where the timed tensors live.
        prefix: put before each fit's name (``"tp:"`` for the tensor-parallel role).
        sizes: the message sizes timed, in bytes.
        timer: times one call (default: the median of a few runs, synchronised).
        kinds: the collectives timed (``"all_to_all"`` too for an ep group).

    Returns:
        ``{prefix + kind/group_size: LinearFit}`` for each of ``kinds``.
    """
    timer = timer or _time_it
    group_size = dist.get_world_size(group)
    fits = {}
    for kind in kinds:
        points = []
        for size in sizes:
            numel = size // 4
            shard = torch.ones(max(numel // group_size, 1), device=device)
            full = torch.ones(shard.numel() * group_size, device=device)

            def run(kind=kind, shard=shard, full=full):
                if kind == "all_gather":
                    all_gather_single(full, shard, group=group)
                elif kind == "reduce_scatter":
                    reduce_scatter_single(shard, full, group=group)
                elif kind == "all_to_all":
                    dist.all_to_all_single(full.clone(), full, group=group)
                else:
                    dist.all_reduce(full, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            points.append((full.numel() * 4, timer(run)))
        fits[f"{prefix}{kind}/{group_size}"] = _fit(points)
    return fits


# Note: [Matmul rates by dtype]
# A graph under mixed precision does its matmuls in ``param_dtype``, whose
# rate differs from float32's by an order of magnitude either way (tensor
# cores on a GPU; no bf16 units on most CPUs); priced at float32's rate, every
# collective of a bf16 graph on a GPU would look hidden behind compute. The
# calibration times one matmul per reduced-precision dtype the device
# computes in, and a matmul node is priced at its output's dtype. Where a
# dtype was not calibrated, float32's rate stands in.
_CALIBRATED_MATMUL_DTYPES = (torch.bfloat16, torch.float16)


def _calibrate_compute(device: torch.device) -> tuple[float, float, dict[str, float]]:
    n = 512 if device.type == "cpu" else 4096

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def matmul_rate(dtype: torch.dtype) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return 2.0 * n**3 / _time_it(lambda: (torch.mm(a, b), sync()))

    flops = matmul_rate(torch.float32)
    by_dtype = {}
    for dtype in _CALIBRATED_MATMUL_DTYPES:
        if device.type == "cpu" and dtype == torch.float16:
            continue  # not a compute dtype on CPUs (reference kernels)
        try:
            by_dtype[str(dtype).removeprefix("torch.")] = matmul_rate(dtype)
        except RuntimeError:  # the device has no matmul in this dtype
            continue
    x = torch.randn(4 * 1024 * 1024, device=device)
    add_s = _time_it(lambda: (torch.add(x, x), sync()))
    return flops, 3 * x.numel() * 4 / add_s, by_dtype


def measure_comm_overlap(
    group, device: torch.device, timer: Callable[[Callable[[], None]], float] | None = None
) -> float:
    """Fraction (0-1) of a 16 MiB all-reduce on ``group`` that runs
    concurrently with matmuls of about its length (Note: [Communication
    competing with compute]). Collective: every rank of ``group`` calls it."""
    timer = timer or _time_it

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    buf = torch.ones(4 << 20, device=device)
    n = 512 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device)
    t_comm = timer(lambda: (dist.all_reduce(buf, group=group), sync()))
    t_mm = timer(lambda: (torch.mm(a, a), sync()))
    reps = max(1, round(t_comm / t_mm))  # compute about as long as the collective

    def compute():
        for _ in range(reps):
            torch.mm(a, a)
        sync()

    def both():
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()
        sync()

    t_compute, t_both = timer(compute), timer(both)
    hidden = t_compute + t_comm - t_both
    return max(0.0, min(1.0, hidden / min(t_compute, t_comm)))


# Measurements of the overlap whose median the cached cost model keeps.
OVERLAP_ROUNDS = 5


def median_comm_overlap(group, device: torch.device, rounds: int = OVERLAP_ROUNDS) -> float:
    """The median of ``rounds`` runs of :func:`measure_comm_overlap`
    (Note: [Communication competing with compute]). Collective."""
    return statistics.median(measure_comm_overlap(group, device) for _ in range(rounds))


def _cache_path(backend: str, world_size: int, device_type: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "simplefsdp"
    name = (
        f"cost-{backend}-w{world_size}-{device_type}-torch{torch.__version__}-v{__version__}.json"
    )
    return root / name.replace("/", "_").replace("+", "_")


def _all_ranks_agree(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def calibration_device(device_type: str | None) -> torch.device:
    """Where calibration measures: the mesh's device type (``device_type``),
    or without one the default process group's (cuda for NCCL, else cpu).

    Not the backend alone: under a mixed backend (``cpu:gloo,cuda:nccl``,
    torch's default when CUDA is visible) a CUDA mesh would otherwise be
    calibrated with gloo on CPU.
    """
    if device_type is None:
        device_type = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def calibrated_cost_model(
    groups: list | None = None,
    device_type: str | None = None,
    tp_groups: list | None = None,
    ep_groups: list | None = None,
) -> CostModel:
    """Measure (or load from cache) this machine's cost model; every rank
    returns rank 0's numbers. Collective: call it on every rank.

    ``groups``: the data-parallel process groups (default: the world);
    ``tp_groups``: the tensor-parallel mesh's groups (``"tp:"`` keys);
    ``ep_groups``: the expert-parallel mesh's (``"ep:all_to_all/N"`` keys).
    ``device_type``: the data-parallel mesh's (see :func:`calibration_device`).
    Takes a few seconds the first time a configuration is seen.
    """
    if not dist.is_initialized():
        return CostModel()
    backend = str(dist.get_backend())
    device = calibration_device(device_type)
    path = _cache_path(backend, dist.get_world_size(), device.type)
    groups = list(groups or []) or [dist.group.WORLD]
    cached = None
    if path.exists() and os.environ.get("SIMPLEFSDP_RECALIBRATE", "") not in ("1", "true"):
        try:
            raw = json.loads(path.read_text())
            # A file written before comm_overlap was measured, measured in
            # fewer rounds than now, or without the matmul rates by dtype
            # (Note: [Matmul rates by dtype]) is recalibrated.
            current = (
                raw.get("overlap_rounds", 1) >= OVERLAP_ROUNDS and "flops_per_s_by_dtype" in raw
            )
            cached = CostModel.from_dict(raw) if "comm_overlap" in raw and current else None
        except (ValueError, KeyError, TypeError):
            cached = None
    tp_groups = list(tp_groups or [])
    sizes = sorted({dist.get_world_size(g) for g in groups})
    tp_sizes = sorted({dist.get_world_size(g) for g in tp_groups})
    ep_groups = list(ep_groups or [])
    ep_sizes = sorted({dist.get_world_size(g) for g in ep_groups})
    have = (
        cached is not None
        and all(f"all_gather/{s}" in cached.comm for s in sizes)
        and all(f"{TENSOR_PARALLEL}:all_gather/{s}" in cached.comm for s in tp_sizes)
        and all(f"{EXPERT_PARALLEL}:all_to_all/{s}" in cached.comm for s in ep_sizes)
    )
    if _all_ranks_agree(have, device):
        model = cached
    else:
        start = time.perf_counter()
        comm: dict[str, LinearFit] = {}
        for group in groups:
            comm.update(calibrate_comm(group, device))
        for group in tp_groups:
            comm.update(calibrate_comm(group, device, prefix=f"{TENSOR_PARALLEL}:"))
        for group in ep_groups:
            comm.update(
                calibrate_comm(group, device, prefix=f"{EXPERT_PARALLEL}:", kinds=("all_to_all",))
            )
        flops, bandwidth, flops_by_dtype = _calibrate_compute(device)
        overlap = median_comm_overlap(groups[0], device)
        model = CostModel(
            comm=comm,
            flops_per_s=flops,
            flops_per_s_by_dtype=flops_by_dtype,
            bytes_per_s=bandwidth,
            comm_overlap=overlap,
        )
        logger.debug("cost model calibrated in %.2fs", time.perf_counter() - start)
    payload = [model.to_dict()]
    dist.broadcast_object_list(payload, src=0)
    model = CostModel.from_dict(payload[0])
    if dist.get_rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**model.to_dict(), "overlap_rounds": OVERLAP_ROUNDS}))
            tmp.replace(path)
        except OSError:
            logger.debug("could not write the cost-model cache %s", path)
    return model
