"""Resolving and validating the data-parallel device mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp.policies import MESH_NDIM_FOR_MODE


def default_device_type() -> str:
    """The device type matching the default process group's backend."""
    backend = dist.get_backend()
    if "nccl" in str(backend) and torch.cuda.is_available():
        return "cuda"
    if str(backend) == "gloo" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def resolve_mesh(mesh: DeviceMesh | None, mode: str) -> DeviceMesh:
    """Return the mesh to place parameters on, or raise a clear error.

    ``None`` builds a 1-D mesh over the default process group on the device
    type its backend serves (``cuda`` for NCCL, ``cpu`` for gloo).
    """
    want_ndim = MESH_NDIM_FOR_MODE[mode]
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "data_parallel needs torch.distributed: the default process group is not "
                "initialised. Call torch.distributed.init_process_group(...) first (torchrun "
                "sets the environment), or pass mesh=init_device_mesh(...)."
            )
        if want_ndim != 1:
            raise ValueError(
                f"mode={mode!r} needs a {want_ndim}-D mesh (replicate dim, shard dim); "
                "pass mesh=init_device_mesh(device_type, (num_replicas, shard_size))"
            )
        return init_device_mesh(default_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got "
            f"{type(mesh).__name__}"
        )
    if mesh.ndim != want_ndim:
        raise ValueError(
            f"mode={mode!r} needs a {want_ndim}-D mesh, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; 1-D for 'replicate'/'fully_shard', 2-D "
            "(replicate, shard) for 'hybrid_shard'"
        )
    return mesh
