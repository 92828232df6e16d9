"""The one resolve step of ``simplefsdp train``: a job -> (spec, config, layout, engine).

:func:`resolve` runs before any process starts and returns every error at
once, one line each. Each rule has one owner, asked here: the config schema
(types and ranges, when the job was loaded), then through
:func:`simplefsdp.engines.resolve.job_errors` the layout, the model family's
spec and the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from simplefsdp.engines.kinds import Engine, get_engine
from simplefsdp.engines.resolve import job_errors as engine_job_errors
from simplefsdp.layout import Layout
from simplefsdp.train.config import JobConfig

#: How ``simplefsdp train`` spells each setting in error messages.
FLAGS = {
    "engine": "parallel.engine",
    "mode": "parallel.mode",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "cp": "parallel.cp",
    "cp_backend": "parallel.cp_backend",
    "mask_document_boundaries": "data.mask_document_boundaries",
    "dp_replicate": "dp_replicate (parallel.mesh_shape[0])",
    "dp_shard": "dp_shard (parallel.mesh_shape[1])",
    "world_size": "world size",
    "pp_schedule": "parallel.pp_schedule",
    "microbatches": "parallel.microbatches",
    "stages_per_rank": "parallel.pp_stages_per_rank",
    "batch": "data.batch_size",
    "seq_len": "data.seq_len",
    "max_seq_len": "model.max_seq_len",
    "sequence_parallel": "--parallel.sequence_parallel",
    "loss_parallel": "parallel.loss_parallel",
    "float8": "float8.enable",
    "hf": "checkpoint.init_from_hf",
    "compile": "compile.enable",
    "fullgraph": "compile.fullgraph",
    "group_reshard": "parallel.reshard_after_forward",
}


@dataclass(frozen=True)
class ResolvedJob:
    """What a job trains and how: the family's spec, the model config, the
    resolved layout and the engine."""

    spec: Any
    config: Any
    layout: Layout
    engine: Engine


def _model(job: JobConfig) -> tuple[Any, Any]:
    """``(spec, config)``: the family and configuration ``checkpoint.init_from_hf``'s
    ``config.json`` describes (checked against ``model.*``), else ``model.name``'s."""
    from simplefsdp.train.parallelism import hf_model, model_config, model_spec

    if job.checkpoint.init_from_hf is not None:
        return hf_model(job)
    m = job.model
    overrides = {
        key: value
        for key, value in (("vocab_size", m.vocab_size), ("max_seq_len", m.max_seq_len))
        if value is not None
    }
    return model_spec(job), model_config(job, **overrides)


def job_errors(
    job: JobConfig, world_size: int, local_world_size: int | None = None
) -> tuple[list[str], ResolvedJob | None]:
    """Every error of ``job`` on ``world_size`` ranks, one line each, and the
    resolved job when there are none.

    Args:
        job: a loaded (schema-validated) job.
        world_size: ranks in the job.
        local_world_size: ranks per node (``hybrid_shard``'s default shape;
            default: ``LOCAL_WORLD_SIZE`` or ``world_size``).
    """
    p, d, m = job.parallel, job.data, job.model
    cp = getattr(p, "cp", 1)
    try:
        spec, config = _model(job)
    except ValueError as exc:
        folder = job.checkpoint.init_from_hf
        where = f"model.name {m.name!r}" if folder is None else f"{FLAGS['hf']} {folder!r}"
        return [f"{where}: {exc}"], None
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    engine = get_engine(p.engine)
    errors: list[str] = []
    layout = Layout(tp=p.tp, pp=p.pp, ep=p.ep, cp=cp)
    try:
        layout = Layout.for_data_parallel(
            p.mode,
            world_size,
            mesh_shape=p.mesh_shape,
            local_world_size=local_world_size,
            replicate_on_2d=engine.replicate_on_2d,
            cp=cp,
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
        )
    except ValueError as exc:
        errors.append(str(exc))
    errors += engine_job_errors(
        spec,
        config,
        layout,
        world_size,
        engine,
        mode=p.mode,
        float8=job.float8.enable,
        # an int N regathers over groups of N ranks; true/false is not a group size
        group_reshard=(
            False if isinstance(p.reshard_after_forward, bool) else p.reshard_after_forward
        ),
        seq_len=d.seq_len,
        sequence_parallel=p.sequence_parallel,
        batch=d.batch_size,
        pp_schedule=p.pp_schedule,
        microbatches=p.microbatches if p.pp > 1 else None,
        stages_per_rank=p.pp_stages_per_rank,
        # the vocabulary is only known here when given (else it is the tokenizer's)
        loss_parallel=m.vocab_size is not None and p.loss_parallel,
        hf_weights=job.checkpoint.init_from_hf is not None,
        compile=job.compile.enable,
        fullgraph=job.compile.fullgraph,
        model_name=job.checkpoint.init_from_hf or m.name,
        names=FLAGS,
        cp_backend=getattr(p, "cp_backend", "allgather"),
        document_masks=getattr(d, "mask_document_boundaries", False),
    )
    if errors:
        return errors, None
    return [], ResolvedJob(spec, config, layout.resolve(world_size), engine)


def resolve(job: JobConfig, world_size: int, local_world_size: int | None = None) -> ResolvedJob:
    """``(spec, config, layout, engine)`` of ``job`` on ``world_size`` ranks.

    Raises:
        ValueError: every error of :func:`job_errors`, one per line.
    """
    errors, resolved = job_errors(job, world_size, local_world_size)
    if errors:
        raise ValueError("\n".join(errors))
    assert resolved is not None
    return resolved
