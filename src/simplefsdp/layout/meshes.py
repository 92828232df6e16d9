"""The job's one ``DeviceMesh`` and its views by role."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp.layout.layout import Layout

logger = logging.getLogger(__name__)

__all__ = ["Meshes", "build_meshes", "meshes_of"]

#: Dims of a mesh that shard parameters with data parallelism (and cp).
_SHARD_DIMS = ("dp_shard", "dp_shard_mod_ep", "ep", "dp_shard_in_ep", "dp")
#: Older names of a mesh's data-parallel dims, read by :func:`meshes_of`.
_REPLICATE_DIMS = ("dp_replicate", "replicate", "rep")


@dataclass(frozen=True)
class Meshes:
    """The views of a job's mesh by role; a role of degree 1 without a dim is ``None``.

    Attributes:
        layout: the resolved degrees.
        world: the one mesh over all ranks (dims in :data:`~simplefsdp.layout.DIM_ORDER`).
        fsdp: what dense parameters are sharded over: ``dp_shard x cp``
            (flattened), or 2-D ``(dp_replicate, dp_shard x cp)`` with
            replicas (HSDP).
        batch: ranks that read different batches: ``dp_replicate x
            dp_shard`` (excludes cp, tp and pp).
        loss: ranks whose losses average into the global loss: ``batch x cp``.
        tp / pp / cp / ep: the tensor-, pipeline-, context- and
            expert-parallel meshes (``None`` at degree 1).
        expert_dp: what the experts' parameters are sharded over
            (``dp_shard x cp / ep``, torchtitan's ``dp_shard_mod_ep``;
            ``None`` without ``ep``).
    """

    layout: Layout
    world: DeviceMesh
    fsdp: DeviceMesh
    batch: DeviceMesh
    loss: DeviceMesh
    tp: DeviceMesh | None = None
    pp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_dp: DeviceMesh | None = None

    @property
    def batch_rank(self) -> int:
        """This rank's index among the ranks that read different batches."""
        return _flat_rank(self.batch)

    @property
    def batch_size(self) -> int:
        """How many different batches a step reads (``dp_replicate * dp_shard``)."""
        return self.batch.size()

    @property
    def stage_mesh(self) -> DeviceMesh:
        """The world without its pipeline dim: what one pipeline stage runs on."""
        names = self.world.mesh_dim_names or ()
        if "pp" not in names:
            return self.world
        return self.world[tuple(n for n in names if n != "pp")]


def _flat_rank(mesh: DeviceMesh) -> int:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this process is not part of the mesh")
    rank = 0
    for dim, index in enumerate(coordinate):
        rank = rank * mesh.size(dim) + index
    return rank


def _view(
    world: DeviceMesh,
    dims: tuple[str, ...],
    name: str,
    cache: dict[tuple[str, ...], DeviceMesh],
) -> DeviceMesh:
    """``world`` restricted to ``dims`` (flattened to one dim ``name`` when several;
    ``cache`` keeps one flattening per set of dims: each makes process groups)."""
    if dims in cache:
        return cache[dims]
    names = world.mesh_dim_names or ()
    if len(dims) == 1:
        view = world if names == dims else world[dims[0]]
    else:
        view = (world if names == dims else world[dims])._flatten(name)
    cache[dims] = view
    return view


def build_meshes(layout: Layout, device_type: str, world_size: int | None = None) -> Meshes:
    """Build ``layout``'s world mesh over the default process group; see :meth:`Layout.build`."""
    if world_size is None:
        world_size = dist.get_world_size()
    layout = layout.resolve(world_size)
    names, sizes = layout.mesh_dims()
    logger.info("mesh %s %s on %s", names, sizes, device_type)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return meshes_of(world, layout)


def meshes_of(world: DeviceMesh, layout: Layout | None = None) -> Meshes:
    """The role views of ``world``, a mesh :meth:`Layout.build` made (or one named alike).

    Dims are read by name: ``pp``, ``tp``, ``cp``; ``dp_replicate``
    (or ``replicate``/``rep``); the sharded dims ``dp_shard`` (or ``dp``,
    ``shard``, or ``dp_shard_mod_ep`` with ``ep``/``dp_shard_in_ep``). A
    mesh whose dims have other names is data parallel on all of them (1-D:
    sharded; 2-D: replicated on the first dim, sharded on the second).

    Args:
        world: the job's mesh.
        layout: its degrees (default: read from ``world``).
    """
    names = tuple(world.mesh_dim_names or ())
    size = dict(zip(names, world.shape, strict=True)) if names else {}
    special = {"pp", "tp", "cp"}
    data = tuple(n for n in names if n not in special)
    if not data:
        raise ValueError(f"mesh {names} has no data-parallel dim besides pp/tp/cp")
    replicate = tuple(n for n in data if n in _REPLICATE_DIMS)
    shard = tuple(n for n in data if n not in _REPLICATE_DIMS)
    if not names or (not replicate and len(shard) == 2 and "dp_shard_mod_ep" not in shard):
        # an unnamed or (replicate, shard)-style 2-D data-parallel mesh
        replicate, shard = data[:1], data[1:]
    if not shard:
        raise ValueError(f"mesh {names} has no sharded data-parallel dim")
    cp = ("cp",) if "cp" in names else ()
    if layout is None:
        shard_size = 1
        for n in shard:
            shard_size *= size[n]
        ep = 1
        if "ep" in size:
            ep = size["ep"]
        elif "dp_shard_in_ep" in size:
            ep = size["dp_shard_in_ep"] * size.get("cp", 1)
        layout = Layout(
            dp_replicate=size[replicate[0]] if replicate else 1,
            dp_shard=shard_size,
            cp=size.get("cp", 1),
            tp=size.get("tp", 1),
            pp=size.get("pp", 1),
            ep=ep,
        )
    fsdp_dims = (*shard, *cp)
    fsdp_name = "dp_shard_cp" if cp else "dp_shard"
    cache: dict[tuple[str, ...], DeviceMesh] = {}
    fsdp = _view(world, fsdp_dims, fsdp_name, cache)
    if replicate:
        if len(fsdp_dims) == 1:
            dims = (*replicate, *fsdp_dims)
            fsdp = world if names == dims else world[dims]
        else:
            # HSDP over a flattened shard dim: (dp_replicate, dp_shard_cp)
            fsdp = world[(replicate[0], fsdp.mesh_dim_names[0])]
    batch_dims = (*replicate, *shard)
    batch = _view(world, batch_dims, "batch", cache)
    loss = _view(world, (*batch_dims, *cp), "loss", cache)
    ep_mesh = expert_dp = None
    if "ep" in size and "dp_shard_mod_ep" in size:
        ep_mesh = world["ep"]
        expert_dp = world["dp_shard_mod_ep"]
    elif "dp_shard_in_ep" in size:
        ep_mesh = _view(world, ("dp_shard_in_ep", "cp"), "ep", cache)
        expert_dp = world["dp_shard_mod_ep"]
    return Meshes(
        layout=layout,
        world=world,
        fsdp=fsdp,
        batch=batch,
        loss=loss,
        tp=world["tp"] if "tp" in size else None,
        pp=world["pp"] if "pp" in size else None,
        cp=world["cp"] if cp else None,
        ep=ep_mesh,
        expert_dp=expert_dp,
    )
