"""A parallel layout of a training job and its validation (``simplefsdp plan``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from simplefsdp.models.llama3 import ModelArgs

ENGINES = ("simplefsdp", "fsdp2")
BUCKETINGS = ("auto", "per_block", "none")
AC_MODES = ("none", "selective", "full")
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Layout:
    """A parallel layout and its options. ``batch`` is per data-parallel rank
    per step (split into ``microbatches`` under pipeline parallelism)."""

    gpus: int
    batch: int
    seq: int
    tp: int = 1
    pp: int = 1
    ac: str = "selective"
    microbatches: int = 1
    reshard_after_forward: bool = True
    bucketing: str = "auto"
    engine: str = "simplefsdp"
    dtype: str = "bf16"  # bf16: bf16 compute and gathers, fp32 reduce; fp32: all fp32

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.dtype != "bf16":
            parts.append(self.dtype)
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp} m{self.microbatches}")
        elif self.microbatches > 1:  # gradient accumulation
            parts.append(f"accum{self.microbatches}")
        parts += [
            f"ac={self.ac}",
            "per_block" if self.engine == "fsdp2" else self.bucketing,
            "reshard" if self.reshard_after_forward else "no-reshard",
        ]
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(args: ModelArgs, layout: Layout) -> None:
    """One-line ``ValueError`` naming the bad value and what would be valid."""
    if layout.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {layout.gpus}")
    if layout.engine not in ENGINES:
        raise ValueError(f"unknown engine {layout.engine!r}; valid: {', '.join(ENGINES)}")
    if layout.bucketing not in BUCKETINGS:
        raise ValueError(f"unknown bucketing {layout.bucketing!r}; valid: {', '.join(BUCKETINGS)}")
    if layout.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {layout.dtype!r}; valid: {', '.join(DTYPES)}")
    if layout.ac not in AC_MODES:
        raise ValueError(f"unknown --ac {layout.ac!r}; valid: {', '.join(AC_MODES)}")
    for name, value in (
        ("--batch", layout.batch),
        ("--seq", layout.seq),
        ("--tp", layout.tp),
        ("--pp", layout.pp),
        ("--microbatches", layout.microbatches),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if layout.gpus % (layout.tp * layout.pp):
        raise ValueError(
            f"--gpus {layout.gpus} is not divisible by tp*pp = {layout.tp}*{layout.pp}; "
            f"valid tp*pp: {', '.join(map(str, _divisors(layout.gpus)))}"
        )
    if layout.seq > args.max_seq_len:
        raise ValueError(f"--seq {layout.seq} exceeds the model's max_seq_len {args.max_seq_len}")
    if layout.tp > 1:
        valid = [d for d in _divisors(math.gcd(args.n_heads, args.n_kv_heads)) if d > 1]
        if args.n_kv_heads % layout.tp or args.n_heads % layout.tp:
            raise ValueError(
                f"--tp {layout.tp} does not divide n_heads={args.n_heads} and "
                f"n_kv_heads={args.n_kv_heads}; valid --tp: 1, {', '.join(map(str, valid))}"
            )
        if layout.seq % layout.tp:
            raise ValueError(
                f"--seq {layout.seq} is not divisible by --tp {layout.tp} (sequence parallelism)"
            )
    if layout.pp > args.n_layers:
        raise ValueError(
            f"--pp {layout.pp} exceeds n_layers={args.n_layers}; valid: 1..{args.n_layers}"
        )
    if layout.pp > 1 and layout.microbatches < layout.pp:
        raise ValueError(
            f"--microbatches {layout.microbatches} is below --pp {layout.pp} "
            f"(1F1B needs at least one microbatch per stage)"
        )
    if layout.batch % layout.microbatches:
        least = layout.pp if layout.pp > 1 else 1
        valid = [d for d in _divisors(layout.batch) if d >= least]
        fix = (
            f"valid --microbatches: {', '.join(map(str, valid))}"
            if valid
            else f"use a --batch that is a multiple of {layout.microbatches}"
        )
        raise ValueError(
            f"--batch {layout.batch} is not divisible by --microbatches "
            f"{layout.microbatches}; {fix}"
        )
