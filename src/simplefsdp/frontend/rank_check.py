"""Whether every rank gathered the same parameters in a forward.

Note: [Same gathers on every rank]
    Sharded data parallelism is SPMD: every rank must issue the same
    collectives in the same order. A forward whose parameter reads depend on
    the rank's data breaks that. A mixture-of-experts layer that runs only the
    experts its tokens were routed to (Hugging Face Mixtral's loop over
    ``expert_hit``), LayerDrop with a per-rank random draw, or an early exit
    all do. Rank 0 then all-gathers expert 0 while rank 1 all-gathers expert
    3.

    When the two collectives differ in size, gloo aborts and NCCL hangs. When
    they have the same size (experts usually do), they pair up. Each rank then
    computes with a weight made of the other rank's shard of another
    parameter, and backward reduce-scatters gradients of different
    parameters into each other. Nothing fails; the model silently trains
    wrong.

    So every read that gathers outside compiled code (``data_parallel``
    without compile, the eager executor's bucket gathers, and the graphs of
    ``simplefsdp.compile(fullgraph=False)`` with the eager code between them)
    folds a key into this process's running digest: the parameter's FQN, the
    bucket's name, or the graph's parameters. After each forward of the
    wrapped root, the ranks all-reduce the digest's minimum and maximum over
    the data-parallel mesh (``ranks_agree``). That is one collective of two
    int64s. Where they differ, every rank raises ``RankDivergenceError``
    before backward, so no gradient and no optimizer step comes of the bad
    forward.

    The check is made whether or not anything was recorded, so all ranks
    call it alike. It catches the silent case: ranks that issued as many
    collectives of the same sizes. Ranks that issued different numbers or
    sizes of collectives fail inside the collectives first, as before.
    ``simplefsdp.compile`` with ``fullgraph=True`` needs no check: the whole
    forward is one graph whose collectives are fixed when it is compiled
    (Note: [Plans from sizes, not guards]). ``data_parallel(...,
    check_ranks=False)`` turns the check off.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_MODULUS = (1 << 61) - 1  # a Mersenne prime: the digest stays a positive int64
_MULTIPLIER = 1_000_003

# This process's running digest of the gathers since the last check
# (Note: [Same gathers on every rank]). Process-wide: model code reads
# parameters through plain attribute access, with no argument to carry it.
_digest = 1


class RankDivergenceError(RuntimeError):
    """The ranks gathered different parameters in one forward
    (Note: [Same gathers on every rank])."""


@functools.lru_cache(maxsize=65536)
def _token(key: str) -> int:
    # Computed once per key: record() runs on every parameter read.
    return zlib.crc32(key.encode()) + 1


def record(key: str) -> None:
    """Fold ``key`` (a parameter FQN, a bucket or graph name) into the digest.
    Not under compilation: there the graph's collectives are fixed instead."""
    global _digest
    _digest = (_digest * _MULTIPLIER + _token(key)) % _MODULUS


def recorded(
    compiled: Callable,
    params: str,
    fqn_by_id: dict[int, str] | None = None,
    positions: Sequence[int] = (),
) -> Callable:
    """``compiled`` (a compiled graph over the parameters ``params``) that
    records each of its runs.

    With ``fqn_by_id`` (parameter ``id`` -> FQN) and the ``positions`` of
    the graph's inputs that are parameters, a run records the parameters it
    is called with: one graph serves every module of a class whose
    parameters are graph inputs (Note: [One swapped class per original
    class]), so the parameters it was compiled for need not be the ones it
    runs on. ``params`` is the key when none of them is a known parameter.
    """
    fallback = f"graph:{params}"
    if not fqn_by_id or not positions:

        @functools.wraps(compiled)
        def run_fixed(*args: Any, **kwargs: Any) -> Any:
            record(fallback)
            return compiled(*args, **kwargs)

        return run_fixed

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        names = [fqn_by_id.get(id(args[i])) for i in positions if i < len(args)]
        key = ",".join(n for n in names if n)
        record(f"graph:{key}" if key else fallback)
        return compiled(*args, **kwargs)

    return run


def reset() -> None:
    """Forget what was recorded since the last check."""
    global _digest
    _digest = 1


def ranks_agree(digest: int, mesh: DeviceMesh) -> bool:
    """Whether every rank of ``mesh`` passed the same ``digest`` (collective
    over the mesh: each dimension in turn)."""
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    values = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    for dim in range(mesh.ndim):
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    low, high = int(values[0]), -int(values[1])
    return low == high


def check(mesh: DeviceMesh, where: str) -> None:
    """Raise ``RankDivergenceError`` if the ranks of ``mesh`` recorded
    different gathers since the last check; collective over ``mesh`` (call it
    on every rank). ``where`` names the forward, for the message."""
    digest = _digest
    reset()
    if mesh.size() == 1 or ranks_agree(digest, mesh):
        return
    raise RankDivergenceError(
        f"simplefsdp: the ranks gathered different parameters in {where}. Its "
        "collectives paired different parameters between the ranks, so its results are "
        "wrong; no gradient was reduced. Every rank must read the same parameters in the "
        "same order in every forward. Control flow that depends on the rank's data breaks "
        "that: a mixture-of-experts layer that runs only the experts its tokens were routed "
        "to (Hugging Face Mixtral's loop over `expert_hit`), LayerDrop with a per-rank random "
        "draw, or an early exit. To fix it, run every expert on every rank (with no tokens "
        "where none were routed), or hold the experts in one parameter (a 3-D expert "
        "weight). Another option is simplefsdp.eager(model, bucketing=<the MoE layer's class>): "
        "it gathers each layer whole, and gives unused experts zero gradients (README: "
        "'Models whose ranks read different parameters')."
    )
