"""Trace a training step for a target layout, in one process, without GPUs.

Note: [Planning traces]
    The model is built by its family's ``ModelSpec.build`` on the meta device
    (nothing is allocated), wrapped by
    ``simplefsdp.data_parallel`` over a *fake* process group of the target
    data-parallel size (times the TP size for a 2-D mesh, with the family's
    ``tensor_parallel`` plan first), and compiled with the ``aot_eager``
    backend, no bucketing and no reordering. One call of the model plus its
    cross-entropy loss and one backward on meta inputs produce the forward and
    backward graphs simplefsdp.compile would build: every collective, every
    tensor shape of the local shard, mixed precision (bf16 compute, fp32
    reduce) and the activation-checkpointing recomputation included.

    Attention is traced as one fused (flash) attention op, as it runs on a GPU:
    torch's CPU build would otherwise decompose ``scaled_dot_product_attention``
    into a math path that materialises the (T x T) score matrix. Wherever it
    is recomputed (full activation checkpointing, or selective AC that does
    not keep it) the op is a planning-only custom op (ATen's CPU flash op
    counts as random, and the meta device cannot save RNG state). SDPA given
    a boolean mask (a sliding window shorter than the sequence) keeps it (the
    flash op's ``attn_mask``, or the planning-only op's ``mask`` where
    recomputed), the mask among the saved inputs, and is priced as the
    memory-efficient kernel over every (query, key) pair.

    A model of ``L`` identical blocks is traced with 1 and 2 blocks only: a
    quantity ``q`` of the graphs (FLOPs, node times, saved bytes, liveness
    peaks) is taken as ``q(1) + (L - 1) * (q(2) - q(1))``. Tests check this
    against a full trace of a small model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.policies import float8_converts

_LIB_NAME = "simplefsdp_plan"


@functools.cache
def _planning_attention_ops():
    """A non-random fused attention op with its backward (see the Note):
    causal without a mask, else over the boolean ``mask`` (SDPA given one:
    a sliding window shorter than the sequence, which
    :func:`~simplefsdp.plan.predict.own_kernel_seconds` prices as the
    memory-efficient kernel over every (query, key) pair)."""

    @torch.library.custom_op(f"{_LIB_NAME}::scaled_dot_product_flash", mutates_args=())
    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is None, attn_mask=mask
        )
        return out, lse

    @attention.register_fake
    def _(q, k, v, mask=None):
        b, h, t, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, t), dtype=torch.float32)

    @torch.library.custom_op(f"{_LIB_NAME}::scaled_dot_product_flash_backward", mutates_args=())
    def attention_backward(
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, mask is None, attn_mask=mask
        )

    @attention_backward.register_fake
    def _(grad, q, k, v, out, lse, mask=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, mask = inputs
        ctx.masked = mask is not None
        ctx.save_for_backward(q, k, v, *output, *([mask] if ctx.masked else []))

    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        grads = attention_backward(grad_out.contiguous(), q, k, v, out, lse, *mask)
        return *grads, None

    attention.register_autograd(backward, setup_context=setup_context)
    return attention


def _flash_sdpa(full_ac: bool):
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_kwargs):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            mask = attn_mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])
            if full_ac:
                return torch.ops.simplefsdp_plan.scaled_dot_product_flash(q, k, v, mask)[0]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask
            )[0]
        if full_ac:
            return torch.ops.simplefsdp_plan.scaled_dot_product_flash(q, k, v)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)[
            0
        ]

    return sdpa


@contextlib.contextmanager
def _patched_attention(full_ac: bool) -> Iterator[None]:
    if full_ac:
        _planning_attention_ops()  # registered before Dynamo sees a call
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa(full_ac)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _enter_autocast_off_meta(original):
    """``torch.amp._enter_autocast`` taking the meta device as the CPU: a
    model that disables autocast around a computation of its own
    (``transformers``' rotary embeddings: ``torch.autocast(device_type=
    x.device.type, enabled=False)``) names the meta device, which autocast
    does not know."""

    def enter(*vals):
        if vals and vals[0] == "meta":
            vals = ("cpu", *vals[1:])
        return original(*vals)

    return enter


def _tensor_via_host(original):
    """``torch.tensor`` building a meta-device tensor on the host and moving
    it: Dynamo keeps ``torch.tensor(data, device="meta")`` in a traced
    forward as a real meta tensor beside its fake ones, which fails the
    trace ("Please convert all Tensors to FakeTensors first"); a host
    constant moved to the meta device traces (``transformers``' BLOOM
    builds its ALiBi slopes so, on the input's device)."""

    def tensor(data, *args, device=None, requires_grad=False, **kwargs):
        if device is not None and not requires_grad and torch.device(device).type == "meta":
            return original(data, *args, **kwargs).to(device)
        return original(data, *args, device=device, requires_grad=requires_grad, **kwargs)

    return tensor


@contextlib.contextmanager
def _meta_tensor_constants() -> Iterator[None]:
    original = torch.tensor
    torch.tensor = _tensor_via_host(original)
    try:
        yield
    finally:
        torch.tensor = original


@contextlib.contextmanager
def _autocast_on_meta() -> Iterator[None]:
    original = torch.amp._enter_autocast
    torch.amp._enter_autocast = _enter_autocast_off_meta(original)
    try:
        yield
    finally:
        torch.amp._enter_autocast = original


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The per-rank ops of torch's loss-parallel cross-entropy of ``(N, V/tp)``
    fp32 logits (``torch.distributed.tensor.parallel.loss``: its
    ``_log_softmax`` forward, its ``_nll_loss_and_log_softmax_backward``
    backward), less the all-reduces of one number per token: the same
    tensors, so the same memory and bytes moved. Forward: max, shift, exp,
    sum, log, shift again; the log-probabilities are saved. Backward: a
    zero gradient with -1 at the targets, plus the probabilities, times
    the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        shifted = x - torch.amax(x, -1, keepdim=True)
        result = shifted - torch.log(torch.sum(torch.exp(shifted), -1, keepdim=True))
        ctx.save_for_backward(result, target)
        return -torch.gather(result, -1, target[:, None]).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        result, target = ctx.saved_tensors
        grad_input = torch.zeros_like(result)
        rows = torch.arange(target.shape[0], device=target.device)
        grad_input[rows, target] = -1.0
        return (grad_input + torch.exp(result)) * (grad / target.shape[0]), None


class _WithLoss(nn.Module):
    """The model and its cross-entropy (fp32 logits, as torchtitan computes it)
    in one module, so the loss's memory is part of the traced graphs.

    Under TP the logits are replicated (all-gathered) before the loss, as in
    ``simplefsdp train`` without loss parallelism. With ``loss_parallel``
    (``--parallel.loss_parallel``: the logits stay sharded over the
    vocabulary) each rank's loss runs torch's vocabulary-parallel
    cross-entropy on its own shard (``_VocabParallelCrossEntropy``: the ops
    ``loss_parallel()`` runs, which does not trace under Dynamo itself).
    """

    def __init__(self, model: nn.Module, loss_parallel: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_parallel = loss_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        if self.loss_parallel:
            from torch.distributed.tensor import DTensor

            assert isinstance(logits, DTensor), type(logits)
            local = logits.to_local().flatten(0, 1).float()
            target = tokens.flatten().remainder(local.shape[-1])
            return _VocabParallelCrossEntropy.apply(local, target)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        # log_softmax + gather: the memory of F.cross_entropy (fp32 logits and
        # log-probabilities), which does not trace through DTensor's backward here.
        logprobs = logits.float().log_softmax(-1)
        return -logprobs.gather(-1, tokens[..., None]).mean()


@dataclass(frozen=True)
class TraceKey:
    """What the traced graphs depend on: the family (its registry name), the
    config and the layout's parts that shape the graphs."""

    family: str
    config: Any
    dp: int
    tp: int
    batch: int  # per data-parallel rank, per microbatch
    seq: int
    ac: str
    reshard_after_forward: bool = True
    dtype: str = "bf16"  # compute dtype: bf16 (mixed precision) or fp32
    loss_parallel: bool = False  # logits sharded over the vocabulary under TP
    # Selective AC keeps the attention's output (Layout.attention_saved).
    attention_saved: bool = True


@dataclass
class Traced:
    """Forward and backward graphs of one trace and its model's parameter FQNs."""

    key: TraceKey
    forward: fx.GraphModule
    backward: fx.GraphModule
    param_fqns: list[str]
    primal_names: dict[str, str]
    groups: object  # simplefsdp.compiler.patterns.CollectiveGroups
    local_param_bytes: int = 0  # this rank's parameter shards (fp32)
    # Activation bytes eager autograd would save for backward, and what the
    # partitioned (compiled) forward saves: the eager engine's extra.
    eager_saved_bytes: int = 0
    compiled_saved_bytes: int = 0
    # Weights torchao's float8 conversion converts with torchtitan's filter:
    # every ``nn.Linear`` but the output layer, both dims divisible by 16.
    float8_fqns: frozenset[str] = frozenset()
    # The model drops out (traced without: the meta device draws no random
    # numbers, so its masks are not planned).
    dropout: bool = False
    # The parameters outside the blocks split into FSDP2 groups before and
    # after them (``bucket_plan.outer_modules``): not where the input and
    # output embeddings are tied, which the fsdp2 engine keeps in one group.
    outer_split: bool = True
    # The model's attention is its code's own eager one (no SDPA path in
    # transformers' code for it): scores materialized, traced as matmuls.
    eager_attention: bool = False


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (rank 0) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "simplefsdp plan traces with its own fake process group; "
            "call it outside torch.distributed (no process group initialised)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_step(key: TraceKey) -> Traced:
    """Trace one training step of ``key`` (Note: [Planning traces])."""
    import simplefsdp
    from simplefsdp.bucket_plan import outer_modules, repeated_blocks
    from simplefsdp.compiler.planning import CostModel
    from simplefsdp.engines.activation import apply_activation_checkpointing
    from simplefsdp.models.registry import get_spec
    from simplefsdp.policies import MixedPrecisionPolicy

    spec = get_spec(key.family)
    torch._dynamo.reset()
    world = key.dp * key.tp
    with fake_process_group(world):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (key.dp, key.tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = spec.build(key.config)
        model.to("meta")  # buffers a family computes on the host (rotary tables)
        dropout = False
        for module in model.modules():
            if isinstance(module, nn.Dropout) and module.p > 0:
                module.p, dropout = 0.0, True
        loss_parallel = key.loss_parallel and key.tp > 1
        if key.tp > 1:
            spec.tensor_parallel(
                model,
                mesh["tp"],
                sequence_parallel=spec.sequence_parallel,
                loss_parallel=loss_parallel,
            )
        apply_activation_checkpointing(model, key.ac, save_attention=key.attention_saved)
        outer_split = outer_modules(model, repeated_blocks(model)) is not None
        wrapped = _WithLoss(model, loss_parallel)
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if key.dtype == "bf16"
            else None
        )
        simplefsdp.data_parallel(
            wrapped, mesh["dp"], mp_policy=mp, reshard_after_forward=key.reshard_after_forward
        )
        simplefsdp.compile(
            wrapped, backend="aot_eager", bucketing="none", reorder=False, cost_model=CostModel()
        )
        backend = wrapped.__dict__["_simplefsdp_backend"]
        backend.saved_activations = []  # for the eager engine's activations
        tokens = torch.zeros(key.batch, key.seq, dtype=torch.long, device="meta")
        recomputed = key.ac == "full" or (key.ac == "selective" and not key.attention_saved)
        with _patched_attention(full_ac=recomputed), _autocast_on_meta():
            with _meta_tensor_constants():
                wrapped(tokens).backward()
        graphs = dict(backend.graph_modules)
        fqns = [name for name, _ in wrapped.named_parameters()]
        primals = _primal_names(graphs["forward"], simplefsdp.comm_report(wrapped))
        groups = backend.groups
        eager_saved = sum(e for e, _ in backend.saved_activations)
        compiled_saved = sum(c for _, c in backend.saved_activations)
        local = sum(_local(p).numel() * _local(p).element_size() for p in wrapped.parameters())
        float8 = frozenset(float8_linear_weights(wrapped))
    torch._dynamo.reset()
    return Traced(
        key,
        graphs["forward"],
        graphs["backward"],
        fqns,
        primals,
        groups,
        local,
        eager_saved,
        compiled_saved,
        float8,
        dropout,
        outer_split,
        getattr(model, "attention_implementation", "sdpa") == "eager",
    )


def float8_linear_weights(module: nn.Module, skip: tuple[str, ...] = ("output",)) -> list[str]:
    """FQNs of the weights ``simplefsdp.convert_linears_to_float8`` converts
    with the filter ``skip`` (torchtitan's: every ``nn.Linear`` whose name
    holds no entry of ``skip``, both dims divisible by 16;
    :func:`simplefsdp.policies.float8_converts`)."""
    return [
        f"{name}.weight"
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Linear) and float8_converts(name, sub, skip)
    ]


def _local(param: torch.Tensor) -> torch.Tensor:
    data = param.data if isinstance(param, nn.Parameter) else param
    return data.to_local() if hasattr(data, "to_local") else data


def _primal_names(gm: fx.GraphModule, report) -> dict[str, str]:
    """Placeholder name -> parameter FQN, from the forward graph's report (each
    data-parallel all-gather names its parameter)."""
    from simplefsdp.compiler.planning import source_placeholder

    nodes = {n.name: n for n in gm.graph.nodes}
    names = {}
    for info in report.graph("forward").collectives:
        node = nodes.get(info.node)
        if info.kind != "all_gather" or node is None or len(info.params) != 1:
            continue
        placeholder = source_placeholder(node.args[0])
        if placeholder is not None:
            names[placeholder.name] = info.params[0]
    return names


def layer_variant(spec: Any, config: Any, n_layers: int) -> Any:
    """``config`` with ``n_layers`` blocks (the family's ``with_layers``)."""
    if spec.with_layers is not None:
        return spec.with_layers(config, n_layers)
    return dataclasses.replace(config, n_layers=n_layers)
