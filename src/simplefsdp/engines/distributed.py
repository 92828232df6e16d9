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
import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

__all__ = [
    "build_mesh",
    "comm_device",
    "data_parallel_rank",
    "default_nproc",
    "teardown_process_group",
    "init_distributed",
    "mesh_shape_for",
    "pick_device",
    "pipeline_mesh",
    "split_mesh",
    "stage_mesh",
]

#: The name of the tensor-parallel mesh dim (always the last, innermost dim).
TP_DIM = "tp"
#: The name of the pipeline-parallel mesh dim (always the first, outermost dim).
PP_DIM = "pp"

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

    The data-parallel part: ``replicate``/``fully_shard`` use a 1-D mesh of
    all data-parallel ranks (FSDP2's ``replicate`` is HSDP on ``(dp, 1)``).
    ``hybrid_shard`` uses ``mesh_shape`` ``[replicate, shard]`` or, when
    unset, ``[dp // local, local]`` (replicate across hosts, shard within a
    host; ``local`` is the data-parallel ranks per host). With ``tp > 1`` a
    last (innermost) dim of ``tp`` ranks is added for tensor parallelism, so
    a tensor-parallel group stays within a host where it can; with ``pp > 1``
    a first (outermost) dim of ``pp`` pipeline stages. The data-parallel part
    covers ``world_size // (pp * tp)`` ranks.

    Raises:
        ValueError: the shape cannot be built from ``world_size`` ranks; the
            message lists the valid ones.
    """
    ParallelDims(world_size, tp=tp, pp=pp).validate()
    dp = world_size // (tp * pp)
    head = (pp,) if pp > 1 else ()
    tail = (tp,) if tp > 1 else ()
    if mode != "hybrid_shard":
        if engine == "fsdp2" and mode == "replicate":
            return (*head, dp, 1, *tail)
        return (*head, dp, *tail)
    if mesh_shape is not None:
        shape = tuple(int(x) for x in mesh_shape)
    else:
        local = max((local_world_size or world_size) // tp, 1)
        if dp % local:
            local = dp
        shape = (dp // local, local)
    if len(shape) != 2 or shape[0] * shape[1] != dp:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        valid = ", ".join(f"[{d}, {dp // d}]" for d in divisors)
        needs = f"needs {shape[0] * shape[1]} ranks" if len(shape) == 2 else "is not 2-D"
        if tp > 1 or pp > 1:
            have = (
                f"there are {dp} data-parallel ranks "
                f"(world size {world_size} / (pp {pp} x tp {tp}))"
            )
        else:
            have = f"the world size is {world_size}"
        raise ValueError(
            f"parallel.mesh_shape {list(shape)} {needs} but {have}; "
            f"valid shapes for {dp} ranks: {valid}"
        )
    return (*head, *shape, *tail)


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
    """The job's ``DeviceMesh`` (shape from :func:`mesh_shape_for`).

    Dimension names: ``"pp"`` first when ``pp > 1``, then ``("dp",)`` for a
    1-D data-parallel mesh or ``("dp_replicate", "dp_shard")`` for a 2-D one,
    then ``"tp"`` when ``tp > 1``. :func:`split_mesh` gives the data-parallel
    and tensor-parallel parts, :func:`pipeline_mesh` the pipeline part.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shape = mesh_shape_for(
        engine,
        mode,
        world_size,
        mesh_shape=mesh_shape,
        local_world_size=local_world_size,
        tp=tp,
        pp=pp,
    )
    dp_ndim = len(shape) - (1 if tp > 1 else 0) - (1 if pp > 1 else 0)
    names: tuple[str, ...] = ("dp_replicate", "dp_shard") if dp_ndim == 2 else ("dp",)
    if tp > 1:
        names = (*names, TP_DIM)
    if pp > 1:
        names = (PP_DIM, *names)
    logger.info("mesh %s %s on %s", names, shape, device_type)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(data-parallel mesh, tensor-parallel mesh or None)`` of a job's mesh.

    The tensor-parallel dim is the one named ``"tp"`` (see :func:`build_mesh`);
    the pipeline dim ``"pp"`` is neither; the other dims are data parallel.
    """
    names = mesh.mesh_dim_names or ()
    if TP_DIM not in names and PP_DIM not in names:
        return mesh, None
    dp_names = tuple(n for n in names if n not in (TP_DIM, PP_DIM))
    if not dp_names:
        raise ValueError(f"mesh {names} has no data-parallel dim besides {TP_DIM!r}/{PP_DIM!r}")
    dp_mesh = mesh[dp_names] if dp_names != names else mesh
    return dp_mesh, (mesh[TP_DIM] if TP_DIM in names else None)


def pipeline_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The pipeline-parallel dim of a job's mesh (named ``"pp"``), or ``None``."""
    names = mesh.mesh_dim_names or ()
    return mesh[PP_DIM] if PP_DIM in names else None


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A job's mesh without its pipeline dim: what each pipeline stage is sharded on."""
    names = mesh.mesh_dim_names or ()
    if PP_DIM not in names:
        return mesh
    rest = tuple(n for n in names if n != PP_DIM)
    return mesh[rest]


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel replicas of ``mesh``.

    Ranks of one tensor-parallel group share a data-parallel rank (they must
    read the same batch); without tensor parallelism it is the global rank.
    """
    dp_mesh, _ = split_mesh(mesh)
    coordinate = dp_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this process is not part of the mesh")
    rank = 0
    for dim, index in enumerate(coordinate):
        rank = rank * dp_mesh.size(dim) + index
    return rank, dp_mesh.size()
