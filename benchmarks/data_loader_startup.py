"""Start-up time and resident memory of the token loader on a prepared folder.

Usage::

    python benchmarks/data_loader_startup.py TOKENS_DIR [--seq-len 512] [--batch-size 8]

Opens ``TOKENS_DIR`` (written by ``simplefsdp data prepare``) as
``simplefsdp train`` does, draws 100 batches, and prints the start-up time
(to the first batch), the time per batch and the process's resident memory
before and after (``VmRSS``, and its anonymous part ``RssAnon``: the
rest is shard pages mapped from the page cache, which the kernel reclaims). Run it in a fresh process per folder.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace


def _rss_mib() -> str:
    """``VmRSS`` and its anonymous part (``RssAnon``; the rest is mapped file pages)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    return (
        f"{fields.get('VmRSS', float('nan')):.0f} (anon {fields.get('RssAnon', float('nan')):.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    from simplefsdp.data import build_data

    before = _rss_mib()
    start = time.perf_counter()
    cfg = SimpleNamespace(path=args.folder, seq_len=args.seq_len, batch_size=args.batch_size,
                          val_fraction=0.05, tokenizer="byte", num_workers=0, max_bytes=None,
                          text_field="text")  # fmt: skip
    loader = build_data(cfg, rank=0, world_size=1, seed=0, report=False).loader
    next(loader)
    startup = time.perf_counter() - start
    t0 = time.perf_counter()
    for _ in range(100):
        next(loader)
    per_batch = (time.perf_counter() - t0) / 100
    print(
        f"{args.folder}: {loader.tokens.numel():,} train tokens, start-up {startup:.2f} s, "
        f"{per_batch * 1e3:.2f} ms/batch, RSS MiB {before} -> {_rss_mib()}"
    )


if __name__ == "__main__":
    main()
