"""Apply data parallelism, activation checkpointing and compilation to a built model.

The composition follows torchtitan's ``parallelize_*`` functions: the model file
knows nothing about parallelism; :func:`parallelize` takes a model built on the
meta device and returns it sharded, materialised on the training device,
initialised and (optionally) compiled:

1. activation checkpointing, per transformer block, *before* sharding;
2. the engine:

   - ``simplefsdp``: :func:`simplefsdp.data_parallel` on the whole model, then
     ``simplefsdp.compile`` (bucketing/reordering passes) when enabled;
   - ``fsdp2``: torch's ``fully_shard`` per block and on the root (the
     baseline); with compile on, each block is compiled in place first;
   - ``ddp``: ``DistributedDataParallel``; with compile on, each block is
     compiled in place first.

The mesh shapes each engine uses are decided by :func:`mesh_shape_for`, a pure
function the CLI also calls before starting any process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp.train.config import CompileConfig, JobConfig, ParallelConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ParallelModel",
    "apply_activation_checkpointing",
    "build_mesh",
    "clip_grad_norm_",
    "mesh_shape_for",
    "parallelize",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParallelModel:
    """A parallelised model.

    Attributes:
        module: the model whose ``parameters()``/``state_dict()`` the optimizer
            and the checkpoints use (never a ``torch.compile`` or DDP wrapper).
        forward: what the training step calls: ``module``, its compiled
            version, or the DDP wrapper.
        engine: ``"simplefsdp"``, ``"fsdp2"`` or ``"ddp"``.
        mesh: the data-parallel mesh.
    """

    module: nn.Module
    forward: Callable[..., torch.Tensor]
    engine: str
    mesh: DeviceMesh

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Skip gradient communication inside the block when ``enabled`` is false.

        Used for all micro-batches but the last of an accumulation step: DDP's
        ``no_sync`` and FSDP2's ``set_requires_gradient_sync``. simplefsdp
        reduces every micro-batch's gradient (its reduction is part of the
        autograd graph), so this is a no-op there.
        """
        if enabled or self.engine == "simplefsdp":
            yield
        elif self.engine == "ddp":
            with self.forward.no_sync():  # type: ignore[attr-defined]
                yield
        else:
            self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)  # type: ignore[operator]


# --------------------------------------------------------------------------- mesh


def mesh_shape_for(
    cfg: ParallelConfig, world_size: int, local_world_size: int | None = None
) -> tuple[int, ...]:
    """The data-parallel mesh shape for ``cfg`` on ``world_size`` ranks.

    ``replicate``/``fully_shard`` use a 1-D mesh of all ranks (FSDP2's
    ``replicate`` is HSDP on ``(world_size, 1)``). ``hybrid_shard`` uses
    ``parallel.mesh_shape`` ``[replicate, shard]`` or, when unset,
    ``[world_size // local_world_size, local_world_size]`` (replicate across
    hosts, shard within a host).

    Raises:
        ValueError: the shape cannot be built from ``world_size`` ranks.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if cfg.mode != "hybrid_shard":
        if cfg.engine == "fsdp2" and cfg.mode == "replicate":
            return (world_size, 1)
        return (world_size,)
    if cfg.mesh_shape is not None:
        shape = tuple(int(x) for x in cfg.mesh_shape)
    else:
        local = local_world_size or world_size
        if world_size % local:
            local = world_size
        shape = (world_size // local, local)
    if shape[0] * shape[1] != world_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        valid = ", ".join(f"[{d}, {world_size // d}]" for d in divisors)
        raise ValueError(
            f"parallel.mesh_shape {list(shape)} needs {shape[0] * shape[1]} ranks but the world "
            f"size is {world_size}; valid shapes for {world_size} ranks: {valid}"
        )
    return shape


def build_mesh(
    cfg: ParallelConfig, device_type: str, world_size: int, local_world_size: int | None = None
) -> DeviceMesh:
    """Build the data-parallel ``DeviceMesh`` (see :func:`mesh_shape_for`)."""
    shape = mesh_shape_for(cfg, world_size, local_world_size)
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    logger.info("data-parallel mesh %s %s on %s", names, shape, device_type)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


# --------------------------------------------------------------------------- AC


def _blocks(model: nn.Module) -> list[tuple[nn.ModuleList, str, nn.Module]]:
    """``(parent, name, block)`` for every child of every ``nn.ModuleList`` in ``model``."""
    return [
        (parent, name, child)
        for parent in model.modules()
        if isinstance(parent, nn.ModuleList)
        for name, child in parent.named_children()
    ]


# Ops whose outputs selective AC keeps: matmuls and attention (expensive to
# recompute); everything else (norms, activations, rotary, casts) is recomputed.
def _sac_save_ops() -> set[Any]:
    """Ops whose outputs selective AC keeps (those that exist in this torch build)."""
    ops = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _sac_context_fn(save_ops: frozenset[Any]) -> tuple[Any, Any]:
    """Selective-checkpoint contexts that save the outputs of ``save_ops`` only."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap every transformer block (each child of an ``nn.ModuleList``) for AC.

    Must run before sharding, so the sharded parameters live inside the
    wrapped blocks. ``"full"`` recomputes the whole block in backward;
    ``"selective"`` saves matmul and attention outputs and recomputes the rest
    (an op-level policy, as torchtitan's selective AC). Checkpoint keys are
    unchanged: DCP and the wrapper's state-dict hooks strip its prefix.

    Returns:
        The number of wrapped blocks.
    """
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(
            f"unknown activation checkpointing mode {mode!r}; valid: none, full, selective"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(_sac_context_fn, frozenset(_sac_save_ops()))
    blocks = _blocks(model)
    for parent, name, block in blocks:
        parent.register_module(name, checkpoint_wrapper(block, **kwargs))
    logger.info("activation checkpointing (%s) on %d blocks", mode, len(blocks))
    return len(blocks)


# --------------------------------------------------------------------------- compile


def _compile_simplefsdp(model: nn.Module, cfg: CompileConfig) -> Callable[..., torch.Tensor]:
    """``simplefsdp.compile`` with the configured backend and bucketing
    (``"per_block"`` is a plan spec ``simplefsdp.plan`` understands directly)."""
    import simplefsdp

    return simplefsdp.compile(model, backend=cfg.backend, bucketing=cfg.bucketing, fullgraph=True)


def _compile_blocks(model: nn.Module, cfg: CompileConfig) -> None:
    """Compile each transformer block in place (``Module.compile``), as torchtitan does."""
    for _, _, block in _blocks(model):
        block.compile(backend=cfg.backend, fullgraph=True)


# --------------------------------------------------------------------------- engines


@contextlib.contextmanager
def _quiet_cpu_dtensor_rng() -> Iterator[None]:
    """Silence DTensor's "random operators may not have complete support on cpu" warning.

    On a CPU mesh each rank initialises its shard from its own generator: the
    result is deterministic for a given seed and world size, which is all the
    trainer needs (CUDA meshes use DTensor's offset-based RNG tracker).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        yield


def _init_weights(model: nn.Module, device: torch.device) -> None:
    """Materialise a meta model on ``device`` and initialise it in place."""
    model.to_empty(device=device)
    with torch.no_grad(), _quiet_cpu_dtensor_rng():
        model.init_weights(buffer_device=device)  # type: ignore[operator]


def _apply_simplefsdp(
    model: nn.Module, job: JobConfig, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    import simplefsdp

    p = job.parallel
    policy = simplefsdp.MixedPrecisionPolicy(
        param_dtype=_DTYPES.get(p.param_dtype or ""), reduce_dtype=_DTYPES.get(p.reduce_dtype or "")
    )
    simplefsdp.data_parallel(
        model, mesh, mode=p.mode, mp_policy=policy, reshard_after_forward=p.reshard_after_forward
    )
    model.to_empty(device=device)
    with torch.no_grad(), simplefsdp.disable_parametrization(), _quiet_cpu_dtensor_rng():
        model.init_weights(buffer_device=device)  # type: ignore[operator]
    forward = _compile_simplefsdp(model, job.compile) if job.compile.enable else model
    return ParallelModel(model, forward, "simplefsdp", mesh)


def _apply_fsdp2(
    model: nn.Module, job: JobConfig, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = job.parallel
    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES.get(p.param_dtype or ""), reduce_dtype=_DTYPES.get(p.reduce_dtype or "")
    )
    if job.compile.enable:
        _compile_blocks(model, job.compile)
    for _, _, block in _blocks(model):
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=p.reshard_after_forward
        )
    # The root keeps embeddings, final norm and output; like torchtitan it is
    # not resharded after forward, since backward needs it first.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    _init_weights(model, device)
    return ParallelModel(model, model, "fsdp2", mesh)


def _apply_ddp(
    model: nn.Module, job: JobConfig, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    from torch.nn.parallel import DistributedDataParallel

    if job.parallel.param_dtype or job.parallel.reduce_dtype:
        logger.warning("parallel.param_dtype/reduce_dtype are ignored by the ddp engine")
    _init_weights(model, device)
    if job.compile.enable:
        _compile_blocks(model, job.compile)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.get_group())
    return ParallelModel(model, ddp, "ddp", mesh)


_ENGINES = {"simplefsdp": _apply_simplefsdp, "fsdp2": _apply_fsdp2, "ddp": _apply_ddp}


def parallelize(
    model: nn.Module, job: JobConfig, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    """Parallelise a model built on the meta device, per ``job.parallel``.

    Applies activation checkpointing (``job.activation_checkpoint.mode``), the
    engine (``job.parallel.engine``) and compilation (``job.compile``), then
    materialises the parameters on ``device`` and initialises them with the
    model's ``init_weights(buffer_device=...)`` under the current RNG state.

    Raises:
        ValueError: unknown engine.
    """
    engine = job.parallel.engine
    if engine not in _ENGINES:
        raise ValueError(f"unknown parallel.engine {engine!r}; valid: {', '.join(_ENGINES)}")
    apply_activation_checkpointing(model, job.activation_checkpoint.mode)
    parallel = _ENGINES[engine](model, job, mesh, device)
    logger.info(
        "parallelized with %s (mode %s, compile %s)",
        engine,
        job.parallel.mode,
        f"{job.compile.backend}/{job.compile.bucketing}" if job.compile.enable else "off",
    )
    return parallel


# --------------------------------------------------------------------------- clipping


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global 2-norm of all gradients across shards and ranks; clip if ``max_norm > 0``.

    Works for plain, DTensor (simplefsdp, FSDP2) and mixed-placement gradients:
    the norm of sharded gradients is reduced over the mesh (``full_tensor``).

    Returns:
        The total norm before clipping, a plain 0-d tensor.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total
