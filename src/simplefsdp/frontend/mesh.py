"""Resolving and validating the data-parallel device mesh."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.policies import MESH_NDIM_FOR_MODE


def _served_device_types() -> set[str]:
    """Device types the default process group's backend serves."""
    config = str(dist.get_backend_config())  # e.g. "cpu:gloo,cuda:gloo"
    return {part.split(":", 1)[0] for part in config.split(",") if ":" in part}


def default_device_type(param_device_types: Iterable[str] = ()) -> str:
    """The device type of the default mesh.

    The parameters' device type when they all live on one that the default
    process group's backend serves: the mesh follows the model, so a CPU model
    under gloo or the fake backend stays on CPU even where CUDA is visible
    (a cuda mesh would move its parameters there, away from its inputs).
    Otherwise (meta or no parameters, mixed devices, or a device the backend
    cannot serve, e.g. CPU parameters under NCCL) the backend's device:
    ``cpu`` for gloo or without CUDA, ``cuda`` otherwise.
    """
    found = {t for t in param_device_types if t != "meta"}
    if len(found) == 1:
        (device_type,) = found
        if device_type in _served_device_types():
            return device_type
    backend = dist.get_backend()
    if "nccl" in str(backend) and torch.cuda.is_available():
        return "cuda"
    if str(backend) == "gloo" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def resolve_mesh(
    mesh: DeviceMesh | None, mode: str, param_device_types: Iterable[str] = ()
) -> DeviceMesh:
    """Return the mesh to place parameters on, or raise a clear error.

    ``None`` builds the FSDP mesh of ``Layout()`` (1-D, every rank of the
    default process group) on
    :func:`default_device_type` (the parameters' device where the backend
    serves it; else ``cuda`` for NCCL, ``cpu`` for gloo).
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
        from simplefsdp.layout import Layout

        device_type = default_device_type(param_device_types)
        return Layout().build(device_type).fsdp
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
