"""Train the debug Llama 3 with ``simplefsdp.data_parallel`` (eager, no compile).

Run on 2 CPU processes::

    torchrun --nproc-per-node 2 examples/data_parallel_llama.py --steps 30

The model is built on the meta device, sharded, materialised and initialised
shard by shard; each rank reads its own slice of every global batch.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import simplefsdp
from simplefsdp.data import DistributedTokenLoader, build_corpus
from simplefsdp.models.llama3 import Transformer, get_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mode", default="fully_shard")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    with torch.device("meta"):
        model = Transformer(get_config("debug"))
    simplefsdp.data_parallel(model, mode=args.mode)
    model.to_empty(device="cpu")
    with simplefsdp.disable_parametrization():
        model.init_weights()

    corpus = build_corpus()
    loader = DistributedTokenLoader(
        corpus.train, seq_len=args.seq_len, batch_size=args.batch_size, rank=rank, world_size=world
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = next(loader)
        logits = model(inputs)  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        if rank == 0 and (step % 5 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item() / world:.4f}  grad_norm {grad_norm:.3f}")
    if rank == 0:
        elapsed = time.perf_counter() - start
        tokens = args.steps * args.batch_size * args.seq_len
        print(
            f"done: {args.steps} steps in {elapsed:.1f}s, {tokens / elapsed:.0f} tokens/s per rank"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
