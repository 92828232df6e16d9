"""Tensor-parallel (TP) plans of the shared components, and of a whole decoder.

The plan lives beside the model, not in it: the model stays a plain
``nn.Module`` and this file describes, as plain data, how torch's own
:func:`torch.distributed.tensor.parallel.parallelize_module` should shard it
over a 1-D ``DeviceMesh`` (Megatron-style, as torchtitan's Llama 3 ``apply_tp``).
One function per component (:func:`attention_plan`, :func:`feed_forward_plan`,
:func:`moe_plan`), composed by :func:`decoder_plan`:

* ``tok_embeddings``: :class:`RowwiseParallel` -- a vocabulary-parallel
  embedding (the table is ``Shard(0)``; each rank looks up the ids it owns and
  the partial results are summed). Token ids come in replicated; the output is
  ``Shard(1)`` (a reduce-scatter onto the sequence dim) with sequence
  parallelism, else ``Replicate`` (an all-reduce).
* ``layers.*.attention_norm``, ``layers.*.ffn_norm``, ``norm``:
  :class:`SequenceParallel` with sequence parallelism (each rank normalises its
  slice of the sequence; the weights are replicated DTensors). Without it they
  are left alone (plain replicated parameters, replicated activations).
* ``layers.*.attention`` / ``layers.*.feed_forward``:
  :class:`PrepareModuleInput` turns the ``Shard(1)`` activation into a
  ``Replicate`` one (an all-gather) once per module, with sequence
  parallelism; without it the replicated input is only wrapped, so the
  backward all-reduces the input gradient once rather than once per
  projection. ``attention`` also gets ``freqs_cis`` as its second positional
  input, a plain tensor that is passed through (``None`` in the layouts).
* ``wq``/``wk``/``wv``/``w1``/``w3``: :class:`ColwiseParallel` (heads and the
  SwiGLU hidden dim are split across ranks; the attention reshapes with ``-1``
  head counts, so local heads just work). ``wo``/``w2``:
  :class:`RowwiseParallel` whose partial output is reduce-scattered to
  ``Shard(1)`` (sequence parallel) or all-reduced to ``Replicate``.
* Float8: a block whose projections are torchao ``Float8Linear`` layers with
  tensorwise dynamic scaling (``convert_to_float8_training`` before TP, as
  torchtitan) gets torchao's float8 styles instead (``Float8ColwiseParallel``,
  ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``): the activation is
  cast to float8 before its sequence all-gather (half the bytes), the scales
  are the whole tensors' amaxes, and the output gradients are cast to float8
  in backward. Rowwise-scaled and unconverted layers keep the plain styles
  (the ``Float8Linear`` then casts its DTensor inputs itself).
* ``layers.*.moe`` (a mixture-of-experts layer): the input is all-gathered
  to the whole sequence and the layer's output, a partial sum over the TP
  ranks, is reduce-scattered back onto it (:class:`MoETensorParallel`;
  all-reduced without sequence parallelism). The router gate stays a plain
  tensor, replicated: every rank routes every token alike
  (:class:`RouterTensorParallel`). The routed experts are split over their
  hidden dim (:class:`ExpertTensorParallel`, torchtitan's expert TP): every
  rank runs every token through its slice of every expert, so each holds
  and computes ``1/tp`` of the experts. The shared experts are sharded like
  a dense feed-forward network; both leave partial sums, added before the
  one reduce-scatter. In backward the input's gradient, partial, is
  reduce-scattered once (Note: [Expert tensor parallelism's gradients]).
* ``output``: :class:`ColwiseParallel` over the vocabulary. With loss
  parallelism the logits stay a ``Shard(-1)`` DTensor
  (``use_local_output=False``) and must be consumed by ``F.cross_entropy``
  inside :func:`loss_parallel_context`; otherwise they are all-gathered to a
  plain replicated ``(B, T, vocab_size)`` tensor.

Constraints (checked by :func:`apply_decoder_tp` where possible):
``n_heads``, ``n_kv_heads`` and the SwiGLU hidden dims (dense, shared and
routed experts) must be divisible by the TP size, and ``vocab_size`` too when ``loss_parallel`` is on (an uneven
vocabulary is otherwise fine: DTensor shards it unevenly). With
``sequence_parallel`` the sequence length of every batch must be divisible by
the TP size -- only known at run time, so :func:`apply_decoder_tp`
registers a forward pre-hook that raises ``ValueError`` otherwise (the bare
plan does not: an uneven split aborts or hangs the process group).

Example::

    mesh = init_device_mesh("cuda", (tp,))
    model = apply_decoder_tp(Transformer(args), mesh, loss_parallel=True)
    with loss_parallel_context(True):
        logits = model(tokens[:, :-1])                   # DTensor, Shard(-1)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel
from torch.distributed.tensor.placement_types import Placement


def attention_plan(
    prefix: str, attention: nn.Module, seq: Placement, styles: Any
) -> dict[str, ParallelStyle]:
    """TP plan of one :class:`~.attention.Attention` at FQN ``prefix``.

    Heads are split (``wq``/``wk``/``wv`` colwise, ``wo`` rowwise); the
    input arrives in layout ``seq`` and is replicated once for the three
    projections; the output leaves in layout ``seq``. ``styles`` is
    ``(colwise, rowwise, prepare)`` from :func:`_styles_for`.
    """
    colwise, rowwise, prepare = styles
    plan: dict[str, ParallelStyle] = {
        prefix: prepare(attention, ("wq", "wk", "wv"))(
            input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
        )
    }
    for name in ("wq", "wk", "wv"):
        plan[f"{prefix}.{name}"] = colwise(attention, name)()
    plan[f"{prefix}.wo"] = rowwise(attention, "wo")(output_layouts=seq)
    return plan


def feed_forward_plan(
    prefix: str,
    ffn: nn.Module,
    seq: Placement,
    styles: Any,
    *,
    output_layout: Placement | None = None,
) -> dict[str, ParallelStyle]:
    """TP plan of one SwiGLU :class:`~.feed_forward.FeedForward` at FQN ``prefix``.

    The hidden dim is split (``w1``/``w3`` colwise, ``w2`` rowwise); the
    input arrives in layout ``seq`` and leaves in ``output_layout``
    (default ``seq``).
    """
    colwise, rowwise, prepare = styles
    plan: dict[str, ParallelStyle] = {
        prefix: prepare(ffn, ("w1", "w3"))(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        )
    }
    for name in ("w1", "w3"):
        plan[f"{prefix}.{name}"] = colwise(ffn, name)()
    plan[f"{prefix}.w2"] = rowwise(ffn, "w2")(
        output_layouts=seq if output_layout is None else output_layout
    )
    return plan


def moe_plan(prefix: str, moe: nn.Module, seq: Placement, styles: Any) -> dict[str, ParallelStyle]:
    """TP plan of one :class:`~.moe.MoE` layer at FQN ``prefix``.

    The layer sees the whole sequence (its input gathered from ``seq``) and
    leaves a partial sum, reduced back onto ``seq`` (:class:`MoETensorParallel`,
    which also leaves the input's gradient partial: one reduce-scatter in
    backward); the router gate is left plain, replicated (:class:`RouterTensorParallel`);
    the routed ``experts`` are split over their hidden dim
    (:class:`ExpertTensorParallel`) and the shared experts are a feed-forward
    network split over TP, its output left partial.
    """
    plan: dict[str, ParallelStyle] = {
        prefix: MoETensorParallel(seq),
        f"{prefix}.router": RouterTensorParallel(),
        f"{prefix}.experts": ExpertTensorParallel(),
    }
    if getattr(moe, "shared_experts", None) is not None:
        plan.update(
            feed_forward_plan(
                f"{prefix}.shared_experts",
                moe.shared_experts,
                Replicate(),
                styles,
                output_layout=Partial(),
            )
        )
    return plan


# Note: [Expert tensor parallelism's gradients]
#     Under TP a mixture-of-experts layer runs on the whole sequence: its
#     input is all-gathered, every rank routes every token alike (the router
#     replicated) and runs it through its slice of every expert, whose
#     output is a partial sum over the ranks; the routed and the shared
#     experts' partial outputs are added and reduce-scattered once. In
#     backward the gradient each rank computes for the gathered input is
#     partial too, so it is reduce-scattered back onto the sequence (one
#     collective the size of the layer's input, as for a dense feed-forward
#     network), not all-reduced where it leaves the experts (``top_k`` times
#     larger: torchtitan's expert TP all-reduces the routed tokens'
#     gradient). For that sum every path into the input must leave a partial
#     gradient:
#     * the routed experts' slices do;
#     * the shared experts' input conversion all-reduces theirs (a DTensor
#       feed-forward network's), so only the first rank passes it on;
#     * the router is replicated and its gradient whole on every rank, so
#       only the first rank passes its input's gradient on. Its routing
#       weights scale the experts' partial outputs: their gradient is
#       partial and is all-reduced (``tokens x top_k`` floats) before it
#       reaches the gate, which then trains alike on every rank.


def _sum_grad_over(tensor: Any, mesh: DeviceMesh) -> Any:
    """``tensor`` unchanged, its gradient all-reduced over ``mesh`` in
    backward (each rank's is a partial sum)."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
        return tensor
    replicated = DTensor.from_local(tensor, mesh, (Replicate(),), run_check=False)
    return replicated.to_local(grad_placements=(Partial(),))


class _GradOnFirstRank(torch.autograd.Function):
    """Identity; in backward the gradient passes on the first rank of the
    mesh only (zeros elsewhere): a whole gradient made a partial sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, first: bool) -> torch.Tensor:
        ctx.first = first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.first else torch.zeros_like(grad)), None


def _grad_on_first_rank(tensor: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
        return tensor
    return _GradOnFirstRank.apply(tensor, mesh.get_local_rank() == 0)


class MoETensorParallel(ParallelStyle):
    """The input and output of a TP-split mixture-of-experts layer (Note:
    [Expert tensor parallelism's gradients]).

    Forward: the input, in layout ``seq`` (plain or a DTensor), is all-gathered to the whole
    sequence (a plain tensor); the output, a partial sum, is reduce-scattered
    back to ``seq`` (all-reduced where ``seq`` is ``Replicate``). Backward:
    the output's gradient is all-gathered; the input's, a partial sum, is
    reduce-scattered. The shared experts' input gradient, whole after their
    own conversion, passes on from the first rank only.
    """

    def __init__(self, seq: Placement) -> None:
        super().__init__()
        self.seq = seq

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        seq = self.seq

        def input_fn(mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):  # a DTensor comes from a SequenceParallel norm
                x = DTensor.from_local(x, device_mesh, (seq,), run_check=False)
            whole = x.redistribute(device_mesh, (Replicate(),))
            return (whole.to_local(grad_placements=(Partial(),)), *args[1:])

        def output_fn(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
            return partial.redistribute(device_mesh, (seq,)).to_local()

        module.register_forward_pre_hook(input_fn)
        module.register_forward_hook(output_fn)
        shared = getattr(module, "shared_experts", None)
        if shared is not None:
            # before the shared experts' own input conversion, whichever comes first
            shared.register_forward_pre_hook(
                lambda mod, args: (_grad_on_first_rank(args[0], device_mesh), *args[1:]),
                prepend=True,
            )
        return module


class RouterTensorParallel(ParallelStyle):
    """The router of a TP-split mixture-of-experts layer: its parameters stay
    plain and replicated (every rank routes every token alike). Backward:
    the gradient of its first output (the routing weights, which scale the
    experts' partial outputs) is all-reduced; its input's gradient, whole,
    passes on from the first rank only (Note: [Expert tensor parallelism's
    gradients]).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod: nn.Module, args: tuple) -> tuple:
            return (_grad_on_first_rank(args[0], device_mesh), *args[1:])

        def output_fn(mod: nn.Module, args: tuple, outputs: Any) -> Any:
            if isinstance(outputs, tuple):
                return (_sum_grad_over(outputs[0], device_mesh), *outputs[1:])
            return _sum_grad_over(outputs, device_mesh)

        module.register_forward_pre_hook(input_fn)
        module.register_forward_hook(output_fn)
        return module


#: Name of the attribute an experts module declares its TP split in: parameter
#: name -> the dim split over the TP ranks, or ``None`` for a parameter kept
#: whole (a bias added to the partial output; see
#: :func:`~.moe.partial_output_bias`).
EXPERT_TP_DIMS = "tp_shard_dims"


class ExpertTensorParallel(ParallelStyle):
    """Split an experts module's stacked experts over the TP ranks, on their
    hidden dim (torchtitan's expert tensor parallelism).

    The module names its split in ``tp_shard_dims`` (:data:`EXPERT_TP_DIMS`),
    e.g. ``{"w1": 1, "w2": 2, "w3": 1}`` for SwiGLU experts stored
    ``(E, hidden, dim)`` / ``(E, dim, hidden)``: each parameter becomes a
    ``Shard(d)`` DTensor (``None``: a ``Replicate`` one). Every rank receives
    every routed token; its slices of the experts leave a partial sum of the
    output, and of the routed tokens' gradient, which the layer's
    :class:`MoETensorParallel` reduce-scatters (Note: [Expert tensor
    parallelism's gradients]).

    The module's forward takes the local tensors (``DTensor.to_local``).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dims = getattr(module, EXPERT_TP_DIMS, None)
        if not dims:
            raise ValueError(
                f"tensor parallel: experts module {type(module).__name__} declares no "
                f"{EXPERT_TP_DIMS} (parameter name -> the dim split over TP); add it to "
                "split its experts over TP"
            )
        for name, param in list(module.named_parameters(recurse=False)):
            if name not in dims:
                raise ValueError(
                    f"tensor parallel: parameter {name!r} of {type(module).__name__} is not in "
                    f"its {EXPERT_TP_DIMS} {sorted(dims)}; name how TP splits it"
                )
            dim = dims[name]
            placement = Replicate() if dim is None else Shard(dim)
            sharded = distribute_tensor(param.data, device_mesh, [placement])
            module.register_parameter(
                name, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )

        return module


def decoder_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    attention: Callable[..., dict[str, ParallelStyle]] = attention_plan,
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a :class:`~.decoder.Decoder`: FQN -> style.

    The result is plain data: inspect or modify it, then pass it to
    ``parallelize_module(model, tp_mesh, plan)`` (or use
    :func:`apply_decoder_tp`, which also validates the model and mesh).
    See the module docstring for what each entry does. A pipeline stage's
    missing embedding or head (``None``) is left out.

    Args:
        model: The (unsharded) decoder or pipeline stage.
        sequence_parallel: Shard activations outside attention / feed-forward
            (norms, residual stream) on the sequence dim. Requires every
            batch's sequence length to be divisible by the TP size.
        loss_parallel: Leave the logits sharded on the vocabulary dim (a
            ``Shard(-1)`` DTensor) for :func:`loss_parallel_context`.
        attention: ``attention(prefix, module, seq, styles)``, the entries of
            one block's attention (default :func:`attention_plan`; another
            attention variant passes its own).

    Returns:
        A new dict mapping module FQNs (e.g. ``"layers.0.attention.wq"``) to
        ``ParallelStyle`` objects.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    styles = _styles_for(model)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel and getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    for key, block in model.layers.items():
        prefix = f"layers.{key}."
        if sequence_parallel:
            plan[prefix + "attention_norm"] = SequenceParallel()
            plan[prefix + "ffn_norm"] = SequenceParallel()
        plan.update(attention(prefix + "attention", block.attention, seq, styles))
        if getattr(block, "moe_enabled", False):
            plan.update(moe_plan(prefix + "moe", block.moe, seq, styles))
        else:
            plan.update(feed_forward_plan(prefix + "feed_forward", block.feed_forward, seq, styles))
    return plan


def built_split_sizes(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes of a built decoder that its TP plan splits over the TP ranks.

    ``n_heads``, ``n_kv_heads``, the first dense block's feed-forward hidden
    dim, the first MoE block's shared- and routed-experts hidden dims, and
    with ``loss_parallel`` the vocabulary; each must divide by the TP size.
    """
    args = model.args
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads}
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False):
            shared = block.moe.shared_experts
            if shared is not None:
                sizes.setdefault("shared-experts hidden dim", shared.w1.out_features)
            sizes.setdefault("routed-experts hidden dim", _expert_hidden_dim(block.moe.experts))
        else:
            sizes.setdefault("feed-forward hidden dim", block.feed_forward.w1.out_features)
    if loss_parallel:
        sizes["vocab_size"] = args.vocab_size
    return sizes


def _expert_hidden_dim(experts: nn.Module) -> int:
    """One routed expert's hidden dim: the size its second projection (the
    one split on its last dim, see :data:`EXPERT_TP_DIMS`) splits."""
    dims = getattr(experts, EXPERT_TP_DIMS, None) or {}
    for name, dim in dims.items():
        param = getattr(experts, name, None)
        if dim is not None and param is not None and dim == param.ndim - 1:
            return param.shape[dim]
    return 1


def is_float8_tensorwise(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` with dynamic tensorwise
    scaling of its input, weight and output gradient: the layers torchao's
    float8 TP styles serve (rowwise recipes are not)."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = (
        module.config.cast_config_input,
        module.config.cast_config_weight,
        module.config.cast_config_grad_output,
    )
    return all(
        c.scaling_type == ScalingType.DYNAMIC
        and c.scaling_granularity == ScalingGranularity.TENSORWISE
        for c in casts
    )


def _styles_for(model: nn.Module):
    """``(colwise, rowwise, prepare)``: functions of (parent module, child
    name(s)) giving the style class for that projection (or the module input
    shared by those projections): torchao's float8 style where every one of
    them :func:`is_float8_tensorwise`, else torch's."""
    if not any(is_float8_tensorwise(m) for m in model.modules()):
        plain = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
        return tuple((lambda *_, s=style: s) for style in plain)
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def float8(parent: nn.Module, names) -> bool:
        names = (names,) if isinstance(names, str) else names
        return all(is_float8_tensorwise(getattr(parent, name)) for name in names)

    return (
        lambda p, n: Float8ColwiseParallel if float8(p, n) else ColwiseParallel,
        lambda p, n: Float8RowwiseParallel if float8(p, n) else RowwiseParallel,
        lambda p, n: PrepareFloat8ModuleInput if float8(p, n) else PrepareModuleInput,
    )


def _check_divisible(name: str, value: int, tp: int, why: str = "") -> None:
    if value % tp != 0:
        divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
        raise ValueError(
            f"tensor parallel: {name}={value} is not divisible by the TP size {tp}{why}; "
            f"valid TP sizes divide {value} (e.g. {divisors})"
        )


def _validate(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    if not isinstance(tp_mesh, DeviceMesh):
        raise ValueError(
            f"tensor parallel: tp_mesh must be a 1-D DeviceMesh, got {type(tp_mesh).__name__}"
        )
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"tensor parallel: tp_mesh must be a 1-D DeviceMesh, got a {tp_mesh.ndim}-D mesh "
            f"of shape {tuple(tp_mesh.shape)}; pass its TP dim, e.g. mesh['tp']"
        )
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"tensor parallel: parameter {name!r} is already a DTensor "
                f"(placements {param.placements}); apply tensor parallelism to a model "
                "of plain tensors, before any other parallelism wraps it"
            )
    args = getattr(model, "args", None)
    if args is None or not isinstance(getattr(model, "layers", None), nn.ModuleDict):
        raise ValueError(
            f"tensor parallel: expected a decoder (with .args and .layers), "
            f"got {type(model).__name__}"
        )
    tp = tp_mesh.size()
    sizes = built_split_sizes(model, loss_parallel=loss_parallel)
    labels = {
        "feed-forward hidden dim": "ffn hidden dim (feed_forward.w1.out_features)",
        "shared-experts hidden dim": "shared experts hidden dim "
        "(moe.shared_experts.w1.out_features)",
        "routed-experts hidden dim": "routed experts hidden dim (moe_hidden_dim)",
    }
    why = {"vocab_size": " (required with loss_parallel=True)"}
    for name, value in sizes.items():
        _check_divisible(labels.get(name, name), value, tp, why.get(name, ""))


def apply_decoder_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    attention: Callable[..., dict[str, ParallelStyle]] = attention_plan,
) -> nn.Module:
    """Shard a decoder over ``tp_mesh`` with :func:`decoder_plan`.

    Parameters are replaced, in place, by DTensors (``nn.Module``s are kept).
    Apply TP before any data-parallel wrapping, on a model of plain tensors.
    All ranks must hold the same initial weights (``parallelize_module``
    distributes from rank 0's values by default).

    With ``sequence_parallel`` every batch's sequence length must be divisible
    by the TP size (the residual stream is split on the sequence dim). That is
    only known at run time: a forward pre-hook on ``model`` raises
    ``ValueError`` for such a batch (left to torch, the ranks' collectives
    would disagree in size and abort or hang the process group). With
    ``loss_parallel`` the model returns a ``Shard(-1)`` DTensor of logits;
    compute the cross-entropy and its backward inside
    :func:`loss_parallel_context`.

    Args:
        model: A decoder (or pipeline stage) with plain-tensor parameters.
        tp_mesh: A 1-D ``DeviceMesh`` (the TP group).
        sequence_parallel: See :func:`decoder_plan`.
        loss_parallel: See :func:`decoder_plan`.
        attention: See :func:`decoder_plan`.

    Returns:
        ``model``, parallelized in place.

    Raises:
        ValueError: a tensorwise float8 model with ``sequence_parallel`` on a
            CPU mesh (gloo has no float8 all-gather); ``tp_mesh`` is not a
            1-D ``DeviceMesh``; a parameter is already a DTensor; a size of
            :func:`built_split_sizes` is not divisible by the TP size. The
            message names the value. (Later, from ``model(tokens)``: an
            uneven sequence split with ``sequence_parallel``.)
    """
    _validate(model, tp_mesh, loss_parallel)
    if sequence_parallel and tp_mesh.device_type == "cpu":
        float8 = next((n for n, m in model.named_modules() if is_float8_tensorwise(m)), None)
        if float8 is not None:
            raise ValueError(
                f"tensor parallel: float8 layer {float8!r} with sequence_parallel=True on a CPU "
                "mesh: gloo cannot all-gather float8 activations; use sequence_parallel=False "
                "on CPU (GPUs gather them in float8)"
            )
    plan = decoder_plan(
        model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, attention=attention
    )
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:
        model.register_forward_pre_hook(_SequenceLengthCheck(tp_mesh.size()), with_kwargs=True)
    return model


class _SequenceLengthCheck:
    """Forward pre-hook: with sequence parallelism an uneven sequence split
    makes the ranks' all-gathers disagree in size, which aborts or hangs the
    process group instead of raising; refuse such a batch up front."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        seqlen = getattr(tokens, "shape", (0, 0))[1]
        if seqlen % self.tp != 0:
            raise ValueError(
                f"tensor parallel: sequence length {seqlen} is not divisible by the TP size "
                f"{self.tp}, which sequence_parallel=True requires; use a multiple of {self.tp} "
                "(or sequence_parallel=False)"
            )


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """torch's ``loss_parallel()`` when ``enabled``, else a no-op context.

    torch's rule: with loss parallelism both ``F.cross_entropy`` on the
    vocabulary-sharded logits AND the ``backward()`` of that loss must run
    inside this context (the custom log-softmax / NLL ops and their gradients
    are only registered while it is active). The logits must be a DTensor
    sharded on the class dim (what the model returns with
    ``loss_parallel=True``); targets are class indices (a plain tensor is fine
    on a 1-D mesh); ``label_smoothing`` is not supported.
    """
    return _torch_loss_parallel() if enabled else contextlib.nullcontext()
