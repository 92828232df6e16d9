"""Device, process group and data-parallel mesh of a training or benchmark process.

The trainer and the benchmark workers set up their process the same way:
:func:`pick_device` (``cuda:LOCAL_RANK`` or ``cpu``), :func:`init_distributed`
(NCCL on CUDA, gloo on CPU; a one-process group without a launcher's
environment), then :func:`build_mesh` with the shape :func:`mesh_shape_for`
decides. ``mesh_shape_for`` and :func:`default_nproc` are pure enough for a
command line to call before it starts any process.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)

__all__ = [
    "build_mesh",
    "comm_device",
    "default_nproc",
    "init_distributed",
    "mesh_shape_for",
    "pick_device",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def default_nproc() -> int:
    """Processes per machine when the user gives none: all visible GPUs, or 2 on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 2


def pick_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when GPUs are visible, else ``cpu``."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def comm_device(device: torch.device) -> torch.device:
    """Where tensors given to the default process group's collectives live."""
    return device if device.type == "cuda" else torch.device("cpu")


def init_distributed(
    device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> tuple[int, int]:
    """Initialise the default process group for ``device`` (if needed); ``(rank, world)``.

    NCCL on CUDA (and the current device set), gloo on CPU. Without a
    launcher's environment (no ``WORLD_SIZE``) a single-process group is made
    on an in-memory store. Under torchelastic with restarts the rendezvous
    store gets a per-attempt prefix (see :func:`_per_attempt_store`).
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if "WORLD_SIZE" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            kwargs: dict[str, Any] = {"timeout": timeout}
            if device.type == "cuda":
                kwargs["device_id"] = device
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:
                kwargs.update(_per_attempt_store(timeout))
            dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()


def _per_attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """``store``/``rank``/``world_size`` for the env:// rendezvous, keyed by restart attempt.

    Under torchelastic the workers of every attempt share the agent's TCPStore;
    a restarted attempt would read the previous attempt's process-group keys
    (e.g. gloo addresses of dead peers) and fail to connect
    (pytorch/pytorch#135712). A per-attempt key prefix keeps the attempts apart,
    so ``torchrun --max-restarts K`` works without further settings.
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"simplefsdp/attempt{attempt}/", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def mesh_shape_for(
    engine: str,
    mode: str,
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None = None,
    local_world_size: int | None = None,
) -> tuple[int, ...]:
    """The data-parallel mesh shape for ``engine``/``mode`` on ``world_size`` ranks.

    ``replicate``/``fully_shard`` use a 1-D mesh of all ranks (FSDP2's
    ``replicate`` is HSDP on ``(world_size, 1)``). ``hybrid_shard`` uses
    ``mesh_shape`` ``[replicate, shard]`` or, when unset,
    ``[world_size // local_world_size, local_world_size]`` (replicate across
    hosts, shard within a host).

    Raises:
        ValueError: the shape cannot be built from ``world_size`` ranks.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if mode != "hybrid_shard":
        if engine == "fsdp2" and mode == "replicate":
            return (world_size, 1)
        return (world_size,)
    if mesh_shape is not None:
        shape = tuple(int(x) for x in mesh_shape)
    else:
        local = local_world_size or world_size
        if world_size % local:
            local = world_size
        shape = (world_size // local, local)
    if len(shape) != 2 or shape[0] * shape[1] != world_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        valid = ", ".join(f"[{d}, {world_size // d}]" for d in divisors)
        needs = f"needs {shape[0] * shape[1]} ranks" if len(shape) == 2 else "is not 2-D"
        raise ValueError(
            f"parallel.mesh_shape {list(shape)} {needs} but the world size is {world_size}; "
            f"valid shapes for {world_size} ranks: {valid}"
        )
    return shape


def build_mesh(
    engine: str,
    mode: str,
    device_type: str,
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None = None,
    local_world_size: int | None = None,
) -> DeviceMesh:
    """The data-parallel ``DeviceMesh`` (shape from :func:`mesh_shape_for`).

    Dimension names: ``("dp",)`` for 1-D meshes, ``("dp_replicate", "dp_shard")``
    for 2-D ones.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shape = mesh_shape_for(
        engine, mode, world_size, mesh_shape=mesh_shape, local_world_size=local_world_size
    )
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    logger.info("data-parallel mesh %s %s on %s", names, shape, device_type)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
