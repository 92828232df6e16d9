"""``simplefsdp.compile``, ``compile_backend`` and ``comm_report``."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from simplefsdp.compiler import first_inputs
from simplefsdp.compiler.backend import CompileOptions, SimpleFSDPBackend
from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.compiler.report import CommReport
from simplefsdp.frontend.accumulation import compiled_read_context
from simplefsdp.frontend.data_parallel import get_data_parallel_state

BACKEND_ATTR = "_simplefsdp_backend"


def compile_backend(
    *,
    backend: str = "inductor",
    bucketing: Any = "auto",
    reorder: bool = True,
    memory_budget_bytes: int | None = None,
    reshard_after_forward: bool | int = True,
    prefetch_distance: int = 1,
    keep_gathered: int | str | list[str] | None = None,
    cost_model: CostModel | None = None,
    model: nn.Module | None = None,
) -> SimpleFSDPBackend:
    """A ``torch.compile`` backend with simplefsdp's resharding and passes.

    Use it as ``torch.compile(model, backend=simplefsdp.compile_backend(...))``
    when you manage ``torch.compile`` yourself; ``simplefsdp.compile`` builds
    one from the model's ``data_parallel`` settings. Arguments are those of
    ``simplefsdp.compile``; ``reshard_after_forward`` is given explicitly here
    (``simplefsdp.compile`` reads it from the wrapped model), and ``model``,
    if given, names parameters in the report (otherwise Dynamo's sources do).

    With ``bucketing="auto"`` and no ``cost_model``, this calibrates the
    cost model (a few collectives and timings): call it on every rank. An
    injected ``cost_model`` must be identical on every rank.

    Raises:
        ValueError / TypeError: invalid option values.
    """
    options = CompileOptions(
        backend=backend,
        bucketing=bucketing,
        reorder=reorder,
        memory_budget_bytes=memory_budget_bytes,
        reshard_after_forward=reshard_after_forward,
        prefetch_distance=prefetch_distance,
        keep_gathered=keep_gathered,
        cost_model=cost_model,
    )
    backend_obj = SimpleFSDPBackend(options, model)
    backend_obj.prepare()  # "auto": calibrate now, on every rank together
    return backend_obj


def compile(  # noqa: A001 - mirrors torch.compile on purpose
    model: nn.Module,
    *,
    backend: str = "inductor",
    bucketing: Any = "auto",
    reorder: bool = True,
    memory_budget_bytes: int | None = None,
    prefetch_distance: int = 1,
    keep_gathered: int | str | list[str] | None = None,
    cost_model: CostModel | None = None,
    fullgraph: bool = True,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Compile a ``data_parallel``-wrapped module with simplefsdp's backend, in place.

    Forward and backward are traced with every collective visible. The FSDP
    all-gathers are recomputed in backward when the model was wrapped with
    ``reshard_after_forward=True`` (saved otherwise), then our passes bucket
    and reorder the collectives, and the graphs run under Inductor or, with
    ``backend="aot_eager"``, eagerly (bitwise equal to uncompiled execution).

    The module is compiled in place (``nn.Module.compile``), so parameter
    names, ``state_dict`` keys and checkpoints are unchanged; it is returned
    for convenience. Compilation happens on the first call.

    Args:
        model: a module wrapped by ``simplefsdp.data_parallel``.
        backend: ``"inductor"`` (default) or ``"aot_eager"`` (debugging).
        bucketing: ``"auto"`` (cost-model plan), ``"none"`` (one collective
            per parameter), or a manual plan: ``"per_block"``, a list of
            lists of module FQNs, a module class, or a predicate
            ``(fqn, module) -> bool`` (see ``simplefsdp.bucket_plan``).
        reorder: prefetch all-gathers and delay waits to overlap compute.
        memory_budget_bytes: peak-memory budget (bytes) for the auto planner
            and for ``keep_gathered="auto"``; ``None``: what eager FSDP2 would
            hold, i.e. the per-block plan's predicted peak plus the
            activations eager autograd saves beyond what the compiled graph
            saves (Note: [Keeping what eager FSDP2 would hold]).
        prefetch_distance: how many buckets ahead all-gathers are issued.
        keep_gathered: with ``reshard_after_forward=True``, buckets whose
            gathered parameters are kept for backward instead of regathered:
            ``"auto"`` (the planner's choice: the last ``prefetch_distance +
            1`` buckets of the forward, gathered at the forward/backward
            boundary anyway, plus the buckets before them that fit in the
            memory budget's slack; with ``reshard_after_forward=N`` only the
            former), an int N (the last N buckets;
            0: none) or a list of module/parameter FQNs (the buckets holding
            them). ``None`` (default): ``"auto"`` with ``bucketing="auto"``,
            else 0. The forward graph's report lists the kept buckets and
            their bytes. Where a parameter's shard group has one rank its
            read is a cast with no all-gather: the same count keeps the casts
            of the last buckets (``"auto"``: the last ``prefetch_distance +
            1``) and the others are cast again in backward.
        cost_model: a ``simplefsdp.compiler.CostModel`` to plan with (must be
            identical on every rank); ``None`` calibrates one on this machine
            when ``bucketing="auto"`` (here, on every rank together; cached on
            disk; rank 0's numbers are used everywhere).
        fullgraph: passed to ``torch.compile``: graph breaks are errors (the
            error says how to compile around them); ``False`` compiles the
            graphs between breaks, each bucketed and planned on its own.
        **torch_compile_kwargs: passed to ``torch.compile`` (e.g. ``dynamic``).

    Returns:
        ``model``, compiled. ``simplefsdp.comm_report(model)`` describes it
        after the first step.

    Raises:
        ValueError: ``model`` is not wrapped by ``data_parallel``, or an
            option is invalid.
    """
    if "backend" in torch_compile_kwargs:
        raise TypeError("pass backend= once (it is simplefsdp.compile's own argument)")
    state = get_data_parallel_state(model)
    simplefsdp_backend = compile_backend(
        backend=backend,
        bucketing=bucketing,
        reorder=reorder,
        memory_budget_bytes=memory_budget_bytes,
        reshard_after_forward=state.reshard_after_forward,
        prefetch_distance=prefetch_distance,
        keep_gathered=keep_gathered,
        cost_model=cost_model,
        model=model,
    )
    model.compile(backend=simplefsdp_backend, fullgraph=fullgraph, **torch_compile_kwargs)
    _run_reads_in_context(model)
    # Note: [Ranks' first inputs]; a hint on graph breaks.
    check = simplefsdp_backend.is_auto and state.mode != "replicate"
    # Note: [Same gathers on every rank]: graphs with eager code between them.
    check_ranks = state.check_ranks and not fullgraph
    simplefsdp_backend.record_graph_runs = check_ranks
    first_inputs.install(model, simplefsdp_backend, state.mesh, check, fullgraph, check_ranks)
    model.__dict__[BACKEND_ATTR] = simplefsdp_backend
    return model


class RecompileLimitError(RuntimeError):
    """A frame of a ``simplefsdp.compile``d model reached Dynamo's recompile
    limit (Note: [No silent fallback at the recompile limit])."""


def _recompile_limit_fails() -> contextlib.AbstractContextManager:
    """Dynamo raises instead of running a frame uncompiled at the recompile
    limit, for the duration of one compiled call (Note: [No silent fallback
    at the recompile limit])."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def _recompile_limit_message(model: nn.Module) -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    limit = torch._dynamo.config.recompile_limit
    return (
        f"simplefsdp: rank {rank}: a frame of {type(model).__name__}'s compiled forward "
        f"recompiled more than torch._dynamo.config.recompile_limit={limit} times; running it "
        "uncompiled would issue other FSDP collectives than the ranks that still run it "
        "compiled, so this rank stops (TORCH_LOGS=recompiles names the guards that failed; "
        "raise the limit if the recompiles are expected)"
    )


def _run_reads_in_context(model: nn.Module) -> None:
    """Run ``model``'s compiled calls under ``compiled_read_context``
    (Note: [Accumulation flags under compiled activation checkpointing]),
    with the recompile limit an error (Note: [No silent fallback at the
    recompile limit])."""
    compiled = model._compiled_call_impl
    limit_hit = torch._dynamo.exc.FailOnRecompileLimitHit

    @functools.wraps(compiled, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        # Note: [No silent fallback at the recompile limit]
        # Past torch._dynamo.config.recompile_limit, Dynamo runs a frame
        # uncompiled from then on, on this rank only. A frame of a
        # data_parallel model reads parameters: compiled, its all-gathers are
        # bucketed by our passes; uncompiled, they are one per parameter. So
        # the rank's collectives would stop pairing with the other ranks'
        # (RankDivergenceError at best, a hang or a wrong result at worst).
        # Each compiled call runs with Dynamo's fail_on_recompile_limit_hit,
        # scoped to the call, and the rank that reaches the limit raises one
        # line saying so. Nothing else in the process sees the option.
        try:
            with compiled_read_context(model), _recompile_limit_fails():
                return compiled(*args, **kwargs)
        except limit_hit as exc:
            raise RecompileLimitError(_recompile_limit_message(model)) from exc

    model._compiled_call_impl = call


def comm_report(compiled: nn.Module | SimpleFSDPBackend) -> CommReport:
    """The communication report of a module compiled by ``simplefsdp.compile``
    (or of a ``compile_backend`` object).

    Per compiled graph (forward, backward): the collectives with kind, dtype,
    bytes, the parameter FQNs they carry, the positions of their issue and
    wait among compute nodes, their process group and ``role`` (``"dp"``:
    data parallel, bucketed and reordered; ``"tp"``: a 2-D model's tensor
    parallel ones, left in place and listed apart; ``"other"``); buckets and
    predictions when passes ran. ``count(graph, kind, role=None)`` and
    ``to_dict()["graphs"][i]["by_role"]`` summarise them per role.
    ``print(report)`` shows a table; ``report.to_dict()`` is JSON-serialisable.

    Raises:
        ValueError: nothing was compiled by simplefsdp for this module, or no
            step has run yet (compilation happens on the first call).
    """
    if isinstance(compiled, SimpleFSDPBackend):
        backend = compiled
    else:
        backend = compiled.__dict__.get(BACKEND_ATTR)
        if backend is None:
            inner = compiled.__dict__.get("_orig_mod")
            backend = inner.__dict__.get(BACKEND_ATTR) if inner is not None else None
        if backend is None:
            raise ValueError(f"{type(compiled).__name__} was not compiled with simplefsdp.compile")
    if not backend.report.graphs:
        raise ValueError("no graph compiled yet: run one step (forward and backward) first")
    return backend.report
