"""Device, process group and data-parallel mesh of a training or benchmark process.

The trainer and the benchmark workers set up their process the same way:
:func:`pick_device` (``cuda:LOCAL_RANK`` or ``cpu``), :func:`init_distributed`
(NCCL on CUDA, gloo on CPU; a one-process group without a launcher's
environment), then the job's meshes from :class:`simplefsdp.layout.Layout`
(:func:`build_mesh` is the world mesh of a data-parallel mode's layout). ``mesh_shape_for`` and :func:`default_nproc` are pure enough for a
command line to call before it starts any process.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.engines.kinds import get_engine
from simplefsdp.layout import Layout, meshes_of

logger = logging.getLogger(__name__)


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
    store gets a per-attempt prefix (see :func:`_per_attempt_store`). On
    gloo, CPU all-gathers avoid torch's coalesced gloo path (Note: [Gloo
    all-gather workaround] in ``simplefsdp._compat``), for every engine.
    """
    if device.type != "cuda":
        from simplefsdp._compat import install_gloo_all_gather_workaround

        install_gloo_all_gather_workaround()
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
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                _warn_multinode_restarts()
                kwargs.update(_per_attempt_store(timeout))
            dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()


def teardown_process_group() -> None:
    """Destroy the default process group once no model holds it; see the Note below.

    Call it after dropping the references to the parallelized model (and its
    optimizer): garbage the model left in reference cycles is collected first.
    """
    # Note: [Process group teardown]
    # A DistributedDataParallel module's C++ reducer keeps its process group
    # alive. If the reducer holds the last reference, freeing the module
    # destroys the gloo group with the GIL held, while a gloo worker thread
    # that just finished a collective may be freeing that work's tensors: it
    # holds the group's mutex and waits for the GIL, the destructor waits for
    # the mutex, and the process never exits (1 of ~15 DDP runs of `simplefsdp
    # train` on CPU hung after "training finished"). Destroyed from Python, the
    # group's destructor releases the GIL. So the models go first, then the
    # group.
    gc.collect()
    dist.destroy_process_group()


def _warn_multinode_restarts() -> None:
    """Restarts on several nodes need a fresh store per attempt (see below)."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes > 1 and restarts > 0 and os.environ.get("RANK") == "0":
        logger.warning(
            "torchrun on %d nodes with --max-restarts %d shares its rendezvous store with the "
            "workers, whose restart counts differ per node: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every restart gets a fresh store "
            "(examples/slurm/train.sbatch does)",
            nodes,
            restarts,
        )


def _per_attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """``store``/``rank``/``world_size`` for the env:// rendezvous, keyed by restart attempt.

    Under torchelastic the workers of every attempt share the agent's TCPStore;
    a restarted attempt would read the previous attempt's process-group keys
    (e.g. gloo addresses of dead peers) and fail to connect
    (pytorch/pytorch#135712). A per-attempt key prefix keeps the attempts apart,
    so ``torchrun --max-restarts K`` works without further settings on one
    node. The attempt count is each node's own (a node restarted because of
    another node's failure does not count it), so on several nodes the
    prefixes would differ: there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    gives every attempt a fresh store and no prefix is used.
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"simplefsdp/attempt{attempt}/", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def _layout_for(
    engine: str,
    mode: str,
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None,
    local_world_size: int | None,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
) -> Layout:
    layout = Layout.for_data_parallel(
        mode,
        world_size,
        mesh_shape=mesh_shape,
        local_world_size=local_world_size,
        replicate_on_2d=get_engine(engine, bench=True).replicate_on_2d,
        cp=cp,
        tp=tp,
        pp=pp,
        ep=ep,
    )
    return layout.resolve(world_size)


def mesh_shape_for(
    engine: str,
    mode: str,
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None = None,
    local_world_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
) -> tuple[int, ...]:
    """The mesh shape for ``engine``/``mode`` on ``world_size`` ranks.

    The shape of :meth:`simplefsdp.layout.Layout.build`'s world mesh for
    :meth:`~simplefsdp.layout.Layout.for_data_parallel`: ``replicate`` and
    ``fully_shard`` shard over all data-parallel ranks (engines that run
    ``replicate`` as HSDP, FSDP2, on ``(dp, 1)``); ``hybrid_shard`` uses
    ``mesh_shape`` ``[replicate, shard]`` or ``[dp // local, local]``; ``pp``
    is the first dim and ``tp`` the last when above 1.

    Raises:
        ValueError: the shape cannot be built from ``world_size`` ranks; the
            message lists the valid ones.
    """
    layout = _layout_for(
        engine,
        mode,
        world_size,
        mesh_shape=mesh_shape,
        local_world_size=local_world_size,
        tp=tp,
        pp=pp,
    )
    return layout.mesh_dims()[1]


def build_mesh(
    engine: str,
    mode: str,
    device_type: str,
    world_size: int,
    *,
    mesh_shape: Sequence[int] | None = None,
    local_world_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
) -> DeviceMesh:
    """The job's world ``DeviceMesh``: ``Layout.build(device_type).world`` for the
    layout of ``engine``/``mode`` (shape from :func:`mesh_shape_for`).

    Dimension names: ``"pp"`` first when ``pp > 1``, then ``"dp_replicate"``
    (replicas), ``"dp_shard"``, then ``"tp"`` when ``tp > 1``.
    :func:`simplefsdp.layout.meshes_of` gives its views by role;
    :func:`split_mesh` the data-parallel and tensor-parallel parts.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    layout = _layout_for(
        engine,
        mode,
        world_size,
        mesh_shape=mesh_shape,
        local_world_size=local_world_size,
        tp=tp,
        pp=pp,
    )
    return layout.build(device_type, world_size).world


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(FSDP mesh, tensor-parallel mesh or None)`` of a job's mesh (its roles
    ``fsdp`` and ``tp``: :func:`simplefsdp.layout.meshes_of`)."""
    meshes = meshes_of(mesh)
    return meshes.fsdp, meshes.tp


def pipeline_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The pipeline-parallel dim of a job's mesh (named ``"pp"``), or ``None``."""
    names = mesh.mesh_dim_names or ()
    return mesh["pp"] if "pp" in names else None


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A job's mesh without its pipeline dim: what each pipeline stage is sharded on."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        return mesh
    return mesh[tuple(n for n in names if n != "pp")]


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """``(rank, size)`` of this process among the ranks that read different batches.

    The ``batch`` role of :func:`simplefsdp.layout.meshes_of`: ranks of one
    tensor-parallel, context-parallel or pipeline group share a batch.
    """
    meshes = meshes_of(mesh)
    return meshes.batch_rank, meshes.batch_size
