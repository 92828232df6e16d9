"""Gradient accumulation without communication: ``simplefsdp.no_sync``.

Note: [Accumulating unreduced gradients]
    A parameter read all-gathers the shard and its autograd is the gradient
    reduction (Note: [Parametrization by property]), so by default every
    micro-batch of an accumulation step reduces. Inside ``no_sync(model)`` a
    read still all-gathers, but the gathered tensor is detached from the
    stored shard (its backward reduces nothing) and passed through
    ``_RouteToAccumulator``: an identity whose backward hands the gradient to
    the parameter's *accumulator*, a leaf tensor of the gathered (unsharded;
    for 2-D parameters TP-local) shape with ``requires_grad=True``. It has
    zero strides, so it holds one element; autograd's own ``AccumulateGrad``
    sums the micro-batches' gradients into ``leaf.grad`` (full size, as FSDP2
    keeps unsharded gradients), eagerly and outside any compiled graph, so
    compiled graphs contain no mutation. ``leaf.grad`` has the reduction dtype
    (``reduce_dtype``, else ``param_dtype``, else the stored dtype): FSDP2's
    choice.

    A read with gradient sync (the last micro-batch) of a parameter whose
    ``leaf.grad`` is set passes the gathered tensor through ``_AddPending``,
    whose backward returns ``grad + leaf.grad``: the read's one reduction
    (reduce-scatter, all-reduce or both, in ``reduce_dtype``) carries every
    micro-batch's gradient. The sum is formed in the accumulator's dtype and
    rounded once to the gradient's dtype (``param_dtype``), because autograd
    hands the reduction a gradient of the gathered tensor's dtype; with
    ``param_dtype == reduce_dtype`` (or no mixed precision) nothing is lost.
    The parameter's post-accumulate-grad hook then drops ``leaf.grad`` (after
    the reduced gradient reached ``param.grad``; after a compiled backward
    too, as it runs eagerly).

    The mode is a flag on the model's ``AccumulationState``, read by every
    parameter read; Dynamo guards on it (and on ``leaf.grad`` being set), so
    compiled code gets one graph per mode and the existing graphs stay as
    they were: a model that never entered ``no_sync`` has no accumulators and
    reads exactly as before. Tied parameters (one ``Parameter`` under several
    modules) have one accumulator; only the first read of a forward adds the
    pending gradient (``consumed``; entering ``no_sync`` resets it, in case
    a synced forward never ran its backward). Frozen parameters have none.
    Reads recomputed by uncompiled activation checkpointing see the same mode
    (forward and backward run in one block) and ``consumed``, so they add
    nothing twice; ``_AddPending`` keeps the sum on its context rather than
    in ``save_for_backward`` so that recomputation saves the same tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from simplefsdp.frontend.data_parallel import STATE_ATTR, get_data_parallel_state
from simplefsdp.frontend.grad_accumulator import (
    ACCUMULATORS_ATTR,
    AccumulationState,
    GradAccumulator,
)
from simplefsdp.frontend.parametrization import SPECS_ATTR, replicate_compute

# The attribute of the wrapped root holding its AccumulationState.
_STATE_ATTR = "_simplefsdp_accumulation"
# simplefsdp.eager_executor.api.EXECUTOR_ATTR (the frontend does not import
# the executors, so the name is spelled out here).
_EAGER_EXECUTOR_ATTR = "_simplefsdp_eager_executor"


def _wrapped_root(model: nn.Module) -> nn.Module:
    """The module ``data_parallel`` wrapped (through ``torch.compile`` wrappers)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"no_sync expects an nn.Module, got {type(model).__name__}")
    module = model
    while STATE_ATTR not in module.__dict__:
        inner = module.__dict__.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            get_data_parallel_state(model)  # raises the usual "not wrapped" error
            raise AssertionError("unreachable")  # pragma: no cover
        module = inner
    return module


def _make_leaf(param: torch.Tensor, spec) -> torch.Tensor:
    shape = spec.tp.local_shape if spec.tp is not None else param.shape
    dtype = spec.reduce_dtype or param.dtype
    # Zero strides: one element of memory; only its gradient matters.
    zero = torch.zeros((), dtype=dtype, device=param.device)
    return zero.expand(shape).detach().requires_grad_(True)


def _install(root: nn.Module, state: AccumulationState) -> None:
    by_param: dict[int, GradAccumulator] = {}
    for module in root.modules():
        specs = module.__dict__.get(SPECS_ATTR)
        if not specs:
            continue
        local: dict[str, GradAccumulator] = {}
        for name, spec in specs.items():
            param = module._parameters.get(name)
            if param is None or not param.requires_grad:
                continue
            accumulator = by_param.get(id(param))
            if accumulator is None:
                if param.is_meta:
                    raise ValueError(
                        f"parameter {spec.fqn!r} is on the meta device; materialise the model "
                        "(to_empty and initialisation) before no_sync"
                    )
                accumulator = GradAccumulator(state, spec.fqn, _make_leaf(param, spec))
                by_param[id(param)] = accumulator
                state.accumulators[spec.fqn] = accumulator
                state.handles.append(
                    param.register_post_accumulate_grad_hook(accumulator.after_reduction)
                )
            local[name] = accumulator
        if local:
            module.__dict__[ACCUMULATORS_ATTR] = local


def accumulation_state(model: nn.Module) -> AccumulationState:
    """``model``'s accumulation state, created (with its accumulators) on first use."""
    root = _wrapped_root(model)
    state = root.__dict__.get(_STATE_ATTR)
    if state is None:
        state = AccumulationState()
        _install(root, state)
        root.__dict__[_STATE_ATTR] = state
    return state


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without communication inside the block.

    The equivalent of FSDP2's ``set_requires_gradient_sync(False)`` and DDP's
    ``no_sync()`` for a ``data_parallel`` model, compiled
    (``simplefsdp.compile``) or not: forward still all-gathers parameters,
    but backward reduces nothing; each parameter's unsharded, unreduced
    gradient is summed on the rank (full parameter size, in the reduction
    dtype). The next backward outside the block (of a forward outside it)
    reduces its own gradient plus the sum, once, into ``param.grad``. A
    read's mode is fixed when forward reads the parameter, and activation
    checkpointing re-reads in backward: run each micro-batch's forward and
    backward inside the block (as with DDP's ``no_sync``). Compiled models
    get one more graph per mode (compiled on first use).

    With mixed precision (``param_dtype`` below ``reduce_dtype``) the sum is
    added to the last micro-batch's gradient in ``param_dtype`` (rounded once;
    FSDP2 adds in ``reduce_dtype``). A model running the eager executor
    (``simplefsdp.eager``) uses the executor's own ``no_sync``.

    Example::

        for micro_batch in micro_batches[:-1]:
            with simplefsdp.no_sync(model):
                loss_fn(model(micro_batch)).backward()
        loss_fn(model(micro_batches[-1])).backward()  # reduces the sum once
        optimizer.step()

    Raises:
        ValueError: ``model`` is not wrapped by ``data_parallel``, or its
            parameters are still on the meta device.
    """
    root = _wrapped_root(model)
    executor = root.__dict__.get(_EAGER_EXECUTOR_ATTR)
    if executor is not None:
        with executor.no_sync():
            yield
        return
    state = accumulation_state(root)
    previous = state.no_sync
    state.no_sync = True
    for accumulator in state.accumulators.values():
        # A synced forward whose backward never ran did not reduce the sum:
        # keep accumulating onto it (the next synced read adds it again).
        accumulator.consumed = False
    try:
        yield
    finally:
        state.no_sync = previous


# torch._dynamo.config's switch for side effects inside activation checkpointing.
_CHECKPOINT_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def compiled_read_context(root: nn.Module) -> contextlib.AbstractContextManager:
    """What a compiled call of ``root`` runs under (``simplefsdp.compile``).

    Note: [Accumulation flags under compiled activation checkpointing]
        A synced read marks its accumulator ``consumed`` (a Python attribute),
        which Dynamo applies after the graph runs. Inside a region of
        ``torch.utils.checkpoint`` Dynamo traces a higher-order op and refuses
        any side effect on an outer object, since eager checkpointing replays
        forward's side effects when it recomputes in backward and a compiled
        graph cannot. Here the flag must be set once, by forward, and not again
        by the recomputation (that is what ``consumed`` guards against in
        eager), so once the model has accumulators its compiled calls run
        with Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``:
        forward's side effects inside checkpointed regions are kept, not
        replayed. A model that never entered ``no_sync`` compiles as before,
        and so do its graphs traced before that (Dynamo does not guard on this
        option). Users driving ``torch.compile`` themselves (with
        ``compile_backend``) set the option around their calls.
    """
    state = root.__dict__.get(_STATE_ATTR)
    config = torch._dynamo.config
    if state is None or not state.accumulators or not hasattr(config, _CHECKPOINT_SIDE_EFFECTS):
        return contextlib.nullcontext()
    return config.patch(**{_CHECKPOINT_SIDE_EFFECTS: True})


def reduce_accumulated(model: nn.Module, *, scale: float | None = None) -> int:
    """Reduce the gradients summed inside :func:`no_sync` now, without a forward.

    For schedules whose last micro-batch's forward runs before the other
    micro-batches' backwards (every pipeline schedule), a synced read cannot
    carry the sum: run every micro-batch inside ``no_sync`` and call this
    once after the last backward. Each parameter with an accumulated
    gradient is read again (its all-gather, uncompiled) and that read's
    backward gets the sum as its gradient: the read's own reduction
    (reduce-scatter, all-reduce or both, in ``reduce_dtype``) runs once and
    adds the result to ``param.grad``, exactly as a synced backward would.

    Args:
        model: a ``data_parallel`` model (compiled or not).
        scale: multiply the sums by this before reducing (e.g. ``1 /
            micro_batches`` for a mean); exact for powers of two.

    Returns:
        The number of parameters reduced (0 if nothing was accumulated).

    Raises:
        ValueError: ``model`` is not wrapped by ``data_parallel`` or runs the
            eager executor (use its own ``no_sync`` and a synced backward).
    """
    root = _wrapped_root(model)
    if root.__dict__.get(_EAGER_EXECUTOR_ATTR) is not None:
        raise ValueError(
            "reduce_accumulated does not apply to a model running the eager executor "
            "(simplefsdp.eager); end its no_sync with a synced backward instead"
        )
    state = root.__dict__.get(_STATE_ATTR)
    if state is None:
        return 0
    outputs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    done: set[int] = set()
    with torch.enable_grad():
        for module in root.modules():
            accumulators = module.__dict__.get(ACCUMULATORS_ATTR)
            if not accumulators:
                continue
            for name, accumulator in accumulators.items():
                pending = accumulator.leaf.grad
                if pending is None or id(accumulator) in done:
                    continue
                done.add(id(accumulator))
                param = module._parameters[name]
                read = replicate_compute(param, module.__dict__[SPECS_ATTR][name])
                grad = pending if scale is None else pending * scale
                local = read.to_local() if isinstance(read, DTensor) else read
                grad = grad.to(local.dtype)
                if isinstance(read, DTensor):
                    grad = DTensor.from_local(
                        grad,
                        read.device_mesh,
                        read.placements,
                        run_check=False,
                        shape=read.shape,
                        stride=read.stride(),
                    )
                outputs.append(read)
                grads.append(grad)
                accumulator.leaf.grad = None
    if outputs:
        torch.autograd.backward(outputs, grads)
    return len(outputs)
