"""The eager executor's collectives: asynchronous c10d calls with profiler labels.

Every collective is issued with ``async_op=True`` on the mesh dimension's
process group and returns a work handle; the runtime decides when to ``wait``.
On NCCL the collective runs on NCCL's stream (``wait`` makes the current
stream wait, the CPU continues); on gloo it runs on the process group's worker
threads while the Python thread keeps computing, so both overlap
communication with compute.

``Collectives`` is a small object rather than free functions so that tests
and benchmarks can wrap it (e.g. inject a communication delay) without
patching torch.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from simplefsdp._compat import all_gather_single, reduce_scatter_single


class Work(Protocol):
    """What an issued collective returns: something to ``wait`` on."""

    def wait(self) -> object: ...


class Collectives:
    """Issues the executor's collectives asynchronously (always with ``SUM``).

    The executor averages by dividing after the sum, so that every backend
    (gloo has no ``AVG`` in older torch) computes the same thing.
    """

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, label: str
    ) -> Work:
        """All-gather ``shard`` (1-D) of every rank of ``group`` into ``output``
        (1-D, rank-major, ``group size * shard.numel()`` elements)."""
        with record_function(f"simplefsdp.eager::all_gather({label})"):
            return all_gather_single(output, shard, group=group, async_op=True)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, label: str
    ) -> Work:
        """Sum ``full`` (1-D, rank-major) over ``group`` and keep this rank's
        chunk in ``output``."""
        with record_function(f"simplefsdp.eager::reduce_scatter({label})"):
            return reduce_scatter_single(
                output, full, op=dist.ReduceOp.SUM, group=group, async_op=True
            )

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> Work:
        """Sum ``tensor`` over ``group`` in place."""
        with record_function(f"simplefsdp.eager::all_reduce({label})"):
            return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
