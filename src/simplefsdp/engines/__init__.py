"""The engine layer: one place that makes a model data parallel, for train and bench.

It owns the engines as classes with declared capabilities (:mod:`.kinds`:
simplefsdp compiled or not, simplefsdp with the eager executor, torch FSDP2,
DDP, the replica limit, and the bench's collectives-only baseline;
:func:`composition_errors` decides what composes), the one parallelize recipe
(:func:`parallelize_model`: pipeline split, TP/EP, activation checkpointing,
data parallelism, compilation), the :class:`ParallelModel` a training step
calls, the global gradient clip, device / process-group set-up, and the one
memory probe. Names load on first use: ``import simplefsdp.engines.kinds``
does not import torch.

Example::

    device = pick_device()
    init_distributed(device)
    meshes = Layout().build(device.type)
    with torch.device("meta"):
        model = spec.build(config)
    parallel = parallelize_model(model, spec, meshes, EngineSpec("simplefsdp", compile=True),
                                 device)
    parallel.step(inputs, targets)
"""

from __future__ import annotations

import importlib
from typing import Any

# every name this package loads on first use -> its module; __all__ is the
# documented (public) part
_EXPORTS = {
    "AC_MODES": "activation",
    "apply_activation_checkpointing": "activation",
    "clip_grad_norm_": "clip",
    "build_mesh": "distributed",
    "comm_device": "distributed",
    "data_parallel_rank": "distributed",
    "default_nproc": "distributed",
    "init_distributed": "distributed",
    "mesh_shape_for": "distributed",
    "pick_device": "distributed",
    "pipeline_mesh": "distributed",
    "split_mesh": "distributed",
    "stage_mesh": "distributed",
    "teardown_process_group": "distributed",
    "MemoryProbe": "memory",
    "lower_mmap_threshold": "memory",
    "COLLECTIVE_KINDS": "parallel_model",
    "LossFn": "parallel_model",
    "ParallelModel": "parallel_model",
    "plain_loss": "parallel_model",
    "ENGINES": "adapters",
    "EngineSpec": "adapters",
    "parallelize": "adapters",
    "torch_passes_patches": "adapters",
    "PIPELINE_SCHEDULES": "pipeline",
    "PipelinedModel": "pipeline",
    "PipelineSpec": "pipeline",
    "parallelize_pipeline": "pipeline",
    "stage_view": "pipeline",
    "Engine": "kinds",
    "composition_errors": "kinds",
    "engine_names": "kinds",
    "engines_with": "kinds",
    "get_engine": "kinds",
    "parallelize_model": "recipe",
    "RecipeOptions": "recipe",
    "job_errors": "resolve",
}

__all__ = [
    "Engine",
    "EngineSpec",
    "ParallelModel",
    "PipelineSpec",
    "PipelinedModel",
    "RecipeOptions",
    "build_mesh",
    "clip_grad_norm_",
    "composition_errors",
    "get_engine",
    "job_errors",
    "parallelize_model",
    "parallelize_pipeline",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simplefsdp.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"simplefsdp.engines.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
