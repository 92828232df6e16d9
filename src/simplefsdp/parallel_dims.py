"""The parallel layout of a job: the valid values and the degrees, checked once.

One vocabulary for ``simplefsdp train`` (the config schema), ``simplefsdp
bench``, ``simplefsdp plan`` and the engine layer: the valid engines, data
parallel modes, pipeline schedules, activation checkpointing modes,
bucketing strategies and compile backends as ``Literal`` types with their
value tuples, and :class:`ParallelDims`, the job's degrees (in the spirit of
torchtitan's ``ParallelDims``) with the one :meth:`ParallelDims.validate`
that every command line calls before any process starts.

Pure data: this module imports neither torch nor the rest of simplefsdp.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "cpu_cores",
    "oversubscription_warning",
    "ACMode",
    "AC_MODES",
    "Bucketing",
    "BUCKETINGS",
    "CompileBackend",
    "COMPILE_BACKENDS",
    "DataParallelMode",
    "DATA_PARALLEL_MODES",
    "Engine",
    "ENGINES",
    "EP_ENGINES",
    "INTERLEAVED_SCHEDULES",
    "PP_ENGINES",
    "PipelineSchedule",
    "PIPELINE_SCHEDULES",
    "REPLICATE_ONLY_ENGINES",
    "TP_ENGINES",
    "ParallelDims",
    "tp_split_sizes",
]

Engine = Literal["simplefsdp", "simplefsdp_eager", "fsdp2", "ddp", "replica"]
"""The engines: simplefsdp (compiled or not), simplefsdp with the eager
executor, torch's FSDP2 and DDP, and the replica limit (no communication)."""
ENGINES: tuple[Engine, ...] = get_args(Engine)
#: Engines that do not shard: they run data-parallel mode ``"replicate"`` only.
REPLICATE_ONLY_ENGINES: tuple[Engine, ...] = ("ddp", "replica")
#: Engines that compose with tensor parallelism (``tp > 1``).
TP_ENGINES: tuple[Engine, ...] = ("simplefsdp", "fsdp2")
#: Engines that compose with pipeline parallelism (``pp > 1``).
PP_ENGINES: tuple[Engine, ...] = ("simplefsdp", "fsdp2")
#: Engines that compose with expert parallelism (``ep > 1``).
EP_ENGINES: tuple[Engine, ...] = ("simplefsdp", "fsdp2")

DataParallelMode = Literal["replicate", "fully_shard", "hybrid_shard"]
"""How parameters are placed on the data-parallel mesh.

- ``"replicate"``: DDP. Every rank holds the full parameter; gradients are all-reduced.
- ``"fully_shard"``: FSDP / ZeRO-3. Parameters are sharded along ``shard_dim``;
  reads all-gather, gradients are reduce-scattered.
- ``"hybrid_shard"``: HSDP on a 2-D mesh ``(replicate, shard)``: sharded within
  mesh dim 1, replicated across mesh dim 0; gradients are reduce-scattered in
  the shard group and all-reduced in the replica group.
"""
DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = get_args(DataParallelMode)

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
"""torch's GPipe, 1F1B and interleaved 1F1B schedules."""
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = get_args(PipelineSchedule)
#: Schedules that run several stages per rank (2 unless told otherwise).
INTERLEAVED_SCHEDULES: tuple[PipelineSchedule, ...] = ("interleaved_1f1b",)

ACMode = Literal["none", "selective", "full"]
"""Activation checkpointing, from the most memory to the least: none, every
other block, or every block (``simplefsdp plan`` suggests leaner modes in this order)."""
AC_MODES: tuple[ACMode, ...] = get_args(ACMode)

Bucketing = Literal["auto", "none", "per_block"]
"""Communication bucketing of the compiler passes."""
BUCKETINGS: tuple[Bucketing, ...] = get_args(Bucketing)

CompileBackend = Literal["inductor", "aot_eager"]
"""``torch.compile`` backends."""
COMPILE_BACKENDS: tuple[CompileBackend, ...] = get_args(CompileBackend)

#: The default spelling of each degree in error messages; a command line
#: passes its own flag names (``{"tp": "--tp", ...}``).
_NAMES = {
    "world_size": "world size",
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
    "tp": "tp",
    "pp": "pp",
    "ep": "ep",
    "microbatches": "microbatches",
    "stages_per_rank": "stages_per_rank",
    "batch": "batch",
    "seq_len": "seq_len",
}


def tp_split_sizes(model_args: Any, *, loss_parallel: bool = False) -> dict[str, int]:
    """The model sizes a Llama-style tensor-parallel plan splits over the TP ranks.

    Each must divide by ``tp``; the one list the TP plan's own checks and the
    command lines' pre-flight checks use.

    Args:
        model_args: anything with ``n_heads``, ``n_kv_heads``,
            ``ffn_hidden_dim`` and (with ``loss_parallel``) ``vocab_size``.
        loss_parallel: the output projection is split over the vocabulary.
    """
    sizes = {
        "n_heads": model_args.n_heads,
        "n_kv_heads": model_args.n_kv_heads,
        "feed-forward hidden dim": model_args.ffn_hidden_dim,
    }
    if loss_parallel:
        sizes["vocab_size"] = model_args.vocab_size
    return sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join(values: list[int]) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a job's parallel layout.

    The mesh is ``(pp, dp_replicate, dp_shard, tp)`` with the degrees of 1
    left out; ``dp_replicate * dp_shard`` data-parallel ranks, each holding
    ``world_size // (pp * tp)`` of the world.

    Attributes:
        world_size: ranks in the job.
        dp_replicate: data-parallel replicas (HSDP's outer dim, DDP's degree).
        dp_shard: data-parallel shards per replica; ``-1``: the ranks left.
        tp: tensor-parallel degree (innermost mesh dim).
        pp: pipeline-parallel degree (outermost mesh dim).
        ep: expert-parallel degree: groups of ``ep`` data-parallel ranks
            each hold ``num_experts / ep`` of a mixture-of-experts model's
            experts (torchtitan's ``dp_shard_mod_ep = dp / ep``); it must
            divide the data-parallel ranks and ``num_experts``.
        microbatches: micro-batches per step (``pp > 1``) or batches
            accumulated per optimizer step; the batch must divide by it
            (``None``: ``pp``).
        pp_schedule: one of :data:`PIPELINE_SCHEDULES`.
        stages_per_rank: pipeline stages each rank holds (``None``: 2 for
            the interleaved schedules, else 1).
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    microbatches: int | None = None
    pp_schedule: str = "1f1b"
    stages_per_rank: int | None = None

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``world_size // (pp * tp)``."""
        return self.world_size // (self.tp * self.pp)

    @property
    def n_microbatches(self) -> int:
        """``microbatches``, or ``pp`` when unset."""
        return self.pp if self.microbatches is None else self.microbatches

    @property
    def interleaved(self) -> bool:
        return self.pp_schedule in INTERLEAVED_SCHEDULES

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all pipeline ranks."""
        per_rank = self.stages_per_rank
        if per_rank is None:
            per_rank = 2 if self.interleaved else 1
        return self.pp * per_rank

    def validate(
        self,
        model_args: Any = None,
        *,
        batch: int | None = None,
        seq_len: int | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        model_name: str | None = None,
        names: Mapping[str, str] | None = None,
    ) -> None:
        """Check the degrees against each other, the world and the model.

        Args:
            model_args: the model's configuration (``n_layers``,
                ``max_seq_len`` and the sizes of :func:`tp_split_sizes`);
                ``None`` checks the degrees only.
            batch: the per-rank batch, split into ``microbatches``.
            seq_len: the sequence length (at most ``max_seq_len``; with
                ``sequence_parallel`` a multiple of ``tp``).
            sequence_parallel: the TP plan shards activations over the sequence.
            loss_parallel: the TP plan splits the output over the vocabulary.
            model_name: the model's name, for the messages.
            names: how the caller's user spells each degree (its flags).

        Raises:
            ValueError: one line naming the bad value and what would be valid.
        """
        n = {**_NAMES, **(names or {})}
        degrees = ("world_size", "dp_replicate", "tp", "pp", "ep", "microbatches")
        for key in degrees:
            value = getattr(self, key)
            if key == "microbatches" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{n[key]} must be >= 1, got {value!r}")
        if self.dp_shard != -1 and (not isinstance(self.dp_shard, int) or self.dp_shard < 1):
            raise ValueError(
                f"{n['dp_shard']} must be >= 1 or -1 (the rest), got {self.dp_shard!r}"
            )
        ws = self.world_size
        for key, what in (("tp", "tensor-parallel"), ("pp", "pipeline-parallel")):
            value = getattr(self, key)
            if ws % value:
                raise ValueError(
                    f"{n[key]} {value} does not divide {n['world_size']} {ws}; "
                    f"valid {what} sizes for {ws} ranks: {_join(_divisors(ws))}"
                )
        if ws % (self.tp * self.pp):
            valid = _divisors(ws // self.pp)
            raise ValueError(
                f"{n['pp']} {self.pp} x {n['tp']} {self.tp} does not divide "
                f"{n['world_size']} {ws}; valid tensor-parallel sizes with {n['pp']} "
                f"{self.pp}: {_join(valid)}"
            )
        dp = self.dp
        if self.dp_shard != -1 and self.dp_replicate * self.dp_shard != dp:
            raise ValueError(
                f"{n['dp_replicate']} {self.dp_replicate} x {n['dp_shard']} {self.dp_shard} "
                f"!= {dp} data-parallel ranks; valid pairs: "
                + ", ".join(f"[{d}, {dp // d}]" for d in _divisors(dp))
            )
        if self.dp_shard == -1 and dp % self.dp_replicate:
            raise ValueError(
                f"{n['dp_replicate']} {self.dp_replicate} does not divide the {dp} data-parallel "
                f"ranks; valid: {_join(_divisors(dp))}"
            )
        self._validate_pipeline(n)
        self._validate_experts(model_args, model_name, n)
        if model_args is not None:
            self._validate_model(
                model_args, seq_len, sequence_parallel, loss_parallel, model_name, n
            )
        micro = self.n_microbatches
        if batch is not None and batch % micro:
            least = self.pp if self.pp > 1 else 1
            valid = [d for d in _divisors(batch) if d >= least]
            fix = (
                f"valid {n['microbatches']}: {_join(valid)}"
                if valid
                else f"use a {n['batch']} that is a multiple of {micro}"
            )
            raise ValueError(
                f"{n['batch']} {batch} is not divisible by {n['microbatches']} {micro}; {fix}"
            )

    def _validate_experts(self, args: Any, model_name: str | None, n: Mapping[str, str]) -> None:
        """``ep`` against the data-parallel ranks and the model's experts.

        Expert parallelism borrows from data parallelism (torchtitan's
        ``dp_shard_mod_ep = dp / ep``): ``ep`` must divide the data-parallel
        ranks and the model's ``num_experts``, and needs a model with experts.
        """
        ep = self.ep
        if ep == 1:
            return
        model = f"model {model_name!r}" if model_name else "the model"
        num_experts = getattr(args, "num_experts", None) if args is not None else None
        if args is not None and not num_experts:
            raise ValueError(
                f"{n['ep']} {ep}: expert parallelism needs a model with experts and {model} has "
                "none; valid: 1, or a mixture-of-experts model"
            )
        if self.tp > 1 or self.pp > 1:
            raise ValueError(
                f"{n['ep']} {ep} with {n['tp']} {self.tp}, {n['pp']} {self.pp}: expert "
                f"parallelism composes with data parallelism only; use {n['tp']} 1 and "
                f"{n['pp']} 1, or {n['ep']} 1"
            )
        dp = self.dp
        if dp % ep:
            valid = [d for d in _divisors(dp) if not num_experts or num_experts % d == 0]
            raise ValueError(
                f"{n['ep']} {ep} does not divide the {dp} data-parallel ranks (expert "
                f"parallelism splits them into groups of {n['ep']}); valid: {_join(valid)}"
            )
        if num_experts and num_experts % ep:
            valid = [d for d in _divisors(num_experts) if dp % d == 0]
            raise ValueError(
                f"{n['ep']} {ep} does not divide the {num_experts} experts of {model} (each "
                f"rank holds num_experts / {n['ep']}); valid: {_join(valid)}"
            )

    def _validate_pipeline(self, n: Mapping[str, str]) -> None:
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"unknown pipeline schedule {self.pp_schedule!r}; valid: "
                + ", ".join(PIPELINE_SCHEDULES)
            )
        per_rank = self.stages_per_rank
        if per_rank is not None:
            if self.interleaved and per_rank < 2:
                raise ValueError(
                    f"schedule {self.pp_schedule!r} needs {n['stages_per_rank']} >= 2, "
                    f"got {per_rank}"
                )
            if not self.interleaved and per_rank != 1:
                raise ValueError(
                    f"schedule {self.pp_schedule!r} runs one stage per rank, got "
                    f"{n['stages_per_rank']} {per_rank}; use 'interleaved_1f1b' for more"
                )
        if self.pp > 1 and self.pp_schedule == "1f1b" and self.n_microbatches < self.pp:
            raise ValueError(
                f"{n['microbatches']} {self.n_microbatches} is below {n['pp']} {self.pp} "
                f"(1F1B needs at least one micro-batch per stage); valid: >= {self.pp}"
            )

    def _validate_model(
        self,
        args: Any,
        seq_len: int | None,
        sequence_parallel: bool,
        loss_parallel: bool,
        model_name: str | None,
        n: Mapping[str, str],
    ) -> None:
        model = f"model {model_name!r}" if model_name else "the model"
        if seq_len is not None and seq_len > args.max_seq_len:
            raise ValueError(
                f"{n['seq_len']} {seq_len} exceeds max_seq_len {args.max_seq_len} of {model}; "
                f"use {n['seq_len']} <= {args.max_seq_len}"
            )
        tp = self.tp
        if tp > 1:
            sizes = tp_split_sizes(args, loss_parallel=loss_parallel)
            bad = {name: size for name, size in sizes.items() if size % tp}
            if bad:
                found = ", ".join(f"{name} {size}" for name, size in bad.items())
                valid = _divisors(math.gcd(*sizes.values()))
                raise ValueError(
                    f"{n['tp']} {tp} does not divide the {found} of {model}; "
                    f"valid tensor-parallel sizes for this model: {valid}"
                )
            if sequence_parallel and seq_len is not None and seq_len % tp:
                raise ValueError(
                    f"{n['seq_len']} {seq_len} is not divisible by {n['tp']} {tp} "
                    "(sequence parallelism shards the sequence over the TP ranks)"
                )
        stages = self.num_stages
        if self.pp > 1 and stages > args.n_layers:
            per_rank = stages // self.pp
            raise ValueError(
                f"{n['pp']} {self.pp} x {per_rank} stages per rank = {stages} stages but "
                f"{model} has {args.n_layers} layers; use at most {args.n_layers} stages"
            )


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def oversubscription_warning(nproc: int, *, cuda: bool, cores: int | None = None) -> str | None:
    """One line when ``nproc`` CPU (gloo) processes exceed the machine's cores,
    else ``None``.

    Args:
        nproc: processes (ranks) on this machine.
        cuda: whether they run on GPUs (then cores do not bound them).
        cores: CPU cores available (default: :func:`cpu_cores`).
    """
    cores = cores or cpu_cores()
    if cuda or nproc <= cores:
        return None
    plural = "s" if cores != 1 else ""
    return (
        f"--nproc {nproc} is more than the {cores} CPU core{plural} of this machine: the processes "
        "will share cores (oversubscription), so every step runs slower than on "
        f"{cores} or fewer processes and timings mean little; the results are unaffected"
    )
