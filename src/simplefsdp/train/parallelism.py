"""How a training job maps onto the engine layer: its mesh, spec and model.

``simplefsdp train``'s parallel, compile and activation-checkpoint sections
become one :class:`~simplefsdp.engines.EngineSpec`; ``parallel.tp > 1`` adds
the Llama 3 tensor-parallel plan, ``parallel.pp > 1`` splits the model into
pipeline stages (:func:`simplefsdp.models.llama3.pipeline_split`) run by
torch's schedules (:class:`~simplefsdp.engines.PipelinedModel`): the one
Llama 3 recipe, :func:`simplefsdp.models.llama3.parallelize.parallelize_llama`,
which the benchmark runs too. A mixture-of-experts model (``model.name`` in
:data:`~simplefsdp.train.config.schema.MOE_MODELS`) takes
:func:`simplefsdp.models.moe.parallelize.parallelize_moe` instead, with
``parallel.ep > 1`` on the ``("dp_shard_mod_ep", "ep")`` mesh of
:func:`simplefsdp.frontend.expert_parallel.build_expert_parallel_mesh`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import (
    EngineSpec,
    ParallelModel,
    PipelinedModel,
    PipelineSpec,
    build_mesh,
)
from simplefsdp.train.config import JobConfig
from simplefsdp.train.config.schema import MOE_MODELS

__all__ = [
    "engine_spec",
    "is_moe",
    "job_mesh",
    "keep_gathered_option",
    "model_config",
    "parallelize_job",
    "pipeline_spec",
]


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
        keep_gathered=keep_gathered_option(c.keep_gathered),
        activation_checkpoint=job.activation_checkpoint.mode,
        tp=p.tp,
        check_ranks=p.check_ranks,
        ep=p.ep,
    )


def keep_gathered_option(value: str | None) -> int | str | list[str] | None:
    """``compile.keep_gathered`` as ``simplefsdp.compile`` takes it: ``None``,
    ``"auto"``, an int (a number) or a list of module names (comma-separated)."""
    text = "" if value is None else value.strip()
    if not text:
        return None
    if text == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    return [name.strip() for name in text.split(",") if name.strip()]


def pipeline_spec(job: JobConfig) -> PipelineSpec:
    """The engine layer's description of ``job``'s pipeline settings (``parallel.pp``)."""
    p = job.parallel
    return PipelineSpec(
        p.pp,
        p.pp_schedule,
        microbatches=p.microbatches if p.microbatches is not None else p.pp,
        stages_per_rank=p.pp_stages_per_rank,
    )


def job_mesh(job: JobConfig, device: torch.device) -> DeviceMesh:
    """The job's mesh over the default process group: ``pp``, data-parallel dims, ``tp``.

    With ``parallel.ep > 1``: the flattened ``"dp"`` mesh of the
    ``("dp_shard_mod_ep", "ep")`` mesh over all ranks (its root holds both).
    """
    p = job.parallel
    if p.ep > 1:
        from simplefsdp.frontend.expert_parallel import build_expert_parallel_mesh

        num_experts = model_config(job).num_experts
        _, dp_mesh = build_expert_parallel_mesh(
            device.type, dist.get_world_size(), p.ep, num_experts
        )
        return dp_mesh
    return build_mesh(
        p.engine,
        p.mode,
        device.type,
        dist.get_world_size(),
        mesh_shape=p.mesh_shape,
        tp=p.tp,
        pp=p.pp,
    )


def convert_to_float8(model: torch.nn.Module, job: JobConfig) -> torch.nn.Module:
    """Swap ``model``'s linear layers for torchao ``Float8Linear`` as ``job.float8`` says.

    ``tensorwise``: dynamic tensorwise scaling with float8 all-gathers
    (Note: [Float8 all-gather]); ``rowwise``: torchao's rowwise recipe (the
    weights gather in ``param_dtype``, as under FSDP2). Skipped: modules whose
    name contains one of ``float8.filter_fqns`` and layers whose dims are not
    multiples of 16 (torchtitan's filter). Works on a meta-device model.

    Raises:
        ValueError: torchao is not installed (one line naming the extra).
    """
    from simplefsdp import convert_linears_to_float8

    return convert_linears_to_float8(model, job.float8.recipe, job.float8.filter_fqns)


# --------------------------------------------------------------------------- MoE models


def is_moe(job: JobConfig) -> bool:
    """``model.name`` is a mixture-of-experts configuration."""
    return job.model.name in MOE_MODELS


def model_config(job: JobConfig, **overrides: Any) -> Any:
    """The model arguments ``model.name`` names (Llama 3 ``ModelArgs`` or ``MoEArgs``).

    Args:
        job: the job (``model.name``; ``model.load_balance`` for MoE models).
        **overrides: fields to replace (``vocab_size``, ``max_seq_len``).

    Raises:
        ValueError: an invalid resulting configuration.
    """
    if not is_moe(job):
        from simplefsdp.models.llama3 import get_config

        return get_config(job.model.name, **overrides)
    from simplefsdp.models.moe import get_config as moe_config

    overrides.setdefault("load_balance", job.model.load_balance)
    return moe_config(job.model.name, **overrides)


def parallelize_job(
    model: torch.nn.Module,
    job: JobConfig,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> ParallelModel | PipelinedModel:
    """Parallelise a Llama 3 or MoE model built on the meta device as ``job`` says.

    :func:`simplefsdp.models.llama3.parallelize.parallelize_llama` with
    ``mesh`` (default: :func:`job_mesh`), :func:`engine_spec` and, with
    ``parallel.pp > 1``, :func:`pipeline_spec`; the weights are initialised
    with the model's ``init_weights`` under the current RNG state.
    """
    from simplefsdp.models.llama3.parallelize import parallelize_llama

    p = job.parallel
    if is_moe(job):
        from simplefsdp.models.moe.parallelize import parallelize_moe

        return parallelize_moe(
            model, engine_spec(job), mesh if mesh is not None else job_mesh(job, device), device
        )
    if job.float8.enable:
        convert_to_float8(model, job)
    return parallelize_llama(
        model,
        engine_spec(job),
        mesh if mesh is not None else job_mesh(job, device),
        device,
        pipeline=pipeline_spec(job) if p.pp > 1 else None,
        sequence_parallel=p.sequence_parallel,
        loss_parallel=p.loss_parallel,
    )
