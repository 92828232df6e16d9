"""How a training job maps onto the engine layer: its layout, meshes, engine and model.

``simplefsdp train``'s parallel section becomes a :class:`~simplefsdp.layout.Layout`
(:func:`job_layout`; its meshes by role: :func:`job_mesh`) and, with the
compile and activation-checkpoint sections, one
:class:`~simplefsdp.engines.EngineSpec`; :func:`parallelize_job` runs the one
recipe, :func:`simplefsdp.engines.parallelize_model`, with the model
family's spec (the benchmark runs it too).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import (
    EngineSpec,
    ParallelModel,
    PipelinedModel,
    PipelineSpec,
    get_engine,
)
from simplefsdp.engines.recipe import RecipeOptions, parallelize_model
from simplefsdp.layout import Layout, Meshes
from simplefsdp.train.config import JobConfig


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
        fullgraph=c.fullgraph,
        activation_checkpoint=job.activation_checkpoint.mode,
        recompute_experts=job.activation_checkpoint.recompute_experts,
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


def job_layout(job: JobConfig, world_size: int) -> Layout:
    """The degrees of ``job`` on ``world_size`` ranks (``dp_shard`` resolved).

    ``parallel.mode`` ``hybrid_shard`` takes ``parallel.mesh_shape`` (or
    replicas across hosts, ``LOCAL_WORLD_SIZE`` ranks per host); the others
    shard over every data-parallel rank (FSDP2's ``replicate``: HSDP on
    ``(dp, 1)``).

    Raises:
        ValueError: the degrees do not fit ``world_size`` (every error, one per line).
    """
    p = job.parallel
    layout = Layout.for_data_parallel(
        p.mode,
        world_size,
        mesh_shape=p.mesh_shape,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        replicate_on_2d=get_engine(p.engine).replicate_on_2d,
        cp=getattr(p, "cp", 1),
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
    )
    return layout.resolve(world_size)


def job_mesh(job: JobConfig, device: torch.device) -> Meshes:
    """The job's meshes over the default process group, by role (:meth:`Layout.build`)."""
    world = dist.get_world_size()
    return job_layout(job, world).build(device.type, world)


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
    """The :class:`~simplefsdp.models.spec.ModelSpec` of the job's model: the
    family ``checkpoint.init_from_hf``'s folder picks (Note: [Which family
    reads a folder] in :mod:`simplefsdp.checkpoint.hf`), else ``model.name``'s.

    Raises:
        ValueError: a folder no family reads (one line).
    """
    from simplefsdp.models.registry import spec_of

    if job.checkpoint.init_from_hf is not None:
        return hf_model(job)[0]
    return spec_of(job.model.name)


def hf_model(job: JobConfig) -> tuple[Any, Any]:
    """``(spec, config)`` of ``checkpoint.init_from_hf``'s folder, checked
    against ``model.name`` (when not the default) and ``model.vocab_size``,
    with ``model.max_seq_len`` applied.

    Raises:
        ValueError: an unreadable or unsupported folder, another family or
            architecture than ``model.name``'s, or another vocabulary (one
            line naming the fields that differ).
    """
    import dataclasses

    from simplefsdp.checkpoint.hf import CONFIG_FILE, hf_model_of_folder
    from simplefsdp.models.registry import family_of, resolve_flavor
    from simplefsdp.train.config.schema import ModelConfig

    m, ck = job.model, job.checkpoint
    folder = ck.init_from_hf or ""
    source = os.path.join(folder, CONFIG_FILE)
    spec, config = hf_model_of_folder(folder, trust_remote_code=ck.trust_remote_code)
    if m.max_seq_len is not None:
        config = dataclasses.replace(config, max_seq_len=m.max_seq_len)
    if m.name != ModelConfig.name:  # a named model must be the folder's
        family = family_of(m.name)
        if family != spec.family:
            raise ValueError(
                f"model.name {m.name!r} is of family {family!r} but {source} holds a "
                f"{spec.family!r} model; leave out model.name to take the model from it"
            )
        named = resolve_flavor(m.name, vocab_size=m.vocab_size or config.vocab_size)[1]
        differ = spec.hf_adapter.config_differences(named, config)
        if differ:
            raise ValueError(
                f"model.name {m.name!r} differs from {source}: {'; '.join(differ)} "
                f"(model vs checkpoint); leave out model.name to take the model from it"
            )
    if m.vocab_size is not None and m.vocab_size != config.vocab_size:
        raise ValueError(
            f"model.vocab_size {m.vocab_size} differs from vocab_size {config.vocab_size} "
            f"of {source}; leave out model.vocab_size"
        )
    if m.load_balance != "auto" and "load_balance" in {f.name for f in dataclasses.fields(config)}:
        config = dataclasses.replace(config, load_balance=m.load_balance)
    return spec, config


def model_config(job: JobConfig, **overrides: Any) -> Any:
    """The configuration of the job's model (its family's config type): the
    one ``checkpoint.init_from_hf``'s folder describes (:func:`hf_model`;
    ``overrides`` must then agree with it), else the one ``model.name`` names.

    Args:
        job: the job (``model.name``; ``model.load_balance`` where the
            configuration has that field).
        **overrides: fields to replace (``vocab_size``, ``max_seq_len``).

    Raises:
        ValueError: an invalid resulting configuration.
    """
    import dataclasses

    from simplefsdp.models.registry import resolve_flavor

    if job.checkpoint.init_from_hf is not None:
        return hf_model(job)[1]
    spec = model_spec(job)
    if job.model.load_balance != "auto" and "load_balance" in {
        f.name for f in dataclasses.fields(spec.config_type)
    }:
        overrides.setdefault("load_balance", job.model.load_balance)
    return resolve_flavor(job.model.name, **overrides)[1]


def parallelize_job(
    model: torch.nn.Module,
    job: JobConfig,
    device: torch.device,
    mesh: Meshes | DeviceMesh | None = None,
    eos_id: int | None = None,
) -> ParallelModel | PipelinedModel:
    """Parallelise a model built on the meta device (or CPU) as ``job`` says.

    :func:`simplefsdp.engines.parallelize_model` with the family's spec,
    ``mesh`` (default: :func:`job_mesh`), :func:`engine_spec` and, with
    ``parallel.pp > 1``, :func:`pipeline_spec`; a meta model's weights are
    initialised with the spec's ``init_weights`` under the current RNG state.
    With ``data.mask_document_boundaries``, attention stays inside the
    documents that ``eos_id`` (the tokenizer's end-of-document token) ends.
    """
    p = job.parallel
    spec = model_spec(job)  # the folder's family with checkpoint.init_from_hf
    if job.float8.enable:
        convert_to_float8(model, job, skip=spec.float8_skip_fqns)
    options = RecipeOptions(
        pipeline_spec(job) if p.pp > 1 else None,
        sequence_parallel=p.sequence_parallel,
        loss_parallel=p.loss_parallel,
        cp_backend=getattr(p, "cp_backend", "allgather"),
        eos_id=eos_id if getattr(job.data, "mask_document_boundaries", False) else None,
        restart_positions=getattr(job.data, "restart_positions", False),
    )
    engine = engine_spec(job)
    if spec.data_dependent_reads is not None and spec.data_dependent_reads(model_config(job)):
        engine = dataclasses.replace(engine, fullgraph=False)  # its expert loop breaks graphs
    return parallelize_model(
        model,
        spec,
        mesh if mesh is not None else job_mesh(job, device),
        engine,
        device,
        options,
    )
