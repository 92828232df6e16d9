"""``simplefsdp export``: a run's (or a checkpoint's) full weights in one safetensors file.

Example::

    simplefsdp export --checkpoint outputs/debug --out model.safetensors

``--checkpoint`` takes a folder of runs (``metrics.output_dir``: the newest
run with a complete checkpoint), a run folder, a run's checkpoint folder (its
newest complete checkpoint) or a ``step-N`` folder; what is written is
:func:`simplefsdp.checkpoint.export.export_checkpoint`'s. An error about a
missing checkpoint lists the runs nearby.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from simplefsdp.checkpoint import latest_checkpoint, read_manifest
from simplefsdp.checkpoint.export import build_parser, export_checkpoint
from simplefsdp.train.runs import describe_runs, list_runs, newest_resumable_run, read_run


def locate_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` names: a run's, the newest run's in a
    folder of runs, else ``path`` itself (a checkpoint folder or a step)."""
    folder = Path(path)
    run = read_run(folder)
    if run is not None:
        return run.checkpoint_folder
    if folder.is_dir() and read_manifest(folder) is None and list_runs(folder):
        found = newest_resumable_run(folder)
        if found is not None:
            return found[0].checkpoint_folder
    return folder


def _runs_near(folder: Path) -> str:
    """``; runs in DIR: ...`` for the nearest folder at or above ``folder`` that holds runs."""
    for parent in [folder, *folder.parents][:4]:
        if read_run(parent) is not None:
            parent = parent.parent
        if list_runs(parent):
            return f"; {describe_runs(parent)}"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp export``; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    target = locate_checkpoint(args.checkpoint)
    if args.format == "hf":
        return _export_hf(target, args)
    try:
        weights, config = export_checkpoint(target, args.out, dtype=args.dtype)
    except (ValueError, RuntimeError) as exc:
        missing = read_manifest(target) is None and latest_checkpoint(target) is None
        near = _runs_near(Path(args.checkpoint)) if missing else ""
        print(f"simplefsdp export: error: {exc}{near}", file=sys.stderr)
        return 2
    print(f"wrote {weights} ({weights.stat().st_size:,} bytes) and {config}")
    return 0


def _export_hf(checkpoint: Path, args) -> int:
    """``--format hf``: see :func:`simplefsdp.checkpoint.hf.export_hf_checkpoint`."""
    from simplefsdp.checkpoint.hf import export_hf_checkpoint

    try:
        files = export_hf_checkpoint(
            checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    except (ValueError, RuntimeError) as exc:
        print(f"simplefsdp export: error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in files)
    config = json.loads((Path(args.out) / "config.json").read_text(encoding="utf-8"))
    what = ", ".join(config.get("architectures") or [str(config.get("model_type"))])
    print(f"wrote {len(files)} files ({size:,} bytes) to {args.out} (Hugging Face format: {what})")
    return 0
