"""``simplefsdp train`` / ``python -m simplefsdp.train``: the training command.

Examples::

    simplefsdp train                                  # debug model, 2 CPU procs or all GPUs
    simplefsdp train --config small --training.steps 500 --parallel.mode hybrid_shard
    simplefsdp train --print-config --compile.enable false
    simplefsdp train --resume                         # continue the newest run (its config)
    simplefsdp train --resume outputs/debug/RUN_ID    # continue that run
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
from typing import Any

from simplefsdp.train.config import (
    SECTIONS,
    JobConfig,
    closest_key,
    config_warnings,
    format_config,
    load_config,
)
from simplefsdp.train.config.schema import VALID_MODELS
from simplefsdp.train.launch import (
    ERROR_DIR_ENV,
    launch,
    launcher_error_dir,
    oversubscription_warning,
    peer_lost,
    under_torchrun,
)
from simplefsdp.train.resume import (
    Resume,
    keep_global_batch,
    output_folders,
    resolve_resume,
    start_run_files,
    this_run,
)
from simplefsdp.train.runs import (
    RUN_ID_ENV,
    check_output_folders,
    output_dir_for_model,
    set_run_status,
)

logger = logging.getLogger(__name__)


DEFAULT_CONFIG = "debug"
EXIT_CONFIG_ERROR = 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp train",
        description="Train a Llama 3 or mixture-of-experts model with simplefsdp (or the "
        "fsdp2/ddp baselines).",
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
        "--model",
        default=None,
        metavar="NAME",
        help="the model to train: --model.name NAME (a flavor of a registered model "
        "family; see --print-config for the valid names)",
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
        nargs="?",
        const="",
        default=None,
        metavar="RUN",
        help="continue run RUN (a run folder, or a run id under metrics.output_dir; default: "
        "the newest run with a complete checkpoint) with its saved config; flags given "
        "on top override it (an error if there is no checkpoint)",
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
    """Check what the config alone cannot: the inputs (data, tokenizer, Hugging
    Face folder, vocabulary; see :mod:`simplefsdp.train.preflight`), mesh, devices.

    Runs before any process is started and before any output is written.

    Raises:
        ValueError: naming the problem and the valid choices
            (:class:`~simplefsdp.train.preflight.InputErrors`: one line per problem).
    """
    from simplefsdp.train.preflight import check_inputs
    from simplefsdp.train.resolve import resolve

    # data, tokenizer, Hugging Face folder, vocabulary: every problem, one line each
    notes = check_inputs(job)
    if not under_torchrun() or (
        os.environ.get("RANK", "0") == "0" and not os.environ.get(ERROR_DIR_ENV)
    ):
        for note in notes:
            print(f"simplefsdp train: note: {note}", file=sys.stderr)
    p = job.parallel
    resolve(job, world_size, local_world_size)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and local_world_size > gpus:
        raise ValueError(
            f"{local_world_size} processes per node but only {gpus} GPUs are visible; "
            f"use --nproc between 1 and {gpus}"
        )
    f8 = job.float8
    if f8.enable and f8.recipe == "tensorwise" and p.tp > 1 and p.sequence_parallel and not gpus:
        raise ValueError(
            "float8.recipe 'tensorwise' with parallel.tp > 1 and parallel.sequence_parallel true "
            "needs GPUs (gloo cannot all-gather float8 activations); on CPU use "
            "--parallel.sequence_parallel false"
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
    except RuntimeError as exc:
        if launcher_error_dir() is None or not peer_lost(exc):
            raise
        # Another rank died; the launcher names it (Note: [Worker failures]).
        logging.getLogger(__name__).debug("collective failed after a peer's death: %s", exc)
        return 1
    finally:
        trainer.close(clean=clean)
        _record_status(trainer, clean)
        error_dir = os.environ.get(ERROR_DIR_ENV)
        if error_dir and os.environ.get("RANK", "0") == "0" and launcher_gone():
            shutil.rmtree(error_dir, ignore_errors=True)  # Note: [Orphaned workers]


def _record_status(trainer: Any, clean: bool) -> None:
    """Under torchrun rank 0 records how the run ended in its ``run.json``
    (under ``simplefsdp train`` the launcher does)."""
    if os.environ.get(ERROR_DIR_ENV) or os.environ.get("RANK", "0") != "0":
        return
    if trainer.run_dir is not None:
        stopped = trainer.summary.interrupted_by
        set_run_status(
            trainer.run_dir, "failed" if not clean else "stopped" if stopped else "finished"
        )


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


def _parse(
    argv: list[str], notes: list[str] | None = None
) -> tuple[argparse.Namespace, JobConfig, Resume | None]:
    """Split known flags from dotted overrides, load the config and pick the run
    to resume, if any (may raise).

    ``notes`` collects one-line notes about the config file (see ``load_config``).
    """
    parser = _build_parser()
    args, overrides = parser.parse_known_args(argv)
    _check_unknown_flags(parser, overrides)
    if args.model is not None:
        overrides = ["--model.name", args.model, *overrides]
    if args.resume is not None:
        overrides = [*overrides, "--checkpoint.resume", "true"]
    if args.resume_if_possible:
        overrides = [*overrides, "--checkpoint.resume_if_possible", "true"]
    try:
        job = load_config(args.config, overrides, notes=notes)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    if args.model is not None and not any(o.startswith("--metrics.output_dir") for o in overrides):
        # runs are filed under the model they train, not under the preset's model
        job.metrics.output_dir = output_dir_for_model(
            job.metrics.output_dir, job.model.name, VALID_MODELS
        )
    try:
        job, resume = resolve_resume(job, args.resume or None, overrides)
    except ValueError:
        if not args.print_config:  # which shows the configuration without a run
            raise
        resume = None
    return args, job, resume


def _worker_argv(argv: list[str], resume: Resume | None = None) -> list[str]:
    """``argv`` without the launcher-only flags (``--nproc``, ``--max-restarts``);
    the run the launcher resumes is named (``--resume RUN_FOLDER``)."""
    out, skip, after_resume = [], False, False
    for token in argv:
        if skip or (after_resume and not token.startswith("--")):
            skip = after_resume = False
            continue
        after_resume = False
        name = token.split("=", 1)[0]
        if name in ("--nproc", "--max-restarts"):
            skip = "=" not in token
            continue
        if resume is not None and name in ("--resume", "--resume-if-possible"):
            after_resume = token == "--resume"
            continue
        out.append(token)
    return out if resume is None else [*out, "--resume", str(resume.run.path)]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp train``; returns the process exit code.

    The command line and the configuration are parsed and validated before
    torch is imported, so ``--help`` and configuration errors are immediate.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    notes: list[str] = []
    try:
        args, job, resume = _parse(argv, notes)
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
    run_id, run_dir = this_run(job, resume)
    if resume is not None and not worker and resume.run.is_running():
        return _error(
            f"--resume: run {resume.run.run_id} is still running (pid {resume.run.pid} on "
            f"{resume.run.host or 'another host'}); stop it first: two processes would "
            "write the same checkpoints"
        )
    try:  # every output folder, before torch is imported (Note: [One run per folder])
        if not worker or (rank == 0 and not os.environ.get(ERROR_DIR_ENV)):
            check_output_folders(output_folders(job, run_dir))
    except ValueError as exc:
        return _error(_one_line(exc))
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
        job, resume = keep_global_batch(job, resume, world)  # Note: [Global batch on resume]
        preflight(job, world_size=world, local_world_size=local)
    except ValueError as exc:
        if not worker or rank == 0:
            lines = getattr(exc, "errors", None)  # the input checks: one line per problem
            if not lines:
                lines = str(exc).splitlines()
                if len(lines) < 2 or lines[0].endswith(":"):
                    lines = [_one_line(exc)]  # else every error of the resolve step
            for line in lines:
                _error(line)
        return EXIT_CONFIG_ERROR
    if resume is not None and (not worker or (rank == 0 and not os.environ.get(ERROR_DIR_ENV))):
        print(f"simplefsdp train: {resume.line()}", flush=True)
    if worker:
        if resume is not None:  # every rank resolved the same run
            os.environ[RUN_ID_ENV] = resume.run.run_id
        _configure_logging(rank)
        from simplefsdp.train.interrupts import watch_launcher

        watch_launcher()  # Note: [Orphaned workers]
        return _run_worker(job)
    return _launch(job, args, argv, resume, run_id, run_dir, world)


def _launch(
    job: JobConfig,
    args: argparse.Namespace,
    argv: list[str],
    resume: Resume | None,
    run_id: str,
    run_dir: Path,
    world: int,
) -> int:
    """Write the run's files, start the workers, record how the run ended."""
    import torch

    start_run_files(job, run_id, run_dir, resumed=resume is not None)
    os.environ[RUN_ID_ENV] = run_id
    device = "cuda (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    warning = oversubscription_warning(world, cuda=torch.cuda.is_available())
    if warning:
        print(f"simplefsdp train: warning: {warning}", file=sys.stderr, flush=True)
    print(f"simplefsdp train: starting {world} processes on {device}", flush=True)
    code = EXIT_CONFIG_ERROR
    try:
        code = launch(
            _worker_argv(argv, resume),
            nproc=world,
            max_restarts=args.max_restarts,
            resume_point=lambda: _resume_point(job, run_dir),
            resume_command=f"simplefsdp train --resume {run_dir}",
        )
    finally:
        set_run_status(run_dir, "finished" if code == 0 else "stopped" if code > 128 else "failed")
    return code


def _resume_point(job: JobConfig, run_dir: Path) -> str | None:
    """The checkpoint a restarted run resumes from (the latest complete one in
    the run's checkpoint folder), or ``None`` with checkpoints off or none saved."""
    if not job.checkpoint.enable:
        return None
    from simplefsdp.checkpoint.steps import latest_checkpoint
    from simplefsdp.train.runs import run_checkpoint_folder

    info = latest_checkpoint(run_checkpoint_folder(job.checkpoint.folder, run_dir))
    return None if info is None else str(info.path)
