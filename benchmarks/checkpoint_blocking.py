"""How long a checkpoint save blocks training: ``checkpoint.async_mode`` none vs async vs staged.

Usage::

    python benchmarks/checkpoint_blocking.py [--model small] [--nproc 2] [--saves 3] [--out DIR]

Builds ``--model`` (``small``: 101M parameters) sharded over ``--nproc`` CPU
processes (gloo) with ``simplefsdp.data_parallel``, takes one AdamW step (so
that the optimizer state exists: parameters plus two moments, fp32), then per
mode saves ``--saves`` checkpoints the way the trainer does
(:class:`simplefsdp.checkpoint.Checkpointer`) and prints, the median over the
saves of the slowest rank:

* ``blocking``: the seconds training waits: the ``save`` call, plus, for
  ``staged``, the wait for the copy before the next optimizer step;
* ``total``: until the checkpoint is committed (published, older ones pruned).

Between two saves each rank computes for ``--gap-s`` seconds (matmuls), as
training would, so that a background save has something to overlap with.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

MODES = ("none", "async", "staged")


def _work(seconds: float) -> None:
    import torch

    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _measure(model_name: str, folder: str, saves: int, gap_s: float) -> dict[str, list]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import simplefsdp
    from simplefsdp.checkpoint import Checkpointer
    from simplefsdp.models.llama3 import Transformer, get_config, num_params

    torch.manual_seed(0)
    args = get_config(model_name)
    model = Transformer(args)
    model = simplefsdp.data_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, args.vocab_size, (1, 64))
    model(tokens).float().mean().backward()
    optimizer.step()
    results: dict[str, list] = {"params": [num_params(args)]}
    for mode in MODES:
        checkpointer = Checkpointer(
            Path(folder) / mode, model=model, optimizer=optimizer, device=torch.device("cpu"),
            keep_last=1, config_hash="", config_json={}, async_mode=mode,
        )  # fmt: skip
        rows = []
        for i in range(saves):
            start = time.perf_counter()
            checkpointer.save(i + 1, {"step": i + 1})
            call_s = time.perf_counter() - start
            _work(gap_s / 2)  # forward and backward of the next step
            wait_s = checkpointer.wait_staged()  # before its optimizer step
            _work(gap_s / 2)
            checkpointer.finish()
            rows.append((call_s + wait_s, time.perf_counter() - start - gap_s))
            dist.barrier()
        checkpointer.close()
        results[mode] = rows
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args()
    from simplefsdp.testing import run_distributed

    with tempfile.TemporaryDirectory(dir=args.out) as folder:
        per_rank = run_distributed(
            _measure, args.nproc, args=(args.model, folder, args.saves, args.gap_s),
            timeout_s=3600,
        )  # fmt: skip
    print(
        f"model {args.model} ({per_rank[0]['params'][0] / 1e6:.0f}M parameters), {args.nproc} ranks (CPU, gloo), {args.saves} saves per mode"
    )
    print(f"{'mode':<8} {'blocking s':>11} {'total s':>9}")
    for mode in MODES:
        slowest = [
            tuple(max(rank[mode][i][k] for rank in per_rank) for k in range(2))
            for i in range(args.saves)
        ]
        blocking = statistics.median(b for b, _ in slowest)
        total = statistics.median(t for _, t in slowest)
        print(f"{mode:<8} {blocking:>11.3f} {total:>9.3f}")


if __name__ == "__main__":
    main()
