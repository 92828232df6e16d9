"""The Llama 3 parallelisation recipe: one function that ``simplefsdp train``
and ``simplefsdp bench`` both call (torchtitan's ``parallelize_llama``).

It composes the engine layer (``simplefsdp.engines``) with what is Llama's:
the tensor-parallel plan (``tensor_parallel.py``), the split into pipeline
stages (``stages.py``), the weights' initialisation (``init_weights``) and the
loss (:func:`cross_entropy`). Activation checkpointing, data parallelism and
compilation are the :class:`~simplefsdp.engines.EngineSpec`'s. The model
package itself stays plain modules: ``import simplefsdp.models.llama3`` does
not load this file.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines import (
    EngineSpec,
    ParallelModel,
    PipelinedModel,
    PipelineSpec,
    parallelize,
    parallelize_pipeline,
)
from simplefsdp.models.llama3.stages import pipeline_split
from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel

__all__ = ["cross_entropy", "parallelize_llama"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean token cross-entropy of ``(B, T, V)`` logits, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize_llama(
    model: nn.Module,
    spec: EngineSpec,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    pipeline: PipelineSpec | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    measure_times: bool = False,
) -> ParallelModel | PipelinedModel:
    """Parallelise a Llama 3 :class:`~simplefsdp.models.llama3.Transformer`.

    With ``spec.tp > 1`` the Llama 3 tensor-parallel plan is applied on the
    mesh's ``"tp"`` dim; then ``spec``'s activation checkpointing, engine
    and compilation (:func:`simplefsdp.engines.parallelize`). A model on the
    meta device is initialised with its ``init_weights`` after sharding,
    under the current RNG state; a model with real weights keeps them. With
    ``pipeline.pp > 1`` the model is split into stages by layer ranges and
    each of this rank's stages is parallelised so (and, on the meta device,
    initialised on its own: the initial weights differ from an unsplit
    run's).

    Args:
        model: the model, on the meta device or with real weights.
        spec: the engine and its settings.
        mesh: the job's mesh (``simplefsdp.engines.build_mesh``).
        device: the training device.
        pipeline: how to pipeline (``None`` or ``pp == 1``: no pipeline).
        sequence_parallel: the TP plan shards activations over the sequence.
        loss_parallel: the TP plan leaves the logits sharded over the
            vocabulary (run the step in ``loss_parallel_context``).
        measure_times: a pipeline measures its stages' times (``times``).

    Returns:
        A :class:`~simplefsdp.engines.ParallelModel` or, with a pipeline, a
        :class:`~simplefsdp.engines.PipelinedModel`; either steps with
        :func:`cross_entropy` as its loss.

    Raises:
        ValueError: the engine layer's errors (mesh, spec, engine).
    """
    tp_fn = None
    if spec.tp > 1:
        tp_fn = functools.partial(
            apply_tensor_parallel, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
    kwargs = {
        "init_fn": lambda m: m.init_weights(buffer_device=device),
        "tp_fn": tp_fn,
        "loss_fn": cross_entropy,
    }
    if pipeline is not None and pipeline.pp > 1:
        return parallelize_pipeline(
            model,
            spec,
            pipeline,
            mesh,
            device,
            split_fn=pipeline_split,
            measure_times=measure_times,
            **kwargs,
        )
    return parallelize(model, spec, mesh, device, **kwargs)
