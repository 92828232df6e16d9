"""The global gradient clip for gradients on any mix of meshes.

Note: [Global norm over mixed meshes]
    ``torch.nn.utils.get_total_norm`` works on DTensors only when they all
    live on one mesh. With tensor parallelism under data parallelism (ours or
    torch FSDP2) the TP-sharded gradients are DTensors on the (dp, tp) mesh
    and the others (norm weights) on the 1-D dp mesh, a slice of it. Here
    each rank instead adds up ``|x|^p`` of the gradient entries it is the one
    to count, and one all-reduce over the default process group sums them:

    * a DTensor gradient's local tensor counts if this rank's coordinate is 0
      on every mesh dim where the gradient is ``Replicate`` (``Shard``,
      ``_StridedShard`` and uneven shards split the tensor into disjoint
      pieces, so every piece counts once), and if this rank's coordinate is
      0 on every *replica dim* of the root mesh: a dim that some parameter's
      mesh spans but this gradient's mesh does not. A DTensor on
      ``mesh["dp"]`` exists once per TP rank, and these copies are replicas
      (a parameter that TP does not shard is the same on every TP rank); a
      dim that no parameter spans (pipeline stages: each holds its own
      parameters) is not one;
    * a ``Partial`` gradient (not reduced yet) is first reduced to
      ``Replicate`` on those mesh dims (a collective on its mesh);
    * plain-tensor gradients (DDP, one process, the replica engine) are the
      same on every rank, or each rank's own: they are added after the
      all-reduce, so each rank counts its own once, as
      ``torch.nn.utils.clip_grad_norm_`` would.

    The all-reduce runs when any parameter is a DTensor (the same on every
    rank: all ranks build the same model), whether or not this rank has any
    gradient, so a rank without gradients still joins. Models of plain
    tensors only communicate nothing; their norm is exactly torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._foreach_utils import _device_has_foreach_support

from simplefsdp._compat import root_mesh


def _norm_type(norm_type: float | str) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if math.isnan(value) or value <= 0 or value == -math.inf:
        raise ValueError(
            f"unsupported norm_type {norm_type!r}: use a p-norm with p > 0 or float('inf')"
        )
    return value


def _max_norm(max_norm: float) -> float:
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        value = math.nan
    if math.isnan(value) or value < 0:
        raise ValueError(f"max_norm must be >= 0 (0: do not clip), got {max_norm!r}")
    return value


def _root_dims_of(mesh) -> set[str]:
    """The names of the root-mesh dims that ``mesh`` spans.

    A slice spans the dims it is named by; a flattened dim (``"dp"`` made
    from ``("dp_shard_mod_ep", "ep")``) spans each root dim along which this
    rank's neighbours are in it too.
    """
    root = root_mesh(mesh)
    names = set(mesh.mesh_dim_names or ())
    root_names = root.mesh_dim_names
    if root_names is None or names <= set(root_names):
        return names
    coordinate = root.get_coordinate()
    if coordinate is None:
        return names & set(root_names)
    members = set(mesh.mesh.flatten().tolist())
    spanned = names & set(root_names)
    for dim, name in enumerate(root_names):
        if root.size(dim) > 1:
            neighbour = list(coordinate)
            neighbour[dim] = (neighbour[dim] + 1) % root.size(dim)
            if int(root.mesh[tuple(neighbour)]) in members:
                spanned.add(name)
    return spanned


def _spanned_dims(params: list[torch.Tensor]) -> dict[int, set[str]]:
    """Per root mesh (by id), the root dim names that some parameter's mesh spans."""
    spanned: dict[int, set[str]] = {}
    for param in params:
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = spanned.setdefault(id(root_mesh(mesh)), set())
            names.update(_root_dims_of(mesh))
    return spanned


def _counts_here(mesh, spanned: dict[int, set[str]], cache: dict[int, bool]) -> bool:
    """Whether this rank is coordinate 0 on ``mesh``'s replica dims of its root."""
    key = id(mesh)
    if key not in cache:
        root = root_mesh(mesh)
        root_names = root.mesh_dim_names
        own = _root_dims_of(mesh)
        ok = True
        if root_names is not None and root is not mesh:
            coordinate = root.get_coordinate() or ()
            replica = spanned.get(id(root), set()) - own
            ok = all(c == 0 for name, c in zip(root_names, coordinate) if name in replica)
        cache[key] = ok
    return cache[key]


def _counted_local(
    grad: DTensor, spanned: dict[int, set[str]], cache: dict[int, bool]
) -> torch.Tensor | None:
    """This rank's piece of ``grad`` to count (see [Global norm over mixed meshes])."""
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the gradient's mesh
        return None
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in grad.placements]
        )
    for placement, coord in zip(grad.placements, coordinate):
        if placement.is_replicate() and coord != 0:
            return None
    if not _counts_here(mesh, spanned, cache):
        return None
    return grad.to_local()


def _local_norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of ``tensors`` together (grouped foreach norms); 0 if none."""
    tensors = [t for t in tensors if t.numel() > 0]  # the inf-norm of nothing is an error
    return torch.nn.utils.get_total_norm(tensors, norm_type=norm_type, foreach=None)


def _comm_device(params: list[torch.Tensor]) -> torch.device:
    for p in params:
        if isinstance(p, DTensor):
            return p.to_local().device
    return params[0].device


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """``grads *= coef`` in place, one foreach multiply per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        device_coef = coef.to(device)
        if _device_has_foreach_support(device):
            torch._foreach_mul_(group, device_coef)
        else:
            for g in group:
                g.mul_(device_coef)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float | str = 2.0,
) -> torch.Tensor:
    """Global ``norm_type``-norm of all gradients across meshes and ranks; clip if ``max_norm > 0``.

    Works for plain, DTensor (simplefsdp, torch FSDP2, tensor parallel) and
    mixed gradients, including DTensors on different meshes (e.g. the 1-D dp
    mesh and the 2-D (dp, tp) mesh). The norm is exact: every entry of every
    gradient is counted once (see [Global norm over mixed meshes]). Clipping
    scales every gradient by ``min(1, max_norm / (total + 1e-6))``, as
    ``torch.nn.utils.clip_grads_with_norm_`` does.

    Collective over the default process group when any parameter is a
    DTensor: every rank calls it, with the same parameters.

    Args:
        parameters: the parameters (or one tensor) whose ``.grad`` to use;
            ``None`` gradients are skipped.
        max_norm: clip to this norm; ``0`` computes the norm only.
        norm_type: ``p`` of the p-norm (``p > 0``) or ``float("inf")``.

    Returns:
        The total norm before clipping, a plain 0-d tensor.

    Raises:
        ValueError: a negative ``max_norm`` or an unsupported ``norm_type``.
    """
    max_norm = _max_norm(max_norm)
    p = _norm_type(norm_type)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [param.grad for param in params if param.grad is not None]
    distributed = any(isinstance(param, DTensor) for param in params)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if not distributed:
        if not grads:
            return torch.zeros(())
        total = _local_norm(plain, p)
    else:
        cache: dict[int, bool] = {}
        spanned = _spanned_dims(params)
        counted = (_counted_local(g, spanned, cache) for g in grads if isinstance(g, DTensor))
        shards = _local_norm([t for t in counted if t is not None], p)
        device = _comm_device(params)
        # From the parameters, not this rank's gradients: the same on every rank.
        wide = any(param.dtype == torch.float64 for param in params)
        acc = torch.float64 if wide else torch.float32
        part = shards.to(device=device, dtype=acc)
        if p != math.inf:
            part = part**p
        if dist.is_available() and dist.is_initialized():
            op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op)
        own = _local_norm(plain, p).to(device=device, dtype=acc)
        total = torch.maximum(part, own) if p == math.inf else (part + own**p) ** (1.0 / p)
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        _scale_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total
