"""bf16 vs float8 training step time and peak memory of a ~1B Llama 3 on one GPU.

For each engine (``simplefsdp``: data_parallel + simplefsdp.compile;
``fsdp2``: fully_shard + torch.compile) and each precision (bf16 mixed
precision; torchao float8 tensorwise with float8 all-gathers, converted as
``simplefsdp train --float8.enable true`` does), builds the model on one rank
(world size 1: the all-gathers are no-ops, so this measures the matmuls and the
casts), runs warm-up steps then timed steps, and prints one row per
configuration: median step time, tokens/s and peak allocated memory.

Needs a GPU with float8 matmuls (compute capability >= 8.9) and the
``float8`` extra (torchao). ``--device cpu`` runs the same code path on the
CPU (gloo, ``aot_eager``, the debug model unless ``--model`` says otherwise)
as a quick check of the script; its times say nothing about GPUs and its
peak memory column is empty.

Usage::

    python benchmarks/float8_step.py              # all four configurations
    python benchmarks/float8_step.py --steps 20 --seq-len 2048 --batch-size 2
    python benchmarks/float8_step.py --device cpu --steps 1 --warmup 1 --seq-len 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="simplefsdp,fsdp2", help="comma-separated engines")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (the measurement) or cpu (a check of the script: gloo, aot_eager)",
    )
    parser.add_argument(
        "--model",
        default=None,
        choices=("1B", "debug"),
        help="1B (Llama 3.2 1B's shape; the default on cuda) or debug (the default on cpu)",
    )
    args = parser.parse_args()
    if args.model is None:
        args.model = "1B" if args.device == "cuda" else "debug"
    return args


def _job(engine: str, float8: bool, recipe: str, device: torch.device):
    from simplefsdp.train.config import load_config

    return load_config(
        None,
        [
            "--parallel.engine", engine,
            "--parallel.param_dtype", "bfloat16",
            "--parallel.reduce_dtype", "float32",
            "--float8.enable", "true" if float8 else "false",
            "--float8.recipe", recipe,
            "--compile.backend", "inductor" if device.type == "cuda" else "aot_eager",
        ],
    )  # fmt: skip


def _model_args(name: str, vocab_size: int = 128256):
    from simplefsdp.models.llama3 import get_config

    if name == "debug":
        return get_config("debug")
    # Llama 3.2 1B's shape.
    return get_config(
        "8B", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256, vocab_size=vocab_size, rope_scaling=None,
    )  # fmt: skip


def _measure(engine: str, float8: bool, args: argparse.Namespace, device: torch.device) -> dict:
    from simplefsdp.models.llama3 import Transformer
    from simplefsdp.train.parallelism import parallelize_job

    cuda = device.type == "cuda"
    job = _job(engine, float8, args.recipe, device)
    model_args = _model_args(args.model)
    with torch.device("meta"):
        model = Transformer(model_args)
    parallel = parallelize_job(model, job, device)
    opt = torch.optim.AdamW(parallel.module.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(
        0, model_args.vocab_size, (args.batch_size, args.seq_len + 1), device=device
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = parallel.step(inputs, targets)  # forward + backward, cross-entropy
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    del parallel, opt, model
    torch._dynamo.reset()  # the next configuration compiles afresh
    return {
        "engine": engine,
        "precision": f"float8-{args.recipe}" if float8 else "bf16",
        "step_s": step_s,
        "tokens_per_s": args.batch_size * args.seq_len / step_s,
        "peak_gib": peak_gib,
        "loss": loss.item(),
    }


def main() -> None:
    args = _parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "float8_step.py: --device cuda needs a CUDA GPU (float8 matmuls); none is visible "
            "(--device cpu checks the script on the CPU)"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    try:
        for engine in args.engines.split(","):
            for float8 in (False, True):
                rows.append(_measure(engine, float8, args, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    print(
        f"{'engine':<12}{'precision':<20}{'step s':>9}{'tokens/s':>11}{'peak GiB':>10}{'loss':>8}"
    )
    for r in rows:
        print(
            f"{r['engine']:<12}{r['precision']:<20}{r['step_s']:>9.3f}"
            f"{r['tokens_per_s']:>11.0f}{r['peak_gib']:>10.2f}{r['loss']:>8.3f}"
        )


if __name__ == "__main__":
    main()
