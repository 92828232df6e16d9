"""``simplefsdp runs``: list the runs of ``simplefsdp train``, remove them on request.

Examples::

    simplefsdp runs                              # the runs in outputs/debug
    simplefsdp runs --root outputs/small         # (or --config small)
    simplefsdp runs remove 20261205-101010-ab12  # prints what it would remove ...
    simplefsdp runs remove 20261205-101010-ab12 --yes   # ... and removes it
    simplefsdp runs prune --keep 3 --yes         # all but the 3 newest runs

Nothing is removed without ``--yes``, and never a run that is still
running (Note: [Live runs]); see Note: [One run per folder] in
:mod:`simplefsdp.train.runs` for what a run folder holds.
"""

from __future__ import annotations

import argparse
import sys

from simplefsdp.train.runs import RunInfo, find_run, list_runs, remove_run


def _build_parser() -> argparse.ArgumentParser:
    # --root and --config are accepted before and after the subcommand; after
    # it they default to SUPPRESS, so that they do not reset the ones before.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--root",
        default=argparse.SUPPRESS,
        help="folder of the runs (default: the config's metrics.output_dir)",
    )
    where.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="config whose metrics.output_dir holds the runs (default: debug)",
    )
    parser = argparse.ArgumentParser(
        prog="simplefsdp runs",
        description="List the runs of simplefsdp train (one folder each under "
        "metrics.output_dir); remove or prune them with --yes.",
        allow_abbrev=False,
        parents=[where],
    )
    sub = parser.add_subparsers(dest="action", metavar="{list,remove,prune}")
    sub.add_parser("list", help="list the runs (the default)", parents=[where])
    remove = sub.add_parser("remove", help="remove runs (with --yes)", parents=[where])
    remove.add_argument("runs", nargs="+", metavar="RUN", help="run id or run folder")
    remove.add_argument("--yes", action="store_true", help="remove; without it, only print")
    prune = sub.add_parser(
        "prune", help="remove all but the newest runs (with --yes)", parents=[where]
    )
    prune.add_argument("--keep", type=int, required=True, help="newest runs to keep (>= 0)")
    prune.add_argument("--yes", action="store_true", help="remove; without it, only print")
    return parser


def _size(num_bytes: int) -> str:
    from simplefsdp.train.metrics import format_bytes

    return format_bytes(num_bytes)


def _process(run: RunInfo) -> str:
    if run.pid is None:
        return "its files changed in the last minutes"
    return f"pid {run.pid} on {run.host}"


def _list(root: str, runs: list[RunInfo]) -> None:
    if not runs:
        print(f"no runs in {root}")
        return
    print(
        f"{'run':<24} {'status':<9} {'step':>6} {'checkpoint':>10} {'model':<14} {'size':>10}  "
        "folder"
    )
    for run in runs:
        last, step = run.last_step(), run.latest_step()
        print(
            f"{run.run_id:<24} {run.shown_status():<9} {'-' if last is None else last:>6} "
            f"{'-' if step is None else f'step-{step}':>10} {run.model():<14} "
            f"{_size(run.size_bytes()):>10}  {run.path}"
        )


def _remove(runs: list[RunInfo], yes: bool) -> int:
    if not runs:
        print("nothing to remove")
        return 0
    for run in runs:
        if run.is_running():
            raise ValueError(f"run {run.run_id} is still running ({_process(run)}); stop it first")
    for run in runs:
        where = str(run.path)
        if not run.checkpoint_folder.resolve().is_relative_to(run.path.resolve()):
            where += f" and {run.checkpoint_folder}"
        if yes:
            remove_run(run)
        print(f"{'removed' if yes else 'would remove'} run {run.run_id} ({run.status}): {where}")
    if not yes:
        print("nothing removed: add --yes to remove")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp runs``; returns the exit code (2 for bad input)."""
    args = _build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    root = getattr(args, "root", None)
    try:
        if root is None:
            from simplefsdp.train.config import load_config

            root = load_config(getattr(args, "config", "debug")).metrics.output_dir
        runs = list_runs(root)
        if args.action in (None, "list"):
            _list(root, runs)
            return 0
        if args.action == "remove":
            return _remove([find_run(spec, root) for spec in args.runs], args.yes)
        if args.keep < 0:
            raise ValueError(f"--keep must be >= 0, got {args.keep}")
        done = [run for run in runs if not run.is_running()]
        for run in runs:
            if run.is_running():
                print(f"keeping run {run.run_id}: still running ({_process(run)})")
        return _remove(done[: max(0, len(done) - args.keep)], args.yes)
    except (ValueError, FileNotFoundError) as exc:
        print(f"simplefsdp runs: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
