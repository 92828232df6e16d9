"""``simplefsdp bench``: simplefsdp side by side with its peers, in one run.

Each configuration runs in fresh processes started by ``torch.distributed.run``
(as ``simplefsdp train`` starts its workers), with the same model, data,
per-rank batch and seed; then a communication-only run times the same
collectives with no compute. The runner merges the ranks' measurements,
checks that all configurations agree on the loss, and writes ``bench.json``,
``bench.png`` and the table it prints into ``--out``.

Example::

    simplefsdp bench --workload compute --out /tmp/bench
    simplefsdp bench --workload comm --configs limit,fsdp2,simplefsdp-manual
    simplefsdp bench --configs fsdp2,simplefsdp-auto --rounds 3   # Note: [Bench rounds]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simplefsdp._exit import exit_quickly
from simplefsdp.bench.configs import (
    COMM_ONLY,
    PHASE_SUFFIX,
    PUBLIC_CONFIGS,
    TORCH_CP_ON_CPU,
    WORKLOADS,
    BenchConfig,
    BenchSpec,
    get_workload,
    resolve_configs,
)
from simplefsdp.bench.report import (
    add_ratios,
    check_losses,
    failed_row,
    format_table,
    merge_comm_only,
    merge_ranks,
    merge_rounds,
    write_json,
    write_png,
)
from simplefsdp.engines.kinds import get_engine
from simplefsdp.engines.resolve import job_errors
from simplefsdp.layout import Layout
from simplefsdp.parallel_dims import oversubscription_warning

EXIT_CONFIG_ERROR = 2
# Variables of an enclosing torchrun that must not leak into the nested one.
_LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp bench",
        description="Compare simplefsdp with torch FSDP2/DDP on this machine: step time, "
        "memory, collectives, compile time and loss per configuration.",
    )
    parser.add_argument(
        "--workload",
        default="compute",
        help="preset, default compute; "
        + "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()),
    )
    parser.add_argument(
        "--configs",
        default="all",
        help=f"comma-separated subset of: {', '.join(PUBLIC_CONFIGS)} (default all: every one "
        "but the float8 ones, which need torchao)",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: the Llama 3 TP plan (sequence parallel) on a (nproc/tp, tp) "
        "mesh; runs the fsdp2 and simplefsdp configurations only (default 1)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel size: the Llama 3 layers split into stages over the outermost "
        "mesh dim, run by torch's schedules; fsdp2 and simplefsdp configurations only (default 1)",
    )
    parser.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        help="pipeline schedule with --pp > 1 (default 1f1b; interleaved: 2 stages per rank)",
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per step (default: --pp)"
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size of a mixture-of-experts workload (--workload moe): ranks per "
        "group exchanging tokens by all-to-all, each holding num_experts/ep experts (default 1)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: ranks that split each sequence (--workload long); with "
        "--cp > 1 the configurations run simplefsdp's context parallelism, and on CUDA "
        "fsdp2-torch-cp runs torch's (default 1)",
    )
    parser.add_argument(
        "--cp-backend",
        default="allgather",
        choices=("allgather", "ring", "ulysses"),
        help="simplefsdp's attention across context-parallel ranks (default allgather)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="batches per optimizer step, gradients communicated on the last only (default 1)",
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (>= 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length")
    parser.add_argument(
        "--model",
        default=None,
        help="the model flavor (default: the workload's; simplefsdp.models.registry lists "
        "them); a mixture of experts with --workload moe",
    )
    parser.add_argument(
        "--model-override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="ModelArgs field override, e.g. n_layers=2 (repeatable)",
    )
    parser.add_argument(
        "--param-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="mixed precision of the fsdp2 and simplefsdp configurations: parameters gathered "
        "and matmuls run in this dtype, gradients reduced in float32 (default float32; ddp and "
        "limit always train in float32)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr", type=float, default=None, help="AdamW learning rate (default: the workload's)"
    )
    parser.add_argument(
        "--loss-rtol", type=float, default=2e-3, help="relative loss tolerance for ok"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, in alternating order (A B, B A, ...), "
        "and pool the measured steps: the machine's drift then falls on all configurations "
        "alike (default 1)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="output folder")
    parser.add_argument("--no-png", action="store_true", help="do not write bench.png")
    return parser


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--model-override expects FIELD=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


def build_spec(args: argparse.Namespace) -> BenchSpec:
    """The run spec from the command line.

    Raises:
        ValueError: unknown workload, model or override field, or bad sizes.
    """
    overrides = dict(_parse_override(o) for o in args.model_override)
    workload = get_workload(
        args.workload,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        model=args.model,
        lr=args.lr,
    )
    workload = dataclasses.replace(
        workload, model_overrides={**workload.model_overrides, **overrides}
    )
    if args.nproc is not None:
        nproc = args.nproc
    else:
        from simplefsdp.engines import default_nproc

        nproc = default_nproc()
    if args.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if args.cp < 1:
        raise ValueError(f"--cp must be >= 1, got {args.cp}")
    microbatches = args.microbatches if args.microbatches is not None else args.pp
    if _has_experts(workload.model):
        from types import SimpleNamespace

        from simplefsdp.models.registry import resolve_flavor

        model_spec, config = resolve_flavor(workload.model, **workload.model_overrides)
        # what the family cannot build (the layout is checked just below)
        errors = model_spec.validate(config, SimpleNamespace(), model_name=workload.model)
        if errors:
            raise ValueError("; ".join(errors))
        if args.cp != 1:
            raise ValueError(
                f"--cp {args.cp}: the mixture-of-experts workload does not run context "
                "parallelism; use --cp 1 (simplefsdp train composes them)"
            )
        _check_moe_layout(nproc, args.tp, args.pp, args.ep, workload)
    else:
        from simplefsdp.models.registry import resolve_flavor

        resolve_flavor(workload.model, **workload.model_overrides)  # validates names and fields
        if args.ep != 1:
            raise ValueError(
                f"--ep {args.ep} applies to mixture-of-experts models (--workload moe); "
                f"{workload.model!r} has no experts"
            )
        _check_layout(
            nproc, args.tp, args.pp, args.pp_schedule, microbatches, workload, args.cp,
            args.cp_backend,
        )  # fmt: skip
    return BenchSpec(
        workload=workload,
        nproc=nproc,
        seed=args.seed,
        timeout_s=args.timeout,
        tp=args.tp,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        microbatches=microbatches,
        grad_accum=args.grad_accum,
        param_dtype=None if args.param_dtype in (None, "float32") else args.param_dtype,
        ep=args.ep,
        cp=args.cp,
        cp_backend=args.cp_backend,
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_experts(flavor: str) -> bool:
    """Flavor ``flavor``'s family has expert parallelism (a mixture of experts).

    Raises:
        ValueError: an unknown flavor (one line, did-you-mean).
    """
    from simplefsdp.models.registry import spec_of

    return spec_of(flavor).supports("ep")


def _check_moe_layout(nproc: int, tp: int, pp: int, ep: int, workload: Any) -> None:
    """A mixture-of-experts workload's layout: the one check of train, bench and
    plan (:func:`simplefsdp.engines.resolve.job_errors`); the workload's
    recipe (Note: [Bench MoE recipes]) runs data and expert parallelism only.

    Raises:
        ValueError: every error (the bad value and the valid ones), joined by "; ".
    """
    from simplefsdp.models.registry import resolve_flavor

    spec, args = resolve_flavor(workload.model, **workload.model_overrides)
    if workload.seq_len > args.max_seq_len:  # as the workers' build_model does
        args = args.replace(max_seq_len=workload.seq_len)
    errors = job_errors(
        spec,
        args,
        Layout(tp=tp, pp=pp, ep=ep),
        nproc,
        model_name=workload.model,
        names={**_LAYOUT_NAMES, "ep": "--ep"},
    )
    for flag, degree, what in (("--tp", tp, "tensor"), ("--pp", pp, "pipeline")):
        if degree > 1:
            errors.append(
                f"{flag} {degree}: the mixture-of-experts workload does not compose with "
                f"{what} parallelism; use {flag} 1"
            )
    if errors:  # every error, on the bench's one error line
        raise ValueError("; ".join(errors))


#: How ``simplefsdp bench`` spells each setting in error messages.
_LAYOUT_NAMES = {
    "world_size": "--nproc",
    "tp": "--tp",
    "pp": "--pp",
    "microbatches": "--microbatches",
    "batch": "--batch-size",
    "seq_len": "--seq-len",
    "cp": "--cp",
    "cp_backend": "--cp-backend",
}


def _check_layout(
    nproc: int,
    tp: int,
    pp: int,
    schedule: str,
    microbatches: int,
    workload: Any,
    cp: int = 1,
    cp_backend: str = "allgather",
) -> None:
    """The degrees against the ranks and the workload's model: the one check of
    train, bench and plan (:func:`simplefsdp.engines.resolve.job_errors`).

    The bench runs the TP plan with sequence parallelism, and raises the
    model's ``max_seq_len`` to the workload's sequence where it is shorter.

    Raises:
        ValueError: every error, joined by "; ".
    """
    from simplefsdp.models.registry import resolve_flavor

    spec, args = resolve_flavor(workload.model, **workload.model_overrides)
    if workload.seq_len > args.max_seq_len:  # as the workers' build_model does
        args = args.replace(max_seq_len=workload.seq_len)
    errors = job_errors(
        spec,
        args,
        Layout(tp=tp, pp=pp, cp=cp),
        nproc,
        seq_len=workload.seq_len,
        sequence_parallel=True,
        batch=workload.batch_size,
        pp_schedule=schedule,
        microbatches=microbatches if pp > 1 else None,
        model_name=workload.model,
        names=_LAYOUT_NAMES,
        cp_backend=cp_backend,
    )
    if errors:  # every error, on the bench's one error line
        raise ValueError("; ".join(errors))


def _worker_env(nproc: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


#: Seconds between "still <phase>" lines while a phase lasts.
STILL_EVERY_S = 60.0


def launch_config(
    name: str,
    spec: BenchSpec,
    spec_path: Path,
    raw_dir: Path,
    on_phase: Callable[[str], None] | None = None,
) -> str | None:
    """Run configuration ``name`` in ``spec.nproc`` fresh processes.

    Args:
        on_phase: called with each phase its rank 0 reports (``compiling
            (...)``, ``measuring N steps``), and with ``still <phase> (N s)``
            every ``STILL_EVERY_S`` seconds while one lasts.

    Returns ``None`` on success, else an error message (the log's tail).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={spec.nproc}", "--max-restarts=0",
        "-m", "simplefsdp.bench.worker",
        "--config", name, "--spec", str(spec_path), "--out", str(raw_dir),
    ]  # fmt: skip
    log_path = raw_dir / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(spec.nproc)
        )
        try:
            rc = _wait_reporting(proc, spec.timeout_s, raw_dir / f"{name}{PHASE_SUFFIX}", on_phase)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return f"timed out after {spec.timeout_s:.0f} s (log: {log_path})"
        except BaseException:  # Ctrl-C or SIGTERM: Note: [Stopping a bench]
            _stop(proc)
            raise
    if rc != 0:
        return f"exit code {rc}: {_failure_reason(log_path)[:300]} (log: {log_path})"
    return None


def _wait_reporting(
    proc: subprocess.Popen,
    timeout_s: float,
    phase_file: Path,
    on_phase: Callable[[str], None] | None,
    poll_s: float = 0.5,
) -> int:
    """``proc.wait(timeout_s)``, passing each new phase in ``phase_file`` (and
    a ``still ...`` line every ``STILL_EVERY_S`` seconds of one) to ``on_phase``."""
    phase_file.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    current, since, said = "", time.monotonic(), time.monotonic()
    while True:
        try:
            rc = proc.wait(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
            phase_file.unlink(missing_ok=True)
            return rc
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        if on_phase is None:
            continue
        try:
            text = phase_file.read_text(encoding="utf-8").strip()
        except OSError:
            text = ""
        now = time.monotonic()
        if text and text != current:
            current, since, said = text, now, now
            on_phase(text)
        elif current and now - said >= STILL_EVERY_S:
            said = now
            on_phase(f"still {current.split(' (')[0]} ({now - since:.0f} s)")


def _descendants(pid: int) -> set[int]:
    """Process ids below ``pid`` at any depth (Linux ``/proc``; empty elsewhere)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the command may hold ")": the fields follow the last one
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Stop a configuration's launcher and its workers: SIGTERM lets the
    elastic agent stop its workers; after 30 s, force.

    A SIGTERM that reaches torchrun's agent while it is starting the workers
    (after it installed its handler, before it holds their process context)
    ends the agent without stopping the workers it already started, which
    run detached from it (setsid): the workers seen before the SIGTERM that
    outlive the agent are killed here (Note: [Stopping a bench]).
    """
    workers = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in workers | _descendants(proc.pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class _Terminated(Exception):
    """SIGTERM arrived (Note: [Stopping a bench])."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?[\w.]*(?:Error|Exception)\b.*:")


def _failure_reason(log_path: Path) -> str:
    """The first worker exception line of a failed run's log (not the
    launcher's ChildFailedError summary), else its last line."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    for line in lines:
        if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "no output"


def _load_ranks(name: str, raw_dir: Path, nproc: int) -> list[dict]:
    paths = [raw_dir / f"{name}.rank{r}.json" for r in range(nproc)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"missing result files: {', '.join(missing)}")
    return [json.loads(p.read_text()) for p in paths]


def _run_one(
    config: BenchConfig,
    spec: BenchSpec,
    spec_path: Path,
    raw_dir: Path,
    on_phase: Callable[[str], None] | None = None,
):
    """Launch one configuration and merge its ranks: (row or comm dict, error)."""
    for stale in raw_dir.glob(f"{config.name}.rank*.json"):
        stale.unlink()
    error = launch_config(config.name, spec, spec_path, raw_dir, on_phase)
    if error is None:
        try:
            ranks = _load_ranks(config.name, raw_dir, spec.nproc)
            if not get_engine(config.engine, bench=True).trains:
                return merge_comm_only(ranks), None
            return merge_ranks(config, ranks, spec.workload), None
        except (FileNotFoundError, KeyError, ValueError) as exc:
            error = f"could not read results: {exc}"
    if not get_engine(config.engine, bench=True).trains:
        return None, error
    return failed_row(config, error), error


def _env(spec: BenchSpec, rows: list[dict], wall_s: float) -> dict[str, Any]:
    import torch

    workload = spec.workload
    if torch.cuda.is_available():
        device = f"{spec.nproc} x {torch.cuda.get_device_name(0)} (nccl)"
        memory_method = "CUDA allocator peak (max_memory_allocated) above start-up"
    else:
        device = f"cpu ({os.cpu_count()} cores, gloo)"
        memory_method = "peak RSS above start-up baseline, glibc mmap threshold 64 KiB"
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "world_size": spec.nproc,
        "omp_num_threads": _worker_env(spec.nproc)["OMP_NUM_THREADS"],
        "workload": workload.name,
        "model": workload.model,
        "model_overrides": workload.model_overrides,
        "num_params": next((r["num_params"] for r in rows if r.get("num_params")), 0),
        "batch_size": workload.batch_size,
        "seq_len": workload.seq_len,
        "tp": spec.tp,
        "pp": spec.pp,
        "ep": spec.ep,
        "moe": _has_experts(workload.model),
        "pp_schedule": spec.pp_schedule if spec.pp > 1 else None,
        "microbatches": spec.microbatches if spec.pp > 1 else None,
        "grad_accum": spec.grad_accum,
        "param_dtype": spec.param_dtype or "float32",
        "tokens_per_step_per_rank": workload.batch_size
        * workload.seq_len
        * spec.grad_accum
        / (spec.tp * spec.pp),
        "steps": workload.steps,
        "warmup": workload.warmup,
        "seed": spec.seed,
        "lr": workload.lr,
        "memory_method": memory_method,
        "wall_s": wall_s,
    }


def _launch_order(configs: list[BenchConfig], rounds: int) -> list[tuple[int, BenchConfig]]:
    """(round, config) in running order: A B C, C B A, A B C, ... (Note: [Bench rounds])."""
    return [
        (r, config) for r in range(rounds) for config in (configs if r % 2 == 0 else configs[::-1])
    ]


def run_bench(
    configs: list[BenchConfig],
    spec: BenchSpec,
    out: Path,
    *,
    loss_rtol: float,
    rounds: int = 1,
) -> dict[str, Any]:
    """Run ``configs`` (``rounds`` times each, Note: [Bench rounds]) and the
    comm-only measurement; return the bench.json content."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    start = time.perf_counter()
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    spec_path = raw_dir / "spec.json"
    spec_path.write_text(spec.to_json())
    per_config: dict[str, list[dict]] = {c.name: [] for c in configs}
    comm_only = comm_only_error = None
    load_avg_1m: list[float] = []
    # The comm-only replay models data-parallel flat buffers over all ranks;
    # with tensor or pipeline parallelism that is not the step's communication.
    # Nor, for a mixture of experts, expert parameters on their own mesh.
    plain = spec.tp == 1 and spec.pp == 1 and not _has_experts(spec.workload.model)
    extra = [(0, COMM_ONLY)] if plain else []
    launches = [*_launch_order(configs, rounds), *extra]
    failed: set[str] = set()
    for i, (r, config) in enumerate(launches):
        if config.name in failed:  # a failure is the row: do not run it again
            continue
        t0 = time.perf_counter()
        # Other processes on the machine slow every measurement: record it.
        load_avg_1m.append(round(os.getloadavg()[0], 2))
        in_rounds = rounds > 1 and get_engine(config.engine, bench=True).trains
        label = config.name + (f" (round {r + 1}/{rounds})" if in_rounds else "")
        prefix = f"[{i + 1}/{len(launches)}] {label}:"
        print(f"{prefix} starting {spec.nproc} processes", flush=True)
        round_dir = raw_dir / f"round{r + 1}" if in_rounds else raw_dir
        round_dir.mkdir(exist_ok=True)
        outcome, error = _run_one(
            config,
            spec,
            spec_path,
            round_dir,
            lambda text, prefix=prefix: print(f"{prefix} {text}", flush=True),
        )
        if not get_engine(config.engine, bench=True).trains:
            comm_only, comm_only_error = outcome, error
        else:
            outcome["load_avg_1m_before"] = load_avg_1m[-1]
            per_config[config.name].append(outcome)
            if error:
                failed.add(config.name)
        took = time.perf_counter() - t0
        if error:
            print(f"{prefix} FAILED ({took:.0f} s): {error}", flush=True)
        else:
            median = outcome["step_time_s_median"]
            print(f"{prefix} {median:.3f} s/step ({took:.0f} s)", flush=True)
    rows = [merge_rounds(per_config[c.name]) for c in configs]
    loss_check = check_losses(rows, loss_rtol)
    add_ratios(rows)
    limit = next((r for r in rows if r["name"] == "limit" and r["step_time_s_median"]), None)
    comm_s = comm_only["step_time_s_median"] if comm_only else None
    bound = None
    if limit and comm_s is not None:
        bound = max(limit["step_time_s_median"], comm_s)
    env = _env(spec, rows, time.perf_counter() - start)
    env["load_avg_1m_before_each"] = load_avg_1m
    env["rounds"] = rounds
    return {
        "env": env,
        "configs": rows,
        "comm_only_s": comm_s,
        "comm_only": comm_only,
        "comm_only_error": comm_only_error,
        "bound_s": bound,
        "loss_check": loss_check,
    }


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp bench``; returns the exit code.

    0 when every configuration and the communication-only run ran and the
    configurations agreed on the loss, 1 when one failed or was flagged, 2
    for a bad command line.
    """
    args = _build_parser().parse_args(argv)
    try:
        # The configurations first: their names need no torch (a family's
        # capabilities do: its spec imports torch).
        cuda = args.cp > 1 and _cuda()  # torch's context parallelism runs on CUDA only
        resolve_configs(args.configs, tp=args.tp, pp=args.pp, cp=args.cp, cuda=cuda)
        model = args.model or get_workload(args.workload).model
        configs = resolve_configs(
            args.configs, tp=args.tp, pp=args.pp, moe=_has_experts(model), cp=args.cp, cuda=cuda
        )
        spec = build_spec(args)
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    except ValueError as exc:
        print(f"simplefsdp bench: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    import torch

    if args.cp > 1 and not cuda and args.configs in (None, "all"):
        print(f"simplefsdp bench: fsdp2-torch-cp skipped: {TORCH_CP_ON_CPU}", flush=True)
    warning = oversubscription_warning(spec.nproc, cuda=torch.cuda.is_available())
    if warning:
        print(f"simplefsdp bench: warning: {warning}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # Note: [Stopping a bench]
    #     Ctrl-C reaches the whole foreground process group, but a signal sent
    #     to this process alone (``kill``, ``timeout -s INT``) does not reach
    #     torchrun's agent or its workers, which would train on, orphaned. On
    #     SIGINT or SIGTERM the running configuration's agent gets SIGTERM (it
    #     stops its workers), then SIGKILL after 30 s, and the command exits
    #     with one line and 128 + the signal's number, writing no results.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        result = run_bench(configs, spec, args.out, loss_rtol=args.loss_rtol, rounds=args.rounds)
    except (KeyboardInterrupt, _Terminated) as exc:
        sig = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
        print(
            f"simplefsdp bench: stopped by {sig.name}; its workers were stopped and no "
            f"results were written (logs in {args.out})",
            file=sys.stderr,
        )
        return 128 + sig
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    table = format_table(result)
    print(table)
    (args.out / "bench.txt").write_text(table + "\n")
    write_json(result, args.out / "bench.json")
    written = [str(args.out / "bench.json")]
    if args.no_png:
        pass
    elif write_png(result, args.out / "bench.png"):
        written.append(str(args.out / "bench.png"))
    else:
        print("matplotlib is not installed: bench.png skipped (pip install 'simplefsdp[bench]')")
    print("wrote " + ", ".join(written))
    ok = all(r["ok"] for r in result["configs"]) and result["comm_only_error"] is None
    return 0 if ok else 1


if __name__ == "__main__":
    exit_quickly(main())
