"""Eager executor vs torch FSDP2 eager vs ``data_parallel`` without an executor.

The executor runs twice: resharding after forward (gathers every bucket again
in backward, as FSDP2 does) and without (``reshard_after_forward=False``,
ZeRO-2, which is what plain eager ``data_parallel`` amounts to: autograd keeps
the gathered parameters for backward).

Run: ``python benchmarks/eager_executor.py [--model small] [--steps 5]``
(2 CPU processes, gloo). Same model, seed and per-rank batch for all three;
the first 2 steps are warm-up. Peak memory is CPU peak RSS above the RSS at
the start of the measured steps, with glibc's mmap threshold lowered
(``simplefsdp.engines.memory``); on GPU, the CUDA allocator peak.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import simplefsdp
from simplefsdp.engines.memory import MemoryProbe, lower_mmap_threshold
from simplefsdp.models.llama3 import Transformer, TransformerBlock, get_config
from simplefsdp.testing import run_distributed

WARMUP = 2


def _build(config: str, engine: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(get_config(config))
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        return fully_shard(model)
    simplefsdp.data_parallel(model, reshard_after_forward=engine != "executor-keep")
    if engine.startswith("executor"):
        simplefsdp.eager(model, bucketing=TransformerBlock)
    return model


def _run(config: str, engine: str, steps: int, batch: int, seq: int) -> dict:
    lower_mmap_threshold(64 * 1024)
    model = _build(config, engine)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    vocab = get_config(config).vocab_size
    gen = torch.Generator().manual_seed(dist.get_rank())
    times, losses, peak_bytes = [], [], 0
    for step in range(WARMUP + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        with MemoryProbe("cpu") as peak:
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
        if step >= WARMUP:
            times.append(elapsed)
            peak_bytes = max(peak_bytes, peak.peak or 0)
        losses.append(loss.item())
    return {"median_s": statistics.median(times), "peak_bytes": peak_bytes, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(
        f"model {args.model}, 2 ranks, batch {args.batch} x {args.seq} per rank, {args.steps} steps"
    )
    print(f"{'engine':<28} {'median step s':>14} {'peak MiB':>9}  final loss")
    for engine, label in (
        ("executor", "simplefsdp.eager (per block)"),
        ("executor-keep", "  same, no reshard (ZeRO-2)"),
        ("fsdp2", "torch FSDP2 eager"),
        ("plain", "data_parallel, no executor"),
    ):
        result = run_distributed(
            _run, 2, args=(args.model, engine, args.steps, args.batch, args.seq), timeout_s=1200
        )[0]
        print(
            f"{label:<28} {result['median_s']:>14.3f} {result['peak_bytes'] / 2**20:>9.1f}  "
            f"{result['losses'][-1]:.5f}"
        )


if __name__ == "__main__":
    main()
