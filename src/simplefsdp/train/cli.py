"""``simplefsdp train`` / ``python -m simplefsdp.train``: the training command.

Examples::

    simplefsdp train                                  # debug model, 2 CPU procs or all GPUs
    simplefsdp train --config small --training.steps 500 --parallel.mode hybrid_shard
    simplefsdp train --print-config --compile.enable false
    simplefsdp train --resume                         # continue from the latest checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m simplefsdp.train --config llama3_8b

Run directly, the command validates the configuration and the data path, then
starts ``--nproc`` local processes (see :mod:`simplefsdp.train.launch`); run
under ``torchrun`` it is the per-rank entry point and trains right away.
Configuration errors print one line to stderr and exit with code 2 before any
process starts or any file is written.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

from simplefsdp.train.config import (
    SECTIONS,
    JobConfig,
    closest_key,
    config_warnings,
    format_config,
    load_config,
)
from simplefsdp.train.launch import ERROR_DIR_ENV, launch, launcher_error_dir, under_torchrun

logger = logging.getLogger(__name__)

__all__ = ["main", "preflight"]

DEFAULT_CONFIG = "debug"
EXIT_CONFIG_ERROR = 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp train",
        description="Train a Llama 3 model with simplefsdp (or the fsdp2/ddp baselines).",
        epilog=(
            "Any config field can be overridden as --section.key VALUE (or --section.key=VALUE), "
            f"with sections {', '.join(SECTIONS)}; e.g. --training.steps 200 "
            "--parallel.mode hybrid_shard --compile.enable false. See --print-config for all keys."
        ),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"TOML file or shipped config name (default: {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes to start when not under torchrun (default: all GPUs, or 2 on CPU)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="restarts after a worker failure (default: 0)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the latest run from its latest checkpoint (an error if there is none); "
        "shorthand for --checkpoint.resume true",
    )
    parser.add_argument(
        "--resume-if-possible",
        action="store_true",
        help="continue from the latest checkpoint if there is one, else start a new run",
    )
    return parser


def _one_line(exc: BaseException) -> str:
    """An exception message on one line (multi-line config errors joined by '; ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return lines[0] + " " + "; ".join(lines[1:])
    return "; ".join(lines)


def _error(message: str) -> int:
    print(f"simplefsdp train: error: {message}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def preflight(job: JobConfig, *, world_size: int, local_world_size: int) -> None:
    """Check what the config alone cannot: data path, tokenizer path, mesh, devices.

    Runs before any process is started and before any output is written.

    Raises:
        ValueError: naming the problem and the valid choices.
    """
    from simplefsdp.engines import mesh_shape_for

    path = job.data.path
    if path is not None:
        p = Path(path).expanduser()
        if not (p.is_file() or p.is_dir()):
            raise ValueError(
                f"data.path {path!r} does not exist; give a text file, a folder of text files, "
                "or leave data.path unset for the embedded stdlib corpus"
            )
        _check_data_files(path)
    tok = job.data.tokenizer
    if tok != "byte":
        if not Path(tok).expanduser().exists():
            raise ValueError(
                f"data.tokenizer {tok!r} does not exist; use 'byte' or the path of a local "
                "tokenizer.json file or Hugging Face tokenizer folder"
            )
        from simplefsdp.data import load_tokenizer

        try:
            load_tokenizer(tok)
        except ValueError as exc:
            raise ValueError(f"data.tokenizer {tok!r}: {_one_line(exc)}") from exc
    _check_resume(job)
    p = job.parallel
    mesh_shape_for(
        p.engine,
        p.mode,
        world_size,
        mesh_shape=p.mesh_shape,
        local_world_size=local_world_size,
        tp=p.tp,
        pp=p.pp,
    )
    _check_seq_len(job)
    _check_tensor_parallel(job)
    _check_pipeline(job)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and local_world_size > gpus:
        raise ValueError(
            f"{local_world_size} processes per node but only {gpus} GPUs are visible; "
            f"use --nproc between 1 and {gpus}"
        )


def _check_data_files(path: str) -> None:
    """``data.path`` must hold at least one non-empty text file, and none that is
    mostly binary (judged by its head) or Parquet without pyarrow."""
    from simplefsdp.data import list_corpus_files, sniff_data_file
    from simplefsdp.data.prepare import is_prepared

    if is_prepared(path):  # token shards of simplefsdp data prepare: checked when opened
        return
    try:
        _, files = list_corpus_files(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"data.path {path!r}: {_one_line(exc)}") from exc
    for f in files:
        problem = sniff_data_file(f)
        if problem is not None:
            raise ValueError(problem)
    if not any(f.stat().st_size > 0 for f in files):
        what = "is empty" if Path(path).is_file() else "holds no non-empty text file"
        raise ValueError(
            f"data.path {path!r} {what}; give a text file or a folder of text files with "
            "some text, or leave data.path unset for the embedded stdlib corpus"
        )


def _check_resume(job: JobConfig) -> None:
    """``--resume`` needs a checkpoint to resume from (``--resume-if-possible`` does not);
    neither resumes from a damaged one (see [Damaged checkpoints] in simplefsdp.checkpoint.steps)."""
    ck = job.checkpoint
    resumes = ck.resume or ck.resume_if_possible
    if not resumes or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    from simplefsdp.checkpoint import resume_checkpoint

    if resume_checkpoint(ck.folder, ck.load_step) is None and ck.resume:
        raise ValueError(
            f"--resume: no complete checkpoint in {ck.folder}; leave out --resume to start a "
            "new run, or pass --resume-if-possible"
        )


def _check_tensor_parallel(job: JobConfig) -> None:
    """With ``parallel.tp > 1`` the model's heads and feed-forward must split evenly."""
    tp = job.parallel.tp
    if tp == 1:
        return
    from simplefsdp.models.llama3 import get_config, tp_split_sizes

    m = job.model
    args = get_config(m.name, **({} if m.vocab_size is None else {"vocab_size": m.vocab_size}))
    # the vocabulary is only known here when given (else it is the tokenizer's)
    loss_parallel = m.vocab_size is not None and job.parallel.loss_parallel
    sizes = tp_split_sizes(args, loss_parallel=loss_parallel)
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        found = ", ".join(f"{name} {size}" for name, size in bad.items())
        top = max(sizes.values())
        valid = [d for d in range(1, top + 1) if all(v % d == 0 for v in sizes.values())]
        raise ValueError(
            f"parallel.tp {tp} does not divide the {found} of model {m.name!r}; "
            f"valid tensor-parallel sizes for this model: {valid}"
        )


def _check_pipeline(job: JobConfig) -> None:
    """With ``parallel.pp > 1`` every stage needs at least one layer."""
    p = job.parallel
    if p.pp == 1:
        return
    from simplefsdp.models.llama3 import get_config

    n_layers = get_config(job.model.name).n_layers
    per_rank = p.pp_stages_per_rank or (2 if p.pp_schedule == "interleaved_1f1b" else 1)
    if p.pp * per_rank > n_layers:
        raise ValueError(
            f"parallel.pp {p.pp} x {per_rank} stages per rank = {p.pp * per_rank} stages but "
            f"model {job.model.name!r} has {n_layers} layers; use at most {n_layers} stages"
        )


def _check_seq_len(job: JobConfig) -> None:
    """``data.seq_len`` must fit the model's rotary table (``max_seq_len``)."""
    from simplefsdp.models.llama3 import get_config

    m = job.model
    overrides = {} if m.max_seq_len is None else {"max_seq_len": m.max_seq_len}
    max_seq_len = get_config(m.name, **overrides).max_seq_len
    if job.data.seq_len > max_seq_len:
        raise ValueError(
            f"data.seq_len {job.data.seq_len} exceeds max_seq_len {max_seq_len} of model "
            f"{m.name!r}; use --data.seq_len <= {max_seq_len} or raise --model.max_seq_len"
        )


def _configure_logging(rank: int) -> None:
    """Rank 0 logs INFO, the other ranks WARNING (application entry point only)."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True
    )


def _report_worker_error(message: str, code: int) -> int:
    """One line per error: to the launcher's error folder (``simplefsdp train``
    prints each distinct one once), or, under torchrun or once that launcher
    is gone, from every failing rank (other ranks name themselves: an error
    on one node only is not lost)."""
    rank = int(os.environ.get("RANK", "0"))
    error_dir = launcher_error_dir()
    if error_dir is not None:
        (error_dir / f"rank{rank}.txt").write_text(f"{code} {message}\n", encoding="utf-8")
    elif rank == 0:
        _error(message)
    else:
        print(f"simplefsdp train: error on rank {rank}: {message}", file=sys.stderr, flush=True)
    return code


def _run_worker(job: JobConfig) -> int:
    """Train on this rank (under torchrun); rank 0 prints the summary.

    Errors the user can act on (bad data, a checkpoint that does not fit, a
    damaged compile cache) end the process with one line and exit code 2
    (1 for a broken environment); anything else is a bug and keeps its
    traceback.
    """
    from simplefsdp.train.interrupts import launcher_gone
    from simplefsdp.train.trainer import Trainer, TrainingError

    trainer = Trainer(job)
    clean = False
    try:
        try:
            trainer.setup()
        except (ValueError, FileNotFoundError) as exc:  # includes CheckpointError
            return _report_worker_error(_one_line(exc), EXIT_CONFIG_ERROR)
        try:
            summary = trainer.train()
        except TrainingError as exc:
            return _report_worker_error(_one_line(exc), 1)
        clean = True
        if not summary.interrupted_by:
            if trainer.rank == 0:  # a stop is reported in one line
                print(summary.format(), flush=True)
            return trainer.exit_code
        # Stopped cleanly and saved: the agent's SIGTERM, sent once another
        # rank has exited, must not cut this rank's teardown short.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        # Under `simplefsdp train` the launcher returns 128 + the signal from
        # rank 0's mark; a non-zero exit would make torchrun's agent restart
        # the group (--max-restarts) and train on after the stop.
        return 0 if os.environ.get(ERROR_DIR_ENV) else trainer.exit_code
    finally:
        trainer.close(clean=clean)
        error_dir = os.environ.get(ERROR_DIR_ENV)
        if error_dir and os.environ.get("RANK", "0") == "0" and launcher_gone():
            shutil.rmtree(error_dir, ignore_errors=True)  # Note: [Orphaned workers]


def _check_unknown_flags(parser: argparse.ArgumentParser, overrides: list[str]) -> None:
    """An undotted ``--flag`` that is not the command's: one line with the closest
    flag or config key.

    Raises:
        ValueError: e.g. ``unknown option --nprocs. Did you mean --nproc?``.
    """

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for token in overrides:
        name = token.split("=", 1)[0]
        if not name.startswith("--") or "." in name or len(name) == 2:
            continue
        scored = [(ratio(name.replace("_", "-"), flag), flag) for flag in flags]
        key = closest_key(name[2:])
        if key is not None:  # a field's own name or a known alias scores 1, a near miss less
            near = ratio(name[2:].replace("-", "_"), key.split(".")[1])
            scored.append((near if 0.75 <= near < 1 else 1.0, f"--{key}"))
        score, best = max(scored, key=lambda pair: pair[0]) if scored else (0.0, "")
        if score >= 0.6:
            raise ValueError(f"unknown option {name}. Did you mean {best}?")


def _parse(argv: list[str], notes: list[str] | None = None) -> tuple[argparse.Namespace, JobConfig]:
    """Split known flags from dotted overrides and load the config (may raise).

    ``notes`` collects one-line notes about the config file (see ``load_config``).
    """
    parser = _build_parser()
    args, overrides = parser.parse_known_args(argv)
    _check_unknown_flags(parser, overrides)
    if args.resume:
        overrides = [*overrides, "--checkpoint.resume", "true"]
    if args.resume_if_possible:
        overrides = [*overrides, "--checkpoint.resume_if_possible", "true"]
    try:
        job = load_config(args.config, overrides, notes=notes)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    return args, job


def _worker_argv(argv: list[str]) -> list[str]:
    """``argv`` without the launcher-only flags (``--nproc``, ``--max-restarts``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--nproc", "--max-restarts"):
            skip = "=" not in token
            continue
        out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp train``; returns the process exit code.

    The command line and the configuration are parsed and validated before
    torch is imported, so ``--help`` and configuration errors are immediate.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    notes: list[str] = []
    try:
        args, job = _parse(argv, notes)
    except ValueError as exc:
        return _error(_one_line(exc))
    worker = under_torchrun()
    rank = int(os.environ.get("RANK", "0"))
    # once: by `simplefsdp train`, else (under a plain torchrun) by rank 0
    if not worker or (rank == 0 and not os.environ.get(ERROR_DIR_ENV)):
        for warning in [*notes, *config_warnings(job)]:
            print(f"simplefsdp train: warning: {warning}", file=sys.stderr)
    if args.print_config:
        print(format_config(job), end="")
        return 0
    if worker:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif args.nproc is not None:
        world = local = args.nproc
    else:
        from simplefsdp.engines import default_nproc

        world = local = default_nproc()
    try:
        if world < 1 or args.max_restarts < 0:
            raise ValueError(
                f"--nproc must be >= 1 and --max-restarts >= 0 (got {world}, {args.max_restarts})"
            )
        preflight(job, world_size=world, local_world_size=local)
    except ValueError as exc:
        if not worker or rank == 0:
            return _error(_one_line(exc))
        return EXIT_CONFIG_ERROR
    if worker:
        _configure_logging(rank)
        from simplefsdp.train.interrupts import watch_launcher

        watch_launcher()  # Note: [Orphaned workers]
        return _run_worker(job)
    import torch

    device = "cuda (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    print(f"simplefsdp train: starting {world} processes on {device}", flush=True)
    return launch(_worker_argv(argv), nproc=world, max_restarts=args.max_restarts)
