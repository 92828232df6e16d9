"""What is alive at the peak of a CUDA allocator snapshot, grouped by where it was allocated.

Reads the ``torch.cuda.memory`` snapshot that ``world_size_one.py --snapshot``
writes (``<variant>_snapshot.pickle.gz``, or an uncompressed ``.pickle``),
replays its trace of allocations and frees, and prints the live bytes at the
largest total, grouped by the first frame in compiled code (Inductor's
generated files), in this repository's scripts, or else the first frame
recorded. Runs without a GPU (the snapshot is a pickle of plain data).

Usage::

    python benchmarks/snapshot_peak.py SNAPSHOT [SNAPSHOT ...] [--top 25] [--by-file]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import pickle


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def _where(frames: list[dict], by_file: bool = False) -> str:
    chosen = next(
        (f for f in frames if "torchinductor" in f.get("filename", "")
         or "/torch/" not in f.get("filename", "")),
        frames[0] if frames else None,
    )  # fmt: skip
    if chosen is None:
        return "(no stack recorded)"
    name = chosen.get("filename", "").rsplit("/", 1)[-1]
    return name if by_file else f"{name}:{chosen.get('line')} ({chosen.get('name')})"


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[tuple[int, list[dict]]]]:
    """(peak bytes above the trace's start, [(size, frames)] alive at it)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    current = peak = 0
    at_peak: list[tuple[int, list[dict]]] = []
    for event in snapshot["device_traces"][device]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            current += event["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())
        elif action == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    return peak, at_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--by-file", action="store_true", help="group by file, not line")
    opts = parser.parse_args()
    for path in opts.snapshots:
        peak, alive = live_at_peak(_load(path))
        by_place: dict[str, list[int]] = collections.defaultdict(list)
        for size, frames in alive:
            by_place[_where(frames, opts.by_file)].append(size)
        print(f"{path}: {peak / 2**30:.3f} GiB above the trace's start at its peak")
        rows = sorted(by_place.items(), key=lambda kv: -sum(kv[1]))
        for place, sizes in rows[: opts.top]:
            common = collections.Counter(round(s / 2**20, 1) for s in sizes).most_common(3)
            shapes = ", ".join(f"{n} x {mib} MiB" for mib, n in common)
            print(f"  {sum(sizes) / 2**20:9.1f} MiB  {place}  [{shapes}]")


if __name__ == "__main__":
    main()
