"""One adapter per engine, behind :func:`parallelize`.

The trainer and the benchmark describe *how* to parallelise with an
:class:`EngineSpec` (plain data) and call :func:`parallelize`, which applies,
in order (as torchtitan's ``parallelize_*`` functions do):

1. tensor parallelism, when ``spec.tp > 1``: the caller's ``tp_fn(model,
   tp_mesh)`` (a model spec's ``tensor_parallel``)
   on the mesh's ``"tp"`` dim; the engine then shards the data-parallel dims
   (engines ``simplefsdp`` and ``fsdp2`` only);
2. activation checkpointing of each repeated block, before sharding;
3. the engine:

   - ``simplefsdp``: :func:`simplefsdp.data_parallel` on the whole model, then
     ``simplefsdp.compile`` (our passes) when ``compile`` is on, or plain
     ``torch.compile`` with Inductor's own bucketing/overlap passes when
     ``torch_passes`` is on (the peer we compare against);
   - ``simplefsdp_eager``: ``data_parallel``, then the eager executor
     (``simplefsdp.eager``), never compiled;
   - ``fsdp2``: torch's ``fully_shard`` as torchtitan applies it: per block,
     on the embedding (resharded after forward like the blocks), on the final
     norm and output together (kept from forward into backward) and on the
     root; with compile on, each block is compiled in place first;
   - ``ddp``: ``DistributedDataParallel``; with compile on, each block is
     compiled in place first;
   - ``replica``: no data parallelism, each rank trains its own copy (the
     single-device limit); with compile on, the whole model is compiled.

4. materialisation: a model built on the meta device is moved to ``device``
   with ``to_empty`` and initialised by ``init_fn`` (after sharding, so each
   rank only materialises its shards; under ``disable_parametrization`` for
   simplefsdp). A model with real tensors is moved to ``device`` first; DDP
   and ``data_parallel`` broadcast rank 0's values, ``fully_shard`` shards the
   tensors it is given, so every engine trains the same initial weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.bucket_plan import outer_modules, repeated_blocks
from simplefsdp.engines.activation import apply_activation_checkpointing
from simplefsdp.engines.kinds import composition_errors, engine_names, get_engine
from simplefsdp.engines.parallel_model import LossFn, ParallelModel
from simplefsdp.layout import Layout, Meshes, meshes_of

logger = logging.getLogger(__name__)


#: The training engines' names (:func:`simplefsdp.engines.kinds.engine_names`).
ENGINES: tuple[str, ...] = engine_names()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

InitFn = Callable[[nn.Module], None]
TensorParallelFn = Callable[[nn.Module, DeviceMesh], Any]


def dtype_from_name(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``/``"float16"``/``"float32"`` (or a dtype, or ``None``) as a torch dtype.

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[value]


@dataclass(frozen=True)
class EngineSpec:
    """How to parallelise and execute a model.

    Attributes:
        engine: one of :data:`ENGINES`.
        mode: ``"replicate"``, ``"fully_shard"`` or ``"hybrid_shard"``
            (simplefsdp engines and fsdp2; ddp and replica ignore it).
        param_dtype / reduce_dtype: mixed precision (``"bfloat16"`` or a
            ``torch.dtype``; ``None`` keeps the parameter dtype). Not used by
            ddp and replica.
        reshard_after_forward: regather parameters in backward (simplefsdp
            engines: the whole model; fsdp2: the blocks, never the root); an
            int N regathers over groups of N ranks (simplefsdp compiled and
            fsdp2; the eager executor reshards fully).
        compile: compile the model (see the module docstring per engine).
        backend: ``torch.compile`` backend.
        bucketing: the bucket plan (simplefsdp engines): ``"auto"``,
            ``"none"`` or a manual plan spec (``simplefsdp.bucket_plan``). The
            eager executor has no graph to plan from: ``"auto"`` and
            ``"none"`` run it with ``"per_block"``.
        reorder: simplefsdp.compile's reordering pass.
        keep_gathered: simplefsdp.compile's per-bucket resharding choice
            (``None``, ``"auto"``, N or module FQNs; see ``simplefsdp.compile``).
        torch_passes: compile ``simplefsdp`` with plain ``torch.compile`` and
            Inductor's own bucketing/overlap passes instead of ours (a peer).
        activation_checkpoint: ``"none"``, ``"full"`` or ``"selective"``.
        recompute_experts: with selective AC, the experts' grouped matmuls
            recomputed too (torchtitan's op list), not saved.
        broadcast_buffers: DDP re-sends buffers from rank 0 every forward
            (``broadcast_buffers``, ``forward_sync_buffers`` in torch >= 2.13);
            buffers are synced at construction either way.
        tp: tensor-parallel size (1: none). The mesh then needs a ``"tp"``
            dim of this size and :func:`parallelize` a ``tp_fn``; engines
            with the ``"tp"`` capability only.
        check_ranks: ``data_parallel``'s rank divergence check (simplefsdp
            engines; it runs where a forward is not one compiled graph).
        ep: expert-parallel size (1: none). The meshes given to
            :func:`parallelize` then have an ``ep`` role (``Layout(ep=...)``):
            the model's ``experts`` modules get ``ExpertParallel`` on it and
            their parameters are sharded over ``expert_dp``; engines with
            the ``"ep"`` capability only (:mod:`simplefsdp.engines.kinds`).
        fullgraph: compile each graph whole; ``False`` lets ``torch.compile``
            break the graph (data-dependent token counts of a
            mixture-of-experts layer: its split sizes are read to the host).
    """

    engine: str = "simplefsdp"
    mode: str = "fully_shard"
    param_dtype: str | torch.dtype | None = None
    reduce_dtype: str | torch.dtype | None = None
    reshard_after_forward: bool | int = True
    compile: bool = False
    backend: str = "inductor"
    bucketing: Any = "auto"
    reorder: bool = True
    keep_gathered: Any = None
    torch_passes: bool = False
    activation_checkpoint: str = "none"
    recompute_experts: bool = False
    broadcast_buffers: bool = True
    tp: int = 1
    check_ranks: bool = True
    ep: int = 1
    fullgraph: bool = True

    def __post_init__(self) -> None:
        get_engine(self.engine)
        for key in ("tp", "ep"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        errors = composition_errors(
            self.engine,
            tp=self.tp,
            ep=self.ep,
            torch_passes=self.torch_passes,
            group_reshard=not isinstance(self.reshard_after_forward, bool),
        )
        if self.ep > 1:
            errors += Layout(tp=self.tp, ep=self.ep).validate(self.tp * self.ep)
        if errors:
            raise ValueError("; ".join(errors) if len(errors) > 1 else errors[0])
        dtype_from_name(self.param_dtype)
        dtype_from_name(self.reduce_dtype)

    def describe(self) -> str:
        """One line for logs: engine, mode and compilation."""
        if self.engine == "simplefsdp_eager":
            how = f"eager executor, bucketing {_eager_plan(self.bucketing)!r}"
        elif not self.compile:
            how = "not compiled"
        elif self.torch_passes:
            how = "torch.compile with Inductor's passes"
        elif self.engine == "simplefsdp":
            how = f"simplefsdp.compile {self.backend}, bucketing {self.bucketing!r}"
        else:
            how = f"torch.compile {self.backend}"
        if self.engine in ("ddp", "replica"):
            return f"{self.engine} ({how})"
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        tp += f" x ep {self.ep}" if self.ep > 1 else ""
        return f"{self.engine} ({self.mode}{tp}; {how})"


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet_cpu_dtensor_rng() -> Iterator[None]:
    """Silence DTensor's "random operators may not have complete support on cpu" warning.

    On a CPU mesh each rank initialises its shard from its own generator: the
    result is deterministic for a given seed and world size (CUDA meshes use
    DTensor's offset-based RNG tracker).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        yield


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _materialize(
    model: nn.Module, device: torch.device, init_fn: InitFn | None, *, sharded_reads: bool
) -> None:
    """``to_empty`` + ``init_fn`` for a meta model (``sharded_reads``: simplefsdp's shards)."""
    if not _is_meta(model):
        return
    if init_fn is None:
        raise ValueError(
            "the model is on the meta device: pass init_fn (e.g. lambda m: m.init_weights()) "
            "to initialise it after sharding"
        )
    model.to_empty(device=device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_quiet_cpu_dtensor_rng())
        if sharded_reads:
            from simplefsdp.frontend import disable_parametrization

            stack.enter_context(disable_parametrization())
        init_fn(model)


def _compile_blocks(model: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """Compile each repeated block in place (``Module.compile``), as torchtitan does."""
    for _, block in repeated_blocks(model):
        block.compile(backend=backend, fullgraph=fullgraph)


def _eager_plan(bucketing: Any) -> Any:
    return (
        "per_block" if isinstance(bucketing, str) and bucketing in ("auto", "none") else bucketing
    )


# Inductor flags of torch's built-in FSDP bucketing and compute/communication
# overlap passes, for the "torch passes" peer; applied only while that model
# runs (ParallelModel.compile_context).
_TORCH_PASS_FLAGS: dict[str, Any] = {
    "bucket_all_gathers_fx": "only_fsdp",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def torch_passes_patches() -> tuple[dict[str, Any], list[str]]:
    """The Inductor config patches of the torch-passes peer that this torch has.

    Returns:
        ``(patches, notes)``: the flags that exist in the installed
        ``torch._inductor.config`` (and, for the reorder passes, only pass
        names ``torch._inductor.comms`` defines), and one note per flag or
        pass that is missing.
    """
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    notes: list[str] = []
    for flag, value in _TORCH_PASS_FLAGS.items():
        if not hasattr(inductor_config, flag):
            notes.append(f"inductor flag {flag} does not exist in this torch; not set")
            continue
        if flag == "reorder_for_compute_comm_overlap_passes":
            missing = [p for p in value if not hasattr(comms, p)]
            notes.extend(f"inductor reorder pass {p} does not exist; skipped" for p in missing)
            value = [p for p in value if p not in missing]
        patches[flag] = value
    return patches, notes


# --------------------------------------------------------------------------- engines


def _apply_simplefsdp(
    model: nn.Module,
    spec: EngineSpec,
    mesh: DeviceMesh,
    device: torch.device,
    init_fn,
    expert_mesh: DeviceMesh | None = None,
) -> ParallelModel:
    import simplefsdp

    policy = simplefsdp.MixedPrecisionPolicy(
        param_dtype=dtype_from_name(spec.param_dtype),
        reduce_dtype=dtype_from_name(spec.reduce_dtype),
    )
    simplefsdp.data_parallel(
        model,
        mesh,
        mode=spec.mode,
        mp_policy=policy,
        reshard_after_forward=spec.reshard_after_forward,
        check_ranks=spec.check_ranks,
        expert_mesh=expert_mesh,
    )
    _materialize(model, device, init_fn, sharded_reads=True)
    parallel = ParallelModel(model, model, spec.engine, mesh)
    if spec.engine == "simplefsdp_eager":
        simplefsdp.eager(model, bucketing=_eager_plan(spec.bucketing))
        if spec.compile:
            parallel.notes.append("the eager executor is never compiled; compile settings unused")
        return parallel
    if not spec.compile:
        return parallel
    parallel.compiled = True
    if spec.torch_passes:
        patches, notes = torch_passes_patches()
        parallel.forward = torch.compile(model, backend=spec.backend, fullgraph=spec.fullgraph)
        parallel.inductor_patches = patches
        parallel.notes += [
            *notes,
            "plain torch.compile: reshard-after-forward is left to the min-cut partitioner",
            "inductor patches: " + ", ".join(f"{k}={v}" for k, v in patches.items()),
        ]
        return parallel
    simplefsdp.compile(
        model,
        backend=spec.backend,
        bucketing=spec.bucketing,
        reorder=spec.reorder,
        keep_gathered=spec.keep_gathered,
        fullgraph=spec.fullgraph,
    )
    return parallel


def _apply_fsdp2(
    model: nn.Module,
    spec: EngineSpec,
    mesh: DeviceMesh,
    device: torch.device,
    init_fn,
    expert_mesh: DeviceMesh | None = None,
) -> ParallelModel:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from simplefsdp.frontend.expert_parallel import EP_MESH_ATTR

    policy = MixedPrecisionPolicy(
        param_dtype=dtype_from_name(spec.param_dtype),
        reduce_dtype=dtype_from_name(spec.reduce_dtype),
    )
    groups: list[list[nn.Module]] = []  # per block: the block, then its experts' groups
    blocks = repeated_blocks(model)
    for _, block in blocks:
        if spec.compile:
            # As torchtitan: per-block compile; with TP the block's DTensor ops
            # are traced too (fullgraph may not hold for every TP plan).
            block.compile(backend=spec.backend, fullgraph=spec.tp == 1 and spec.fullgraph)
        experts_groups = []
        if expert_mesh is not None:
            # As torchtitan: the experts (ExpertParallel's DTensors on "ep")
            # get their own FSDP group on the ranks holding the same experts.
            for experts in block.modules():
                if EP_MESH_ATTR in experts.__dict__:
                    fully_shard(
                        experts,
                        mesh=expert_mesh,
                        mp_policy=policy,
                        reshard_after_forward=spec.reshard_after_forward,
                    )
                    experts_groups.append(experts)
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward
        )
        groups.append([block, *experts_groups])
    # As torchtitan (pytorch/torchtitan#1094): the embedding a group of its
    # own, resharded after forward like the blocks; the final norm and the
    # output one group, kept from forward into backward, which needs them
    # first. Tied embeddings stay in the root group, not resharded either.
    outer = outer_modules(model, blocks)
    if outer is not None:
        for side, reshard in zip(outer, (spec.reshard_after_forward, False)):
            modules = [m for _, m in side]
            if modules:
                group = modules if len(modules) > 1 else modules[0]
                fully_shard(group, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    if expert_mesh is not None and groups:
        _prefetch_explicitly(model, groups)
    _materialize(model, device, init_fn, sharded_reads=False)
    return ParallelModel(model, model, "fsdp2", mesh, compiled=spec.compile)


def _prefetch_explicitly(root: nn.Module, groups: list[list[nn.Module]]) -> None:
    """FSDP2's all-gathers issued one block ahead, the block's experts with it
    (``groups``: per block in forward order, the block and its experts'
    groups), as torchtitan sets them under expert parallelism: the token
    counts' device-to-host read in every MoE layer stops the host from
    running ahead, so FSDP2's implicit prefetch (the next all-gather
    issued when the host reaches it) would leave each gather exposed."""
    root.set_modules_to_forward_prefetch(groups[0])
    root.set_modules_to_backward_prefetch(groups[-1])
    for current, following in zip(groups, groups[1:]):
        current[0].set_modules_to_forward_prefetch(following)
        following[0].set_modules_to_backward_prefetch(current)


def _apply_ddp(
    model: nn.Module, spec: EngineSpec, mesh: DeviceMesh, device: torch.device, init_fn
) -> ParallelModel:
    from torch.nn.parallel import DistributedDataParallel

    notes = []
    if spec.param_dtype or spec.reduce_dtype:
        notes.append("param_dtype/reduce_dtype are not used by the ddp engine")
        logger.warning(notes[-1])
    _materialize(model, device, init_fn, sharded_reads=False)
    if spec.compile:
        _compile_blocks(model, spec.backend, spec.fullgraph)
    kwargs: dict[str, Any] = {}
    if not spec.broadcast_buffers:
        # torch >= 2.13 renames it (the old name warns); both still sync at init.
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        kwargs[name] = False
        notes.append(f"{name}=False")
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(),
        **kwargs,
    )
    return ParallelModel(model, ddp, "ddp", mesh, compiled=spec.compile, notes=notes)


def _apply_replica(
    model: nn.Module, spec: EngineSpec, mesh: DeviceMesh, device: torch.device, init_fn
) -> ParallelModel:
    _materialize(model, device, init_fn, sharded_reads=False)
    forward = torch.compile(model, backend=spec.backend, fullgraph=True) if spec.compile else model
    notes = ["each rank trains its own replica (no gradient sync)"]
    return ParallelModel(model, forward, "replica", mesh, compiled=spec.compile, notes=notes)


_ADAPTERS = {
    "simplefsdp": _apply_simplefsdp,
    "simplefsdp_eager": _apply_simplefsdp,
    "fsdp2": _apply_fsdp2,
    "ddp": _apply_ddp,
    "replica": _apply_replica,
}


def _meshes(mesh: DeviceMesh | Meshes, ep: int) -> Meshes:
    """The roles of ``mesh``; a flattened data-parallel mesh of an expert-parallel
    ``("dp_shard_mod_ep", "ep")`` mesh reads its experts' meshes from its root."""
    if isinstance(mesh, Meshes):
        return mesh
    meshes = meshes_of(mesh)
    if ep > 1 and meshes.ep is None:
        from simplefsdp._compat import root_mesh

        root = root_mesh(mesh)
        names = root.mesh_dim_names or ()
        if "ep" not in names or "dp_shard_mod_ep" not in names:
            raise ValueError(
                f"spec.ep={ep} needs a mesh with expert-parallel dims (Layout(ep={ep}).build()); "
                f"got a mesh whose root is {names} {tuple(root.shape)}"
            )
        meshes = dataclasses.replace(meshes, ep=root["ep"], expert_dp=root["dp_shard_mod_ep"])
    return meshes


def parallelize(
    model: nn.Module,
    spec: EngineSpec,
    mesh: DeviceMesh | Meshes,
    device: torch.device,
    *,
    init_fn: InitFn | None = None,
    tp_fn: TensorParallelFn | None = None,
    loss_fn: LossFn | None = None,
    need_experts: bool = True,
) -> ParallelModel:
    """Parallelise ``model`` with ``spec``; see the module docstring.

    Args:
        model: any module; on the meta device or with real tensors.
        spec: what to apply.
        mesh: the job's meshes (``Layout(...).build(device_type)``), or its
            world mesh (roles read by :func:`simplefsdp.layout.meshes_of`):
            parameters are sharded over ``fsdp``, TP applied on ``tp``, the
            experts parallelised over ``ep`` and sharded over ``expert_dp``.
        device: the training device.
        init_fn: initialises a meta-device model in place after sharding
            (e.g. ``lambda m: m.init_weights()``); required for meta models.
        tp_fn: applies tensor parallelism in place, ``tp_fn(model, tp_mesh)``
            (e.g. a model spec's ``tensor_parallel``);
            required when ``spec.tp > 1``.
        loss_fn: ``loss_fn(output, targets)``, for :meth:`ParallelModel.step`
            and :meth:`ParallelModel.eval_loss`.
        need_experts: with ``spec.ep > 1``, a model without ``experts``
            modules is an error; ``False`` parallelises it without expert
            parallelism (a pipeline stage of dense blocks only).

    Raises:
        ValueError: a meta model without ``init_fn``, a mesh that does not
            match ``spec.tp`` or ``spec.ep``, ``spec.tp > 1`` without ``tp_fn``,
            ``spec.ep > 1`` on a model without ``experts`` modules (with
            ``need_experts``), or invalid
            settings (the engines' own errors).
    """
    meshes = _meshes(mesh, spec.ep)
    tp_mesh = meshes.tp
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    if tp_size != spec.tp:
        raise ValueError(
            f"the mesh {meshes.world.mesh_dim_names} {tuple(meshes.world.shape)} has a "
            f"tensor-parallel size of {tp_size} but spec.tp is {spec.tp}; build it with "
            f"Layout(tp={spec.tp})"
        )
    ep_size = meshes.ep.size() if meshes.ep is not None else 1
    if ep_size != spec.ep:
        raise ValueError(
            f"the mesh {meshes.world.mesh_dim_names} {tuple(meshes.world.shape)} has an "
            f"expert-parallel size of {ep_size} but spec.ep is {spec.ep}; build it with "
            f"Layout(ep={spec.ep})"
        )
    if spec.tp > 1 and tp_fn is None:
        raise ValueError(
            f"spec.tp={spec.tp} needs tp_fn(model, tp_mesh) to apply tensor parallelism "
            "(e.g. the model spec's tensor_parallel)"
        )
    if not _is_meta(model):
        model.to(device)
    if tp_mesh is not None and tp_fn is not None:
        tp_fn(model, tp_mesh)
    expert_mesh = None
    if spec.ep > 1:
        from simplefsdp.frontend.expert_parallel import apply_expert_parallel

        applied = apply_expert_parallel(model, meshes.ep)
        if not applied and need_experts:
            raise ValueError(
                f"spec.ep={spec.ep} but {type(model).__name__} has no submodule named 'experts' "
                "to shard over the expert-parallel ranks"
            )
        if applied:
            logger.info("expert parallelism (ep %d) on %d experts modules", spec.ep, len(applied))
            expert_mesh = meshes.expert_dp
    apply_activation_checkpointing(model, spec.activation_checkpoint, spec.recompute_experts)
    if expert_mesh is not None:
        parallel = _ADAPTERS[spec.engine](model, spec, meshes.fsdp, device, init_fn, expert_mesh)
    else:
        parallel = _ADAPTERS[spec.engine](model, spec, meshes.fsdp, device, init_fn)
    parallel.tp_mesh = tp_mesh
    parallel.loss_fn = loss_fn
    logger.info("parallelized with %s", spec.describe())
    return parallel
