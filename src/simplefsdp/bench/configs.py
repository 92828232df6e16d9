"""What ``simplefsdp bench`` runs: configurations, workloads and the run spec.

A *configuration* says how the model is parallelised and executed (DDP,
FSDP2, simplefsdp with or without compile, which passes); a *workload* says
what is trained (model size, per-rank batch, sequence length, steps). Both
are plain frozen data, validated here once, so the worker processes only read
them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from simplefsdp.engines.kinds import engine_names, engines_with, get_engine

#: The engine layer's engines and the bench-only baselines (``"comm"``:
#: collectives only), as :mod:`simplefsdp.engines.kinds` declares them.
ENGINES: tuple[str, ...] = engine_names(bench=True)


#: Suffix of the file (``<config><suffix>`` in the raw folder) where a
#: configuration's rank 0 says what it is doing (compiling, warming up,
#: measuring), read by the bench runner.
PHASE_SUFFIX = ".phase"


@dataclass(frozen=True)
class BenchConfig:
    """One way of running the same training step.

    Attributes:
        name: the name used on the command line, in the table and in bench.json.
        engine: an engine of ``simplefsdp.engines`` (``"replica"``: each rank
            trains its own full copy, no communication; ``"ddp"``;
            ``"fsdp2"``; ``"simplefsdp"``; ``"simplefsdp_eager"``: the eager
            executor) or ``"comm"`` (collectives only, no compute).
        compiled: run under ``torch.compile`` (Inductor).
        bucketing: the bucket plan (simplefsdp engines; ``None``: the
            engine's default).
        reorder: simplefsdp's ``reorder`` option (compiled simplefsdp only).
        torch_passes: compile with plain ``torch.compile`` and torch's own
            Inductor bucketing/overlap passes instead of ``simplefsdp.compile``.
        syncs_grads: gradients are averaged over ranks, so the loss must match
            the other data-parallel configurations step for step.
        lr_scale: learning-rate multiplier; 1.0 except in the test-only
            configuration that must be flagged as wrong.
        float8: convert the linear layers with torchao's float8 training
            (tensorwise scaling, weights all-gathered in float8), as
            ``simplefsdp train --float8.enable true`` does (the output layer
            and layers with dims not multiples of 16 stay high precision).
        torch_cp: run torch's context parallelism
            (``torch.distributed.tensor.experimental.context_parallel``
            around SDPA) instead of simplefsdp's (``--cp > 1``; CUDA only:
            torch's has no CPU attention handler).
        description: one line for ``--help`` and the docs.
    """

    name: str
    engine: str
    compiled: bool
    description: str
    bucketing: str | None = None
    reorder: bool = False
    torch_passes: bool = False
    keep_gathered: Any = None
    syncs_grads: bool = True
    lr_scale: float = 1.0
    float8: bool = False
    torch_cp: bool = False

    def __post_init__(self) -> None:
        engine = get_engine(self.engine, bench=True)
        if self.float8 and not engine.supports("float8"):
            raise ValueError(
                f"float8 runs with engines {', '.join(FLOAT8_ENGINES)}, not {self.engine!r}"
            )

    @property
    def supports_tp(self) -> bool:
        """Whether the configuration runs with ``--tp > 1`` (and ``--pp > 1``)."""
        return get_engine(self.engine, bench=True).supports("tp")

    def numerics(self, param_dtype: str | None = None) -> str:
        """What the losses of this configuration are compared within: the
        parameter dtype the matmuls run in (``float32`` without mixed
        precision; ddp and replica ignore ``param_dtype``), with ``+float8``
        for float8 configurations. Only rows of the same numerics must agree
        on the loss."""
        mixed = get_engine(self.engine, bench=True).supports("mixed_precision")
        dtype = param_dtype if param_dtype and mixed else None
        return (dtype or "float32") + ("+float8" if self.float8 else "")

    def engine_spec(self, tp: int = 1, param_dtype: str | None = None) -> Any:
        """This configuration as a ``simplefsdp.engines.EngineSpec`` (not for ``comm``).

        ``param_dtype``: mixed precision (gradients reduced in float32, as
        torchtitan); ``None`` trains in the parameters' float32.
        """
        from simplefsdp.engines import EngineSpec

        mixed = param_dtype is not None and get_engine(self.engine).supports("mixed_precision")
        return EngineSpec(
            tp=tp,
            engine=self.engine,
            param_dtype=param_dtype if mixed else None,
            reduce_dtype="float32" if mixed else None,
            mode="fully_shard",
            compile=self.compiled,
            backend="inductor",
            bucketing=self.bucketing or "auto",
            reorder=self.reorder,
            keep_gathered=self.keep_gathered,
            torch_passes=self.torch_passes,
            # The only buffer (the rotary table) is constant: no per-step broadcast.
            broadcast_buffers=False,
        )


#: Engines that train torchao float8 models (as ``simplefsdp train --float8.enable``).
FLOAT8_ENGINES: tuple[str, ...] = engines_with("float8")

CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "limit",
            "replica",
            True,
            "each rank trains its own compiled full replica, no communication",
            syncs_grads=False,
        ),
        BenchConfig("ddp", "ddp", True, "torch DistributedDataParallel with each block compiled"),
        BenchConfig("fsdp2", "fsdp2", False, "torch fully_shard per block and root, eager"),
        BenchConfig("fsdp2-compile", "fsdp2", True, "fully_shard with each block compiled"),
        BenchConfig("simplefsdp-uncompiled", "simplefsdp", False, "data_parallel without compile"),
        BenchConfig(
            "simplefsdp-eager",
            "simplefsdp_eager",
            False,
            "data_parallel with the eager executor, one bucket per block",
            bucketing="per_block",
        ),
        BenchConfig(
            "simplefsdp-none",
            "simplefsdp",
            True,
            "simplefsdp.compile, no bucketing, no reordering",
            bucketing="none",
        ),
        BenchConfig(
            "simplefsdp-torch-passes",
            "simplefsdp",
            True,
            "data_parallel + torch.compile with Inductor's own bucketing/overlap passes",
            torch_passes=True,
        ),
        BenchConfig(
            "simplefsdp-manual",
            "simplefsdp",
            True,
            "simplefsdp.compile, one bucket per block, reordered",
            bucketing="per_block",
            reorder=True,
        ),
        BenchConfig(
            "simplefsdp-auto",
            "simplefsdp",
            True,
            "simplefsdp.compile, auto bucket plan, reordered",
            bucketing="auto",
            reorder=True,
        ),
    )
}

# Public, but not run by "all": they need torchao (the ``float8`` extra). Their
# losses are checked against each other (Note: [Loss groups] in report.py).
FLOAT8_CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "fsdp2-float8",
            "fsdp2",
            True,
            "fsdp2-compile with torchao float8 linears, weights all-gathered in float8",
            float8=True,
        ),
        BenchConfig(
            "simplefsdp-float8",
            "simplefsdp",
            True,
            "simplefsdp-auto with torchao float8 linears, weights all-gathered in float8",
            bucketing="auto",
            reorder=True,
            float8=True,
        ),
    )
}

# Run with --cp > 1 only: torch's context parallelism, the peer of simplefsdp's.
CP_CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "fsdp2-torch-cp",
            "fsdp2",
            False,
            "fully_shard with torch's context parallelism (SDPA, head-tail load balance; CUDA)",
            torch_cp=True,
        ),
    )
}
#: Why :data:`CP_CONFIGS` do not run on this machine's CPU (one line).
TORCH_CP_ON_CPU = (
    "torch's context parallelism does not run on CPU (its SDPA handlers cover the CUDA "
    "kernels only)"
)
# Not listed in --help nor run by default: candidates being measured, and a
# deliberately wrong configuration (10x learning rate) that the
# loss-agreement check must flag.
TEST_CONFIGS: dict[str, BenchConfig] = {
    "simplefsdp-auto-reshard-all": BenchConfig(
        "simplefsdp-auto-reshard-all",
        "simplefsdp",
        True,
        "simplefsdp-auto regathering every bucket in backward (keep_gathered=0)",
        bucketing="auto",
        reorder=True,
        keep_gathered=0,
    ),
    "simplefsdp-auto-keep-all": BenchConfig(
        "simplefsdp-auto-keep-all",
        "simplefsdp",
        True,
        "simplefsdp-auto keeping every bucket gathered from forward to backward",
        bucketing="auto",
        reorder=True,
        keep_gathered=1_000_000,
    ),
    "test-wrong-lr": BenchConfig(
        "test-wrong-lr",
        "simplefsdp",
        False,
        "test only: simplefsdp uncompiled with a 10x learning rate (must be flagged ok=false)",
        lr_scale=10.0,
    ),
}

#: The communication-only measurement (run with every benchmark, not a row).
COMM_ONLY = BenchConfig(
    "comm-only",
    "comm",
    False,
    "the per-step all-gathers and reduce-scatters of per-block flat buffers, no compute",
)

DEFAULT_CONFIGS: tuple[str, ...] = tuple(CONFIGS)

#: Every configuration a user can name (``all`` runs :data:`DEFAULT_CONFIGS`).
PUBLIC_CONFIGS: tuple[str, ...] = (*CONFIGS, *FLOAT8_CONFIGS, *CP_CONFIGS)


def _names(names: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if names is None or names == "all":
        return []
    if isinstance(names, str):
        return [n.strip() for n in names.split(",") if n.strip()]
    return list(names)


def _cp_configs(
    names: str | list[str] | tuple[str, ...] | None, cp: int, cuda: bool
) -> list[BenchConfig]:
    """:func:`resolve_configs` with context parallelism (or a torch CP configuration named)."""
    if cp == 1:
        raise ValueError(f"configurations {', '.join(CP_CONFIGS)} run with --cp > 1; add --cp 2")
    allowed = [n for n in DEFAULT_CONFIGS if get_engine(CONFIGS[n].engine).supports("cp")]
    chosen = _names(names) or [*allowed, *(CP_CONFIGS if cuda else ())]
    for name in chosen:
        if name in CP_CONFIGS and not cuda:
            raise ValueError(f"configuration {name!r}: {TORCH_CP_ON_CPU}")
        if name not in allowed and name not in CP_CONFIGS:
            raise ValueError(
                f"configuration {name!r} does not run with --cp {cp}; valid: "
                f"{', '.join([*allowed, *CP_CONFIGS])}"
            )
    return [CP_CONFIGS.get(n) or CONFIGS[n] for n in dict.fromkeys(chosen)]


def _torchao_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is None


def resolve_configs(
    names: str | list[str] | tuple[str, ...] | None,
    tp: int = 1,
    pp: int = 1,
    *,
    moe: bool = False,
    cp: int = 1,
    cuda: bool = False,
) -> list[BenchConfig]:
    """The configurations named by ``--configs`` (comma-separated or a list).

    With ``cp > 1``, ``None`` or ``"all"`` selects the default configurations
    whose engine composes with context parallelism, and with ``cuda`` torch's
    (:data:`CP_CONFIGS`), which run only with ``cp > 1`` and on CUDA.

    ``None`` or ``"all"`` selects every public configuration (with ``tp > 1``
    or ``pp > 1``, every one that composes with tensor and pipeline
    parallelism: the engines ``simplefsdp`` and ``fsdp2``); the float8
    configurations (:data:`FLOAT8_CONFIGS`) run only when named. With
    ``moe`` (a mixture-of-experts model) only the configurations of
    ``simplefsdp.bench.moe.MOE_BENCH_CONFIGS`` run. The order given is kept
    and duplicates are dropped.

    Raises:
        ValueError: an unknown name (the message lists the valid names), a
            configuration that does not run with ``tp > 1`` or ``pp > 1``,
            a float8 configuration without torchao, a configuration the MoE
            workload does not run, or an empty selection.
    """
    if cp > 1 or any(n in CP_CONFIGS for n in _names(names)):
        return _cp_configs(names, cp, cuda)
    flag = f"--tp {tp}" if tp > 1 else f"--pp {pp}"
    tp = max(tp, pp)  # the same engines compose with both
    if moe:
        from simplefsdp.bench.moe import MOE_BENCH_CONFIGS

        if names is None or names == "all":
            return [CONFIGS[n] for n in MOE_BENCH_CONFIGS]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        for name in names:
            if name and name not in MOE_BENCH_CONFIGS and name not in TEST_CONFIGS:
                raise ValueError(
                    f"configuration {name!r} does not run a mixture-of-experts model; "
                    f"valid: {', '.join(MOE_BENCH_CONFIGS)}"
                )
    if names is None or names == "all":
        return [CONFIGS[n] for n in DEFAULT_CONFIGS if tp == 1 or CONFIGS[n].supports_tp]
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    chosen: list[BenchConfig] = []
    for name in names:
        if not name:
            continue
        config = CONFIGS.get(name) or FLOAT8_CONFIGS.get(name) or TEST_CONFIGS.get(name)
        if config is None:
            raise ValueError(
                f"unknown configuration {name!r}; valid configurations: "
                f"{', '.join(PUBLIC_CONFIGS)} (or 'all')"
            )
        if config.float8 and tp > 1:
            raise ValueError(
                f"configuration {name!r} (float8) does not run with {flag}; float8 training "
                "runs with data parallelism only"
            )
        if config.float8 and _torchao_missing():
            raise ValueError(f'configuration {name!r} needs torchao: pip install -e ".[float8]"')
        if tp > 1 and not config.supports_tp:
            valid = [n for n in DEFAULT_CONFIGS if CONFIGS[n].supports_tp]
            raise ValueError(
                f"configuration {name!r} (engine {config.engine}) does not run with {flag}; "
                f"configurations with tensor/pipeline parallelism: {', '.join(valid)}"
            )
        if config not in chosen:
            chosen.append(config)
    if not chosen:
        raise ValueError(f"no configuration selected; valid: {', '.join(DEFAULT_CONFIGS)}")
    return chosen


@dataclass(frozen=True)
class Workload:
    """What is trained: model, per-rank batch, sequence length and step counts.

    Attributes:
        name: preset name (``compute``, ``comm``, ``memory``, ``long``, ``moe``).
        model: a flavor name of ``simplefsdp.models.registry``.
        batch_size: per-rank micro-batch.
        seq_len: tokens per sequence.
        steps: measured steps.
        warmup: steps run before measuring (the first one compiles).
        lr: AdamW learning rate (constant, no weight decay); small enough
            that the loss falls from the first step on.
        model_overrides: ``ModelArgs`` fields replaced in the named config.
        description: what the preset stresses.
    """

    name: str
    model: str
    batch_size: int
    seq_len: int
    steps: int
    warmup: int
    description: str
    lr: float = 1e-3
    model_overrides: dict[str, Any] = field(default_factory=dict)


WORKLOADS: dict[str, Workload] = {
    "compute": Workload(
        "compute", "debug", 4, 256, 6, 2, "compute-heavy: debug model, batch 4 x 256 per rank"
    ),
    "comm": Workload(
        "comm", "debug", 1, 128, 8, 2, "communication-heavy: debug model, batch 1 x 128 per rank"
    ),
    "memory": Workload(
        "memory",
        "small",
        1,
        128,
        4,
        2,
        "parameter-memory-heavy: small model (~101M parameters), batch 1 x 128 per rank",
        lr=1e-4,
    ),
    "long": Workload(
        "long",
        "debug",
        1,
        2048,
        3,
        1,
        "long sequences: debug model, batch 1 x 2048 per context-parallel group, split by "
        "--cp (docs/long-context.md)",
    ),
    "moe": Workload(
        "moe",
        "moe_debug",
        2,
        128,
        6,
        3,
        "mixture of experts: moe_debug (8 experts, top 2, a shared expert), batch 2 x 128 per "
        "rank, experts sharded by --ep (docs/benchmarks.md, Workloads)",
    ),
}


def get_workload(name: str, **overrides: Any) -> Workload:
    """The preset ``name`` with fields replaced by the non-``None`` ``overrides``.

    Raises:
        ValueError: unknown preset (the message lists the valid ones) or a
            non-positive size.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    workload = dataclasses.replace(WORKLOADS[name], **changes)
    if workload.lr <= 0:
        raise ValueError(f"lr must be > 0, got {workload.lr}")
    for attr in ("batch_size", "seq_len", "steps"):
        if getattr(workload, attr) < 1:
            raise ValueError(f"{attr} must be >= 1, got {getattr(workload, attr)}")
    if workload.warmup < 1:
        # The first step compiles; measuring it would time the compiler.
        raise ValueError(f"warmup must be >= 1 (the first step compiles), got {workload.warmup}")
    return workload


@dataclass(frozen=True)
class BenchSpec:
    """Everything a worker needs besides its configuration (written as JSON).

    Attributes:
        workload: what is trained.
        nproc: ranks per configuration.
        seed: model-initialisation and data-order seed.
        data_max_bytes: bytes of the embedded stdlib corpus read.
        timeout_s: per-configuration time limit (also the process-group timeout).
        tp: tensor-parallel size (the Llama 3 plan with sequence parallelism);
            the data-parallel ranks are ``nproc // (tp * pp)``.
        pp: pipeline-parallel size (the model spec's ``pipeline_split``
            stages run by torch's schedules).
        pp_schedule: the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``).
        microbatches: micro-batches per pipeline step (``None``: ``pp``).
        grad_accum: batches per optimizer step; all but the last run without
            gradient communication (``ParallelModel.grad_sync(False)``).
        param_dtype: mixed precision of the data-parallel engines
            (``"bfloat16"``; ``None``: float32 throughout).
        ep: expert-parallel degree of a MoE model (Note: [Bench MoE recipes]).
        cp: context-parallel degree: groups of ``cp`` ranks split each
            sequence (they read the same batches).
        cp_backend: simplefsdp's attention across those ranks (``allgather``,
            ``ring``, ``ulysses``).
    """

    workload: Workload
    nproc: int = 2
    seed: int = 0
    data_max_bytes: int = 1_000_000
    timeout_s: float = 900.0
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    grad_accum: int = 1
    param_dtype: str | None = None
    ep: int = 1
    cp: int = 1
    cp_backend: str = "allgather"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        data = json.loads(text)
        data["workload"] = Workload(**data["workload"])
        return cls(**data)
