"""``simplefsdp.eager``: run a ``data_parallel`` model with the FSDP paper's eager runtime."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from simplefsdp.bucket_plan import BucketPlan, PlanSpec, resolve_plan
from simplefsdp.eager_executor.flat_bucket import FlatBucket, MeshGroups, dtensor_like, make_slots
from simplefsdp.eager_executor.hooks import (
    find_owner_modules,
    install_hooks,
    remove_view_dicts,
    view_targets,
)
from simplefsdp.eager_executor.runtime import EagerExecutor, EagerOptions
from simplefsdp.frontend.data_parallel import DataParallelState, get_data_parallel_state
from simplefsdp.frontend.float8 import is_float8_weight

logger = logging.getLogger(__name__)

EXECUTOR_ATTR = "_simplefsdp_eager_executor"


def eager(
    model: nn.Module,
    bucketing: PlanSpec = "per_block",
    *,
    forward_prefetch: bool = True,
    backward_prefetch: bool = True,
    limit_all_gathers: int = 2,
    cpu_offload: bool = False,
) -> nn.Module:
    """Execute a ``data_parallel`` model eagerly with flat buckets, in place.

    The FSDP paper's runtime on simplefsdp's sharded representation: the
    parameters, ``state_dict`` and checkpoints stay exactly as
    ``data_parallel`` made them; only how forward and backward communicate
    changes. Per bucket of the plan, forward issues one all-gather into a flat
    buffer (padded so every rank's shard is even) and module code reads views
    of it; backward issues one reduce-scatter (all-reduce for ``replicate``;
    reduce-scatter then all-reduce across replicas for ``hybrid_shard``) once
    the bucket's last gradient is ready, and writes each parameter's shard of
    the gradient to ``param.grad`` (a DTensor with the parameter's placements,
    averaged or summed per the model's ``reduce_op``, cast to its dtype).
    Gathered buckets are freed after forward and regathered before their
    backward when the model was wrapped with ``reshard_after_forward=True``
    (or an int N: this executor regathers over the whole shard group),
    or kept until their backward (ZeRO-2) otherwise; the root bucket (the last
    to finish forward) is never freed after forward. The model's
    ``MixedPrecisionPolicy`` applies: gathers and compute in ``param_dtype``,
    reductions in ``reduce_dtype``. See Note: [Eager schedule] in
    ``runtime.py`` for when things happen. A plan bucket whose parameters
    have different dtypes (without a ``param_dtype`` to unify them; e.g.
    frozen bf16 weights beside fp32 adapters) runs as one flat bucket per
    dtype, as ``simplefsdp.compile``'s bucketing splits by dtype too.

    Gradient accumulation: ``simplefsdp.get_eager_executor(model).no_sync()``
    (or ``set_requires_gradient_sync(False)``) keeps gradients unsharded and
    unreduced; the next backward with sync reduces their sum once.

    Unused parameters: a parameter that forward did not read gets a zero
    gradient (its slot of the bucket's flat gradient) when other parameters of
    its bucket got one, as FSDP1's flat parameters do, where ``data_parallel``
    alone leaves it ``None``; so an optimizer with weight decay still updates
    it.

    Args:
        model: a module wrapped by ``simplefsdp.data_parallel`` (its parameters
            materialised, not on the meta device). Modified in place.
        bucketing: the bucket plan, in the format of ``simplefsdp.compile``'s
            ``bucketing=`` (see ``simplefsdp.bucket_plan``): ``"per_block"``
            (default), a list of lists of module/parameter FQNs, a module
            class, or a predicate ``(fqn, module) -> bool``. (``"auto"`` and
            ``"none"`` exist only for ``simplefsdp.compile``.)
        forward_prefetch: from the second iteration, gather the next buckets
            of the recorded forward order early (for static graphs).
        backward_prefetch: gather the next bucket of backward order (the
            reverse of the recorded forward order) before the current
            bucket's reduce-scatter is issued.
        limit_all_gathers: at most this many buckets gathered ahead of use at
            once (the rate limiter); an int >= 1.
        cpu_offload: keep sharded parameters and gradients in pinned CPU
            memory, copy each bucket to the device for its gather, step the
            optimizer on the CPU. Create the optimizer after calling
            ``eager``, since the parameters are replaced by CPU ones, and read
            parameters only inside forward (the DTensor fallback path cannot
            gather host shards on a device mesh). On a CPU mesh it has no
            effect (logged). Not yet exercised on a GPU by the test-suite.

    Returns:
        ``model``; its executor is ``simplefsdp.get_eager_executor(model)``.

    Raises:
        ValueError: ``model`` is not wrapped by ``data_parallel``, has
            tensor-parallel or expert-parallel parameters or torchao float8
            all-gather weights, already runs eagerly, has meta
            parameters, ``limit_all_gathers < 1``, the plan is invalid
            (``resolve_plan``'s errors).
        TypeError: wrong argument types.
    """
    _validate_options(forward_prefetch, backward_prefetch, limit_all_gathers, cpu_offload)
    state = get_data_parallel_state(model)
    if state.tp_mesh is not None:
        raise ValueError(
            f"{type(model).__name__} has tensor-parallel parameters (mesh "
            f"{state.tp_mesh.mesh_dim_names}); the eager executor gathers flat buffers of "
            "data-parallel shards only. Run it uncompiled or with simplefsdp.compile"
        )
    if state.expert_mesh is not None:
        raise ValueError(
            f"{type(model).__name__} has expert-parallel parameters; the eager executor gathers "
            "flat buffers of data-parallel shards only. Run it uncompiled or with "
            "simplefsdp.compile"
        )
    float8 = next((n for n, p in model.named_parameters() if is_float8_weight(p)), None)
    if float8 is not None:
        raise ValueError(
            f"{float8} is a torchao float8 all-gather weight; the eager executor gathers "
            "in high precision only: run the model uncompiled or with simplefsdp.compile"
        )
    if EXECUTOR_ATTR in model.__dict__:
        raise ValueError(
            f"{type(model).__name__} already runs with simplefsdp.eager; call "
            "simplefsdp.remove_eager(model) before applying eager again"
        )
    meta = [fqn for fqn, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"parameters {meta[:3]} are on the meta device; call model.to_empty(...) and "
            "initialise them before simplefsdp.eager"
        )
    plan = split_by_dtype(model, resolve_plan(model, bucketing), state.mp_policy.param_dtype)
    device = _compute_device(state)
    offload = _resolve_offload(cpu_offload, device)
    if offload:
        _offload_parameters(model)
    options = EagerOptions(
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        limit_all_gathers=limit_all_gathers,
        cpu_offload=offload,
        # An int (a smaller group, Note: [Partial resharding]) reshards fully here.
        reshard_after_forward=bool(state.reshard_after_forward),
        reduce_op=state.reduce_op,
    )
    flat_buckets = _build_buckets(model, plan, state, device)
    owners = find_owner_modules(model, plan)
    executor = EagerExecutor(
        flat_buckets,
        view_targets(model, plan),
        [{id(m) for m in found} for found in owners],
        options,
    )
    install_hooks(model, executor, owners)
    model.__dict__[EXECUTOR_ATTR] = executor
    logger.info(
        "simplefsdp.eager: %d buckets, mode=%s, reshard_after_forward=%s, prefetch fwd=%s bwd=%s, "
        "limit_all_gathers=%d",
        len(flat_buckets),
        state.mode,
        state.reshard_after_forward,
        forward_prefetch,
        backward_prefetch,
        limit_all_gathers,
    )
    return model


def get_eager_executor(model: nn.Module) -> EagerExecutor:
    """The ``EagerExecutor`` that ``simplefsdp.eager`` attached to ``model``
    (``simplefsdp.get_eager_executor``).

    Raises:
        ValueError: ``model`` does not run with ``simplefsdp.eager``.
    """
    executor = model.__dict__.get(EXECUTOR_ATTR)
    if executor is None:
        raise ValueError(
            f"{type(model).__name__} does not run with simplefsdp.eager; call "
            "simplefsdp.eager(model, ...) first"
        )
    return executor


def remove_eager(model: nn.Module) -> nn.Module:
    """Undo ``simplefsdp.eager`` (``simplefsdp.remove_eager``): parameter reads
    gather through DTensor again.

    Call between iterations (after a backward). Offloaded parameters stay on
    the CPU. Raises ``ValueError`` like ``get_eager_executor``.
    """
    get_eager_executor(model).uninstall()
    remove_view_dicts(model)
    del model.__dict__[EXECUTOR_ATTR]
    return model


def _validate_options(
    forward_prefetch: object,
    backward_prefetch: object,
    limit_all_gathers: object,
    cpu_offload: object,
) -> None:
    flags = {
        "forward_prefetch": forward_prefetch,
        "backward_prefetch": backward_prefetch,
        "cpu_offload": cpu_offload,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if isinstance(limit_all_gathers, bool) or not isinstance(limit_all_gathers, int):
        raise TypeError(f"limit_all_gathers must be an int, got {limit_all_gathers!r}")
    if limit_all_gathers < 1:
        raise ValueError(
            f"limit_all_gathers={limit_all_gathers} must be >= 1 (the number of buckets "
            "that may be gathered ahead of use); disable prefetching with "
            "forward_prefetch=False, backward_prefetch=False instead"
        )


def _compute_device(state: DataParallelState) -> torch.device:
    device_type = state.mesh.device_type
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _resolve_offload(cpu_offload: bool, device: torch.device) -> bool:
    if cpu_offload and device.type == "cpu":
        logger.info(
            "simplefsdp.eager: cpu_offload=True has no effect on a CPU mesh; the parameters "
            "and gradients already live in host memory"
        )
        return False
    return cpu_offload


def _offload_parameters(model: nn.Module) -> None:
    """Replace every parameter by one whose local shard is in pinned CPU memory."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in replaced:
                host = param.to_local().detach().to("cpu").pin_memory()
                replaced[id(param)] = nn.Parameter(
                    dtensor_like(param, host), requires_grad=param.requires_grad
                )
            module._parameters[name] = replaced[id(param)]


def _mesh_groups(state: DataParallelState) -> tuple[MeshGroups, int]:
    mesh = state.mesh
    shard_mesh_dim = 1 if state.mode == "hybrid_shard" else 0
    groups = MeshGroups(
        shard_group=mesh.get_group(shard_mesh_dim),
        shard_size=mesh.size(shard_mesh_dim),
        shard_rank=mesh.get_local_rank(shard_mesh_dim),
        replicate_group=mesh.get_group(0) if state.mode == "hybrid_shard" else None,
        dp_size=mesh.size(),
    )
    return groups, shard_mesh_dim


def split_by_dtype(
    model: nn.Module, plan: BucketPlan, param_dtype: torch.dtype | None
) -> BucketPlan:
    """``plan`` with each bucket whose parameters gather in different dtypes
    split into one bucket per dtype, in order of first appearance, named
    ``"<bucket>[<dtype>]"``; a flat buffer holds one dtype. ``param_dtype``
    (the mixed-precision policy's) unifies them: then nothing is split."""
    params = dict(model.named_parameters())
    buckets = []
    for bucket in plan.buckets:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for fqn in bucket.param_fqns:
            by_dtype.setdefault(param_dtype or params[fqn].dtype, []).append(fqn)
        if len(by_dtype) == 1:
            buckets.append(bucket)
            continue
        for dtype, fqns in by_dtype.items():
            name = f"{bucket.name}[{str(dtype).removeprefix('torch.')}]"
            buckets.append(dataclasses.replace(bucket, name=name, param_fqns=tuple(fqns)))
    return BucketPlan(tuple(buckets))


def _build_buckets(
    model: nn.Module, plan: BucketPlan, state: DataParallelState, device: torch.device
) -> list[FlatBucket]:
    groups, shard_mesh_dim = _mesh_groups(state)
    params = dict(model.named_parameters())
    policy = state.mp_policy
    result = []
    for index, bucket in enumerate(plan.buckets):
        named = [(fqn, params[fqn]) for fqn in bucket.param_fqns]
        assert all(isinstance(p, DTensor) for _, p in named)
        # one dtype per bucket: split_by_dtype
        (compute_dtype,) = {policy.param_dtype or p.dtype for _, p in named}
        reduce_dtype = policy.reduce_dtype or compute_dtype
        sharded, replicated = make_slots(named, shard_mesh_dim, groups)
        result.append(
            FlatBucket(
                index, bucket.name, sharded, replicated, groups, compute_dtype, reduce_dtype, device
            )
        )
    return result
