"""The sections of a ``simplefsdp train`` job config, their choices and :func:`validate_config`.

Pure data and checks: this module imports neither torch nor the rest of
simplefsdp but the torch-free vocabulary of :mod:`simplefsdp.parallel_dims`
and the engines' declarations (:mod:`simplefsdp.engines.kinds`), so a config
can be validated before anything heavy is loaded. The schema owns types and
ranges and asks the engines what composes; the degrees against the world,
the model against the layout and the pipeline settings are checked by
:func:`simplefsdp.train.resolve.resolve` before any process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from simplefsdp.engines.kinds import composition_errors, get_engine
from simplefsdp.models.registry import flavor_names
from simplefsdp.parallel_dims import (
    AC_MODES,
    BUCKETINGS,
    COMPILE_BACKENDS,
    DATA_PARALLEL_MODES,
    ENGINES,
    PIPELINE_SCHEDULES,
    ACMode,
    Bucketing,
    CompileBackend,
    DataParallelMode,
    Engine,
    PipelineSchedule,
)

#: Names of the model flavors ``model.name`` may refer to (canonical names,
#: then the accepted aliases; :mod:`simplefsdp.models.registry`).
VALID_MODELS: tuple[str, ...] = flavor_names(aliases=True)
#: Load balancing of a mixture-of-experts model (``model.load_balance``).
#: ``"auto"`` keeps the model's own.
LOAD_BALANCE_MODES: tuple[str, ...] = ("auto", "bias", "aux_loss", "none")
#: Data-parallel sharding modes (``parallel.mode``).
PARALLEL_MODES = DATA_PARALLEL_MODES
#: Pipeline schedules (``parallel.pp_schedule``), torch's GPipe, 1F1B and interleaved 1F1B.
PP_SCHEDULES = PIPELINE_SCHEDULES
#: Mixed-precision dtypes (``None`` means "keep the parameter dtype").
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: Attention across context-parallel ranks (simplefsdp.context_parallel.BACKENDS).
CP_BACKENDS: tuple[str, ...] = ("allgather", "ring", "ulysses")
#: Communication bucketing strategies of the compiler passes.
BUCKETING_MODES = BUCKETINGS
#: How checkpoints are written (``checkpoint.async_mode``); see Note:
#: [Asynchronous checkpoints] in the ``simplefsdp.checkpoint`` package.
CHECKPOINT_ASYNC_MODES: tuple[str, ...] = ("none", "async", "staged")
#: torchao float8 recipes (``float8.recipe``).
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")


def _choices(values: tuple[str, ...], *, optional: bool = False) -> dict[str, Any]:
    """Field metadata declaring the valid values of an enumeration field."""
    return {"choices": values, "optional": optional}


def suggest(name: str, candidates: list[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """Which model to train: a flavor of a registered model family.

    Attributes:
        name: One of :data:`VALID_MODELS` (a flavor of
            :mod:`simplefsdp.models.registry`); flavors whose family cannot
            build them are refused before any process starts.
        vocab_size: Overrides the model's vocabulary size (``None``: use the
            tokenizer's / model's own).
        max_seq_len: Overrides the model's maximum sequence length.
        load_balance: Mixture-of-experts models only; ``"auto"`` (the
            default) keeps the model's own (its flavor's, or its Hugging Face folder's:
            ``moe`` and ``deepseek_v3`` flavors route with ``"bias"``,
            Qwen3-MoE with ``"aux_loss"``, GPT-OSS with ``"none"``), else one
            of :data:`LOAD_BALANCE_MODES`: ``"bias"`` (DeepSeek-V3's
            auxiliary-loss-free routing bias, updated after every optimizer
            step from the tokens each expert received on all ranks),
            ``"aux_loss"`` (a switch-style auxiliary loss whose gradient
            trains the router) or ``"none"``.
    """

    name: str = field(default="debug", metadata=_choices(VALID_MODELS))
    vocab_size: int | None = None
    max_seq_len: int | None = None
    load_balance: str = field(default="auto", metadata=_choices(LOAD_BALANCE_MODES))


@dataclass
class DataConfig:
    """Training data.

    Attributes:
        path: A text file or a folder of text files (read recursively), or
            a folder of token shards written by ``simplefsdp data prepare``
            (memory-mapped); ``None`` uses the embedded corpus (this Python's
            stdlib sources).
        seq_len: Tokens per training sequence.
        batch_size: Per-rank micro-batch size (sequences).
        val_fraction: Fraction of documents held out for validation, in [0, 1).
        tokenizer: ``"byte"`` or a path to a local ``tokenizer.json`` / Hugging
            Face tokenizer directory.
        max_bytes: Cap on the bytes read from the corpus (``None``: 8 MB for
            the embedded stdlib corpus, unlimited for a user ``path``).
        text_field: The field of each JSON Lines record (``.jsonl``,
            ``.ndjson``) and the column of a Parquet file (``.parquet``, needs
            ``pyarrow``) that holds the text; other files are read as text.
        mask_document_boundaries: Leave out of the loss the targets that
            follow an end-of-document token inside a sequence (the first
            token of the next document, predicted from another document),
            and let attention stay inside each packed document
            (block-causal). Not with ``parallel.pp``.
        restart_positions: With ``mask_document_boundaries``, rotary
            positions restart at 0 in each document; ``false`` (the default,
            as torchtitan's Llama 3) counts them along the packed sequence.
    """

    path: str | None = None
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.05
    tokenizer: str = "byte"
    max_bytes: int | None = None
    text_field: str = "text"
    mask_document_boundaries: bool = False
    restart_positions: bool = False


@dataclass
class TrainingConfig:
    """Optimisation.

    Attributes:
        steps: Number of optimizer steps.
        lr: Peak learning rate (AdamW).
        min_lr_ratio: Final learning rate of the cosine decay, as a fraction of ``lr``.
        warmup_steps: Linear warm-up steps.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_norm: Gradient-norm clipping threshold; ``0`` disables clipping.
        grad_accum_steps: Micro-batches accumulated per optimizer step.
        seed: Seed for model initialisation and data order.
        deterministic: Request deterministic algorithms from PyTorch.
    """

    steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_norm: float = 1.0
    grad_accum_steps: int = 1
    seed: int = 0
    deterministic: bool = False


@dataclass
class ParallelConfig:
    """Data and tensor parallelism.

    Attributes:
        engine: One of :data:`ENGINES`: ``simplefsdp`` (``data_parallel``, plus
            ``simplefsdp.compile`` when ``compile.enable``), ``simplefsdp_eager``
            (``data_parallel`` plus the eager executor; never compiled,
            ``compile.enable``/``compile.backend`` are ignored), ``fsdp2``
            (torch ``fully_shard`` per block and on the root), ``ddp``
            (``DistributedDataParallel``) or ``replica`` (each rank trains its
            own full copy, no gradient sync: the single-device limit).
        mode: One of :data:`PARALLEL_MODES` (``ddp`` and ``replica`` support
            ``replicate`` only).
        mesh_shape: ``[replicate, shard]`` sizes for ``hybrid_shard``
            (``None``: chosen by the trainer).
        reshard_after_forward: Free gathered parameters after the forward pass;
            an int ``N`` >= 2 keeps a 1/N piece and regathers in backward over
            groups of N ranks, e.g. within a node (``data_parallel``'s and
            FSDP2's int form; engines ``simplefsdp`` compiled and ``fsdp2``).
        param_dtype: Compute dtype of parameters (``None``: unchanged).
        reduce_dtype: Gradient reduction dtype (``None``: the ``param_dtype``).
        tp: Tensor-parallel size: each group of ``tp`` ranks splits every
            block's attention heads and feed-forward (the model family's
            tensor-parallel plan, ``ModelSpec.tensor_parallel``; a
            mixture-of-experts layer's routed experts over their hidden dim);
            the data-parallel dims cover ``world_size / tp`` ranks. Engines
            ``simplefsdp`` and ``fsdp2`` only.
        sequence_parallel: With ``tp > 1``, shard the norms' activations along
            the sequence (``data.seq_len`` must divide by ``tp``).
        loss_parallel: With ``tp > 1``, keep the logits sharded over the
            vocabulary and compute the cross-entropy on the shards.
        pp: Pipeline-parallel size: the model's layers are split into
            stages over ``pp`` groups of ranks (outermost mesh dim), each
            stage sharded on the remaining data-parallel (and ``tp``) dims.
            Engines ``simplefsdp`` and ``fsdp2`` only.
        pp_schedule: One of :data:`PP_SCHEDULES` (torch's schedules).
        microbatches: Micro-batches per pipeline step (``data.batch_size``
            must divide by it; ``None``: ``pp``).
        pp_stages_per_rank: Stages per pipeline rank (``None``: 2 for
            ``interleaved_1f1b``, else 1).
        check_ranks: After each forward that runs outside one compiled graph
            (engine ``simplefsdp`` with ``compile.enable false``, and
            ``simplefsdp_eager``), check that every rank gathered the same
            parameters, raising ``simplefsdp.RankDivergenceError`` before
            backward where they did not (``data_parallel``'s
            ``check_ranks``); ``false`` saves its one small all-reduce per
            forward.
        ep: Expert-parallel size (mixture-of-experts models): groups of
            ``ep`` data-parallel ranks each hold ``num_experts / ep`` of every
            MoE layer's experts and exchange tokens by all-to-all; expert
            parameters are sharded over the ``world_size / ep`` ranks that
            hold the same experts (torchtitan's ``dp_shard_mod_ep``), the
            others over all ranks. Must divide the data-parallel ranks and
            ``num_experts``; engines ``simplefsdp`` and ``fsdp2``, modes
            ``fully_shard`` and ``replicate``; with ``pp`` each pipeline
            stage's data-parallel ranks form their own groups; not with
            ``tp`` (which splits every expert's hidden dim instead).
        cp: Context-parallel size: groups of ``cp`` ranks split each
            sequence (load-balanced: head-tail chunks for causal batches,
            balanced block-causal work with document masks); they read the
            same batch and shard the parameters with the data-parallel ranks
            (``dp_shard x cp``); the loss averages over batch x cp.
            ``data.seq_len`` must divide by ``2 x cp``; not with ``pp``.
            Families whose attention declares it (``cp`` capability).
        cp_backend: One of :data:`CP_BACKENDS`: how attention reaches the
            other ranks' keys: ``allgather`` (gather keys/values; gradients
            reduce-scattered), ``ring`` (rotate key/value blocks, merge by
            log-sum-exp) or ``ulysses`` (all-to-all from sequence to head
            shards; ``n_heads`` must divide by ``tp x cp``).
    """

    engine: Engine = field(default="simplefsdp", metadata=_choices(ENGINES))
    mode: DataParallelMode = field(default="fully_shard", metadata=_choices(PARALLEL_MODES))
    mesh_shape: list[int] | None = None
    reshard_after_forward: bool | int = True
    param_dtype: str | None = field(default=None, metadata=_choices(DTYPES, optional=True))
    reduce_dtype: str | None = field(default=None, metadata=_choices(DTYPES, optional=True))
    tp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = False
    pp: int = 1
    pp_schedule: PipelineSchedule = field(default="1f1b", metadata=_choices(PP_SCHEDULES))
    microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    check_ranks: bool = True
    ep: int = 1
    cp: int = 1
    cp_backend: str = field(default="allgather", metadata=_choices(CP_BACKENDS))


@dataclass
class CompileConfig:
    """``torch.compile``.

    Attributes:
        enable: Compile the model (engine ``simplefsdp_eager`` never compiles).
        backend: One of :data:`COMPILE_BACKENDS`.
        bucketing: One of :data:`BUCKETING_MODES`.
        keep_gathered: With ``parallel.reshard_after_forward``, the buckets
            kept gathered for backward (engine ``simplefsdp``): ``"auto"``
            (the last ones, gathered at the forward/backward boundary
            anyway), a number N (the last N buckets) or comma-separated
            module names (``"layers.31,norm,output"``); unset: ``"auto"``
            with ``bucketing = "auto"``, else none.
        fullgraph: Compile each forward as one graph; ``false`` compiles
            around graph breaks, each graph between them bucketed on its
            own (a model's own code that branches on tensor values, such as
            ``transformers``' OPT with its layerdrop). Tensor parallelism
            needs ``true``.
    """

    enable: bool = True
    backend: CompileBackend = field(default="inductor", metadata=_choices(COMPILE_BACKENDS))
    bucketing: Bucketing = field(default="auto", metadata=_choices(BUCKETING_MODES))
    keep_gathered: str | None = None
    fullgraph: bool = True


@dataclass
class ActivationCheckpointConfig:
    """Activation checkpointing.

    Attributes:
        mode: One of :data:`AC_MODES`: ``full`` recomputes each block in
            backward; ``selective`` is torchtitan's op policy (attention and
            every other matmul saved, the rest recomputed), which also
            saves the experts' grouped matmuls of a mixture-of-experts block.
        recompute_experts: With ``selective``: the experts' grouped matmuls
            recomputed too, as torchtitan's op list does: less activation
            memory for one more forward of the experts per MoE layer.
    """

    mode: ACMode = field(default="none", metadata=_choices(AC_MODES))
    recompute_experts: bool = False


@dataclass
class CheckpointConfig:
    """Distributed checkpoints.

    Attributes:
        enable: Save checkpoints.
        folder: Where checkpoints go: empty (the default) for the run's own
            ``<metrics.output_dir>/<run id>/checkpoints``, else ``<folder>/<run id>``.
        interval: Save every ``interval`` steps.
        keep_last: Number of most recent checkpoints kept.
        resume: Continue the newest run in ``metrics.output_dir`` that has a
            complete checkpoint, with its saved configuration; an error when
            there is none (``simplefsdp train --resume RUN`` names the run).
        resume_if_possible: The same when there is such a run, else start a
            new run.
        load_step: The step of the checkpoint to resume from (``-1``: the
            latest). Resuming never passes over a damaged checkpoint on its
            own: its one-line error names this flag and the previous good
            step. Restarts after a failure (``--max-restarts``) resume from
            the latest checkpoint.
        init_from_hf: A Hugging Face checkpoint folder (``config.json`` and
            safetensors, e.g. a downloaded Llama 3) to start a new run from.
            The folder picks the model family (``model_type``, then
            ``architectures``; a causal LM no native family reads trains
            through ``transformers``' own modeling code, family
            ``transformers``) and the model is the one ``config.json``
            describes (with ``model.name`` left at ``debug``; another name
            must be of the same family and describe the same architecture,
            else one line names the fields that differ); each rank reads only
            the slices of the tensors its shards hold. Resuming a run loads
            its own checkpoint instead.
        trust_remote_code: Let a ``checkpoint.init_from_hf`` folder whose
            ``config.json`` has ``auto_map`` run its own Python modeling
            code (never without this flag).
        async_mode: ``none``: a save blocks training until it is written;
            ``async``: training waits only for the copy of the tensors to host
            memory, the files are written in the background; ``staged``: the
            copy runs in the background too (pinned memory on CUDA) and the
            next optimizer step waits for it. A save being written when the
            process dies never becomes the latest checkpoint; the run waits
            for it before exiting.
    """

    enable: bool = True
    folder: str = ""
    interval: int = 100
    keep_last: int = 3
    resume: bool = False
    resume_if_possible: bool = False
    load_step: int = -1
    init_from_hf: str | None = None
    trust_remote_code: bool = False
    async_mode: str = field(default="none", metadata=_choices(CHECKPOINT_ASYNC_MODES))


@dataclass
class MetricsConfig:
    """Logging and validation.

    Attributes:
        log_interval: Log training metrics every ``log_interval`` steps.
        output_dir: Folder of the runs: each run writes its configuration,
            metrics, TensorBoard events and (by default) checkpoints into
            ``<output_dir>/<run id>/``.
        tensorboard: Write TensorBoard events.
        val_interval: Validate every ``val_interval`` steps (``0`` disables).
        val_batches: Validation batches per evaluation.
        wandb: Also log the metrics to Weights & Biases (``pip install
            simplefsdp[wandb]``; ``WANDB_MODE=offline`` writes them locally,
            without a network).
        wandb_project: The W&B project.
        wandb_run_name: The W&B run's name (empty: the run id).
    """

    log_interval: int = 10
    output_dir: str = "outputs"
    tensorboard: bool = False
    val_interval: int = 100
    val_batches: int = 10
    wandb: bool = False
    wandb_project: str = "simplefsdp"
    wandb_run_name: str = ""


@dataclass
class Float8Config:
    """torchao float8 training of the linear layers.

    Attributes:
        enable: Convert the linear layers with torchao's
            ``convert_to_float8_training`` before data parallelism (needs the
            ``float8`` extra: ``pip install -e ".[float8]"``).
        recipe: ``"tensorwise"`` (dynamic tensorwise scaling; the weights are
            all-gathered in float8) or ``"rowwise"`` (rowwise scaling for the
            matmuls; the weights are gathered in ``param_dtype``).
        filter_fqns: Comma-separated module names left in high precision (a
            module whose name contains one is skipped), as torchtitan's
            default ``"output"``; layers whose dims are not multiples of 16
            are always skipped.
    """

    enable: bool = False
    recipe: str = field(default="tensorwise", metadata=_choices(FLOAT8_RECIPES))
    filter_fqns: str = "output"


@dataclass
class JobConfig:
    """The complete configuration of a training job (one attribute per section)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    float8: Float8Config = field(default_factory=Float8Config)


#: Section name -> section dataclass, in display order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


# --------------------------------------------------------------------------- validation


def validate_config(cfg: JobConfig) -> None:
    """Check enumerations, numeric ranges and cross-field rules of ``cfg``.

    All problems are collected and reported together.

    Raises:
        ValueError: one line per problem, each naming the field, the bad value
            and the valid choices or range.
    """
    errors: list[str] = []

    # Enumerations (declared in the field metadata).
    for section, cls in SECTIONS.items():
        sec = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            if choices is None:
                continue
            value = getattr(sec, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            if value not in choices:
                valid = list(choices) + (["none"] if f.metadata.get("optional") else [])
                hint = suggest(str(value), list(choices))
                errors.append(
                    f"{section}.{f.name}: invalid value {value!r}; valid choices: {valid}.{hint}"
                )

    def check(ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            errors.append(f"{name}: invalid value {value!r}; must be {rule}")

    def finite(x: float) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    m, d, t, p = cfg.model, cfg.data, cfg.training, cfg.parallel
    ck, mt = cfg.checkpoint, cfg.metrics
    check(m.vocab_size is None or m.vocab_size >= 1, "model.vocab_size", m.vocab_size, ">= 1")
    check(m.max_seq_len is None or m.max_seq_len >= 1, "model.max_seq_len", m.max_seq_len, ">= 1")

    check(d.seq_len > 0, "data.seq_len", d.seq_len, "> 0")
    check(d.batch_size > 0, "data.batch_size", d.batch_size, "> 0")
    check(
        finite(d.val_fraction) and 0.0 <= d.val_fraction < 1.0,
        "data.val_fraction",
        d.val_fraction,
        "in [0, 1)",
    )
    check(bool(d.tokenizer.strip()), "data.tokenizer", d.tokenizer, "'byte' or a tokenizer path")
    check(d.max_bytes is None or d.max_bytes > 0, "data.max_bytes", d.max_bytes, "> 0 or none")
    check(bool(d.text_field.strip()), "data.text_field", d.text_field, "a field name")
    if m.max_seq_len is not None and d.seq_len > m.max_seq_len:
        errors.append(
            f"data.seq_len: invalid value {d.seq_len!r}; must be <= model.max_seq_len ({m.max_seq_len})"
        )

    check(t.steps > 0, "training.steps", t.steps, "> 0")
    check(finite(t.lr) and t.lr > 0, "training.lr", t.lr, "> 0")
    check(
        finite(t.min_lr_ratio) and 0.0 <= t.min_lr_ratio <= 1.0,
        "training.min_lr_ratio",
        t.min_lr_ratio,
        "in [0, 1]",
    )
    check(t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, ">= 0")
    check(
        finite(t.weight_decay) and t.weight_decay >= 0,
        "training.weight_decay",
        t.weight_decay,
        ">= 0",
    )
    check(
        all(finite(b) and 0.0 <= b < 1.0 for b in t.betas),
        "training.betas",
        t.betas,
        "two values in [0, 1)",
    )
    check(finite(t.max_norm) and t.max_norm >= 0, "training.max_norm", t.max_norm, ">= 0")
    check(t.grad_accum_steps >= 1, "training.grad_accum_steps", t.grad_accum_steps, ">= 1")
    check(t.seed >= 0, "training.seed", t.seed, ">= 0")

    check(
        p.mesh_shape is None or (len(p.mesh_shape) == 2 and all(x > 0 for x in p.mesh_shape)),
        "parallel.mesh_shape",
        p.mesh_shape,
        "two positive ints, e.g. [2, 2]",
    )
    partial = not isinstance(p.reshard_after_forward, bool)
    check(
        not partial or p.reshard_after_forward >= 2,
        "parallel.reshard_after_forward",
        p.reshard_after_forward,
        "true, false or a group size >= 2",
    )
    check(p.tp >= 1, "parallel.tp", p.tp, ">= 1")
    check(p.pp >= 1, "parallel.pp", p.pp, ">= 1")
    check(p.cp >= 1, "parallel.cp", p.cp, ">= 1")
    micro = p.microbatches if p.microbatches is not None else p.pp
    check(micro >= 1, "parallel.microbatches", p.microbatches, ">= 1")
    interleaved = p.pp_schedule == "interleaved_1f1b"
    if p.pp_stages_per_rank is not None:
        valid = ">= 2 for 'interleaved_1f1b'" if interleaved else f"1 for {p.pp_schedule!r}"
        check(
            p.pp_stages_per_rank >= 2 if interleaved else p.pp_stages_per_rank == 1,
            "parallel.pp_stages_per_rank",
            p.pp_stages_per_rank,
            valid,
        )
    f8 = cfg.float8
    if not any(e.startswith("parallel.engine:") for e in errors):
        errors += composition_errors(
            p.engine,
            mode=p.mode,
            tp=max(p.tp, 1),
            pp=max(p.pp, 1),
            ep=max(p.ep, 1),
            float8=f8.enable,
            group_reshard=p.reshard_after_forward if partial else False,
            names=_ENGINE_FLAGS,
        )

    if f8.enable and importlib.util.find_spec("torchao") is None:
        errors.append(
            'float8.enable: invalid value True without torchao; install it with pip install -e ".[float8]"'
        )
    if f8.enable and p.pp > 1:
        errors.append(
            f"float8.enable: invalid value True with parallel.pp={p.pp}; "
            "float8 training runs with data and tensor parallelism (pp = 1)"
        )

    errors.extend(_expert_parallel_errors(cfg))
    ac = cfg.activation_checkpoint
    check(
        not ac.recompute_experts or ac.mode == "selective",
        "activation_checkpoint.recompute_experts",
        ac.recompute_experts,
        f"false with activation_checkpoint.mode {ac.mode!r} (it applies to 'selective')",
    )

    check(ck.interval >= 1, "checkpoint.interval", ck.interval, ">= 1")
    check(ck.keep_last >= 1, "checkpoint.keep_last", ck.keep_last, ">= 1")
    check(ck.load_step >= -1, "checkpoint.load_step", ck.load_step, ">= 0, or -1 for the latest")
    check(
        ck.folder == "" or bool(ck.folder.strip()),
        "checkpoint.folder",
        ck.folder,
        "a path, or empty for the run folder's checkpoints/",
    )
    if ck.init_from_hf is not None:
        check(
            os.path.isfile(os.path.join(ck.init_from_hf, "config.json")),
            "checkpoint.init_from_hf",
            ck.init_from_hf,
            "a Hugging Face checkpoint folder holding config.json",
        )

    check(mt.log_interval >= 1, "metrics.log_interval", mt.log_interval, ">= 1")
    check(mt.val_interval >= 0, "metrics.val_interval", mt.val_interval, ">= 0 (0 disables)")
    check(mt.val_batches >= 0, "metrics.val_batches", mt.val_batches, ">= 0")
    check(bool(mt.output_dir.strip()), "metrics.output_dir", mt.output_dir, "a non-empty path")

    if errors:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(errors))


#: How the schema's messages name the settings the engines check.
_ENGINE_FLAGS = {
    "engine": "parallel.engine",
    "mode": "parallel.mode",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "float8": "float8.enable",
    "group_reshard": "parallel.reshard_after_forward",
}


def _has_field(flavor: str, field_name: str) -> bool:
    """Flavor ``flavor``'s configuration has field ``field_name`` (imports its family)."""
    import dataclasses

    from simplefsdp.models.registry import spec_of

    try:
        config_type = spec_of(flavor).config_type
    except ValueError:  # an unknown name: reported by validate_config
        return True
    return field_name in {f.name for f in dataclasses.fields(config_type)}


def _expert_parallel_errors(cfg: JobConfig) -> list[str]:
    """The mixture-of-experts rules of :func:`validate_config`, one line each
    (the degrees and the model against the layout: :func:`simplefsdp.train.resolve.resolve`)."""
    p = cfg.parallel
    errors = []
    if p.ep < 1:
        errors.append(f"parallel.ep: invalid value {p.ep!r}; must be >= 1")
    return errors


#: Bytes of the embedded stdlib corpus read when ``data.max_bytes`` is unset
#: (``simplefsdp.data.DEFAULT_STDLIB_MAX_BYTES``; this module does not import the data package).
_STDLIB_BYTES = 8_000_000


def _contradictions(job: JobConfig) -> list[str]:
    """Valid settings that contradict each other, one line each with the fix."""
    t, d, mt, ck = job.training, job.data, job.metrics, job.checkpoint
    out = []
    if t.warmup_steps > 0 and t.warmup_steps >= t.steps:
        fix = min(max(1, t.steps // 10), t.steps - 1)
        out.append(
            f"training.warmup_steps {t.warmup_steps} is not below training.steps {t.steps}: "
            "the learning rate warms up for the whole run and never decays; use "
            f"--training.warmup_steps {fix} (or more training.steps)"
        )
    validates = mt.val_interval > 0 and mt.val_batches > 0
    if validates and d.val_fraction == 0:
        out.append(
            f"metrics.val_interval {mt.val_interval} but data.val_fraction 0 holds out no "
            "validation data (no val_loss); set --data.val_fraction 0.05 or "
            "--metrics.val_interval 0"
        )
    corpus_bytes = d.max_bytes if d.max_bytes is not None else None
    if corpus_bytes is None and d.path is None:
        corpus_bytes = _STDLIB_BYTES
    if validates and d.val_fraction > 0 and corpus_bytes is not None:
        # tokens ~ bytes for the byte tokenizer, fewer for subword tokenizers
        held_out = int(corpus_bytes * d.val_fraction)
        batch = d.batch_size * (d.seq_len + 1)
        if held_out < batch:
            need = math.ceil(batch / corpus_bytes * 100) / 100
            fix = f"--data.val_fraction {need:g}" if need < 0.5 else "more data (data.max_bytes)"
            out.append(
                f"data.val_fraction {d.val_fraction:g} of about {corpus_bytes} bytes holds out "
                f"about {held_out} tokens, less than one validation batch of "
                f"data.batch_size {d.batch_size} x (data.seq_len {d.seq_len} + 1) = {batch} "
                f"tokens per rank (no val_loss); use {fix}, or --metrics.val_interval 0"
            )
    if ck.load_step >= 0 and not (ck.resume or ck.resume_if_possible):
        out.append(
            f"checkpoint.load_step {ck.load_step} is only used when resuming; add --resume "
            "to resume from it"
        )
    return out


def config_warnings(job: JobConfig) -> list[str]:
    """Settings that are valid but have no effect or contradict each other, one line each.

    The command line prints them once (``simplefsdp train: warning: ...``),
    not once per rank.
    """
    p = job.parallel
    warnings = _contradictions(job)
    if p.mesh_shape is not None and p.mode != "hybrid_shard":
        warnings.append(
            f"parallel.mesh_shape={list(p.mesh_shape)} is only used by mode 'hybrid_shard' "
            f"(mode is {p.mode!r})"
        )
    if (
        not isinstance(p.reshard_after_forward, bool)
        and get_engine(p.engine).fused_buckets
        and not (job.compile.enable)
    ):
        warnings.append(
            f"parallel.reshard_after_forward={p.reshard_after_forward} needs compile.enable "
            "true; uncompiled, simplefsdp regathers over the whole shard group"
        )
    if job.model.load_balance != "auto" and not _has_field(job.model.name, "load_balance"):
        warnings.append(
            f"model.load_balance is only used by the mixture-of-experts models "
            f"(model.name is {job.model.name!r})"
        )
    if p.tp == 1 and p.loss_parallel:
        warnings.append("parallel.loss_parallel is only used with parallel.tp > 1")
    if job.compile.keep_gathered is not None and (
        not get_engine(p.engine).fused_buckets
        or not job.compile.enable
        or not p.reshard_after_forward
    ):
        warnings.append(
            "compile.keep_gathered is only used by engine 'simplefsdp' when compiled with "
            "parallel.reshard_after_forward true"
        )
    if p.pp == 1 and (p.microbatches is not None or p.pp_stages_per_rank is not None):
        warnings.append(
            "parallel.microbatches and parallel.pp_stages_per_rank are only used with "
            "parallel.pp > 1"
        )
    return warnings
