"""How a training job maps onto the engine layer: its mesh, spec and model.

``simplefsdp train``'s parallel, compile and activation-checkpoint sections
become one :class:`~simplefsdp.engines.EngineSpec`; what is the model's comes
from its family's :class:`~simplefsdp.models.spec.ModelSpec` (found from
``model.name`` through :mod:`simplefsdp.models.registry`): ``parallel.tp > 1``
applies ``spec.tensor_parallel``, ``parallel.pp > 1`` splits the model with
``spec.pipeline_split`` into stages run by torch's schedules
(:class:`~simplefsdp.engines.PipelinedModel`), ``parallel.ep > 1`` shards the
``experts`` modules on the ``("dp_shard_mod_ep", "ep")`` mesh of
:func:`simplefsdp.frontend.expert_parallel.build_expert_parallel_mesh`, and
``spec.loss``/``spec.init_weights``/``spec.fullgraph`` fill in the rest.
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

__all__ = [
    "engine_spec",
    "model_spec",
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


def convert_to_float8(
    model: torch.nn.Module, job: JobConfig, skip: tuple[str, ...] = ()
) -> torch.nn.Module:
    """Swap ``model``'s linear layers for torchao ``Float8Linear`` as ``job.float8`` says.

    ``tensorwise``: dynamic tensorwise scaling with float8 all-gathers
    (Note: [Float8 all-gather]); ``rowwise``: torchao's rowwise recipe (the
    weights gather in ``param_dtype``, as under FSDP2). Skipped: modules whose
    name contains one of ``float8.filter_fqns`` or of ``skip`` (the model
    family's ``float8_skip_fqns``) and layers whose dims are not multiples of
    16 (torchtitan's filter). Works on a meta-device model.

    Raises:
        ValueError: torchao is not installed (one line naming the extra).
    """
    from simplefsdp import convert_linears_to_float8

    filter_fqns = ",".join([job.float8.filter_fqns, *skip])
    return convert_linears_to_float8(model, job.float8.recipe, filter_fqns)


# --------------------------------------------------------------------------- the model


def model_spec(job: JobConfig) -> Any:
    """The :class:`~simplefsdp.models.spec.ModelSpec` of ``model.name``'s family."""
    from simplefsdp.models.registry import spec_of

    return spec_of(job.model.name)


def model_config(job: JobConfig, **overrides: Any) -> Any:
    """The configuration ``model.name`` names (its family's config type).

    Args:
        job: the job (``model.name``; ``model.load_balance`` where the
            configuration has that field).
        **overrides: fields to replace (``vocab_size``, ``max_seq_len``).

    Raises:
        ValueError: an invalid resulting configuration.
    """
    import dataclasses

    from simplefsdp.models.registry import resolve_flavor

    spec = model_spec(job)
    if "load_balance" in {f.name for f in dataclasses.fields(spec.config_type)}:
        overrides.setdefault("load_balance", job.model.load_balance)
    return resolve_flavor(job.model.name, **overrides)[1]


def parallelize_job(
    model: torch.nn.Module,
    job: JobConfig,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> ParallelModel | PipelinedModel:
    """Parallelise a model built on the meta device as ``job`` says.

    The model's family spec supplies the tensor-parallel plan, the pipeline
    split, the initialisation, the loss and whether a compiled forward is
    one graph; ``mesh`` defaults to :func:`job_mesh`, the engine spec to
    :func:`engine_spec` and, with ``parallel.pp > 1``, the pipeline to
    :func:`pipeline_spec`. The weights are initialised with the spec's
    ``init_weights`` under the current RNG state.
    """
    import dataclasses
    import functools

    from simplefsdp.engines import parallelize, parallelize_pipeline

    p = job.parallel
    spec = model_spec(job)
    engine = engine_spec(job)
    if not spec.fullgraph:
        engine = dataclasses.replace(engine, fullgraph=False)
    if job.float8.enable:
        convert_to_float8(model, job, skip=spec.float8_skip_fqns)
    tp_fn = None
    if p.tp > 1:
        tp_fn = functools.partial(
            spec.tensor_parallel,
            sequence_parallel=p.sequence_parallel,
            loss_parallel=p.loss_parallel,
        )
    kwargs = {
        "init_fn": lambda m: spec.init_weights(m, device),
        "tp_fn": tp_fn,
        "loss_fn": spec.loss,
    }
    mesh = mesh if mesh is not None else job_mesh(job, device)
    if p.pp > 1:
        return parallelize_pipeline(
            model, engine, pipeline_spec(job), mesh, device, split_fn=spec.pipeline_split, **kwargs
        )
    return parallelize(model, engine, mesh, device, **kwargs)
