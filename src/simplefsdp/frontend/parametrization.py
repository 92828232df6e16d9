"""Parameter reads as "replicate computation" on sharded DTensors.

Note: [Parametrization by property]
    ``data_parallel`` stores every parameter as a sharded DTensor in the module's
    ``_parameters`` (so ``named_parameters()``/``state_dict()`` see the shards
    under their original names) and swaps the module's class for a subclass
    that defines one property per parameter name. Reading ``module.weight``
    inside ``forward`` therefore goes through ``replicate_compute``:
    ``redistribute`` to ``Replicate`` (the all-gather, in ``param_dtype``) and
    ``to_local(grad_placements=Partial)``, whose autograd is the gradient
    reduction (reduce-scatter / all-reduce, in ``reduce_dtype``).
    We do not use ``torch.nn.utils.parametrize`` because it renames parameters
    (``parametrizations.weight.original``), which would change checkpoint keys.
    The generated subclass keeps the original class's name and module and only
    adds properties, so ``isinstance`` checks, ``repr`` and ``copy.deepcopy``
    behave as before. It is not importable by name, so pickling a whole wrapped
    module object (``torch.save(model)``) is not supported; save ``state_dict()``
    instead, which is the supported checkpoint format anyway.

Note: [One swapped class per original class]
    The subclass depends only on the original class and the parameter names
    (the properties read each instance's specs from its ``__dict__``), so
    modules of one class with the same names share one subclass. Dynamo
    guards a module's type: with a subclass per instance, each of 16 experts'
    ``nn.Linear`` was a new type, and a frame compiled around a graph break
    inside the expert (``simplefsdp.compile(fullgraph=False)``) recompiled per
    expert. Past ``torch._dynamo.config.recompile_limit`` (8) Dynamo runs the
    frame uncompiled, and where the ranks' token counts made them reach the
    limit at different experts, one rank gathered a bucket while the other
    gathered one parameter: a collective mismatch (gloo aborts, NCCL hangs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from simplefsdp.frontend import rank_check
from simplefsdp.frontend.float8 import float8_gather, float8_gather_applies
from simplefsdp.frontend.grad_accumulator import (
    ACCUMULATORS_ATTR,
    GradAccumulator,
    accumulating_read,
)

# The attribute of a swapped module holding {param_name: ParamSpec}.
SPECS_ATTR = "_simplefsdp_param_specs"
# The attribute holding a module's registered views dict (Note: [Parameter
# view providers]); private to this module, use the functions below.
_VIEWS_ATTR = "_simplefsdp_param_views"


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where a tensor-parallel parameter lives besides its data-parallel shard.

    Attributes:
        mesh: the (tensor-parallel) mesh the parameter was a DTensor on before
            ``data_parallel``; compute sees the parameter as a DTensor there.
        placements: its placements on ``mesh`` (e.g. ``(Shard(0),)`` for a
            column-wise linear weight).
        dp_mesh: the data-parallel mesh (1-D, or 2-D for ``hybrid_shard``).
        dp_placements: the placements on ``dp_mesh`` of the TP-local tensor
            (plain ``Shard``/``Replicate``; the stored DTensor may say
            ``_StridedShard`` for the same layout).
        local_shape: this rank's tensor-parallel shard's shape: the tensor
            that the data-parallel dims shard and gather.
        local_stride: its stride.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    dp_mesh: DeviceMesh
    dp_placements: tuple[Placement, ...]
    local_shape: torch.Size
    local_stride: tuple[int, ...]


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is stored, gathered and reduced.

    Attributes:
        fqn: the parameter's (first) fully qualified name in the wrapped root.
        placements: placements of the stored DTensor on the mesh.
        grad_placements: placements given to ``to_local`` so that autograd reduces
            the gradient (``Partial(avg)`` or ``Partial(sum)`` per mesh dim).
        param_dtype: dtype of the all-gather and of compute (``None``: unchanged).
        reduce_dtype: dtype of the gradient reduction (``None``: gradient's dtype).
    """

    fqn: str
    placements: tuple[Placement, ...]
    grad_placements: tuple[Placement, ...]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    # hybrid_shard only: the 1-D submeshes of the (replicate, shard) mesh.
    replicate_mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None
    # Parameters that tensor parallelism had already made DTensors: how the
    # TP layout is kept under the data-parallel one (Note: [2-D parameters]).
    tp: TensorParallelLayout | None = None

    @property
    def dp_placements(self) -> tuple[Placement, ...]:
        """The placements on the data-parallel mesh dims only."""
        return self.placements if self.tp is None else self.tp.dp_placements

    @property
    def replicate_placements(self) -> tuple[Placement, ...]:
        """The data-parallel placements after the gather (all ``Replicate``)."""
        return tuple(Replicate() for _ in self.dp_placements)

    @property
    def is_sharded(self) -> bool:
        return any(p.is_shard() for p in self.placements)


def make_grad_placements(ndim: int, reduce_op: str) -> tuple[Placement, ...]:
    return tuple(Partial(reduce_op) for _ in range(ndim))


# Note: [Global parametrization switch]
# ``disable_parametrization`` must affect every wrapped module at once (a user
# initialises a whole model under it), and model code reads parameters through
# plain attribute access, so there is no argument through which to pass it.
# It is therefore a process-wide flag, changed only by the context manager below
# (restored in ``finally``). Dynamo guards on it, so compiled code stays correct.
_parametrization_enabled = True


def parametrization_enabled() -> bool:
    """Whether parameter reads currently all-gather (``False`` inside
    ``disable_parametrization``)."""
    return _parametrization_enabled


@contextlib.contextmanager
def disable_parametrization() -> Iterator[None]:
    """Make parameter reads return the stored sharded DTensors.

    Use it to initialise a model in place after ``to_empty`` (so ``init_weights``
    writes into the shards instead of into a gathered copy), or to inspect the
    stored parameters. Nesting is allowed; the previous state is restored on exit.

    Example::

        with simplefsdp.disable_parametrization():
            model.init_weights()
    """
    global _parametrization_enabled
    previous = _parametrization_enabled
    _parametrization_enabled = False
    try:
        yield
    finally:
        _parametrization_enabled = previous


def replicate_compute(
    param: DTensor, spec: ParamSpec, accumulator: GradAccumulator | None = None
) -> torch.Tensor:
    """The unsharded local tensor that compute uses in place of ``param``.

    Forward: cast the shard to ``param_dtype`` and all-gather it (no-op gather
    for replicated parameters). Backward: cast the gradient to
    ``reduce_dtype``, reduce it over the mesh (reduce-scatter for sharded mesh
    dims, all-reduce for replicated ones) and cast it back to the stored dtype.
    See Note: [Hybrid sharding order] for ``hybrid_shard``. With an
    ``accumulator`` (the model entered ``no_sync`` once), see Note:
    [Accumulating unreduced gradients].
    """
    if spec.tp is not None:
        return _tp_replicate_compute(param, spec, accumulator)
    return _dp_gather(param, spec, accumulator)


def _dp_gather(
    param: DTensor, spec: ParamSpec, accumulator: GradAccumulator | None = None
) -> torch.Tensor:
    """All-gather ``param`` over its data-parallel mesh; the local result."""
    if accumulator is not None and param.requires_grad:
        return accumulating_read(_dp_gather(param, spec), accumulator)
    if float8_gather_applies(param, spec):  # Note: [Float8 all-gather]
        return float8_gather(param, spec)
    if spec.shard_mesh is not None:
        return _hybrid_replicate_compute(param, spec)
    gathered = param.redistribute(
        placements=spec.replicate_placements,
        forward_dtype=spec.param_dtype,
        backward_dtype=spec.reduce_dtype,
    )
    return gathered.to_local(grad_placements=spec.grad_placements)


# Note: [2-D parameters]
# A parameter that tensor parallelism already made a DTensor on a ``tp`` mesh
# is stored as one DTensor on the mesh spanning the data-parallel dims and the
# TP dims (their common root sliced by name), placements ``(dp..., tp...)``:
# the data-parallel dims shard this rank's TP-local tensor. When both shard
# the same tensor dim the data-parallel placement is ``_StridedShard`` (as in
# FSDP2 + TP), so ``full_tensor()``, state dicts and DCP see the right global
# tensor and checkpoints reshard between (dp, tp) and (dp') layouts. Reading
# it views the local shard as a DTensor on the data-parallel mesh alone,
# gathers that (the data-parallel all-gather; its autograd is the data-parallel
# reduce-scatter/all-reduce) and hands compute the TP-local result as a DTensor
# on the TP mesh, which is what the TP plan's modules expect. TP's own
# collectives stay where the TP plan put them.
def _tp_replicate_compute(
    param: DTensor, spec: ParamSpec, accumulator: GradAccumulator | None
) -> torch.Tensor:
    tp = spec.tp
    dp_view = DTensor.from_local(
        param.to_local(),
        tp.dp_mesh,
        spec.dp_placements,
        run_check=False,
        shape=tp.local_shape,
        stride=tp.local_stride,
    )
    tp_local = _dp_gather(dp_view, spec, accumulator)
    return DTensor.from_local(
        tp_local,
        tp.mesh,
        tp.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


# Note: [Hybrid sharding order]
# Reducing a (Partial, Partial) gradient to (Replicate, Shard) in one DTensor
# redistribute all-reduces the *full* gradient across replicas first, then
# reduce-scatters it: the cross-host traffic that hybrid sharding exists to
# avoid. We instead go through the two 1-D submeshes: the backward of the
# shard-group DTensor reduce-scatters within the shard group first, and the
# backward of the replicate-group ``from_local``/``to_local`` pair then
# all-reduces only this rank's shard across replicas (in the gradient's dtype,
# i.e. the stored parameter dtype).
def _hybrid_replicate_compute(param: DTensor, spec: ParamSpec) -> torch.Tensor:
    local = param.to_local()  # 1-D shard; its gradient is already fully reduced
    reduce_op = spec.grad_placements[0]
    replicated = DTensor.from_local(
        local, spec.replicate_mesh, (Replicate(),), run_check=False
    ).to_local(grad_placements=(reduce_op,))  # backward: all-reduce across replicas
    sharded = DTensor.from_local(
        replicated,
        spec.shard_mesh,
        (spec.dp_placements[1],),
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    gathered = sharded.redistribute(
        placements=(Replicate(),),
        forward_dtype=spec.param_dtype,
        backward_dtype=spec.reduce_dtype,
    )
    return gathered.to_local(grad_placements=(reduce_op,))  # backward: reduce-scatter


# Note: [Parameter view providers]
# An executor that gathers parameters itself (the eager executor,
# ``simplefsdp.eager``) registers a views dict on each module holding a
# parameter it manages, with ``register_param_views``, and fills and clears its
# entries as it gathers and frees: while the dict maps a parameter name to a
# tensor, reading that parameter returns the tensor instead of gathering
# through DTensor. The getter does a plain dict lookup (no graph break under
# torch.compile); modules without a registered dict pay one ``dict.get``.
def register_param_views(module: nn.Module) -> dict[str, torch.Tensor]:
    """The views dict that reads of ``module``'s parameters consult, created
    empty on the first call (later calls return the same dict).

    The caller owns the entries: ``views[name] = tensor`` makes reads of
    ``module.<name>`` return ``tensor``; removing the entry restores gathering.
    """
    return module.__dict__.setdefault(_VIEWS_ATTR, {})


def remove_param_views(module: nn.Module) -> None:
    """Drop ``module``'s views dict (if any): reads gather through DTensor again."""
    module.__dict__.pop(_VIEWS_ATTR, None)


def has_param_views(module: nn.Module) -> bool:
    """Whether ``module`` has a registered views dict."""
    return _VIEWS_ATTR in module.__dict__


def _make_property(name: str) -> property:
    def getter(self: nn.Module) -> torch.Tensor | None:
        param = self._parameters[name]
        if param is None or not _parametrization_enabled:
            return param
        # Note: [Parameter view providers]: a plain dict lookup (no graph break
        # under torch.compile; the dict is absent unless an executor registered it).
        views = self.__dict__.get(_VIEWS_ATTR)
        if views is not None and name in views:
            return views[name]
        # Note: [Accumulating unreduced gradients]: no accumulators (reads as
        # before) unless the model has entered no_sync.
        accumulators = self.__dict__.get(ACCUMULATORS_ATTR)
        accumulator = None if accumulators is None else accumulators.get(name)
        spec = self.__dict__[SPECS_ATTR][name]
        if not torch.compiler.is_compiling():
            rank_check.record(spec.fqn)  # Note: [Same gathers on every rank]
        return replicate_compute(param, spec, accumulator)

    def setter(self: nn.Module, value: torch.Tensor | None) -> None:
        # nn.Module.__setattr__ handles Parameter assignment before reaching the
        # property; this covers object.__setattr__-style writes.
        self._parameters[name] = value

    return property(getter, setter)


# Swapped classes by (original class, parametrized names): Note: [One
# swapped class per original class].
_SWAPPED_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def swap_module_class(module: nn.Module, specs: dict[str, ParamSpec]) -> None:
    """Give ``module`` a subclass whose properties parametrize ``specs``' names.

    See Note: [Parametrization by property]. Modules of one class with the
    same parameter names share the subclass: Note: [One swapped class per
    original class].
    """
    cls = module.__class__
    key = (cls, frozenset(specs))
    swapped = _SWAPPED_CLASSES.get(key)
    if swapped is None:
        namespace = {name: _make_property(name) for name in specs}
        namespace["__module__"] = cls.__module__
        namespace["__qualname__"] = cls.__qualname__
        namespace["_simplefsdp_original_class"] = cls
        swapped = _SWAPPED_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    module.__class__ = swapped
    module.__dict__[SPECS_ATTR] = dict(specs)


def is_swapped(module: nn.Module) -> bool:
    return SPECS_ATTR in module.__dict__
