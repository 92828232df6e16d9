"""The parallel layout of a job: the valid values and the degrees, checked once.

One vocabulary for ``simplefsdp train`` (the config schema), ``simplefsdp
bench``, ``simplefsdp plan`` and the engine layer: the valid engines, data
parallel modes, pipeline schedules, activation checkpointing modes,
bucketing strategies and compile backends as ``Literal`` types with their
value tuples. The job's degrees and their checks are
:class:`simplefsdp.layout.Layout`'s; what an engine composes with,
:mod:`simplefsdp.engines.kinds`'.

Pure data: this module imports neither torch nor the rest of simplefsdp.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

Engine = Literal["simplefsdp", "simplefsdp_eager", "fsdp2", "ddp", "replica"]
"""The engines: simplefsdp (compiled or not), simplefsdp with the eager
executor, torch's FSDP2 and DDP, and the replica limit (no communication).
What each composes with is declared by its class in
:mod:`simplefsdp.engines.kinds`, the one place that decides it."""
ENGINES: tuple[Engine, ...] = get_args(Engine)

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
