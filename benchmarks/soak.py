"""Soak: many consecutive compiled 2-rank trainings, counting native crashes.

Each *training* builds a small model (embedding, residual MLP blocks with
LayerNorm, head: 12-13-float shards and gathered outputs of 24-26 floats, the
sizes of the gloo all-gather crashes in docs/crashes.md), wraps it with ``simplefsdp.data_parallel``,
runs a few AdamW steps and checks that the loss is finite. Trainings run in
*sessions*: one ``run_distributed`` job of 2 ranks (gloo) that runs
``--per-session`` trainings back to back, so process start-up and, by
default, compilation are paid once per session and configuration:

- ``--recompile`` off (default): the model is compiled once per session and
  configuration; every training re-initialises its parameters (a new seed),
  builds a new optimizer and trains. All the runtime work of a training (the
  compiled forward and backward with their gloo collectives, the optimizer)
  is repeated; compilation is not.
- ``--recompile``: every training builds and compiles a new model
  (``torch._dynamo.reset()`` first). Slow with Inductor (our backend turns
  off the FX graph cache), but it repeats compilation too.

A configuration is ``BACKEND:RESHARD:BUCKETING``, e.g. ``inductor:1:auto``
(``BACKEND``: ``inductor``, ``aot_eager`` or ``eager_executor``;
``RESHARD``: 1 or 0; ``BUCKETING``: ``none``, ``auto``, ``per_block``; for
``eager_executor`` only ``per_block`` and ``none`` mean something). Each session
runs every configuration of ``--configs`` in turn.

A *crash* is a rank that died of a signal (SIGSEGV, SIGABRT, ...); the
session is then counted as failed and the next one starts; trainings that
completed before the crash still count (rank 0 records each in a progress
file). Exceptions and hangs are counted apart. glibc's checks for the ranks:

- ``--malloc-check``: ``LD_PRELOAD`` glibc's debug malloc
  (``libc_malloc_debug.so.0``, glibc >= 2.34) with ``MALLOC_CHECK_=3``: heap
  consistency checks on every malloc and free, abort on the first problem;
- ``--no-tcache``: ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0`` (small
  frees go to the fastbins, where glibc checks them);
- ``--perturb N``: ``MALLOC_PERTURB_=N`` (freed and new memory filled with a
  byte pattern, so use-after-free reads return garbage instead of old data).

``SIMPLEFSDP_GLOO_ALLGATHER_WORKAROUND=0`` in the environment runs without
simplefsdp's gloo all-gather workaround (docs/crashes.md). Other knobs:
``--no-reorder`` (no prefetching: every collective's wait comes
right after it), ``--steps``, ``--simdlen`` (Inductor's
``cpp.simdlen``). The summary (stdout, and JSON with ``--json``) holds the
counts per configuration: trainings completed, sessions, crashes (with
signal and the telling part of the crashed rank's standard error),
errors, hangs.

Usage::

    OMP_NUM_THREADS=1 nice -n 15 python benchmarks/soak.py --runs 1000 \\
        --configs aot_eager:1:none,aot_eager:0:auto,inductor:1:auto,inductor:0:none \\
        --malloc-check --no-tcache [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

BACKENDS = ("inductor", "aot_eager", "eager_executor")
DEBUG_MALLOC = "libc_malloc_debug.so.0"
VOCAB, DIM, SEQ, LOCAL_BATCH = 23, 12, 5, 2


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)  # 25 rows: 13-row shards, 26-row gathers
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(self.norm(x))))


class SoakModel(nn.Module):
    """Embedding -> 3 residual MLP blocks -> LayerNorm -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block(DIM) for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@dataclass(frozen=True)
class Config:
    backend: str
    reshard: bool
    bucketing: str

    @classmethod
    def parse(cls, text: str) -> Config:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in BACKENDS or parts[1] not in ("0", "1"):
            raise argparse.ArgumentTypeError(
                f"configuration {text!r}: want BACKEND:RESHARD:BUCKETING, e.g. inductor:1:auto"
            )
        return cls(parts[0], parts[1] == "1", parts[2])

    def __str__(self) -> str:
        return f"{self.backend}:{int(self.reshard)}:{self.bucketing}"


@dataclass
class Counts:
    trainings: int = 0
    sessions: int = 0
    crashes: int = 0
    errors: int = 0
    hangs: int = 0
    reports: list[str] = field(default_factory=list)


def _reinit(model: nn.Module, seed: int) -> None:
    """Fresh parameters (written into this rank's shards; deterministic per seed)."""
    import simplefsdp

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad(), simplefsdp.disable_parametrization():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(torch.randn(local.shape, generator=gen) * 0.2)


def _build(config: Config, options: dict) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    import simplefsdp

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = simplefsdp.data_parallel(SoakModel(), mesh, reshard_after_forward=config.reshard)
    if config.backend == "eager_executor":
        bucketing = "per_block" if config.bucketing == "auto" else config.bucketing
        if bucketing == "none":
            bucketing = [[name] for name, _ in model.named_modules() if name]
        simplefsdp.eager(model, bucketing)
    else:
        simplefsdp.compile(
            model,
            backend=config.backend,
            bucketing=config.bucketing,
            reorder=options["reorder"],
        )
    return model


def _train(model: nn.Module, seed: int, steps: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    _reinit(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(10_000 + seed)
    loss = torch.zeros(())
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ + 1), generator=gen)
        local = tokens[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        logits = model(local[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"training {seed}: loss {value}")
    return value


def _session(configs: list[Config], per_session: int, first_seed: int, options: dict) -> int:
    """One rank's share of a session; rank 0 appends one line per training
    to the progress file. Returns the number of trainings run."""
    if options["simdlen"] is not None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = options["simdlen"]
    models: dict[Config, nn.Module] = {}
    done = 0
    for i in range(per_session):
        config = configs[i % len(configs)]
        if options["recompile"] or config not in models:
            if options["recompile"]:
                models.clear()
                torch._dynamo.reset()
            models[config] = _build(config, options)
        _train(models[config], first_seed + i, options["steps"])
        done += 1
        if dist.get_rank() == 0:
            with open(options["progress"], "a") as f:
                f.write(f"{config}\n")
    return done


def _rank_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    if args.malloc_check:
        env["LD_PRELOAD"] = DEBUG_MALLOC
        env["MALLOC_CHECK_"] = "3"
    if args.no_tcache:
        env["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=0"
    if args.perturb:
        env["MALLOC_PERTURB_"] = str(args.perturb)
    return env


def _classify(exc: BaseException) -> str:
    from simplefsdp.testing import RankCrashed

    if isinstance(exc, RankCrashed):
        return "crash"
    if isinstance(exc, TimeoutError):
        return "hang"
    if re.search(r"died with exit code -\d+ \(SIG", str(exc)):
        return "crash"  # a crash that followed another rank's exception
    return "error"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="trainings in all")
    parser.add_argument(
        "--configs",
        type=lambda s: [Config.parse(c) for c in s.split(",")],
        default=[Config.parse(c) for c in ("aot_eager:1:none", "inductor:1:auto")],
        help="comma-separated BACKEND:RESHARD:BUCKETING",
    )
    parser.add_argument("--per-session", type=int, default=50, help="trainings per 2-rank job")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per training")
    parser.add_argument("--recompile", action="store_true", help="compile every training anew")
    parser.add_argument("--no-reorder", action="store_true", help="wait right after collectives")
    parser.add_argument("--simdlen", type=int, default=None, help="Inductor cpp.simdlen")
    parser.add_argument("--malloc-check", action="store_true", help="glibc debug malloc")
    parser.add_argument("--no-tcache", action="store_true", help="tcache_count=0")
    parser.add_argument("--perturb", type=int, default=0, help="MALLOC_PERTURB_ byte (0: off)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per session")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.per_session < 1 or args.steps < 1:
        parser.error("--runs, --per-session and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from simplefsdp.testing import run_distributed

    args = _parse(argv)
    os.environ.update(_rank_env(args))  # spawned ranks inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    counts = {str(c): Counts() for c in args.configs}
    start, seed = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="simplefsdp-soak-") as tmp:
        progress = os.path.join(tmp, "progress")
        options = {
            "reorder": not args.no_reorder,
            "recompile": args.recompile,
            "simdlen": args.simdlen,
            "steps": args.steps,
            "progress": progress,
        }
        total = 0
        while total < args.runs:
            n = min(args.per_session, args.runs - total)
            open(progress, "w").close()
            outcome, report = "ok", ""
            try:
                run_distributed(
                    _session,
                    2,
                    args=(args.configs, n, seed, options),
                    timeout_s=args.timeout,
                    crash_retries=0,
                )
            except (RuntimeError, TimeoutError) as exc:
                outcome, report = _classify(exc), str(exc)
            with open(progress) as f:
                finished = [line.strip() for line in f if line.strip()]
            for name in finished:
                counts[name].trainings += 1
            # The configuration that was running when the session ended.
            current = str(args.configs[len(finished) % len(args.configs)])
            for name in {str(c) for c in args.configs[: min(n, len(args.configs))]}:
                counts[name].sessions += 1
            if outcome != "ok":
                bucket = counts[current]
                if outcome == "crash":
                    bucket.crashes += 1
                elif outcome == "hang":
                    bucket.hangs += 1
                else:
                    bucket.errors += 1
                bucket.reports.append(report[-4000:])
            total += max(len(finished), 1) if outcome == "ok" else len(finished) + 1
            seed += n
            elapsed = time.monotonic() - start
            print(
                f"[soak] {total}/{args.runs} trainings, {elapsed:.0f}s; session: {outcome}, "
                f"{len(finished)}/{n} finished"
                + (f" (while {current})" if outcome != "ok" else ""),
                flush=True,
            )
            if outcome != "ok":
                print(report[-2000:], file=sys.stderr, flush=True)
    summary = {
        "runs": args.runs,
        "seconds": round(time.monotonic() - start, 1),
        "rank_env": _rank_env(args),
        "options": {k: v for k, v in options.items() if k != "progress"},
        "configs": {name: asdict(c) for name, c in counts.items()},
    }
    print(f"{'configuration':<24} {'trainings':>9} {'crashes':>7} {'errors':>6} {'hangs':>5}")
    for name, c in counts.items():
        print(f"{name:<24} {c.trainings:>9} {c.crashes:>7} {c.errors:>6} {c.hangs:>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if any(c.crashes or c.errors or c.hangs for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
