"""``data_parallel``: turn any module's parameters into sharded DTensors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from simplefsdp._compat import install_gloo_all_gather_workaround, root_mesh, slices_of_one_mesh
from simplefsdp.frontend import rank_check
from simplefsdp.frontend.expert_parallel import apply_expert_parallel, expert_parallel_params
from simplefsdp.frontend.mesh import resolve_mesh
from simplefsdp.frontend.parametrization import (
    ParamSpec,
    TensorParallelLayout,
    is_swapped,
    make_grad_placements,
    swap_module_class,
)
from simplefsdp.policies import DATA_PARALLEL_MODES, GRAD_REDUCE_OPS, MixedPrecisionPolicy

logger = logging.getLogger(__name__)

STATE_ATTR = "_simplefsdp_state"


@dataclass
class DataParallelState:
    """What ``data_parallel`` decided, kept on the wrapped root module.

    ``simplefsdp.compile``, the eager executor and the reports read it; it is
    plain data (the mesh aside) and never changes after wrapping.
    """

    mesh: DeviceMesh
    mode: str
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int
    shard_dim: int
    reduce_op: str
    param_specs: dict[str, ParamSpec] = field(default_factory=dict)  # by FQN
    # The tensor-parallel mesh of parameters that were DTensors already
    # (Note: [2-D parameters]); ``None`` for a purely data-parallel model.
    tp_mesh: DeviceMesh | None = None
    # With ``reshard_after_forward=N``: this rank's group of N by the name of
    # the shard group it splits (Note: [Partial resharding]); else empty.
    reshard_groups: dict[str, PartialReshardGroup] = field(default_factory=dict)
    # Note: [Same gathers on every rank]: checked after each forward.
    check_ranks: bool = True
    # The data-parallel mesh of the parameters ``ExpertParallel`` sharded
    # (their ``ParamSpec.tp`` holds the ep mesh); ``None`` without experts.
    expert_mesh: DeviceMesh | None = None


@dataclass(frozen=True)
class PartialReshardGroup:
    """The smaller group a parameter stays sharded over between forward and
    backward with ``reshard_after_forward=N`` (Note: [Partial resharding]).

    Attributes:
        group_name: the process group of this rank and its ``size - 1``
            neighbours in the shard group (consecutive shard-group ranks).
        size: ``N``.
        rank: this rank's index in that group: the ``rank``-th of ``N``
            contiguous pieces of the gathered parameter is what it keeps.
    """

    group_name: str
    size: int
    rank: int


def get_data_parallel_state(module: nn.Module) -> DataParallelState:
    """The ``DataParallelState`` of a module wrapped by ``data_parallel``.

    Raises:
        ValueError: ``module`` was not wrapped with ``simplefsdp.data_parallel``.
    """
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        # torch.compile's OptimizedModule keeps the original under _orig_mod.
        inner = module.__dict__.get("_orig_mod")
        if isinstance(inner, nn.Module):
            return get_data_parallel_state(inner)
        raise ValueError(
            f"{type(module).__name__} is not wrapped by simplefsdp.data_parallel; "
            "call simplefsdp.data_parallel(model, ...) first"
        )
    return state


def _placements_for(param: torch.Tensor, mode: str, shard_dim: int) -> tuple[Placement, ...]:
    if mode == "replicate" or param.ndim == 0:
        shard: Placement = Replicate()
    else:
        # Parameters with fewer dims than shard_dim are sharded on their dim 0.
        shard = Shard(shard_dim if param.ndim > shard_dim else 0)
    if mode == "hybrid_shard":
        return (Replicate(), shard)
    return (shard,)


PlacementFn = Callable[[str, nn.Parameter], Placement | None]
"""``placement_fn(fqn, param) -> Shard(d) | Replicate() | None`` (see :func:`data_parallel`)."""


def _chosen_placements(
    placement_fn: PlacementFn,
    fqn: str,
    param: nn.Parameter,
    mode: str,
    default: tuple[Placement, ...],
) -> tuple[Placement, ...]:
    """The placements ``placement_fn`` chooses for ``param`` (``default`` for ``None``)."""
    chosen = placement_fn(fqn, param)
    if chosen is None:
        return default
    ok = isinstance(chosen, Replicate) or (
        isinstance(chosen, Shard) and type(chosen) is Shard and 0 <= chosen.dim < param.ndim
    )
    if not ok:
        raise ValueError(
            f"placement_fn gave {chosen!r} for parameter {fqn!r} of shape {tuple(param.shape)}; "
            f"valid: Shard(d) with 0 <= d < {param.ndim}, Replicate() or None"
        )
    if mode == "replicate" and not isinstance(chosen, Replicate):
        raise ValueError(
            f"placement_fn gave {chosen!r} for parameter {fqn!r} with mode='replicate'; "
            "valid: Replicate() or None (use mode='fully_shard' to shard)"
        )
    return (Replicate(), chosen) if mode == "hybrid_shard" else (chosen,)


def _stored_tp_placements(
    dp_placements: tuple[Placement, ...], tp_placements: tuple[Placement, ...], tp_mesh: DeviceMesh
) -> tuple[Placement, ...]:
    """The placements of a 2-D parameter on the spanning mesh: a data-parallel
    shard of a dim that TP also shards is strided (Note: [2-D parameters])."""
    from torch.distributed.tensor.placement_types import _StridedShard

    stored: list[Placement] = []
    for placement in dp_placements:
        if placement.is_shard():
            split = 1
            for mesh_dim, tp_placement in enumerate(tp_placements):
                if tp_placement.is_shard() and tp_placement.dim == placement.dim:
                    split *= tp_mesh.size(mesh_dim)
            if split > 1:
                placement = _StridedShard(placement.dim, split_factor=split)
        stored.append(placement)
    return (*stored, *tp_placements)


def _validate_args(
    module: object,
    mode: object,
    mp_policy: object,
    reshard_after_forward: object,
    shard_dim: object,
    reduce_op: object,
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"data_parallel expects an nn.Module, got {type(module).__name__}")
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(DATA_PARALLEL_MODES)}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a simplefsdp.MixedPrecisionPolicy or None, got "
            f"{type(mp_policy).__name__}"
        )
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"reshard_after_forward must be a bool or an int (the group size to reshard to), "
            f"got {reshard_after_forward!r}"
        )
    if not isinstance(reshard_after_forward, bool) and mode == "replicate":
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward} reshards to a smaller group, but "
            "mode='replicate' gathers nothing; use mode='fully_shard' or 'hybrid_shard'"
        )
    if reduce_op not in GRAD_REDUCE_OPS:
        raise ValueError(
            f"unknown reduce_op {reduce_op!r}; valid choices: {', '.join(GRAD_REDUCE_OPS)}"
        )
    if isinstance(shard_dim, bool) or not isinstance(shard_dim, int):
        raise TypeError(f"shard_dim must be an int, got {shard_dim!r}")
    if STATE_ATTR in module.__dict__ or any(is_swapped(m) for m in module.modules()):
        raise ValueError(
            f"{type(module).__name__} (or one of its submodules) is already wrapped by "
            "simplefsdp.data_parallel; wrap the original module once"
        )
    if any(_is_fully_sharded(m) for m in module.modules()):
        raise ValueError(
            f"{type(module).__name__} (or one of its submodules) is already sharded by "
            "torch's fully_shard; use either fully_shard or simplefsdp.data_parallel"
        )
    for name, sub in module.named_modules():
        sparse = isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
        if sparse and sub.weight.requires_grad:
            raise ValueError(
                f"{f'submodule {name!r}' if name else 'the module'} ({type(sub).__name__}) has "
                "sparse=True: its "
                "gradients are sparse tensors, which data_parallel can neither reduce-scatter "
                "nor all-reduce (nor can torch's fully_shard); construct it with sparse=False"
            )


def _is_fully_sharded(module: nn.Module) -> bool:
    return any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)


def _tensor_parallel_mesh(
    module: nn.Module, mesh: DeviceMesh, skip: frozenset[int] = frozenset()
) -> DeviceMesh | None:
    """The one mesh of ``module``'s DTensor parameters (those whose ``id`` is
    not in ``skip``), checked against the data-parallel ``mesh`` (Note: [2-D
    parameters]); ``None`` if all are plain."""
    found: dict[str, DTensor] = {
        name: p
        for name, p in module.named_parameters()
        if isinstance(p, DTensor) and id(p) not in skip
    }
    if not found:
        return None
    name, first = next(iter(found.items()))
    tp_mesh = first.device_mesh
    for other_name, param in found.items():
        if param.device_mesh != tp_mesh:
            raise ValueError(
                f"DTensor parameters {name!r} and {other_name!r} live on different meshes "
                f"({tuple(tp_mesh.shape)} vs {tuple(param.device_mesh.shape)}); "
                "data_parallel composes with one tensor-parallel mesh"
            )
        partial = [p for p in param.placements if p.is_partial()]
        if partial:
            raise ValueError(
                f"parameter {other_name!r} has placements {param.placements}; a parameter "
                "cannot be Partial (valid: Shard or Replicate on the tensor-parallel mesh)"
            )
    dp_names, tp_names = mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names is None or tp_names is None:
        raise ValueError(
            "composing data_parallel with tensor-parallel (DTensor) parameters needs named "
            "mesh dims: build one mesh with init_device_mesh(device_type, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')), use mesh['tp'] for the TP plan and pass "
            "mesh['dp'] to data_parallel"
        )
    shared = set(dp_names) & set(tp_names)
    if shared:
        raise ValueError(
            f"parameter {name!r} is already a DTensor on the data-parallel mesh dims "
            f"{sorted(shared)}; data_parallel shards plain or tensor-parallel parameters, "
            "pass the mesh dims that are not the tensor-parallel ones (e.g. mesh['dp'])"
        )
    if not slices_of_one_mesh(mesh, tp_mesh):
        raise ValueError(
            f"the data-parallel mesh {dp_names} and the tensor-parallel mesh {tp_names} of "
            f"parameter {name!r} are not slices of one mesh; build one mesh with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and slice both from it"
        )
    return tp_mesh


def _spanning_mesh(mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The slice of the common root mesh over the data-parallel then TP dims."""
    names = (*mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
    try:
        return root_mesh(mesh)[names]
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"cannot slice mesh dims {names} from the root mesh "
            f"{root_mesh(mesh).mesh_dim_names}: the data-parallel dims must come before the "
            f"tensor-parallel dims in init_device_mesh ({exc})"
        ) from None


def _check_shard_dim(module: nn.Module, shard_dim: int, mode: str) -> None:
    if mode == "replicate":
        return
    max_ndim = max((p.ndim for p in module.parameters()), default=0)
    if shard_dim < 0 or (max_ndim > 0 and shard_dim >= max_ndim):
        raise ValueError(
            f"shard_dim={shard_dim} is out of range: the module's parameters have at most "
            f"{max_ndim} dims, so valid values are 0..{max(max_ndim - 1, 0)}"
        )


def _hybrid_submeshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """The (replicate, shard) 1-D submeshes of a 2-D hybrid mesh."""
    names = mesh.mesh_dim_names
    if names is None:
        # Slicing needs dim names; an unnamed mesh gets a named twin over the
        # same ranks (new process groups, created once at wrap time).
        names = ("dp_replicate", "dp_shard")
        mesh = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=names)
    return mesh[names[0]], mesh[names[1]]


# Note: [Partial resharding]
# ``reshard_after_forward=N`` (FSDP2's int form) frees each gathered parameter
# after forward down to a 1/N piece instead of the 1/W shard of its shard
# group of W ranks. The group is split into W/N groups of N consecutive ranks
# (the GPUs of one node when N is the node size and ranks are numbered by
# node); each rank keeps the piece of the gathered parameter named by its
# position in its group of N, and backward regathers the parameter over that
# group only, so the backward all-gathers stay inside the node. The memory
# between forward and backward is W/N shards per parameter instead of one.
# ``simplefsdp.compile`` rewrites the joint graph to do so (passes/reshard.py);
# the numerics are those of full resharding. The eager executor reshards fully.
def _partial_reshard_groups(
    mesh: DeviceMesh, specs: list[ParamSpec], size: int
) -> dict[str, PartialReshardGroup]:
    """This rank's group of ``size`` for each shard group its parameters gather over."""
    import torch.distributed as dist

    made: dict[tuple[int, ...], PartialReshardGroup] = {}
    result: dict[str, PartialReshardGroup] = {}
    for spec in specs:
        if isinstance(spec.dp_placements[-1], Replicate):  # 0-d: nothing gathered
            continue
        gather_mesh = spec.shard_mesh or (spec.tp.dp_mesh if spec.tp is not None else mesh)
        group = gather_mesh.get_group(gather_mesh.ndim - 1)
        if group.group_name in result:
            continue
        ranks = dist.get_process_group_ranks(group)
        width = len(ranks)
        if not 1 < size < width or width % size:
            valid = [d for d in range(2, width) if width % d == 0]
            raise ValueError(
                f"reshard_after_forward={size} must divide the shard group size {width} and "
                f"lie strictly between 1 and {width}; valid here: "
                f"{', '.join(map(str, valid)) or 'none'} (or True/False)"
            )
        start = ranks.index(dist.get_rank()) // size * size
        members = tuple(ranks[start : start + size])
        if members not in made:
            # Only the members create their group; the name is the same on each.
            pg = dist.new_group(list(members), use_local_synchronization=True)
            made[members] = PartialReshardGroup(pg.group_name, size, dist.get_rank(pg))
        result[group.group_name] = made[members]
    return result


def _to_2d_dtensor_param(
    param: nn.Parameter,
    mesh: DeviceMesh,
    dp_placements: tuple[Placement, ...],
    spanning: DeviceMesh,
    stored: tuple[Placement, ...],
) -> nn.Parameter:
    """Shard a tensor-parallel DTensor parameter's local tensor over ``mesh``."""
    tp_local = param.detach().to_local()
    dp_local = _to_dtensor_param(nn.Parameter(tp_local), mesh, dp_placements).detach().to_local()
    dtensor = DTensor.from_local(
        dp_local, spanning, stored, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _to_dtensor_param(
    param: nn.Parameter, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> nn.Parameter:
    tensor = param.detach()
    if tensor.device.type == "meta":
        # No data to distribute: only the local shard's shape matters.
        src_data_rank = None
    else:
        # Rank 0's values win, as in DDP's construction-time broadcast, so ranks
        # that initialised differently still start from one model.
        src_data_rank = 0
        if tensor.device.type != mesh.device_type:
            tensor = tensor.to(mesh.device_type)
    dtensor = distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _install_rank_check(module: nn.Module, mesh: DeviceMesh) -> None:
    """After each forward outside compiled code, check that every rank
    gathered the same parameters (Note: [Same gathers on every rank])."""
    where = f"the forward of {type(module).__name__}"

    def start(_module, _args):
        # Reads since the last check that no check covered (another model's
        # forward in this process, a pipeline stage's) are not this forward's.
        if not torch.compiler.is_compiling():
            rank_check.reset()

    def check_ranks(_module, _args, _output):
        if not torch.compiler.is_compiling():
            rank_check.check(mesh, where)

    module.register_forward_pre_hook(start)
    module.register_forward_hook(check_ranks)


def _install_mixed_precision_hooks(module: nn.Module, mp_policy: MixedPrecisionPolicy) -> None:
    param_dtype = mp_policy.param_dtype
    if param_dtype is not None and mp_policy.cast_forward_inputs:

        def cast_inputs(_module, args, kwargs):
            def cast(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(param_dtype)
                return x

            return tree_map(cast, args), tree_map(cast, kwargs)

        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)

    output_dtype = mp_policy.output_dtype
    if output_dtype is not None:

        def cast_outputs(_module, _args, output):
            def cast(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(output_dtype)
                return x

            return tree_map(cast, output)

        module.register_forward_hook(cast_outputs)


def data_parallel(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    mode: str = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    shard_dim: int = 0,
    reduce_op: str = "avg",
    check_ranks: bool = True,
    expert_mesh: DeviceMesh | None = None,
    placement_fn: PlacementFn | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` as DTensors, in place.

    Every parameter becomes an ``nn.Parameter`` wrapping a DTensor placed per
    ``mode``; ``named_parameters()``/``state_dict()`` return these shards under
    the original names, without communication. Inside ``forward``, reading a
    parameter all-gathers it (DTensor ``redistribute``) and returns the
    unsharded local tensor, so model code runs unchanged; the gradient flows
    back through DTensor autograd as a reduce-scatter (``fully_shard``), an
    all-reduce (``replicate``) or both (``hybrid_shard``). After ``backward``
    each ``param.grad`` is a DTensor with the parameter's placements holding
    this rank's shard of the gradient averaged (``reduce_op="avg"``, DDP's
    semantics) or summed (``reduce_op="sum"``) over the data-parallel ranks.

    Tied parameters (one ``Parameter`` object used by several modules) stay
    tied: one sharded parameter, gathered at every use, gradients from every
    use accumulated into it. Frozen parameters (``requires_grad=False``) are
    gathered but never reduced. Buffers are left as they are (replicated).
    0-d parameters are replicated. A dimension that does not divide by the
    shard count is sharded unevenly (the last ranks hold fewer rows), as
    ``torch.chunk`` does.

    Tensor parallelism composes: apply torch's ``parallelize_module`` on
    ``mesh["tp"]`` first, then pass ``mesh["dp"]`` (or the ``(replicate,
    shard)`` sub-mesh for ``hybrid_shard``) of the same named mesh. Each
    parameter the TP plan made a DTensor is then stored as one DTensor on the
    (dp..., tp) mesh: the data-parallel dims shard its TP-local tensor
    (``_StridedShard`` where both shard one tensor dim), and reads hand
    compute the TP-local tensor as a DTensor on ``mesh["tp"]``; the other
    parameters are sharded on the data-parallel mesh only. See Note:
    [2-D parameters].

    Expert parallelism composes the same way: apply
    ``parallelize_module(experts, mesh["ep"], ExpertParallel())`` to each
    experts module first, then pass the mesh of all data-parallel ranks as
    ``mesh`` and the data-parallel ranks holding the same experts as
    ``expert_mesh`` (torchtitan's ``dp_shard_mod_ep``): dense parameters are
    sharded over ``mesh``, expert parameters over ``expert_mesh``, so one
    model's parameters live on two meshes.

    Modules built under ``torch.device("meta")`` can be wrapped directly; then
    call ``module.to_empty(device=...)`` and initialise the parameters inside
    ``simplefsdp.disable_parametrization()`` (so in-place init writes the
    shards). Real (non-meta) parameters are distributed from rank 0's values.

    Args:
        module: any ``nn.Module``; modified in place and returned.
        mesh: data-parallel ``DeviceMesh``. ``None`` builds a 1-D mesh over the
            default process group on the parameters' device type when the
            backend serves it (else ``cuda`` for NCCL, ``cpu`` for gloo).
            ``hybrid_shard`` needs a 2-D mesh ``(replicate, shard)``.
        mode: ``"replicate"`` (DDP), ``"fully_shard"`` (FSDP, default) or
            ``"hybrid_shard"`` (HSDP).
        mp_policy: ``MixedPrecisionPolicy``; ``None`` means full precision.
        reshard_after_forward: free gathered parameters after forward and
            gather them again in backward (``True``, ZeRO-3) or keep them
            (``False``, ZeRO-2); an int ``N`` (FSDP2's int form) keeps a 1/N
            piece and regathers over groups of ``N`` consecutive ranks of the
            shard group, e.g. within a node (Note: [Partial resharding]).
            ``N`` must divide the shard group size and lie strictly between 1
            and it. Honoured by ``simplefsdp.compile``; eager execution
            reshards fully for ``True`` and ``N``.
        shard_dim: tensor dim to shard (parameters with fewer dims use dim 0).
        reduce_op: ``"avg"`` (default) or ``"sum"`` of gradients across ranks.
        check_ranks: after each forward that ran outside compiled code (this
            wrapping alone, ``simplefsdp.eager``, or ``simplefsdp.compile``
            with ``fullgraph=False``), all-reduce a digest of the parameters
            each rank gathered and raise ``RankDivergenceError`` where they
            differ, before any gradient is reduced: data-dependent parameter
            use (a mixture-of-experts layer that runs only its routed
            experts) would otherwise pair different parameters' collectives
            silently. One collective of two int64s per forward (Note: [Same
            gathers on every rank]).
        expert_mesh: 1-D data-parallel mesh of the parameters that
            ``ExpertParallel`` sharded (required when there are some);
            ``mesh`` and the ep mesh must be slices of one named mesh.
        placement_fn: per-parameter placement, as FSDP2's
            ``fully_shard(shard_placement_fn=...)``: ``placement_fn(fqn,
            param)`` returns the placement of a plain (not tensor- or
            expert-parallel) parameter on the shard dim of ``mesh``,
            ``Shard(d)`` or ``Replicate()``, or ``None`` for the default
            (``Shard(shard_dim)``; ``Replicate()`` in mode ``"replicate"``).

    Returns:
        ``module`` itself, wrapped.

    Raises:
        TypeError: wrong argument types.
        ValueError: ``reshard_after_forward=N`` that does not divide the shard
            group (or with ``mode="replicate"``), no process group and no mesh, mesh dimensionality not
            matching ``mode``, unknown ``mode``/``reduce_op``, ``shard_dim`` out
            of range, ``module`` already wrapped (or sharded by
            ``fully_shard``), an ``nn.Embedding``/``nn.EmbeddingBag`` with
            ``sparse=True`` (sparse gradients), or tensor-parallel parameters whose mesh is not
            a differently named slice of the data-parallel mesh's root (or
            ``mesh`` not given for them).
    """
    _validate_args(module, mode, mp_policy, reshard_after_forward, shard_dim, reduce_op)
    install_gloo_all_gather_workaround()  # Note: [Gloo all-gather workaround]
    expert_params, ep_mesh = expert_parallel_params(module, expert_mesh, mode)
    expert_spanning = _spanning_mesh(expert_mesh, ep_mesh) if ep_mesh is not None else None
    has_tp = any(isinstance(p, DTensor) and id(p) not in expert_params for p in module.parameters())
    if (has_tp or expert_params) and mesh is None:
        raise ValueError(
            f"{type(module).__name__} holds tensor-parallel (DTensor) parameters; pass the "
            "data-parallel mesh explicitly: mesh=mesh['dp'] of the mesh the TP plan used"
        )
    mesh = resolve_mesh(mesh, mode, {p.device.type for p in module.parameters()})
    tp_mesh = _tensor_parallel_mesh(module, mesh, frozenset(expert_params))
    spanning = _spanning_mesh(mesh, tp_mesh) if tp_mesh is not None else None
    _check_shard_dim(module, shard_dim, mode)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    replicate_mesh, shard_mesh = _hybrid_submeshes(mesh) if mode == "hybrid_shard" else (None, None)

    fqn_of: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
    new_params: dict[int, nn.Parameter] = {}  # id(old param) -> DTensor param
    spec_of: dict[int, ParamSpec] = {}
    per_module_specs: list[tuple[nn.Module, dict[str, ParamSpec]]] = []
    for submodule in module.modules():
        local_specs: dict[str, ParamSpec] = {}
        for name, param in list(submodule._parameters.items()):
            if param is None:
                continue
            key = id(param)
            if key not in new_params:
                tp_layout = None
                # Expert parameters: the ep mesh plays the TP mesh's part.
                param_dp_mesh, param_tp_mesh, param_spanning = (
                    (expert_mesh, expert_params[key], expert_spanning)
                    if key in expert_params
                    else (mesh, tp_mesh, spanning)
                )
                if isinstance(param, DTensor):
                    tp_local = param.to_local()
                    dp_placements = _placements_for(tp_local, mode, shard_dim)
                    placements = _stored_tp_placements(
                        dp_placements, param.placements, param_tp_mesh
                    )
                    new_params[key] = _to_2d_dtensor_param(
                        param, param_dp_mesh, dp_placements, param_spanning, placements
                    )
                    tp_layout = TensorParallelLayout(
                        mesh=param_tp_mesh,
                        placements=tuple(param.placements),
                        dp_mesh=param_dp_mesh,
                        dp_placements=dp_placements,
                        local_shape=tp_local.shape,
                        local_stride=tp_local.stride(),
                    )
                else:
                    placements = _placements_for(param, mode, shard_dim)
                    if placement_fn is not None:
                        placements = _chosen_placements(
                            placement_fn, fqn_of[key], param, mode, placements
                        )
                    new_params[key] = _to_dtensor_param(param, mesh, placements)
                is_sharded = (tp_layout.dp_placements if tp_layout else placements)[-1].is_shard()
                spec_of[key] = ParamSpec(
                    fqn=fqn_of[key],
                    placements=placements,
                    grad_placements=make_grad_placements(param_dp_mesh.ndim, reduce_op),
                    param_dtype=mp_policy.param_dtype,
                    # Like FSDP2: without a reduce_dtype, reduce in param_dtype.
                    reduce_dtype=mp_policy.reduce_dtype or mp_policy.param_dtype,
                    replicate_mesh=replicate_mesh if is_sharded else None,
                    shard_mesh=shard_mesh if is_sharded else None,
                    tp=tp_layout,
                )
            submodule._parameters[name] = new_params[key]
            local_specs[name] = spec_of[key]
        if local_specs:
            per_module_specs.append((submodule, local_specs))
    for submodule, local_specs in per_module_specs:
        swap_module_class(submodule, local_specs)

    _install_mixed_precision_hooks(module, mp_policy)
    if not isinstance(check_ranks, bool):
        raise TypeError(f"check_ranks must be a bool, got {check_ranks!r}")
    if check_ranks and mesh.size() > 1:
        _install_rank_check(module, mesh)
    partial = not isinstance(reshard_after_forward, bool)
    module.__dict__[STATE_ATTR] = DataParallelState(
        mesh=mesh,
        mode=mode,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        shard_dim=shard_dim,
        reduce_op=reduce_op,
        param_specs={spec.fqn: spec for spec in spec_of.values()},
        tp_mesh=tp_mesh,
        reshard_groups=(
            _partial_reshard_groups(mesh, list(spec_of.values()), reshard_after_forward)
            if partial
            else {}
        ),
        check_ranks=check_ranks,
        expert_mesh=expert_mesh if expert_params else None,
    )
    logger.debug("data_parallel: mode=%s mesh=%s params=%d", mode, tuple(mesh.shape), len(spec_of))
    return module


def parallelize_experts_and_data(
    model: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, **data_parallel_kwargs: Any
) -> nn.Module:
    """``apply_expert_parallel`` over ``mesh["ep"]``, then ``data_parallel``
    with the dense parameters over ``dp_mesh`` and the experts over
    ``mesh["dp_shard_mod_ep"]``.

    Args:
        model: the model (may be on the meta device).
        mesh, dp_mesh: from :func:`~simplefsdp.frontend.expert_parallel.build_expert_parallel_mesh`.
        **data_parallel_kwargs: passed to ``data_parallel`` (``mode``,
            ``mp_policy``, ``reshard_after_forward``, ...).

    Returns:
        ``model``, wrapped in place.
    """
    apply_expert_parallel(model, mesh["ep"])
    return data_parallel(
        model, dp_mesh, expert_mesh=mesh["dp_shard_mod_ep"], **data_parallel_kwargs
    )
