"""What verifying token shards costs: checksum speed, ``data prepare`` again, the first run.

Usage::

    python benchmarks/data_verify.py [--gb 1.0] [--dir /tmp/simplefsdp-verify] [--workers 2]

Writes a text corpus of ``gb / 2`` GB into ``DIR/corpus`` (this Python's
stdlib sources, repeated with variation), prepares it with the byte
tokenizer into ``DIR/tokens`` (``gb`` GB of ``uint16`` shards; kept between
runs, so only the first run pays for it) and prints:

* the speed of the shard checksum (CRC-32, and CRC-32 plus the largest id,
  as ``simplefsdp data prepare`` and the verifier compute them) next to
  sha256 and blake2b over the same bytes, all from the page cache;
* the time of ``data prepare`` run again on the complete folder (it
  re-verifies every shard's checksum) against the index and fingerprint alone;
* the first run: the loader drawing batches while the background thread
  verifies every shard, against a second run (verification recorded:
  nothing is read again): seconds until the verifier is done and the time
  per batch in both.

Nothing is written into the repository; remove ``DIR`` afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace


def _corpus(folder: Path, nbytes: int) -> None:
    """``nbytes`` of text in files of about 8 MB (stdlib sources, each copy numbered)."""
    if folder.is_dir() and sum(f.stat().st_size for f in folder.iterdir()) >= nbytes:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_bytes() for p in sorted(root.glob("*.py"))]
    block = b"".join(sources)
    written, i = 0, 0
    while written < nbytes:
        n = min(8_000_000, nbytes - written)
        data = (f"# copy {i}\n".encode() + block * (1 + n // max(len(block), 1)))[:n]
        (folder / f"part{i:05d}.txt").write_bytes(data)
        written, i = written + n, i + 1


def _speed(label: str, files: list[Path], update, limit: int) -> None:
    """MB/s of ``update(chunk)`` over the first ``limit`` bytes of ``files``."""
    done, start = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while done < limit and (chunk := fh.read(1 << 24)):
                update(chunk)
                done += len(chunk)
        if done >= limit:
            break
    elapsed = time.perf_counter() - start
    print(
        f"  {label:<26} {done / elapsed / 1e6:8.0f} MB/s ({done / 1e6:.0f} MB in {elapsed:.2f} s)"
    )


def _cfg(folder: Path) -> SimpleNamespace:
    return SimpleNamespace(path=str(folder), seq_len=512, batch_size=8, val_fraction=0.05,
                           tokenizer="byte", max_bytes=None, text_field="text")  # fmt: skip


def _run(folder: Path, batches: int) -> tuple[float, float]:
    """``(seconds until the verifier is done, ms per batch)`` of one loader."""
    from simplefsdp.data import build_data

    start = time.perf_counter()
    loader = build_data(_cfg(folder), verify=(0, 1), report=False).loader
    next(loader)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    per_batch = (time.perf_counter() - t0) / batches
    loader.verifier.wait()
    return time.perf_counter() - start, per_batch * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of token shards")
    parser.add_argument("--dir", default="/tmp/simplefsdp-verify")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    import logging
    import zlib

    import numpy as np

    from simplefsdp.data.prepare import prepare
    from simplefsdp.data.verify import VERIFIED_DIR, scan_shard

    logging.basicConfig(level=logging.WARNING)
    work = Path(args.dir)
    _corpus(work / "corpus", int(args.gb * 1e9 / 2))
    tokens = work / "tokens"
    if not (tokens / "index.json").is_file():
        start = time.perf_counter()
        prepare(work / "corpus", tokens, workers=args.workers, progress=False)
        print(f"data prepare (first time): {time.perf_counter() - start:.1f} s")
    files = sorted((tokens / "shards").glob("*.bin"))
    total = sum(f.stat().st_size for f in files)
    print(f"{tokens}: {len(files)} shard files, {total / 1e9:.2f} GB")
    for f in files:  # into the page cache, as after prepare
        f.read_bytes()

    print("checksum speed (one thread, page cache):")
    crc = {"v": 0}
    _speed("zlib.crc32", files, lambda c: crc.__setitem__("v", zlib.crc32(c, crc["v"])), total)

    def crc_max(chunk: bytes) -> None:
        crc["v"] = zlib.crc32(chunk, crc["v"])
        np.frombuffer(chunk, np.uint16).max(initial=0)

    _speed("crc32 + largest id", files, crc_max, total)
    limit = min(total, 500_000_000)
    _speed("hashlib.sha256", files, hashlib.sha256().update, limit)
    _speed("hashlib.blake2b", files, hashlib.blake2b().update, limit)
    start = time.perf_counter()
    for f in files:
        scan_shard(f, np.dtype("<u2"))
    print(f"  scan_shard over all shards   {time.perf_counter() - start:.2f} s")

    start = time.perf_counter()
    prepare(work / "corpus", tokens, workers=args.workers, progress=False)
    print(f"data prepare again (complete; re-verifies every checksum): "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip

    shutil.rmtree(tokens / VERIFIED_DIR, ignore_errors=True)
    first_s, first_ms = _run(tokens, args.batches)
    again_s, again_ms = _run(tokens, args.batches)
    print(
        f"first run: verifier done after {first_s:.1f} s, {first_ms:.2f} ms/batch while it "
        f"runs; second run (recorded): {again_s:.1f} s, {again_ms:.2f} ms/batch "
        f"({args.batches} batches of 8 x 512)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
