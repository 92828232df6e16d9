"""A parallel layout of a training job and its validation (``simplefsdp plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simplefsdp.engines.kinds import ENGINE_CLASSES, get_engine
from simplefsdp.engines.resolve import job_errors
from simplefsdp.layout import Layout as Degrees
from simplefsdp.layout.pipeline import num_stages
from simplefsdp.parallel_dims import AC_MODES, BUCKETINGS, ACMode, Bucketing, Engine

#: The engines whose step ``simplefsdp plan`` predicts (those declared ``plannable``).
ENGINES: tuple[Engine, ...] = tuple(c.name for c in ENGINE_CLASSES if c.plannable)  # type: ignore[misc]
DTYPES = ("bf16", "fp32")


#: How ``simplefsdp plan`` spells each setting in error messages.
_LAYOUT_NAMES = {
    "world_size": "--gpus",
    "engine": "--engine",
    "tp": "--tp",
    "pp": "--pp",
    "microbatches": "--microbatches",
    "batch": "--batch",
    "seq_len": "--seq",
    "max_seq_len": 'max_seq_len with --config FILE.json (holding {"max_seq_len": N})',
    "float8": "--float8",
    "cp": "--cp",
    "loss_parallel": "--loss-parallel",
    "pp_schedule": "--pp-schedule",
    "stages_per_rank": "--stages-per-rank",
}


#: Context-parallel attention ``simplefsdp plan`` predicts: simplefsdp's
#: ``allgather`` (default) and ``ulysses`` backends, and torch's
#: context_parallel (what torchtitan runs).
CP_BACKENDS = ("allgather", "ulysses", "torch")

#: How FSDP2 groups the parameters outside the blocks (``Layout.fsdp2_root``):
#: ``split``, the embedding a group of its own, resharded after forward, and
#: the final norm with the output one kept gathered from forward into
#: backward (the fsdp2 engine's grouping, torchtitan's ``apply_fsdp`` from
#: pytorch/torchtitan#1094 on); ``whole``, one root group (embedding, final
#: norm, output) gathered from its forward to the end of backward (torchtitan
#: before that, and the fsdp2 engine with tied embeddings).
FSDP2_ROOTS = ("split", "whole")


def cp_describe(cp: int, backend: str) -> str:
    """A layout's context-parallel part (``cp2``, ``cp2 torch``; the default
    backend unnamed)."""
    return f"cp{cp}" + (f" {backend}" if backend != "allgather" else "")


def cp_mask_queries(seq: int, cp: int, backend: str) -> int:
    """The rows of the boolean mask simplefsdp's masked backends pass SDPA
    (against all ``seq`` keys): this rank's ``seq / cp`` queries
    (``allgather``), the whole sequence (``ulysses``), none (``torch``, or no
    context parallelism)."""
    if cp == 1 or backend == "torch":
        return 0
    return seq if backend == "ulysses" else seq // cp


def cp_mask_note(seq: int, queries: int, backend: str) -> str:
    """The plan's note on a masked backend's attention."""
    return (
        f"context parallel attention ({backend}): SDPA with a {queries} x {seq} boolean mask "
        f"and its bf16 bias ({3 * queries * seq / 2**30:.2f} GiB per attention), the "
        "memory-efficient kernel over every query-key pair; --cp-backend torch plans torch's "
        "flash-attention ring"
    )


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
    # Context parallelism: each of ``cp`` ranks holds 1/cp of every sequence;
    # FSDP shards over dp x cp.
    cp: int = 1
    # How attention reaches the other CP ranks' keys (``CP_BACKENDS``):
    # simplefsdp's ``allgather`` and ``ulysses`` backends (SDPA with a boolean
    # mask), or ``torch``: torch's context_parallel (a ring of
    # flash-attention blocks; torchtitan's).
    cp_backend: str = "allgather"
    # The loss compiled (Inductor): the fp32 upcast, log-softmax and NLL of
    # the logits fused, none of their fp32 tensors materialised (Note: [Plan
    # model]); else the loss runs eager, as traced.
    fused_loss: bool = False
    # fsdp2 with each block compiled in place (``--parallel.engine fsdp2
    # --compile.enable true``, torchtitan's "FSDP + torch.compile"): Inductor's
    # fused kernels and the compiled step's activations under FSDP2's
    # per-block groups and hooks. simplefsdp is always planned compiled.
    compile: bool = False
    # Async TP (torchtitan's ``enable_async_tensor_parallel``, torch's
    # micro-pipelined TP under compile): each sequence-parallel all-gather
    # and reduce-scatter split into ``tp`` chunks that overlap the matmuls
    # they feed or read. simplefsdp train runs TP's collectives whole.
    async_tp: bool = False
    # The pipeline's schedule (``PIPELINE_SCHEDULES``: gpipe, 1f1b,
    # interleaved_1f1b) and the stages each rank holds (``None``: the
    # schedule's default, 2 interleaved, else 1).
    pp_schedule: str = "1f1b"
    stages_per_rank: int | None = None
    # FSDP2's grouping of the parameters outside the blocks (FSDP2_ROOTS).
    fsdp2_root: str = "split"
    # Selective AC keeps the attention's output. False models an op list
    # that does not name the kernel the run uses (torchtitan of 2025-08 puts
    # cuDNN's attention first on B200s; its list names flash's and the
    # memory-efficient one): every block's attention is recomputed.
    attention_saved: bool = True
    # The caching allocator maps pages into one growing segment per pool
    # and stream (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which
    # torchtitan's run_train.sh sets) rather than reserving fixed segments,
    # its default (Note: [Caching allocator simulation]).
    expandable_segments: bool = False

    @property
    def stages_of_rank(self) -> int:
        """The pipeline stages each rank holds (1 without a pipeline)."""
        if self.pp == 1:
            return 1
        return num_stages(self.pp, self.pp_schedule, self.stages_per_rank) // self.pp

    @property
    def compiled(self) -> bool:
        """The step's kernels are compiled (fused chains of non-matmul ops,
        the partitioner's activations): simplefsdp, or fsdp2 with ``compile``."""
        return self.compile or get_engine(self.engine).fused_buckets

    @property
    def dp(self) -> int:
        """Data-parallel ranks (distinct batches): the GPUs over tp, pp and cp."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def fsdp(self) -> int:
        """The ranks FSDP shards over: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def degrees(self) -> Degrees:
        """The degrees as the job's :class:`simplefsdp.layout.Layout` (dp_shard: the rest)."""
        return Degrees(tp=self.tp, pp=self.pp, cp=self.cp)

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.dtype != "bf16":
            parts.append(self.dtype)
        if self.float8:
            parts.append("float8")
        if self.tp > 1:
            parts.append(
                f"tp{self.tp}"
                + (" async" if self.async_tp else "")
                + (" loss-parallel" if self.loss_parallel else "")
            )
        if self.cp > 1:
            parts.append(cp_describe(self.cp, self.cp_backend))
        if self.fused_loss:
            parts.append("fused-loss")
        parts += pipeline_describe(self)
        parts += [
            f"ac={self.ac}",
            "per_block" if get_engine(self.engine).fsdp2_runtime else self.bucketing,
            *(
                ["compiled blocks"]
                if self.compile and not get_engine(self.engine).fused_buckets
                else []
            ),
            "reshard" if self.reshard_after_forward else "no-reshard",
        ]
        if get_engine(self.engine).fsdp2_runtime and self.fsdp2_root != "split":
            parts.append(f"{self.fsdp2_root}-root")
        if not self.attention_saved and self.ac == "selective":
            parts.append("attention-recomputed")
        if self.expandable_segments:
            parts.append("expandable")
        return " ".join(parts)


def pipeline_describe(layout: Any) -> list[str]:
    """The pipeline's (or gradient accumulation's) words of a layout's
    one-line description: ``pp8 m8``, ``interleaved_1f1b v2``, ``accum2``."""
    if layout.pp > 1:
        parts = [f"pp{layout.pp} m{layout.microbatches}"]
        if layout.pp_schedule != "1f1b":
            parts.append(f"{layout.pp_schedule} v{layout.stages_of_rank}")
        return parts
    return [f"accum{layout.microbatches}"] if layout.microbatches > 1 else []


def _spec_of(args: Any) -> Any:
    """The model family whose configuration ``args`` is."""
    from simplefsdp.models.registry import family_names, get_spec

    for family in family_names():
        spec = get_spec(family)
        if isinstance(args, spec.config_type):
            return spec
    raise ValueError(f"no model family has the configuration type {type(args).__name__}")


def check_engine(name: str) -> None:
    """A ``ValueError`` (one line, the valid names) unless ``simplefsdp plan``
    predicts engine ``name``."""
    try:
        plannable = get_engine(name).plannable
    except ValueError:
        plannable = False
    if not plannable:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(ENGINES)}")


def check_fsdp2_root(root: str, engine: str) -> None:
    """A one-line ``ValueError`` for an unknown ``--fsdp2-root``, or one
    other than the default for an engine without FSDP2's groups."""
    if root not in FSDP2_ROOTS:
        raise ValueError(f"unknown --fsdp2-root {root!r}; valid: {', '.join(FSDP2_ROOTS)}")
    if root != FSDP2_ROOTS[0] and not get_engine(engine).fsdp2_runtime:
        raise ValueError(
            f"--fsdp2-root {root} groups FSDP2's parameters; --engine {engine} has no such "
            "groups (use it with --engine fsdp2)"
        )


def validate(args: Any, layout: Layout) -> None:
    """One-line ``ValueError`` naming the first bad value and what would be valid.

    The options here, then the one check of train and bench
    (:func:`simplefsdp.engines.resolve.job_errors`: the degrees, the model
    against them, the engine; a 1F1B pipeline, the TP plan with sequence
    parallelism).
    """
    check_engine(layout.engine)
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
    for name, value in (("--batch", layout.batch), ("--seq", layout.seq), ("--cp", layout.cp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rest = layout.tp * layout.pp
    if layout.cp > 1 and (layout.gpus % (rest * layout.cp) or layout.gpus < rest * layout.cp):
        valid = [c for c in range(1, layout.gpus // rest + 1) if layout.gpus % (rest * c) == 0]
        raise ValueError(
            f"--cp {layout.cp} does not divide the {layout.gpus} GPUs over tp x pp = {rest}; "
            f"valid --cp: {', '.join(map(str, valid))}"
        )
    if layout.async_tp and layout.tp == 1:
        raise ValueError("--async-tp overlaps tensor-parallel collectives; it needs --tp > 1")
    if layout.async_tp and not layout.compiled:
        raise ValueError(
            f"--async-tp is a compiler pass; --engine {layout.engine} runs eager here "
            "(valid: --engine simplefsdp, or --engine fsdp2 with --compile)"
        )
    if layout.pp == 1 and (layout.pp_schedule != "1f1b" or layout.stages_per_rank is not None):
        flag = "--stages-per-rank" if layout.stages_per_rank is not None else "--pp-schedule"
        raise ValueError(f"{flag} schedules a pipeline; it needs --pp > 1")
    check_fsdp2_root(layout.fsdp2_root, layout.engine)
    if layout.cp_backend not in CP_BACKENDS:
        raise ValueError(
            f"--cp-backend {layout.cp_backend!r} is not planned; valid: {', '.join(CP_BACKENDS)}"
        )
    if layout.cp > 1 and layout.seq % (2 * layout.cp):
        raise ValueError(
            f"--seq {layout.seq} does not split over --cp {layout.cp} (load-balanced causal "
            f"attention needs a multiple of 2 * cp = {2 * layout.cp})"
        )
    spec = _spec_of(args)
    if layout.async_tp and not spec.sequence_parallel:
        raise ValueError(
            "--async-tp overlaps sequence parallelism's all-gathers and reduce-scatters with "
            f"their matmuls; the {spec.family} family's TP plan has none (it all-reduces): "
            "plan it without --async-tp"
        )
    # A family that does not declare context parallelism yet is planned with
    # cp folded into FSDP's degree (the note of the prediction says so).
    degrees = layout.degrees if spec.supports("cp") else Degrees(tp=layout.tp, pp=layout.pp)
    errors = job_errors(
        spec,
        args,
        degrees,
        layout.gpus,
        layout.engine,
        float8=layout.float8,
        seq_len=layout.seq,
        sequence_parallel=spec.sequence_parallel,
        loss_parallel=layout.loss_parallel and layout.tp > 1,
        batch=layout.batch,
        microbatches=layout.microbatches,
        pp_schedule=layout.pp_schedule,
        stages_per_rank=layout.stages_per_rank,
        build=False,  # planned, not built
        names=_LAYOUT_NAMES,
    )
    if errors:  # the first, on one line: what plan prints
        raise ValueError(errors[0])
