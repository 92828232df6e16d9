"""The one check of a job's model, layout and engine, shared by train, bench and plan.

:func:`job_errors` asks each rule's owner and returns every error at once,
one line each: the layout (degrees against the world:
:meth:`simplefsdp.layout.Layout.validate`; pipeline settings:
:func:`simplefsdp.layout.pipeline.pipeline_errors`), the model family's spec
(what it composes with, then ``spec.validate(config, layout)``) and the
engine (:func:`simplefsdp.engines.kinds.composition_errors`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simplefsdp.engines.kinds import FEATURES, composition_errors
from simplefsdp.layout import Layout
from simplefsdp.layout.pipeline import num_stages, pipeline_errors

__all__ = ["job_errors"]

_NAMES = {
    "engine": "engine",
    "mode": "mode",
    "seq_len": "seq_len",
    "sequence_parallel": "sequence_parallel",
    "model": "model",
}


def job_errors(
    spec: Any,
    config: Any,
    layout: Layout,
    world_size: int,
    engine: Any = None,
    *,
    mode: str | None = None,
    float8: bool = False,
    group_reshard: bool | int = False,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    batch: int | None = None,
    pp_schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Every error of a job, one line each (empty: it can run).

    Args:
        spec: the model family's :class:`~simplefsdp.models.spec.ModelSpec`.
        config: the model's configuration.
        layout: the degrees (``dp_shard`` may be -1).
        world_size: ranks in the job.
        engine: the engine or its name (``None``: not checked).
        mode / float8 / group_reshard: the engine's features asked for.
        seq_len: the sequence length (at most the model's ``max_seq_len``;
            with ``sequence_parallel`` a multiple of ``tp``).
        batch: the per-rank batch, split into ``microbatches``.
        pp_schedule / microbatches / stages_per_rank: the pipeline's settings.
        model_name: the model's name, for the messages.
        names: how the caller's user spells each setting (its flags).
    """
    n = {**_NAMES, **{k: k for k in ("tp", "pp", "ep", "cp")}, **(names or {})}
    model = f"model {model_name!r}" if model_name else "the model"
    errors: list[str] = []
    if engine is not None:
        errors += composition_errors(
            engine,
            mode=mode,
            tp=layout.tp,
            pp=layout.pp,
            ep=layout.ep,
            cp=layout.cp,
            float8=float8,
            group_reshard=group_reshard,
            names=n,
        )
    layout_errors = layout.validate(world_size, names=n)
    errors += layout_errors
    missing = [
        k
        for k in ("tp", "pp", "ep", "cp")
        if isinstance(getattr(layout, k), int) and getattr(layout, k) > 1 and not spec.supports(k)
    ]
    for key in missing:
        errors.append(
            f"{n[key]} {getattr(layout, key)}: {model} (family {spec.family!r}) does not "
            f"compose with {FEATURES[key]}; use {n[key]} 1"
        )
    if not layout_errors:
        for line in spec.validate(config, layout.resolve(world_size)):
            key = line.split(" ", 1)[0]
            if key in missing:
                continue
            if key in ("tp", "pp", "ep", "cp"):  # the family names a degree: the caller's flag
                line = n[key] + line[len(key) :]
            errors.append(line)
    max_seq_len = getattr(config, "max_seq_len", None)
    if seq_len is not None and max_seq_len is not None and seq_len > max_seq_len:
        errors.append(
            f"{n['seq_len']} {seq_len} exceeds max_seq_len {max_seq_len} of {model}; "
            f"use {n['seq_len']} <= {max_seq_len}"
        )
    tp = layout.tp if isinstance(layout.tp, int) else 1
    if tp > 1 and sequence_parallel and seq_len is not None and seq_len % tp:
        errors.append(
            f"{n['seq_len']} {seq_len} is not divisible by {n['tp']} {tp} (sequence "
            f"parallelism shards the sequence over the TP ranks); use a multiple of {tp} "
            f"or {n['sequence_parallel']} false"
        )
    pp = layout.pp if isinstance(layout.pp, int) else 1
    n_layers = getattr(config, "n_layers", None)
    stages = num_stages(pp, pp_schedule, stages_per_rank)
    if pp > 1 and n_layers is not None and stages > n_layers:
        errors.append(
            f"{n['pp']} {pp} x {stages // pp} stages per rank = {stages} stages but {model} "
            f"has {n_layers} layers; use at most {n_layers} stages"
        )
    errors += pipeline_errors(pp, pp_schedule, microbatches, stages_per_rank, batch=batch, names=n)
    return errors
