"""The wrapper ``simplefsdp.compile`` puts around the compiled call: whether
every rank's first inputs have the same shapes, checked before the first
graph of each kind compiles, and a note on graph breaks under
``fullgraph=True``.

Note: [Ranks' first inputs]
    An auto plan is made once, from the sizes of the first graph over a set
    of parameters, and reused by every recompile (Note: [Plans from sizes,
    not guards]). If the ranks' first inputs differ in shape (each rank pads
    its batch to its own longest sequence, say), their first graphs differ,
    and so may their plans: the ranks would issue different collectives and
    hang. So ``simplefsdp.compile`` (``bucketing="auto"``, a sharded mode)
    wraps the compiled call: on the first call with gradients enabled
    (``forward`` graphs) and the first without (``inference`` graphs) it
    hashes the structure, shapes and dtypes of the arguments (and the value
    of non-tensor ones, which Dynamo specialises on) and all-reduces the
    hash's minimum and maximum over the data-parallel mesh: one collective
    of two int64s, outside the compiled code, on a call that is collective
    anyway (a sharded model's forward all-gathers). Ranks that differ plan
    that kind of graph without sizes (the per-block plan; ``keep_gathered``
    the buckets gathered at the forward/backward boundary anyway), with a
    warning and a report note; every rank knows, because every rank sees
    the same reduced hashes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from simplefsdp.frontend import rank_check

if TYPE_CHECKING:
    from simplefsdp.compiler.backend import SimpleFSDPBackend

logger = logging.getLogger(__name__)


def input_digest(args: tuple, kwargs: dict) -> int:
    """A signed 63-bit hash of a call's argument structure, tensor shapes and
    dtypes, and non-tensor values."""
    leaves, spec = tree_flatten((args, kwargs))
    parts = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"T{tuple(leaf.shape)}{leaf.dtype}")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append(repr(leaf))
        else:
            parts.append(type(leaf).__qualname__)
    digest = hashlib.sha256("|".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _fullgraph_note(data_dependent: bool) -> str:
    note = (
        "simplefsdp.compile traces the whole forward as one graph by default "
        "(fullgraph=True); to compile around this graph break, pass "
        "simplefsdp.compile(..., fullgraph=False) (simplefsdp train: "
        "--compile.fullgraph false): each graph between breaks is then bucketed "
        "on its own"
    )
    if data_dependent:
        note += (
            ". Control flow on data that differs between ranks (a mixture-of-experts "
            "layer that runs only its routed experts) also needs every rank to read the "
            "same parameters (README: 'Models whose ranks read different parameters')"
        )
    return note


def install(
    model: nn.Module,
    backend: SimpleFSDPBackend,
    mesh: DeviceMesh,
    check: bool,
    fullgraph: bool,
    check_ranks: bool = False,
) -> None:
    """Wrap ``model``'s compiled call (``nn.Module.compile``): with ``check``,
    the check of Note: [Ranks' first inputs]; with ``fullgraph``, a graph
    break's error gets a note on how to compile around it; with
    ``check_ranks`` (``fullgraph=False``), the check after each call of
    Note: [Same gathers on every rank]."""
    compiled = model._compiled_call_impl
    check = check and mesh.size() > 1
    check_ranks = check_ranks and mesh.size() > 1
    if compiled is None or not (check or fullgraph or check_ranks):
        return
    checked: set[str] = set()

    @functools.wraps(compiled, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        kind = "forward" if torch.is_grad_enabled() else "inference"
        if check and kind not in checked and not torch.compiler.is_compiling():
            checked.add(kind)
            if not rank_check.ranks_agree(input_digest(args, kwargs), mesh):
                backend.size_independent.add(kind)
                logger.warning(
                    "simplefsdp auto plan: the ranks' first %s inputs differ in shape; "
                    "planning %s graphs without sizes (the per-block plan), so that every "
                    "rank issues the same collectives",
                    kind,
                    kind,
                )
        try:
            output = compiled(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            # A UserError gets the note only for data-dependent control flow.
            data_dependent = "data-dependent" in str(exc)
            is_break = isinstance(exc, torch._dynamo.exc.Unsupported) or data_dependent
            if fullgraph and is_break and hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(_fullgraph_note(data_dependent))
            raise
        if check_ranks and not torch.compiler.is_compiling():
            rank_check.check(mesh, f"the forward of {type(model).__name__} (compiled)")
        return output

    model._compiled_call_impl = call
