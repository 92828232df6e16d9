"""Where a CPU bench step's small allocations land in the glibc heap.

On CPU the bench measures peak RSS (Note: [Measuring peak memory on CPU]).
Allocations below the 64 KiB mmap threshold come from glibc's main heap,
whose freed pages stay resident, so a step whose small allocations spread
over many heap pages raises RSS beyond the tensors it holds. This runs bench
configurations with ``heap_pages_shim.c`` preloaded and reports, per
measured step on each rank, the main thread's allocations below 64 KiB and
the distinct 4 KiB heap pages they landed on (Linux with glibc and a C
compiler; the steps are the bench worker's own).

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


def _read(path: Path) -> tuple[int, int, int]:
    """(allocations, bytes, distinct pages) of one report file."""
    allocs = nbytes = pages = 0
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields[0] == "pages":
            pages = int(fields[1])
        else:
            allocs, nbytes = allocs + int(fields[1]), nbytes + int(fields[2])
    return allocs, nbytes, pages


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
          "per step, median over steps: main-thread allocations < 64 KiB, their bytes, "
          "distinct 4 KiB heap pages they landed on")  # fmt: skip
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
            allocs, nbytes, pages = (statistics.median(col) for col in zip(*rows))
            print(f"{config:<24} rank {rank}: {allocs:9.0f} allocations  "
                  f"{nbytes / 2**20:6.1f} MiB  {pages:6.0f} pages ({pages * 4 / 1024:.1f} MiB)")  # fmt: skip
    print(f"reports in {out}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(_worker(sys.argv[1:]))
    sys.exit(main())
