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
from types import SimpleNamespace
from typing import Any

from simplefsdp.engines.kinds import FEATURES, composition_errors, get_engine
from simplefsdp.layout import Layout
from simplefsdp.layout.pipeline import num_stages, pipeline_errors

_NAMES = {
    "engine": "engine",
    "mode": "mode",
    "seq_len": "seq_len",
    "sequence_parallel": "sequence_parallel",
    "model": "model",
    "float8": "float8",
    "hf": "init_from_hf",
    "compile": "compile",
}

#: How messages name a capability a family may lack.
_CAPABILITY_WORDS = {**FEATURES, "hf": "Hugging Face weights"}


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
    loss_parallel: bool = False,
    hf_weights: bool = False,
    compile: bool = False,
    fullgraph: bool = True,
    build: bool = True,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
    cp_backend: str = "allgather",
    document_masks: bool = False,
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
        loss_parallel: the TP plan splits the output over the vocabulary.
        hf_weights: the job starts from Hugging Face weights.
        compile: the model is compiled; ``fullgraph`` false: around graph
            breaks.
        build: the model is built (``False``: planned only, so flavors the
            family cannot build yet pass).
        model_name: the model's name, for the messages.
        names: how the caller's user spells each setting (its flags).
        cp_backend: attention across context-parallel ranks.
        document_masks: attention is masked to packed documents.
    """
    n = {**_NAMES, **{k: k for k in ("tp", "pp", "ep", "cp")}, **(names or {})}
    model = f"model {model_name!r}" if model_name else "the model"
    errors: list[str] = []
    if isinstance(engine, str):
        engine = get_engine(engine)
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
    features = {
        **{k: getattr(layout, k) for k in ("tp", "pp", "ep", "cp")},
        "float8": float8,
        "hf": hf_weights,
    }
    missing = [
        k
        for k, value in features.items()
        if value and (isinstance(value, bool) or value > 1) and not spec.supports(k)
    ]
    for key in missing:
        degree = key in ("tp", "pp", "ep", "cp")
        what = f"{n[key]} {features[key]}" if degree else n[key]
        fix = f"use {n[key]} 1" if degree else f"leave {n[key]} unset"
        errors.append(
            f"{what}: {model} (family {spec.family!r}) does not compose with "
            f"{_CAPABILITY_WORDS[key]}; {fix} (the family composes with: "
            f"{', '.join(sorted(spec.capabilities)) or 'data parallelism only'})"
        )
    if not layout_errors:
        degrees = layout.resolve(world_size)
        # the degrees and the pipeline's stage count, which the family checks its layers against
        view = SimpleNamespace(
            **degrees.degrees(),
            num_stages=num_stages(degrees.pp, pp_schedule, stages_per_rank),
        )
        for line in spec.validate(
            config,
            view,
            seq_len=seq_len,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            build=build,
            model_name=model_name,
            names=n,
        ):
            if not any(line.startswith(f"{n[k]} ") for k in missing if k in n):
                errors.append(line)
    if (
        engine is not None
        and engine.needs_same_reads
        and spec.data_dependent_reads is not None
        and spec.data_dependent_reads(config)
    ):
        errors.append(
            f"{n.get('engine', 'engine')} {engine.name}: {model} runs only the experts its "
            "tokens picked, so ranks with different data would read different parameters; "
            f"use {n.get('engine', 'engine')} simplefsdp_eager (it gathers and reduces whole "
            "blocks)"
        )
    tp = layout.tp if isinstance(layout.tp, int) else 1
    breaks = not spec.fullgraph or (
        spec.data_dependent_reads is not None and spec.data_dependent_reads(config)
    )
    if tp > 1 and compile and not fullgraph:
        flag = n.get("fullgraph", "fullgraph")
        errors.append(
            f"{n['tp']} {tp} with {flag} false: tensor parallelism compiles whole graphs; "
            f"use {flag} true, {n.get('compile', 'compile')} false or {n['tp']} 1"
        )
    elif tp > 1 and compile and breaks:
        # A DTensor graph split by graph breaks fails in AOTAutograd ("Mixing
        # fake modes"): tensor parallelism of such a model runs uncompiled.
        errors.append(
            f"{n['tp']} {tp} with {n.get('compile', 'compile')} true: {model} compiles with "
            f"graph breaks, which tensor parallelism does not support; use "
            f"{n.get('compile', 'compile')} false or {n['tp']} 1"
        )
    errors += _sequence_errors(
        config, layout, seq_len, cp_backend, document_masks, model, n, spec.supports("cp")
    )
    cp = layout.cp if isinstance(layout.cp, int) else 1
    wants_context = document_masks or (cp > 1 and spec.supports("cp"))
    refusal = (
        spec.sequence_context_error(config)
        if wants_context and build and spec.sequence_context_error is not None
        else None
    )
    if refusal is not None:
        key = n.get("mask_document_boundaries")
        masks = (f"{key} false", key) if key else ("no document masks", "document masks")
        what = f"{n['cp']} {cp}" if cp > 1 else masks[1]
        fixes = ([f"{n['cp']} 1"] if cp > 1 else []) + ([masks[0]] if document_masks else [])
        errors.append(
            f"{what}: {model} cannot take a sequence context: {refusal}; use {' and '.join(fixes)}"
        )
    pp = layout.pp if isinstance(layout.pp, int) else 1
    errors += pipeline_errors(pp, pp_schedule, microbatches, stages_per_rank, batch=batch, names=n)
    return errors


def _sequence_errors(
    config: Any,
    layout: Layout,
    seq_len: int | None,
    backend: str,
    document_masks: bool,
    model: str,
    n: Mapping[str, str],
    supported: bool,
) -> list[str]:
    """Context parallelism and document masks against the sequence, heads and stages.

    The rules of :mod:`simplefsdp.context_parallel` that any family's job
    meets: the head-tail split cuts the sequence into ``2 x cp`` chunks;
    Ulysses splits each rank's ``n_heads / tp`` heads over ``cp``; pipeline
    schedules split micro-batches by rows, which document masks depend on.
    """
    cp = layout.cp if isinstance(layout.cp, int) else 1
    tp = layout.tp if isinstance(layout.tp, int) else 1
    pp = layout.pp if isinstance(layout.pp, int) else 1
    flag, backend_flag = n["cp"], n.get("cp_backend", "cp_backend")
    errors = []
    if cp > 1 and supported and seq_len is not None and seq_len % (2 * cp):
        errors.append(
            f"{n['seq_len']} {seq_len} is not divisible by 2 x {flag} = {2 * cp} (the "
            f"head-tail split); use a multiple of {2 * cp}, or {flag} 1"
        )
    heads = getattr(config, "n_heads", None)
    if cp > 1 and supported and backend == "ulysses" and heads and heads % (tp * cp):
        errors.append(
            f"{backend_flag} 'ulysses': the {heads} attention heads of {model} do not divide "
            f"by tp x cp = {tp * cp}; use {backend_flag} allgather or ring"
        )
    if pp > 1 and document_masks:
        what = n.get("mask_document_boundaries", "document masks")
        errors.append(
            f"{what}: pipeline schedules split micro-batches by rows, which document masks "
            f"depend on; use {n['pp']} 1 with document masks"
        )
    return errors
