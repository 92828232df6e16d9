"""How a training job maps onto the engine layer: its mesh, spec and model.

``simplefsdp train``'s parallel, compile and activation-checkpoint sections
become one :class:`~simplefsdp.engines.EngineSpec`; ``parallel.tp > 1`` adds
the Llama 3 tensor-parallel plan.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import EngineSpec, ParallelModel, build_mesh, parallelize
from simplefsdp.train.config import JobConfig

__all__ = ["engine_spec", "job_mesh", "parallelize_job"]


def engine_spec(job: JobConfig) -> EngineSpec:
    """The engine layer's description of ``job``'s parallel, compile and AC sections."""
    p, c = job.parallel, job.compile
    return EngineSpec(
        engine=p.engine,
        mode=p.mode,
        param_dtype=p.param_dtype,
        reduce_dtype=p.reduce_dtype,
        reshard_after_forward=p.reshard_after_forward,
        compile=c.enable,
        backend=c.backend,
        bucketing=c.bucketing,
        activation_checkpoint=job.activation_checkpoint.mode,
        tp=p.tp,
    )


def job_mesh(job: JobConfig, device: torch.device) -> DeviceMesh:
    """The job's mesh over the default process group: data-parallel dims, then ``tp``."""
    p = job.parallel
    return build_mesh(
        p.engine, p.mode, device.type, dist.get_world_size(), mesh_shape=p.mesh_shape, tp=p.tp
    )


def parallelize_job(
    model: torch.nn.Module,
    job: JobConfig,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> ParallelModel:
    """Parallelise a Llama 3 model built on the meta device as ``job`` says.

    Uses ``mesh`` (default: :func:`job_mesh`), applies the Llama 3 tensor-parallel
    plan when ``parallel.tp > 1`` and :func:`engine_spec` through
    ``simplefsdp.engines.parallelize``, and initialises the weights with the
    model's ``init_weights`` under the current RNG state.
    """
    from simplefsdp.models.llama3 import apply_tensor_parallel

    p = job.parallel
    tp_fn = functools.partial(
        apply_tensor_parallel, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel
    )
    return parallelize(
        model,
        engine_spec(job),
        mesh if mesh is not None else job_mesh(job, device),
        device,
        init_fn=lambda m: m.init_weights(buffer_device=device),
        tp_fn=tp_fn if p.tp > 1 else None,
    )
