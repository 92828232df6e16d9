"""``simplefsdp plan --calibrate``: measure this machine into a hardware profile.

Two processes (gloo on CPU, or NCCL on two GPUs when CUDA is available)
measure, at the same time as in training:

* the collectives: a least-squares ``latency + bytes * seconds_per_byte`` fit
  over 1-64 MiB buffers (training-sized; the compiler's own calibration stops
  at 4 MiB), turned into the profile's ring bus bandwidth and latency;
* compute: a square fp32 matmul (FLOP/s into a touched buffer, and what a
  new output buffer adds per byte) and a large add (bytes/s), so
  efficiencies are 1, and fused attention forward and backward, whose rate
  relative to the matmul's is the profile's ``attention_efficiency``;
* the fixed cost of one small op (dispatch and launch);
* a foreach AdamW step (seconds per parameter);
* what one eager FSDP2 group costs per step beyond its compute (its hooks),
  and what FSDP2's copies cost per byte beyond its collectives;
* how much a collective slows down while a matmul runs (``comm_overlap``:
  1 when they run fully in parallel, 0 when they take turns).

Each timing is the median over repeats (see ``_median_time``): calibrate under
the load the predicted runs will see. The whole measurement runs in rounds
(``--calibrate-rounds``, default 3) and the profile takes each quantity's
median over them (``median_raw``). On CPU the workers lower glibc's mmap
threshold as ``simplefsdp bench``'s workers do (Note: [Measuring peak memory
on CPU]): every tensor above 64 KiB is then a fresh mapping whose pages fault
in when first written, a cost of every op that allocates, which the bench's
steps pay and a run without the lowered threshold mostly does not.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from simplefsdp.plan.hardware import HardwareProfile

WORLD = 2


def _median_time(fn, repeats: int = 7) -> float:
    """The median of ``repeats`` timings (after one warm-up): unlike the
    compiler's calibration (the minimum), the machine's load at calibration
    time stays in the profile, as it stays in the runs the profile predicts."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


COMM_SIZES_BYTES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)  # training-sized buffers


def _comm_fits(group, device) -> dict:
    from simplefsdp.compiler.planning import calibrate_comm

    return calibrate_comm(
        group, device, sizes=COMM_SIZES_BYTES, timer=lambda run: _median_time(run, repeats=5)
    )


def _compute_rates(device, sync) -> dict:
    """Matmul FLOP/s into a touched buffer, a matmul's extra cost per byte
    of output when the output is a new buffer, elementwise bytes/s (an add:
    two inputs and the output), and a copy's cost in bytes moved at that
    rate per byte written.

    Why the matmul into a touched buffer: with every tensor above 64 KiB a
    fresh mapping (the bench's lowered mmap threshold), a matmul's output
    pages fault in as it writes them, which costs per byte of output, not
    per FLOP, and weighs most on small matmuls; so the FLOP rate is measured
    into a touched buffer and the first touch is a rate of its own, about
    the same for a matmul's output, an add's and a fill's (docs/scale.md).
    """
    import torch

    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    mm_into_s = _median_time(lambda: (torch.mm(a, a, out=out), sync()), repeats=5)
    x = torch.randn(16 << 20, device=device)
    add_s = _median_time(lambda: (torch.add(x, x), sync()), repeats=5)
    copy_s = _median_time(lambda: (x.clone(), sync()), repeats=5)
    bytes_per_s = 3 * x.numel() * 4 / add_s
    # The first-touch cost, measured where it is most of the time (a fill):
    # the difference of the matmul's two timings is within their noise.
    y = torch.empty(4 << 20, device=device)
    fill_new_s = _median_time(lambda: (torch.empty_like(y).fill_(1.0), sync()), repeats=9)
    fill_into_s = _median_time(lambda: (y.fill_(1.0), sync()), repeats=9)
    return {
        "flops": 2.0 * n**3 / mm_into_s,
        "alloc_s_per_byte": max(fill_new_s - fill_into_s, 0.0) / (y.numel() * 4),
        "bytes_per_s": bytes_per_s,
        "copy_bytes_per_byte": copy_s * bytes_per_s / (x.numel() * 4),
    }


# (batch, heads, sequence, head dim) of the attention timing: a small
# model's on CPU, a large one's on GPU.
ATTENTION_SHAPES = {"cpu": (4, 8, 256, 32), "cuda": (4, 32, 2048, 128)}


def _attention_rate(device, sync) -> float:
    """FLOP/s of causal fused attention, forward and backward, counted as
    the cost model counts them (``node_flops``: ``4 b h s^2 d`` forward,
    2.5 times that backward)."""
    import torch
    import torch.nn.functional as F

    b, h, s, d = ATTENTION_SHAPES.get(device.type, ATTENTION_SHAPES["cuda"])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (
        torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        sync()

    return 3.5 * 4.0 * b * h * s * s * d / _median_time(run, repeats=5)


# (tensors, floats each) of the AdamW timing: parameter shards of a small
# model on CPU, of a large one on GPU.
ADAMW_SHAPES = {"cpu": (32, 1 << 19), "cuda": (32, 1 << 22)}


def _adamw_rate(device, sync) -> float:
    """Seconds per parameter of a foreach AdamW step with fp32 state, as the
    trainer and ``simplefsdp bench`` run it (its state already created)."""
    import torch

    count, numel = ADAMW_SHAPES.get(device.type, ADAMW_SHAPES["cuda"])
    params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=True)
    return _median_time(lambda: (optimizer.step(), sync()), repeats=5) / (count * numel)


# The FSDP2 timing's blocks, parameters per block (a Llama block's: seven
# matrices and two norms) and their width: small enough that compute,
# copies and collectives are next to nothing beside the hooks.
FSDP2_BLOCKS, FSDP2_PARAMS, FSDP2_WIDTH = 8, 9, 16


def fsdp2_group_seconds(own_group, device, sync, timer=None) -> float:
    """Seconds per step that one eager FSDP2 group costs beyond its model's
    compute: its hooks (pre/post forward and backward), autograd's
    bookkeeping around them and its tiny copies, on a one-rank mesh
    (``own_group``: this rank alone), so no communication is in it.

    Measured as (forward+backward, gradients dropped, of ``FSDP2_BLOCKS``
    tiny blocks of ``FSDP2_PARAMS`` linear layers, each block its own
    ``fully_shard`` group, and the root) minus (the same model unsharded), per group: the
    hooks do per-parameter work too, so the blocks hold as many
    parameters as a Llama block. The per-op cost does not cover it
    (docs/scale.md).
    """
    timer = timer or (lambda run: _median_time(run, repeats=15))
    plain_s, sharded_s = _fsdp2_step_times(own_group, device, sync, FSDP2_WIDTH, timer)
    return max(sharded_s - plain_s, 0.0) / (FSDP2_BLOCKS + 1)


# The FSDP2 copy timing: the same blocks at this width (a 256 KiB fp32
# matrix each), so that what FSDP2 does per byte stands out of its hooks.
FSDP2_WIDE = 256


def fsdp2_copy_written_bytes(width: int, world_size: int) -> float:
    """Bytes the plan model's copies write per step for the FSDP2 timing's
    model at ``width`` (``copy_seconds``' count, resharding after forward):
    per block two all-gathers, each the shards in and the block out, and one
    reduce-scatter's gradients in."""
    block = FSDP2_PARAMS * width * width * 4
    return FSDP2_BLOCKS * (2 * (block + block / world_size) + block)


def fsdp2_sharded_seconds(group, device, sync, timer=None) -> tuple[float, float]:
    """(seconds per byte its copies write, seconds per group) that eager
    FSDP2 spends on ``group`` beyond the model's compute and its collectives
    alone: the plan model's ``fsdp2_copy_s_per_byte`` (per byte of
    ``fsdp2_copy_written_bytes``, the model's count) and
    ``fsdp2_sharded_group_s``.

    Measured with the model of ``fsdp2_group_seconds`` at two widths,
    ``FSDP2_WIDTH`` and ``FSDP2_WIDE``, each a training step (forward,
    backward, gradients dropped) sharded by ``fully_shard`` over ``group``
    against the same model unsharded; from each difference the time of its
    collectives alone is taken (two flat all-gathers and one flat
    reduce-scatter per block, fp32, as FSDP2 issues them). What remains is
    ``groups * group_s + rate * written_bytes(width)`` at both widths, two
    equations for the two unknowns: what grows from the narrow model to the
    wide one is per byte, the narrow model's rest less its copies is per
    group. FSDP2's copies do not run at the elementwise rate, it copies on
    one rank too, and a group costs more where it shards than on one rank
    (docs/scale.md).
    """
    import torch
    import torch.distributed as dist

    from simplefsdp._compat import all_gather_single, reduce_scatter_single

    timer = timer or (lambda run: _median_time(run, repeats=9))
    world_size = dist.get_world_size(group)

    def extra_s(width: int) -> float:
        plain_s, sharded_s = _fsdp2_step_times(group, device, sync, width, timer)
        block = FSDP2_PARAMS * width * width // world_size
        shard = torch.ones(block, device=device)
        full = torch.empty(block * world_size, device=device)
        grads = torch.ones(block * world_size, device=device)
        out = torch.empty(block, device=device)

        def collectives():
            for _ in range(FSDP2_BLOCKS):
                for _ in range(2):
                    all_gather_single(full, shard, group=group)
                reduce_scatter_single(out, grads, group=group)
            sync()

        return sharded_s - plain_s - timer(collectives)

    wide, narrow = extra_s(FSDP2_WIDE), extra_s(FSDP2_WIDTH)
    narrow_bytes = fsdp2_copy_written_bytes(FSDP2_WIDTH, world_size)
    grown = fsdp2_copy_written_bytes(FSDP2_WIDE, world_size) - narrow_bytes
    rate = max(wide - narrow, 0.0) / grown
    group_s = max(narrow - rate * narrow_bytes, 0.0) / (FSDP2_BLOCKS + 1)
    return rate, group_s


def _fsdp2_step_times(group, device, sync, width, timer) -> tuple[float, float]:
    """(unsharded, FSDP2) seconds of a training step of the FSDP2 timing's
    model at ``width``, its gradients dropped after each."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        blocks = [
            nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(FSDP2_PARAMS)))
            for _ in range(FSDP2_BLOCKS)
        ]
        return nn.Sequential(*blocks).to(device)

    x = torch.randn(4, width, device=device)
    plain, sharded = model(), model()
    mesh = DeviceMesh.from_group(group, device.type)
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    def step(m):
        def run():
            m(x).sum().backward()
            m.zero_grad(set_to_none=True)
            sync()

        return run

    def timed(m) -> float:
        dist.barrier()  # every rank times the same model at the same time
        return timer(step(m))

    return timed(plain), timed(sharded)


def _worker(rank: int, port: int, out: str, device_type: str, num_rounds: int = 1) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device_type == "cpu":
        from simplefsdp.engines.memory import lower_mmap_threshold

        lower_mmap_threshold()  # as simplefsdp bench's workers (see the module docstring)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)

    def sync():
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    # One-rank groups for the FSDP2 timing (every rank creates every group).
    own = [dist.new_group([r]) for r in range(WORLD)][rank]
    try:
        rounds = [_measure_once(device, sync, own) for _ in range(num_rounds)]
        if rank == 0:
            Path(out).write_text(json.dumps({**median_raw(rounds), "rounds": rounds}))
    finally:
        dist.destroy_process_group()


def _measure_once(device, sync, own_group=None) -> dict:
    """One round of every measurement (collective on the group; the FSDP2
    group cost on ``own_group``, this rank alone, when given)."""
    import torch
    import torch.distributed as dist

    from simplefsdp.compiler.planning import measure_comm_overlap

    fits = _comm_fits(dist.group.WORLD, device)
    rates = _compute_rates(device, sync)
    attention_flops = _attention_rate(device, sync)
    adamw_s = _adamw_rate(device, sync)
    # Per-op framework cost: a tiny autograd chain (4 ops forward, 4 backward).
    tiny = torch.ones(8, device=device, requires_grad=True)

    def chain():
        ((tiny * 2 + 1).relu().sum()).backward()
        sync()

    op_s = _median_time(chain, repeats=200) / 8
    overlap = measure_comm_overlap(dist.group.WORLD, device, timer=_median_time)
    group_s = fsdp2_group_seconds(own_group, device, sync) if own_group is not None else 0.0
    copy_s, sharded_group_s = fsdp2_sharded_seconds(dist.group.WORLD, device, sync)
    return {
        "fits": {k: [v.latency_s, v.seconds_per_byte] for k, v in fits.items()},
        **rates,
        "attention_flops": attention_flops,
        "adamw_s_per_param": adamw_s,
        "fsdp2_group_s": group_s,
        "fsdp2_copy_s_per_byte": copy_s,
        "fsdp2_sharded_group_s": sharded_group_s,
        "op_s": op_s,
        "overlap": overlap,
    }


def median_raw(rounds: list[dict]) -> dict:
    """Per measured quantity the median over ``rounds`` (each fit's latency
    and per-byte cost apart).

    On a shared machine one round can land on a burst of load, which moves
    single quantities by 2x; the median of several rounds is robust to one
    of them.
    """
    if not rounds:
        raise ValueError("median_raw needs at least one round")
    merged: dict = {}
    for key, value in rounds[0].items():
        if key == "fits":
            merged[key] = {
                kind: [statistics.median(r[key][kind][i] for r in rounds) for i in range(2)]
                for kind in value
            }
        else:
            merged[key] = statistics.median(r[key] for r in rounds)
    return merged


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(device_type: str = "cpu", rounds: int = 1) -> dict:
    """Run the two measuring processes; the raw measurements (rank 0's), the
    median of ``rounds`` rounds (``median_raw``), each round under ``"rounds"``."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"calibration rounds must be an int >= 1, got {rounds!r}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        mp.spawn(_worker, args=(_free_port(), out, device_type, rounds), nprocs=WORLD, join=True)
        raw = json.loads(Path(out).read_text())
    raw["load_avg_1m"] = os.getloadavg()[0]
    return raw


def profile_from(raw: dict, name: str, device_type: str) -> HardwareProfile:
    """A profile from ``measure``'s numbers (ring factor 1/2 for 2 ranks)."""
    import torch

    fits = raw["fits"]
    # One bus bandwidth for all kinds: the mean of the all-gather's and the
    # reduce-scatter's (the FSDP collectives) per-byte costs.
    gather, scatter = fits[f"all_gather/{WORLD}"], fits[f"reduce_scatter/{WORLD}"]
    latency, per_byte = (gather[0] + scatter[0]) / 2, (gather[1] + scatter[1]) / 2
    factor = (WORLD - 1) / WORLD
    bandwidth = factor / per_byte if per_byte > 0 else float("inf")
    if device_type == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        description = torch.cuda.get_device_name(0)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        description = f"this machine's CPU ({os.cpu_count()} cores), gloo"
    return HardwareProfile(
        name=name,
        description=description,
        peak_bf16_flops=raw["flops"],
        peak_fp32_flops=raw["flops"],
        matmul_efficiency=1.0,
        memory_bytes=float(memory),
        usable_memory_fraction=0.9,
        memory_bandwidth=raw["bytes_per_s"],
        memory_efficiency=1.0,
        kernel_overhead_s=raw["op_s"],
        gpus_per_node=1 << 20,  # every rank on this machine
        intra_bandwidth=bandwidth,
        intra_latency_s=latency,
        inter_bandwidth=bandwidth,
        inter_latency_s=latency,
        comm_overlap=raw["overlap"],
        attention_efficiency=min(raw.get("attention_flops", raw["flops"]) / raw["flops"], 1.0),
        copy_bytes_per_byte=raw.get("copy_bytes_per_byte", 2.0),
        adamw_s_per_param=raw.get("adamw_s_per_param", 0.0),
        alloc_s_per_byte=raw.get("alloc_s_per_byte", 0.0),
        fsdp2_group_s=raw.get("fsdp2_group_s", 0.0),
        fsdp2_copy_s_per_byte=raw.get("fsdp2_copy_s_per_byte", 0.0),
        fsdp2_sharded_group_s=raw.get("fsdp2_sharded_group_s", 0.0),
        source=f"measured by simplefsdp plan --calibrate ({WORLD} ranks), {time.strftime('%Y-%m-%d')}",
        caching_allocator=device_type == "cuda",
    )


def calibrate_main(ns) -> int:
    import torch

    device_type = "cuda" if torch.cuda.device_count() >= WORLD else "cpu"
    raw = measure(device_type, ns.calibrate_rounds)
    name = "calibrated-" + ("gpu" if device_type == "cuda" else "cpu-gloo")
    profile = profile_from(raw, name, device_type)
    out = Path(ns.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"profile": profile.to_dict(), "raw": raw}, indent=2))
    print(json.dumps(profile.to_dict(), indent=2))
    print(f"wrote {path} (use it with --hardware {path})", file=sys.stderr)
    return 0
