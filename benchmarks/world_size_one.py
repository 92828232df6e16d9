"""What a 1-rank mesh costs on one GPU: step time split by phase, against the unsharded floors.

One training configuration per process (Llama 3, about 1.0B parameters by
default: dim 2048, 8 layers, vocabulary 128256; batch 4 x 2048), bf16 compute:

- ``limit``: the plain model in bf16, ``torch.compile``: no master weights, no
  sharding machinery (the floor for a one-GPU run);
- ``limit-mp``: the plain model with fp32 parameters read through a
  ``torch.nn.utils.parametrize`` cast to bf16, ``torch.compile``: the floor of
  any fp32-master-weight scheme (the cast in forward, the gradient's cast back,
  an fp32 optimizer), still without sharding machinery; ``limit-mp-block``
  compiles each block on its own instead (as ``fsdp2c`` does);
- ``fsdp2c``: torch FSDP2 per block (bf16 params, fp32 reduce), each block compiled;
- ``sfsdp-auto`` / ``sfsdp-keep`` / ``sfsdp-none``: ``simplefsdp.data_parallel``
  (bf16 params, fp32 reduce) + ``simplefsdp.compile`` with ``bucketing="auto"``
  (resharding after forward, the planner keeping what fits), with
  ``reshard_after_forward=False``, and with ``bucketing="none"``.

Each measured step records device events between its phases (forward with the
loss, backward, gradient clipping, optimizer step with ``zero_grad``) and the
host time to issue each phase. An extra step after the measured ones
synchronizes between phases and records each phase's peak allocated memory.
With ``--snapshot DIR`` the CUDA allocator's history over
that step goes to ``DIR/<variant>_snapshot.pickle.gz`` (``torch.cuda.memory``'s
snapshot format). With ``--profile DIR`` two more steps run under ``torch.profiler`` and the
device time by kernel goes to ``DIR/<variant>.txt``, with totals by kind in
the JSON line, the profiler's trace to ``DIR/<variant>_trace.json.gz`` and
a Python profile of one forward call's host time to ``DIR/<variant>_host.txt``. A benchmark, not a test: it prints one JSON line and never
fails on a time.

Usage (one process, a 1-rank NCCL or gloo group)::

    PYTHONPATH=src python benchmarks/world_size_one.py VARIANT [--out results.jsonl] [--profile DIR]

Environment: ``WS1_DIM``, ``WS1_LAYERS``, ``WS1_VOCAB``, ``WS1_B``, ``WS1_T``,
``WS1_STEPS``, ``WS1_WARMUP``, ``WS1_PEAK_FLOPS`` (default 989e12, bf16 dense H100/H200).
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import simplefsdp
from simplefsdp.models.llama3 import ModelArgs, Transformer, flops_per_token, num_params

VARIANTS = (
    "limit",
    "limit-mp",
    "limit-mp-block",
    "fsdp2c",
    "sfsdp-auto",
    "sfsdp-keep",
    "sfsdp-none",
)
PHASES = ("forward", "backward", "clip", "optimizer")


class _CastTo(nn.Module):
    """A parametrization that reads an fp32 master weight as ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _env(name: str, default):
    return type(default)(os.environ.get(name, default))


def _build(variant: str, args: ModelArgs, mesh, device: torch.device):
    bf16 = torch.bfloat16
    with torch.device("meta"):
        model = Transformer(args)
    if variant in ("limit", "limit-mp", "limit-mp-block"):
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        if variant == "limit":
            model.to(bf16)
        else:
            for module in list(model.modules()):
                for name, _ in list(module.named_parameters(recurse=False)):
                    parametrize.register_parametrization(module, name, _CastTo(bf16), unsafe=True)
        if variant == "limit-mp-block":
            for block in model.layers.values():
                block.compile(fullgraph=True)
            return model, model
        return model, torch.compile(model)
    if variant == "fsdp2c":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for block in (
            model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
        ):
            block.compile(fullgraph=True)
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        return model, model
    bucketing = "none" if variant == "sfsdp-none" else "auto"
    simplefsdp.data_parallel(
        model,
        mesh,
        mode="fully_shard",
        mp_policy=simplefsdp.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
        reshard_after_forward=variant != "sfsdp-keep",
    )
    model.to_empty(device=device)
    with torch.no_grad(), simplefsdp.disable_parametrization():
        model.init_weights(buffer_device=device)
    return model, simplefsdp.compile(model, bucketing=bucketing, fullgraph=True)


def _kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("multi_tensor", "foreach", "adam")):
        return "optimizer (foreach)"
    if "triton" in n:
        return "triton (fused elementwise/reduction)"
    if any(k in n for k in ("copy", "cast", "elementwise", "vectorized", "reduce", "fill")):
        return "aten elementwise/copy"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--out", default=None, help="append the JSON line to this file")
    parser.add_argument(
        "--profile", default=None, metavar="DIR", help="profile two steps; kernels to DIR"
    )
    parser.add_argument(
        "--snapshot",
        default=None,
        metavar="DIR",
        help="CUDA allocator snapshot of the phase step to DIR",
    )
    opts = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (1,))

    dim, layers = _env("WS1_DIM", 2048), _env("WS1_LAYERS", 8)
    vocab, batch, seq = _env("WS1_VOCAB", 128256), _env("WS1_B", 4), _env("WS1_T", 2048)
    steps, warmup = _env("WS1_STEPS", 15), _env("WS1_WARMUP", 4)
    peak_flops = _env("WS1_PEAK_FLOPS", 989e12)
    args = ModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=dim // 128,
        n_kv_heads=max(1, dim // 512),
        vocab_size=vocab,
        ffn_dim_multiplier=1.5,
        max_seq_len=seq,
    )
    torch.manual_seed(0)
    t_setup = time.perf_counter()
    model, fwd = _build(opts.variant, args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(4)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(i: int, phase_sync: bool = False):
        """One step; returns (loss, host seconds per phase, device events)."""
        x = data[i % len(data)]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if cuda else []
        host = []

        def mark(k: int) -> None:
            if phase_sync:
                sync()
            if events:
                events[k].record()
            host.append(time.perf_counter())

        mark(0)
        logits = fwd(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        mark(1)
        loss.backward()
        mark(2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark(3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(4)
        return loss, [host[k + 1] - host[k] for k in range(4)], events

    times, losses, first = [], [], None
    host_phase = {p: [] for p in PHASES}
    device_phase = {p: [] for p in PHASES}
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss, host, events = step(i)
        sync()
        dt = time.perf_counter() - t0
        losses.append(round(loss.item(), 5))
        if i == 0:
            first = dt
        if i >= warmup:
            times.append(dt)
            for k, p in enumerate(PHASES):
                host_phase[p].append(host[k])
                if events:
                    device_phase[p].append(events[k].elapsed_time(events[k + 1]) / 1e3)

    # The peak over every step so far (compilation included), before the
    # phase step below resets the counter.
    peak_alloc = torch.cuda.max_memory_allocated() if cuda else None
    # Phase peaks: one more step, synchronized between phases.
    phase_peak = {}
    if cuda:
        sync()
        if opts.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
        start = torch.cuda.memory_allocated()
        x = data[0]
        torch.cuda.reset_peak_memory_stats()
        logits = fwd(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        sync()
        phase_peak["forward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync()
        phase_peak["backward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        phase_peak["optimizer"] = torch.cuda.max_memory_allocated()
        if opts.snapshot:
            os.makedirs(opts.snapshot, exist_ok=True)
            pickled = os.path.join(opts.snapshot, f"{opts.variant}_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(pickled)
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(pickled, "rb") as src, gzip.open(pickled + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(pickled)
        phase_peak = {k: round((v - start) / 2**30, 3) for k, v in phase_peak.items()}
        phase_peak["at_step_start"] = round(start / 2**30, 3)

    med = statistics.median(times)
    tok_s = batch * seq / med
    rec = dict(
        variant=opts.variant,
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        params=num_params(args),
        dim=dim,
        layers=layers,
        batch=batch,
        seq=seq,
        step_s_median=round(med, 5),
        step_s_min=round(min(times), 5),
        tok_s=round(tok_s, 1),
        mfu=round(tok_s * flops_per_token(args, seq) / peak_flops, 4),
        device_s_by_phase={p: round(statistics.median(v), 5) for p, v in device_phase.items() if v},
        host_s_by_phase={p: round(statistics.median(v), 5) for p, v in host_phase.items()},
        first_step_s=round(first, 2),
        setup_s=round(time.perf_counter() - t_setup, 1),
        peak_alloc_gib=round(peak_alloc / 2**30, 3) if cuda else None,
        phase_peak_above_start_gib=phase_peak or None,
        losses=losses,
    )

    if opts.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for i in range(2):
                step(i)
            sync()
        wall = (time.perf_counter() - t0) / 2
        by_kind: dict[str, float] = {}
        rows = []
        for evt in prof.key_averages():
            dev_us = getattr(evt, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(evt, "self_cuda_time_total", 0)
            if dev_us <= 0 or getattr(evt, "device_type", None) is None:
                continue
            if str(evt.device_type).endswith("CPU"):
                continue
            rows.append((dev_us / 2, evt.count // 2, evt.key))
            kind = _kind(evt.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + dev_us / 2
        rows.sort(reverse=True)
        os.makedirs(opts.profile, exist_ok=True)
        trace = os.path.join(opts.profile, f"{opts.variant}_trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        # Where the host spends a forward call (Python level), e.g. before the first kernel.
        sync()
        host_prof = cProfile.Profile()
        host_prof.enable()
        logits = fwd(data[0][:, :-1])
        host_prof.disable()
        sync()
        del logits
        text = io.StringIO()
        stats = pstats.Stats(host_prof, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        with open(os.path.join(opts.profile, f"{opts.variant}_host.txt"), "w") as f:
            f.write(text.getvalue())
        with open(os.path.join(opts.profile, f"{opts.variant}.txt"), "w") as f:
            f.write(
                f"# {opts.variant}: device time per step by kernel (2 profiled steps), wall {wall:.4f} s\n"
            )
            for us, count, key in rows[:60]:
                f.write(f"{us / 1e3:9.3f} ms  x{count:<5d} {_kind(key):<38s} {key[:150]}\n")
        rec["profile"] = dict(
            wall_s_per_step=round(wall, 5),
            kernel_s_per_step=round(sum(by_kind.values()) / 1e6, 5),
            kernel_s_by_kind={
                k: round(v / 1e6, 5) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
            },
        )

    if opts.variant.startswith("sfsdp"):
        try:
            report = simplefsdp.comm_report(fwd).to_dict()
            rec["report"] = json.dumps(report)[:4000]
        except Exception as exc:  # noqa: BLE001 - a benchmark records what failed
            rec["report_error"] = repr(exc)
    line = json.dumps(rec)
    if opts.out:
        with open(opts.out, "a") as f:
            f.write(line + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k not in ("report", "losses")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
