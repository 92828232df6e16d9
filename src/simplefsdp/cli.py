"""Command-line entry point: ``simplefsdp <subcommand> [options]``.

Each subcommand lives in its own module and is imported only when used, so
``simplefsdp --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from simplefsdp._exit import exit_quickly
from simplefsdp._version import __version__

# subcommand -> (module with ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "simplefsdp.train.cli",
        "train a Llama 3 model (starts processes or runs under torchrun)",
    ),
    "export": (
        "simplefsdp.train.export_cli",
        "write a checkpoint's full weights to one safetensors file",
    ),
    "runs": (
        "simplefsdp.train.runs_cli",
        "list the runs of simplefsdp train; remove or prune them on request",
    ),
    "data": (
        "simplefsdp.data.prepare",
        "data prepare: tokenise a corpus into memory-mapped token shards",
    ),
    "bench": ("simplefsdp.bench.cli", "compare simplefsdp with torch FSDP2/DDP on this machine"),
    "plan": (
        "simplefsdp.plan.cli",
        "predict per-GPU memory and throughput of a job on a GPU cluster, without GPUs",
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp",
        description="simplefsdp: fully sharded data parallel for PyTorch, compiled.",
    )
    parser.add_argument("--version", action="version", version=f"simplefsdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if argv and argv[0] in SUBCOMMANDS:
        module_name, _ = SUBCOMMANDS[argv[0]]
        return int(importlib.import_module(module_name).main(argv[1:]) or 0)
    parser.parse_args(argv)  # --version, --help, or an error for anything else
    parser.print_help()
    return 0


def run() -> None:
    """The ``simplefsdp`` command: :func:`main`, then a quick exit."""
    exit_quickly(main())


if __name__ == "__main__":
    run()
