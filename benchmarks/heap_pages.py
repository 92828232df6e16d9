"""Where a CPU bench step's allocations land in the glibc heap.

On CPU the bench measures peak RSS (Note: [Measuring peak memory on CPU]),
and before the measured steps it runs ``malloc_trim``, which gives the free
pages inside the main heap back to the OS. A step that then allocates in
those free chunks makes their pages resident again, and they stay resident
after it frees them: RSS the step's tensors alone do not explain. This runs
bench configurations with ``heap_pages_shim.c`` preloaded and reports, per
measured step on each rank, for the main thread (Linux with glibc and a C
compiler; the steps are the bench worker's own):

- allocations below 64 KiB (served from the heap), their bytes, and the
  distinct 4 KiB pages they landed on (median over the measured steps);
- pages given back by the trim that the step's allocations made resident
  again, for allocations below 64 KiB and for larger ones (which glibc
  serves from a free heap chunk that fits before mapping new memory), with
  the number of large allocations served from the heap; in the first
  measured step, the one after the trim, and in all of them.

Usage::

    python benchmarks/heap_pages.py --workload memory --configs fsdp2,simplefsdp-auto [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = Path(__file__).with_name("heap_pages_shim.c")


def _worker(argv: list[str]) -> int:
    """Under torchrun: the bench worker, with counting around each measured step."""
    import simplefsdp.bench.worker as worker

    lib = ctypes.CDLL(None)
    warmup, steps = int(os.environ["HEAP_PAGES_WARMUP"]), int(os.environ["HEAP_PAGES_STEPS"])
    prefix, rank = os.environ["HEAP_PAGES_OUT"], os.environ["RANK"]
    timed, calls = worker.timed, [0]

    def counted(fn, device):
        i, calls[0] = calls[0], calls[0] + 1
        measured = warmup <= i < warmup + steps
        if measured:
            lib.heap_pages_enable(1)
        out = timed(fn, device)
        if measured:
            lib.heap_pages_enable(0)
            lib.heap_pages_report(f"{prefix}.step{i - warmup}.rank{rank}".encode())
        return out

    worker.timed = counted
    return worker.main(argv)


def _read(path: Path) -> dict[str, int]:
    """One report file: allocations and bytes below 64 KiB, distinct pages,
    re-touched pages (small, large) and large allocations in the heap."""
    row = dict.fromkeys(("allocs", "bytes", "pages", "small", "large", "large_allocs"), 0)
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields[0] == "pages":
            row["pages"] = int(fields[1])
        elif fields[0] == "retouched":
            row["small"], row["large"], row["large_allocs"] = map(int, fields[1:4])
        else:
            row["allocs"] += int(fields[1])
            row["bytes"] += int(fields[2])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="memory")
    parser.add_argument("--configs", default="fsdp2,simplefsdp-auto")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder for the reports")
    args = parser.parse_args()
    from simplefsdp.bench.configs import BenchSpec, get_workload

    out = args.out or Path(tempfile.mkdtemp(prefix="heap-pages-"))
    out.mkdir(parents=True, exist_ok=True)
    shim = out / "libheap_pages.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(SHIM)], check=True)
    workload = get_workload(args.workload)
    spec = out / "spec.json"
    spec.write_text(BenchSpec(workload, nproc=args.nproc).to_json())
    print(f"workload {workload.name}, {args.nproc} ranks, {workload.steps} measured steps; "
          "main thread. Per step, median over steps: allocations < 64 KiB, their bytes, "
          "distinct 4 KiB heap pages they landed on. Heap pages made resident again "
          "after the bench's malloc_trim, first measured step / all: by allocations "
          "< 64 KiB, by larger ones (how many of those the heap served)")  # fmt: skip
    for config in args.configs.split(","):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "LD_PRELOAD": str(shim),
            "HEAP_PAGES_WARMUP": str(workload.warmup),
            "HEAP_PAGES_STEPS": str(workload.steps),
            "HEAP_PAGES_OUT": str(out / config),
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", __file__, "--worker", "--config", config,
               "--spec", str(spec), "--out", str(out / "results")]  # fmt: skip
        with open(out / f"{config}.log", "w") as log:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            print(f"{config}: failed (exit {proc.returncode}); see {out / (config + '.log')}")
            continue
        for rank in range(args.nproc):
            rows = [_read(out / f"{config}.step{s}.rank{rank}") for s in range(workload.steps)]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            total = {k: sum(r[k] for r in rows) for k in rows[0]}
            first = rows[0]
            print(f"{config:<24} rank {rank}: {med['allocs']:9.0f} allocations  "
                  f"{med['bytes'] / 2**20:6.1f} MiB  {med['pages']:6.0f} pages "
                  f"({med['pages'] * 4 / 1024:.1f} MiB); re-touched "
                  f"{first['small']}/{total['small']} small, "
                  f"{first['large']}/{total['large']} large "
                  f"({first['large_allocs']}/{total['large_allocs']} allocations), "
                  f"first step {(first['small'] + first['large']) * 4 / 1024:.1f} MiB")  # fmt: skip
    print(f"reports in {out}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(_worker(sys.argv[1:]))
    sys.exit(main())
