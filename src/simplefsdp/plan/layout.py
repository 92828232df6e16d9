"""A parallel layout of a training job and its validation (``simplefsdp plan``)."""

from __future__ import annotations

from dataclasses import dataclass

from simplefsdp.models.llama3 import ModelArgs
from simplefsdp.parallel_dims import AC_MODES, BUCKETINGS, ACMode, Bucketing, Engine, ParallelDims

#: The engines whose step ``simplefsdp plan`` predicts.
ENGINES: tuple[Engine, ...] = ("simplefsdp", "fsdp2")
DTYPES = ("bf16", "fp32")

__all__ = ["AC_MODES", "BUCKETINGS", "DTYPES", "ENGINES", "Layout", "validate"]

#: How ``simplefsdp plan`` spells each degree of :class:`ParallelDims`.
_LAYOUT_NAMES = {
    "world_size": "--gpus",
    "tp": "--tp",
    "pp": "--pp",
    "microbatches": "--microbatches",
    "batch": "--batch",
    "seq_len": "--seq",
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout and its options. ``batch`` is per data-parallel rank
    per step (split into ``microbatches`` under pipeline parallelism)."""

    gpus: int
    batch: int
    seq: int
    tp: int = 1
    pp: int = 1
    ac: ACMode = "selective"
    microbatches: int = 1
    reshard_after_forward: bool = True
    bucketing: Bucketing = "auto"
    engine: Engine = "simplefsdp"
    dtype: str = "bf16"  # bf16: bf16 compute and gathers, fp32 reduce; fp32: all fp32
    # torchao float8 training (tensorwise scaling, float8 all-gather) of the
    # linears torchtitan converts: every one but the output layer.
    float8: bool = False
    # With tp > 1: the logits stay sharded over the vocabulary for the loss.
    loss_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.dtype != "bf16":
            parts.append(self.dtype)
        if self.float8:
            parts.append("float8")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + (" loss-parallel" if self.loss_parallel else ""))
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


def validate(args: ModelArgs, layout: Layout) -> None:
    """One-line ``ValueError`` naming the bad value and what would be valid.

    The options here, the degrees in :meth:`ParallelDims.validate` (a 1F1B
    pipeline, the Llama 3 TP plan with sequence parallelism).
    """
    if layout.engine not in ENGINES:
        raise ValueError(f"unknown engine {layout.engine!r}; valid: {', '.join(ENGINES)}")
    if layout.bucketing not in BUCKETINGS:
        raise ValueError(f"unknown bucketing {layout.bucketing!r}; valid: {', '.join(BUCKETINGS)}")
    if layout.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {layout.dtype!r}; valid: {', '.join(DTYPES)}")
    if layout.float8 and layout.dtype != "bf16":
        raise ValueError(
            f"--float8 trains with bf16 mixed precision; got --dtype {layout.dtype!r} "
            "(valid with --float8: bf16)"
        )
    if layout.ac not in AC_MODES:
        raise ValueError(f"unknown --ac {layout.ac!r}; valid: {', '.join(AC_MODES)}")
    for name, value in (("--batch", layout.batch), ("--seq", layout.seq)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    dims = ParallelDims(layout.gpus, tp=layout.tp, pp=layout.pp, microbatches=layout.microbatches)
    dims.validate(
        args,
        batch=layout.batch,
        seq_len=layout.seq,
        sequence_parallel=True,
        loss_parallel=layout.loss_parallel and layout.tp > 1,
        names=_LAYOUT_NAMES,
    )
