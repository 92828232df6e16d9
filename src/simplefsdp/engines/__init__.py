"""The engine layer: one place that makes a model data parallel, for train and bench.

It owns the :class:`ParallelModel` (what a training step calls, with gradient
sync control), one adapter per engine (:data:`ENGINES`: simplefsdp compiled or
not, simplefsdp with the eager executor, torch FSDP2, DDP, and the replica
limit) behind :func:`parallelize`, activation checkpointing, the global
gradient clip, device / process-group / mesh set-up, and the one memory probe.

Example::

    device = pick_device()
    init_distributed(device)
    mesh = build_mesh("simplefsdp", "fully_shard", device.type, dist.get_world_size())
    with torch.device("meta"):
        model = Transformer(args)
    parallel = parallelize(model, EngineSpec("simplefsdp", compile=True), mesh, device,
                           init_fn=lambda m: m.init_weights())
    loss_fn(parallel.forward(batch)).backward()
"""

from simplefsdp.engines.activation import AC_MODES, apply_activation_checkpointing
from simplefsdp.engines.clip import clip_grad_norm_
from simplefsdp.engines.distributed import (
    build_mesh,
    comm_device,
    data_parallel_rank,
    default_nproc,
    init_distributed,
    mesh_shape_for,
    pick_device,
    pipeline_mesh,
    split_mesh,
    stage_mesh,
    teardown_process_group,
)
from simplefsdp.engines.memory import MemoryProbe, lower_mmap_threshold
from simplefsdp.engines.parallel_model import COLLECTIVE_KINDS, LossFn, ParallelModel, plain_loss
from simplefsdp.engines.parallelize import (
    ENGINES,
    TP_ENGINES,
    EngineSpec,
    parallelize,
    torch_passes_patches,
)
from simplefsdp.engines.pipeline import (
    PIPELINE_SCHEDULES,
    PP_ENGINES,
    PipelinedModel,
    PipelineSpec,
    parallelize_pipeline,
    stage_view,
)

__all__ = [
    "AC_MODES",
    "COLLECTIVE_KINDS",
    "ENGINES",
    "PIPELINE_SCHEDULES",
    "PP_ENGINES",
    "TP_ENGINES",
    "EngineSpec",
    "MemoryProbe",
    "LossFn",
    "ParallelModel",
    "PipelineSpec",
    "PipelinedModel",
    "apply_activation_checkpointing",
    "build_mesh",
    "clip_grad_norm_",
    "comm_device",
    "data_parallel_rank",
    "default_nproc",
    "init_distributed",
    "lower_mmap_threshold",
    "mesh_shape_for",
    "parallelize",
    "parallelize_pipeline",
    "pick_device",
    "pipeline_mesh",
    "plain_loss",
    "split_mesh",
    "stage_mesh",
    "stage_view",
    "teardown_process_group",
    "torch_passes_patches",
]
