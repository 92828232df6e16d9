"""Build the benchmark model and parallelise it the way a configuration says.

Every configuration starts from the same model: built on the CPU under one
seed (``Transformer.__init__`` initialises it), then moved to the device and
parallelised. DDP and ``data_parallel`` broadcast rank 0's values and
``fully_shard`` shards the tensors it is given, so all configurations train
the same initial weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.bench.configs import BenchConfig, Workload, torch_passes_patches
from simplefsdp.models.llama3 import Transformer, get_config

__all__ = ["Parallel", "build_model", "comm_report_summary", "parallelize", "transformer_blocks"]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass
class Parallel:
    """A parallelised model.

    Attributes:
        module: the module whose parameters the optimizer updates.
        forward: what the step calls (``module``, a compiled or DDP wrapper).
        inductor_patches: Inductor config patches active while the step runs
            (compilation happens in the first step); empty except for the
            torch-passes peer.
        notes: remarks for the result row.
    """

    module: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    inductor_patches: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def compile_context(self) -> Iterator[None]:
        """Apply ``inductor_patches`` (scoped; nothing global is left changed)."""
        if not self.inductor_patches:
            yield
            return
        import torch._inductor.config as inductor_config

        with inductor_config.patch(self.inductor_patches):
            yield


def build_model(workload: Workload, seed: int) -> Transformer:
    """The workload's Llama 3 model on the CPU, initialised under ``seed``."""
    overrides = dict(workload.model_overrides)
    base = get_config(workload.model, **overrides)
    if workload.seq_len > base.max_seq_len:
        overrides["max_seq_len"] = workload.seq_len
    args = get_config(workload.model, **overrides)
    torch.manual_seed(seed)
    return Transformer(args)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every child of every ``nn.ModuleList`` (the transformer blocks)."""
    return [
        child
        for parent in model.modules()
        if isinstance(parent, nn.ModuleList)
        for child in parent.children()
    ]


def _replica(config: BenchConfig, model: nn.Module) -> Parallel:
    forward = torch.compile(model, fullgraph=True) if config.compiled else model
    return Parallel(model, forward, notes=["each rank trains its own replica (no gradient sync)"])


def _ddp(config: BenchConfig, model: nn.Module, mesh: DeviceMesh, device: torch.device) -> Parallel:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # The only buffer (rotary table) is constant: no per-step broadcast.
    ddp = DistributedDataParallel(
        model, device_ids=device_ids, process_group=mesh.get_group(), broadcast_buffers=False
    )
    forward = torch.compile(ddp) if config.compiled else ddp
    return Parallel(model, forward, notes=["broadcast_buffers=False"])


def _fsdp2(config: BenchConfig, model: nn.Module, mesh: DeviceMesh) -> Parallel:
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        if config.compiled:
            # torchtitan's recipe: compile each block in place, then shard.
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh)
    # The root (embeddings, final norm, output) is needed first in backward:
    # not resharded after forward, as in torchtitan.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return Parallel(model, model)


def _simplefsdp(config: BenchConfig, model: nn.Module, mesh: DeviceMesh) -> Parallel:
    import simplefsdp

    simplefsdp.data_parallel(model, mesh, mode="fully_shard")
    if not config.compiled:
        return Parallel(model, model)
    if config.torch_passes:
        patches, notes = torch_passes_patches()
        notes = [
            *notes,
            "plain torch.compile: reshard-after-forward is left to the min-cut partitioner",
            "inductor patches: " + ", ".join(f"{k}={v}" for k, v in patches.items()),
        ]
        forward = torch.compile(model, backend="inductor", fullgraph=True)
        return Parallel(model, forward, inductor_patches=patches, notes=notes)
    simplefsdp.compile(model, bucketing=config.bucketing, reorder=config.reorder)
    return Parallel(model, model)


def parallelize(
    config: BenchConfig, model: nn.Module, mesh: DeviceMesh, device: torch.device
) -> Parallel:
    """Move ``model`` to ``device`` and apply ``config``'s engine and compilation.

    Compilation itself happens lazily in the first step.

    Raises:
        ValueError: the configuration has no model (``engine="comm"``).
    """
    model.to(device)
    if config.engine == "replica":
        return _replica(config, model)
    if config.engine == "ddp":
        return _ddp(config, model, mesh, device)
    if config.engine == "fsdp2":
        return _fsdp2(config, model, mesh)
    if config.engine == "simplefsdp":
        return _simplefsdp(config, model, mesh)
    raise ValueError(f"configuration {config.name!r} (engine {config.engine!r}) trains no model")


def _number(values: dict, key: str) -> float | None:
    value = values.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def comm_report_summary(module: nn.Module) -> dict | None:
    """Collective counts and cost-model predictions from ``simplefsdp.comm_report``.

    Returns ``None`` when ``module`` was not compiled by ``simplefsdp.compile``.
    Counts add the latest forward and backward graph of each compiled Dynamo
    graph. ``predicted_step_time_s`` sums the graphs' predicted ``time_s``
    (``None`` unless every graph has one); ``predicted_peak_mem_bytes`` is the
    largest predicted peak of any graph (``None`` when no graph has one).
    """
    import simplefsdp

    try:
        report = simplefsdp.comm_report(module)
    except ValueError:
        return None
    latest = {(g.graph_id, g.graph): g for g in report.graphs if g.graph != "inference"}
    counts = {kind: sum(g.count(kind) for g in latest.values()) for kind in COLLECTIVE_KINDS}
    predicted = {f"{name}{graph_id}": dict(g.predicted) for (graph_id, name), g in latest.items()}
    # Keys of simulate() (cost_model.py) and MemoryEstimate (memory.py).
    times = [_number(p, "time_s") for p in predicted.values()]
    peaks = [_number(p, "peak_bytes") for p in predicted.values()]
    complete_times = bool(times) and all(t is not None for t in times)
    known_peaks = [p for p in peaks if p is not None]
    return {
        "counts": counts,
        "predicted": {k: v for k, v in predicted.items() if v} or None,
        "predicted_step_time_s": sum(times) if complete_times else None,  # type: ignore[arg-type]
        "predicted_peak_mem_bytes": int(max(known_peaks)) if known_peaks else None,
    }
