"""The one parallelize recipe that ``simplefsdp train`` and ``simplefsdp bench`` call.

:func:`parallelize_model` applies, in torchtitan's order, to a model a
:class:`~simplefsdp.models.spec.ModelSpec` built:

1. the pipeline split (``spec.pipeline_split``) when the layout has ``pp > 1``;
2. tensor parallelism (``spec.tensor_parallel`` on ``meshes.tp``) and expert
   parallelism (``ExpertParallel`` on every ``experts`` module over ``meshes.ep``);
3. activation checkpointing;
4. the engine's data parallelism over ``meshes.fsdp`` (the experts over
   ``meshes.expert_dp``), the weights' initialisation after sharding
   (``spec.init_weights``);
5. compilation (whole graphs unless ``spec.fullgraph`` is ``False``);
6. context parallelism and document masks: the model's steps split each
   sequence over ``meshes.cp`` and mask packed documents
   (:class:`simplefsdp.context_parallel.SequenceOptions`). Nothing in the
   model changes: parameters keep their shapes, so checkpoints move between
   cp degrees.

Nothing here names a model family or compares engines: what differs per
family is the spec's, what differs per engine is its class's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.context_parallel import SequenceOptions
from simplefsdp.engines.adapters import EngineSpec, parallelize
from simplefsdp.engines.parallel_model import ParallelModel
from simplefsdp.engines.pipeline import PipelinedModel, PipelineSpec, parallelize_pipeline
from simplefsdp.layout import Meshes


@dataclass(frozen=True)
class RecipeOptions:
    """The recipe's settings beyond the engine's.

    Attributes:
        pipeline: how to pipeline (``None`` or ``pp == 1``: no pipeline).
        sequence_parallel: the TP plan shards activations over the sequence.
        loss_parallel: the TP plan leaves the logits sharded over the vocabulary.
        measure_times: a pipeline measures its stages' times.
        cp_backend: attention across context-parallel ranks (``allgather``,
            ``ring`` or ``ulysses``).
        eos_id: the end-of-document token: attention stays inside packed
            documents (``None``: plain causal attention).
        restart_positions: with ``eos_id``, rotary positions restart at 0
            in each document.
    """

    pipeline: PipelineSpec | None = None
    sequence_parallel: bool = True
    loss_parallel: bool = False
    measure_times: bool = False
    cp_backend: str = "allgather"
    eos_id: int | None = None
    restart_positions: bool = False


def parallelize_model(
    model: nn.Module,
    spec: Any,
    meshes: Meshes | DeviceMesh,
    engine: EngineSpec,
    device: torch.device,
    options: RecipeOptions | None = None,
) -> ParallelModel | PipelinedModel:
    """Parallelise ``model`` (built by ``spec``) on ``meshes`` with ``engine``; see the module.

    Args:
        model: the model, on the meta device (initialised with
            ``spec.init_weights`` after sharding, under the current RNG
            state) or with real weights (kept).
        spec: the model family's :class:`~simplefsdp.models.spec.ModelSpec`.
        meshes: the job's meshes (``Layout(...).build(device.type)``) or its
            world mesh.
        engine: the engine and its settings (``engine.tp``/``engine.ep``
            match the layout's).
        device: the training device.
        options: pipeline and TP-plan settings.

    Returns:
        A :class:`~simplefsdp.engines.ParallelModel`, or with a pipeline a
        :class:`~simplefsdp.engines.PipelinedModel`; either steps with
        ``spec.loss``.

    Raises:
        ValueError: the family lacks a plan the layout asks for, or the
            engine layer's errors.
    """
    options = options or RecipeOptions()
    pipelined = options.pipeline is not None and options.pipeline.pp > 1
    missing = [
        what
        for what, wanted, have in (
            ("a tensor-parallel plan", engine.tp > 1, spec.tensor_parallel),
            ("a pipeline split", pipelined, spec.pipeline_split),
        )
        if wanted and have is None
    ]
    if missing:
        raise ValueError(f"model family {spec.family!r} has no {' or '.join(missing)}")
    sequence = _sequence_options(meshes, options)
    if pipelined and sequence.eos_id is not None:
        raise ValueError(
            "pipeline stages split micro-batches by rows, which document masks depend on: "
            "use pp 1 with document masks"
        )
    if not spec.fullgraph and engine.fullgraph:
        engine = dataclasses.replace(engine, fullgraph=False)
    tp_fn = None
    if engine.tp > 1:
        tp_fn = functools.partial(
            spec.tensor_parallel,
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
        )
    kwargs = {
        "init_fn": lambda m: spec.init_weights(m, device),
        "tp_fn": tp_fn,
        "loss_fn": spec.loss,
    }
    if pipelined:
        return parallelize_pipeline(
            model,
            engine,
            options.pipeline,
            meshes,
            device,
            split_fn=spec.pipeline_split,
            measure_times=options.measure_times,
            sequence=sequence,
            **kwargs,
        )
    parallel = parallelize(model, engine, meshes, device, **kwargs)
    parallel.sequence = sequence
    return parallel


def _sequence_options(meshes: Meshes | DeviceMesh, options: RecipeOptions) -> SequenceOptions:
    """How steps split (over ``meshes.cp``) and mask their sequences."""
    cp_mesh = meshes.cp if isinstance(meshes, Meshes) else None
    if cp_mesh is None or cp_mesh.size() == 1:
        return SequenceOptions(
            backend=options.cp_backend,
            eos_id=options.eos_id,
            restart_positions=options.restart_positions,
        )
    return SequenceOptions(
        cp=cp_mesh.size(),
        rank=cp_mesh.get_local_rank(),
        group=cp_mesh.get_group().group_name,
        backend=options.cp_backend,
        eos_id=options.eos_id,
        restart_positions=options.restart_positions,
    )
