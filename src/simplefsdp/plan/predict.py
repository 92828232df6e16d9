"""Predict per-GPU peak memory and step time of a training job from traced graphs.

:func:`predict` is the planner's one entry point: it predicts a flavor of a
model family by its ``ModelSpec.plan_method``, from traced graphs here
(:func:`predict_traced`, for ``"trace"``) or from the config's shapes
(:mod:`simplefsdp.plan.analytic`, for ``"analytic"``). The traced model
needs of the family only its spec: ``build``, ``tensor_parallel``,
``pipeline_split`` and ``flops_per_token``.

Note: [Plan model]
    Graph quantities come from the traced forward and backward graphs (Note:
    [Planning traces]), extrapolated from 1 and 2 traced blocks to the
    model's (or pipeline stage's) blocks.

    Memory per GPU (bytes), for the most loaded pipeline stage:
      parameters   fp32 shards (the graphs' parameter inputs),
      gradients    fp32 shards, the same size,
      optimizer    AdamW's two fp32 moments, twice the parameters,
      activations  what the forward graph saves for backward, times the
                   microbatches in flight on the stage (1F1B: up to ``pp``);
                   for the eager engine (FSDP2) what eager autograd saves
                   instead, which is more: the compiled step's min-cut
                   partitioner recomputes cheap ops (norms, activations,
                   casts) where eager saves their inputs and outputs
                   (``eager_saved_bytes`` of the joint graph, Note: [Keeping
                   what eager FSDP2 would hold]),
      gathered     the bucket plan's extra gathered buffers beyond the
                   unbucketed graph (the compiler's own model: worst
                   ``2 * B_i + B_{i+1}``, ``prefetch_extra_bytes``); for
                   the compiled engine with the parameters its keep search
                   keeps gathered from forward to backward held from their
                   bucket on, beside the later buckets and, when backward
                   starts, beside the first bucket it gathers again); for
                   FSDP2 (resharding after forward) what it holds where
                   the activations peak, as backward starts: the root
                   group, gathered from its forward to the end of
                   backward, the last block gathered again and copied out
                   and the one before it prefetched; with torchtitan's
                   split root (``fsdp2_root``) the final norm and output
                   alone, resharded before that prefetch
                   (``fsdp2_gathered_bytes``),
      accumulated  with more than one microbatch (gradient accumulation, or
                   a pipeline's microbatches), the unreduced gradient sums
                   (Note: [Gradient accumulation in the plan]),
      temporary    the rest of the larger of the forward graph's and the
                   backward graph's liveness peaks (``estimate_memory``):
                   logits and their fp32 loss, casts, one gathered parameter;
                   the backward's beyond the gradients it has produced by
                   then (``transient_peak_bytes``: its peak comes early,
                   before most gradients exist, and the gradients are
                   counted whole above).
    The traced loss runs eager (fp32 upcast, log-softmax, NLL): it saves
    the fp32 log-probabilities and its backward holds their gradient and the
    logits' fp32 gradient, 12 bytes per logit; with loss parallelism it is
    torch's vocabulary-parallel decomposition on the rank's shard of the
    logits (``trace._VocabParallelCrossEntropy``). FSDP2 with compiled
    blocks (``compile``) runs what lies outside the blocks eager: there the
    activations are eager autograd's (the fp32 log-probabilities, where the
    whole-step partitioner keeps the bf16 logits and recomputes them), the
    outside part of ``eager_extra_saved_bytes``. ``fused_loss`` (the loss
    compiled by Inductor, as torchtitan's ``build_cross_entropy_loss`` does
    with compile on) saves the bf16 logits and writes their bf16 gradient in
    one kernel, 4 bytes per logit: activations lose 2 bytes per logit,
    temporaries 6 (10 from the vocabulary-parallel backward) (where the loss's backward is the step's peak, as in every
    traced Llama layout we checked).
      cached       where the profile's memory comes from PyTorch's CUDA
                   caching allocator (``caching_allocator``): what it
                   reserves beyond the tensors, the free blocks it holds at
                   its reserved peak (``torch.cuda.memory_stats()``'s
                   ``reserved_bytes.all.peak``, torchtitan's
                   ``max_reserved_gib``): the allocator simulated (Note:
                   [Caching allocator simulation]) over two steps of the
                   2-block trace (Note: [Events of a training step]), its
                   reserved minus allocated peak taken whole, not
                   extrapolated: the blocks repeat each other's sizes, so
                   the cache they leave fits the next, and what does not
                   fit is the loss's: the bf16 logits' freed block is half
                   the fp32 tensors that follow it. The device's usable
                   memory, less the plan's bytes beyond the simulated ones,
                   is the allocator's capacity: past it the cache is
                   released and the allocation retried (noted). For
                   FSDP2, eager or with compiled blocks (its hooks stay
                   eager), the all-gathers' and the
                   reduce-scatters' buffers and copy-ins are allocated on
                   streams of their own, whose cached blocks the compute
                   stream cannot use (``fsdp2_stream``): the gradients
                   freed by ``zero_grad`` stay cached on the
                   reduce-scatter stream through the next forward. With
                   ``fused_loss`` the traced loss's fp32 tensors of the
                   vocabulary's width allocate nothing
                   (``fused_loss_skips``).
    The peak is the sum; the breakdown adds up to it.

    Step time: compute per node from the hardware profile (``CostModel``:
    matmul FLOPs at the achievable rate plus the first touch of their new
    output buffer (``alloc_s_per_byte``; CPU profiles measured by
    ``--calibrate``), fused attention at its share of the matmul rate
    (``attention_efficiency``), other ops by the bytes they move at the
    achievable HBM bandwidth, plus a per-kernel overhead), and the copies
    around the collectives, which the traced graph (one all-gather per
    parameter) does not hold but both engines run on the compute stream:
    per all-gather the shards copied in and the gathered bucket copied out
    to the parameters, per reduce-scatter the gradients copied in
    (``copy_seconds``), and for the eager engine (FSDP2) each group's hooks
    (one group per block and the root, ``fsdp2_group_s`` of the profile,
    or ``fsdp2_sharded_group_s`` where the data-parallel degree is above 1
    and the profile has it, measured by ``--calibrate``; 0 on the built-in
    GPU profiles). Where the
    profile measured eager FSDP2's copies (``fsdp2_copy_s_per_byte``, CPU
    profiles from ``--calibrate``), its copies are priced at that rate
    instead, at world size 1 too, where FSDP2 still copies around its
    one-rank collectives (``fsdp2_copy_seconds``). For the
    compiled engine (simplefsdp) chains of non-matmul ops count as one fused
    kernel each, moving only the tensors that enter and leave the chain (what
    Inductor generates), and so for FSDP2 with its blocks compiled
    (``--compile``, torchtitan's "FSDP + torch.compile": the compiled step's
    kernels and activations, FSDP2's groups, hooks and copies); for eager
    FSDP2 each op is a kernel.
    The bucket plan (our greedy planner under the compiler's default
    budget, Note: [Keeping what eager FSDP2 would hold], with its keep
    search; or FSDP2's per-block groups) is
    replayed on one link and one compute stream (``pipeline_time_s``, with
    each unit's window scaled to its share of the traced forward + backward
    compute); what does not hide is exposed communication. The optimizer
    step follows: foreach AdamW at the profile's measured seconds per
    parameter (``adamw_s_per_param``, from ``--calibrate``), or, where the
    profile has none, memory bound at 28 bytes moved per fp32 parameter;
    before it gradient-norm clipping (the trainer's default ``max_norm``
    of 1.0, torchtitan's too): 12 bytes per parameter (the norm reads the
    gradient shards, the scaling reads and writes them) and the norm's
    all-reduce.
    Pipeline parallelism: Note: [Pipeline schedules in the plan].

Note: [Pipeline schedules in the plan]
    The most loaded pipeline rank (its ``v`` stages' blocks, ``v`` 2 for
    interleaved 1F1B unless ``stages_per_rank`` says otherwise, else 1) is
    planned; one microbatch's forward and backward over its blocks is a
    slot. With ``m`` microbatches over ``p`` ranks of uniform stages a
    step takes (Narayanan et al., 2021)
      GPipe, 1F1B         ``m + p - 1`` slots,
      interleaved 1F1B    ``m + (p - 1) / v`` slots (each idle step is one
                          stage's, ``1 / v`` of the rank's blocks);
    the slots beyond ``m`` are the bubble. Memory is the first rank's, the
    one with the most forwards ahead of its backwards: its forwards and
    backwards are replayed in the schedule's order (``first_rank_actions``,
    torch's: GPipe all forwards first; 1F1B ``min(m, p)`` forwards, then
    a backward and a forward each step; interleaved 1F1B its warmup of
    ``(v - 1) r + 2 (p - 1)`` stage-forwards, ``r`` microbatches per
    round, then a forward and a backward each step, the stages in rounds
    of ``r``, backwards from the last local stage). A forward adds one
    stage's share of a microbatch's activations, a backward frees it, and
    a stage's first backward adds its share of the gradient sums (Note:
    [Gradient accumulation in the plan]); the plan takes the moment the
    two together peak (``pipeline_peak``). Interleaving lowers that peak
    where the last local stage's backwards free their activations before
    the first stage's sums appear.
    FSDP2 without resharding after forward (torchtitan's setting under PP)
    gathers each parameter once per step, at the first forward, and
    reduce-scatters it once, at the last backward (torch's stages leave its
    groups gathered and unsynchronised after every other backward): one
    slot of the step carries the data-parallel collectives and their
    copies, the others run without them. The compiled engine gathers per
    microbatch: every slot carries them.

Note: [Gradient accumulation in the plan]
    Over the microbatches of a step (``--microbatches`` without a pipeline,
    or a pipeline's), both engines reduce each gradient once: they sum the
    microbatches' unreduced gradients on the rank, whole (not sharded), in
    the reduction dtype (fp32): ``simplefsdp.no_sync``'s accumulators, FSDP2's
    ``unsharded_accumulated_grad`` under ``set_requires_gradient_sync(False)``
    (torch's pipeline stages set it). That is 4 bytes per parameter of the
    stage (TP-local), ``fsdp`` times the gradient shards, each stage's held
    from its first backward to the step's reduction: without a pipeline
    beside the last microbatch's activations; under a pipeline as the
    schedule has them alive where the first rank's memory peaks (Note:
    [Pipeline schedules in the plan]).
    FSDP2 under a pipeline also holds the stage's parameters whole (bf16, or
    float8 for converted weights): torch's stages keep its groups gathered
    after every backward but the step's last, and without resharding after
    forward (torchtitan's setting under PP) they are kept from the first
    forward, one set for all the microbatches in flight, where the traced
    forward saves them per microbatch.

Note: [Float8 in the plan]
    ``--float8`` predicts torchao's float8 training (tensorwise dynamic
    scaling, float8 all-gather) of the linears torchtitan converts (every
    ``nn.Linear`` but the output layer, ``float8_linear_weights``) from the
    same bf16 traces:
      matmuls      a matmul none of whose operands has the output layer's
                   (local) vocabulary dimension runs in float8, all three of
                   a linear's (forward, grad input, grad weight), at the
                   profile's ``peak_fp8_flops * fp8_matmul_efficiency``;
                   attention and the output layer stay bf16;
      casts        each such matmul's activation operands (those with the
                   token dimension; the weights arrive in float8 from the
                   all-gather) are cast to float8 by the bytes they move:
                   an amax pass and a cast pass, 2 + 2 + 1 bytes per
                   element eager, 2 + 1 compiled (the amax fused into the
                   producer);
      all-gathers  converted weights gather 1 byte per parameter instead of
                   2 (buckets, prefetch memory and the copies around them
                   shrink with them); gradients are still reduced in fp32;
      scales       one all-reduce of every converted weight's amax per step
                   (torchao's ``precompute_float8_dynamic_scale_for_fsdp``),
                   after the optimizer.
    Activations are as bf16's: torchao saves the bf16 inputs and casts again
    in backward. MFU stays against the bf16 peak (torchtitan's convention).

Note: [Tensor-parallel communication in the plan]
    Sequence parallelism's collectives (an all-gather of the normed
    activations before the attention's and the feed-forward's first
    matmuls, a reduce-scatter of their last matmuls' outputs, the mirror of
    each in backward) are waited on where the graph has them: exposed
    (Note: [Planning around tensor-parallel collectives]). The bucket
    planner's units carry their forward's, priced at its bytes and
    mirrored in backward; the plan scales them to what the two traced
    graphs run (``tp_comm_seconds``): the backward graph's own collectives,
    a recomputed forward's among them (full AC recomputes every one,
    selective AC the all-gathers), and
      float8   an all-gather whose matmuls all run in float8 moves one
               byte per element: torchao's float8 TP styles cast before
               gathering (in backward, the row-parallel linears' gathered
               gradient is float8 too); reduce-scatters stay bf16;
      async TP each all-gather and reduce-scatter with the matmuls that
               read its gathered tokens or write what it scatters (found
               through reshapes: ``tp_matmuls``) run as ``tp`` chunks: the
               local chunk's matmul needs no communication and the others
               overlap it, so the pair takes ``max(m, c + m / tp)`` for
               communication ``c`` and matmuls ``m`` (each priced as ``tp``
               matmuls of ``1 / tp`` of its rows by the kernel model); what
               is exposed is ``max(c + m / tp - m, 0)`` plus what the
               chunks lose against the whole matmuls. Collectives without
               such matmuls stay whole: the embedding's, a gradient summed
               over several linears before its reduce-scatter, and the
               weight gradients' gathers (their contraction runs over the
               gathered tokens). Async TP's symmetric-memory buffers are
               not modelled.

Note: [Context parallelism in the plan]
    ``--cp N`` (torchtitan's layout: FSDP over ``dp x cp``, each CP rank
    1/cp of every sequence, causal attention load-balanced over the ranks,
    keys and values all-gathered per attention) is planned from the trace
    of one CP rank: FSDP group ``dp * cp``, sequence ``seq / cp``. What
    the trace cannot see is added:
      attention    each rank's queries meet all ``seq`` keys: its FLOPs and
                   time are ``cp`` times the traced (local x local) ones;
      K/V comm     per attention node of either graph (forward, recomputed
                   forward, backward) one collective of the gathered keys
                   and values (``cp`` times the local ones) over the CP
                   group (ranks ``tp`` apart), exposed: attention waits for
                   it;
      memory       the gathered keys and values beyond the local ones,
                   saved for backward per block (no or selective AC) or one
                   block's at a time (full AC, temporary).
    How attention reaches those keys (``cp_backend``): ``torch`` is torch's
    context_parallel (a ring of flash-attention blocks, load-balanced, what
    torchtitan runs), priced as the traced flash attention above, plus, per
    attention node, the memory-bound passes of its ring code outside the
    kernels (``ring_attention_bytes`` in ``plan/costs.py``: the keys and
    values concatenated per step, the fp32 merges of the steps' outputs in
    forward, the fp32 gradient sums in backward; fused where the step is
    compiled);
    ``allgather`` (simplefsdp's default backend) calls SDPA with a boolean
    mask built from the positions, ``(T/cp) x T``, which SDPA turns into a
    bf16 bias: the memory-efficient kernel over every query-key pair (no
    causal block skipped: twice the flash kernel's work, at its
    ``MEMORY_EFFICIENT_FRACTION``, the bias read per head), the mask and the
    bias written and read once per attention (4 bytes per pair), and held
    while it runs (3 bytes per pair, temporary; without AC the bias is saved
    for backward, 2 bytes per pair per block).
    A sliding window that runs in chunks (Note: [Sliding windows across
    ranks]) reaches no further across ranks than in the trace: its traced
    chunks (their masks included) are its attention, not multiplied by
    ``cp``, and no ``(T/cp) x T`` mask is added for it; what it gathers is
    the keys and values its layer computed, found by walking back from the
    chunks' keys through the ops that only repeat, pad or move them
    (``_source_bytes``), as full attention's.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from simplefsdp.compiler.planning import (
    CostModel,
    GatherUnit,
    bucket_comm_s,
    choose_kept,
    collective_group_size,
    collective_kind,
    estimate_memory,
    find_sites,
    free_keep_count,
    gather_units,
    greedy_buckets,
    is_compute,
    node_bytes,
    node_flops,
    pipeline_time_s,
    step_extra_bytes,
    wait_of,
)
from simplefsdp.engines.kinds import get_engine
from simplefsdp.plan.allocator import simulate_traced
from simplefsdp.plan.costs import (
    ADAMW_BYTES_PER_PARAM,
    CLIP_BYTES_PER_PARAM,
    copy_seconds,
    cost_model_for,
    fsdp2_copy_seconds,
    prefetch_extra_bytes,
    ring_attention_bytes,
)
from simplefsdp.plan.hardware import HardwareProfile, check_float8
from simplefsdp.plan.kernels import KernelModel, kernel_model
from simplefsdp.plan.layout import Layout, cp_mask_note, cp_mask_queries, validate
from simplefsdp.plan.pipeline import pipeline_note, pipeline_peak, pipeline_slots, stage_blocks
from simplefsdp.plan.prediction import Prediction
from simplefsdp.plan.trace import Traced, TraceKey, layer_variant, trace_step

aten = torch.ops.aten


# ------------------------------------------------------------ engines


def _compiled(engine: str) -> bool:
    """``engine`` is simplefsdp compiled (the bucket planner and its keep
    search run); the other is FSDP2 (per-block groups, hooks per group),
    whose kernels are fused only where ``Layout.compile`` compiles its
    blocks (``Layout.compiled``)."""
    return get_engine(engine).fused_buckets


# ------------------------------------------------------------ graph measures


_HEAVY = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _is_heavy(node: fx.Node) -> bool:
    """Matmuls, attention and embeddings: their own kernels, never fused."""
    if node.target in _HEAVY:
        return True
    name = str(node.target)
    return "scaled_dot_product" in name or "embedding" in name


def _dims(node) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()


def _gemm_dims(node: fx.Node) -> tuple[int, int, int, int] | None:
    """``(batch, M, N, K)`` of a matmul node, ``None`` for other nodes."""
    target, args = node.target, node.args
    if target is aten.mm.default:
        a, b = _dims(args[0]), _dims(args[1])
        return (1, a[0], b[1], a[1]) if len(a) == 2 and len(b) == 2 else None
    if target is aten.addmm.default:
        a, b = _dims(args[1]), _dims(args[2])
        return (1, a[0], b[1], a[1]) if len(a) == 2 and len(b) == 2 else None
    if target in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if target is aten.bmm.default else (args[1], args[2])
        a, b = _dims(a), _dims(b)
        return (a[0], a[1], b[2], a[2]) if len(a) == 3 and len(b) == 3 else None
    return None


def _dtype_name(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and val:
        val = val[0]
    dtype = getattr(val, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "bfloat16"


def kernel_seconds(node: fx.Node, kernels: KernelModel, cost_model: CostModel) -> float:
    """Seconds of a matmul, attention or embedding node by the kernel model
    (Note: [Kernel model]); other nodes as the cost model prices them."""
    dims = _gemm_dims(node)
    if dims is not None:
        batch, m, n, k = dims
        return kernels.gemm_seconds(m, n, k, _dtype_name(node), batch)
    name = str(node.target)
    if "scaled_dot_product" in name:
        moved = node_bytes(node) + sum(node_bytes(i) for i in node.all_input_nodes)
        return kernels.attention_seconds(node_flops(node), moved, "backward" in name)
    return cost_model.node_time(node)


def _has_mask(node: fx.Node) -> bool:
    """A traced attention node runs with a boolean mask (a sliding window
    shorter than the sequence; Note: [Planning traces] in ``plan/trace.py``)."""
    if node.kwargs.get("attn_mask") is not None:  # ATen's op
        return True
    if "simplefsdp_plan" not in str(node.target):
        return False
    last = node.args[-1]  # the planning op's mask: its last argument, if given
    return isinstance(last, fx.Node) and last.meta["val"].dtype == torch.bool


def _reaches_the_sequence(node: fx.Node) -> bool:
    """A traced attention node whose queries meet keys of their own length:
    the sequence (causal, or over its mask), whose keys context parallelism
    multiplies. A sliding window in chunks meets more keys per call than it
    has queries, and reaches no further across ranks (Note: [Sliding windows
    across ranks] in ``context_parallel/attention.py``)."""
    backward = "backward" in str(node.target)
    q, k = (node.args[1], node.args[2]) if backward else (node.args[0], node.args[1])
    return q.meta["val"].shape[-2] == k.meta["val"].shape[-2]


# Ops that only move, pad, repeat or select elements of their input.
_MOVES = frozenset(
    "view _unsafe_view reshape expand unsqueeze squeeze clone contiguous constant_pad_nd pad "
    "slice select cat transpose permute t repeat repeat_interleave index index_select alias "
    "split split_with_sizes getitem as_strided".split()
)


def _source_bytes(args: tuple[fx.Node, ...]) -> float:
    """Bytes of what ``args`` are made of: walking back through ops that
    only move, pad, repeat or select elements (:data:`_MOVES`) to the nodes
    that compute them (or the graph's inputs), each counted once."""
    seen: set[fx.Node] = set()
    total, stack = 0.0, list(args)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        name = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "")
        if node.op == "call_function" and name in _MOVES:
            stack.extend(node.all_input_nodes)
        else:
            total += node_bytes(node)
    return total


def _masked_attention_seconds(node: fx.Node, kernels: KernelModel, scale: int) -> float:
    """Seconds of one traced attention node (its keys ``scale`` times the
    traced ones, the caller multiplies by ``scale``) run as SDPA with a
    boolean mask: the memory-efficient kernel, every (query, key) pair
    computed (no causal skip), the mask's bf16 bias read per head."""
    q = node.args[1] if "backward" in str(node.target) else node.args[0]
    b, h, tq, _ = q.meta["val"].shape
    bias = b * h * tq * tq * 2  # per traced key block; the caller scales by ``scale``
    moved = node_bytes(node) + sum(node_bytes(i) for i in node.all_input_nodes) + bias
    backward = "backward" in str(node.target)
    return kernels.attention_seconds(2 * node_flops(node), moved, backward, flash=False)


@dataclass(frozen=True)
class Float8Matmuls:
    """Which matmuls of a traced graph run in float8, and their cost (Note:
    [Float8 in the plan]).

    Attributes:
        flops_per_s: achievable float8 matmul rate.
        tokens: the token dimension of a microbatch's activations
            (``batch * seq``).
        skip_dim: the output layer's local vocabulary size: a matmul with
            an operand of that dimension stays bf16.
    """

    flops_per_s: float
    tokens: int
    skip_dim: int
    kernels: KernelModel | None = None

    def converts(self, node: fx.Node) -> bool:
        """A 2-D matmul of a converted linear."""
        if node.target not in (aten.mm.default, aten.addmm.default):
            return False
        return not any(self.skip_dim in _dims(n) for n in (node, *node.all_input_nodes))

    def seconds(self, node: fx.Node, cost_model: CostModel, fused: bool) -> float:
        """The matmul at the float8 rate plus the casts of its activation
        operands (those with the token dimension) to float8."""
        inputs = [n for n in node.all_input_nodes if len(_dims(n)) == 2]
        cast = [n for n in inputs if self.tokens in _dims(n)]
        elements = sum(_dims(n)[0] * _dims(n)[1] for n in cast)
        per_element = 3.0 if fused else 5.0  # amax fused into the producer, or its own pass
        kernels = len(cast) * (1 if fused else 2)
        dims = _gemm_dims(node)
        if self.kernels is not None and dims is not None:
            batch, m, n, k = dims
            matmul = self.kernels.gemm_seconds(m, n, k, "float8", batch)
        else:
            matmul = node_flops(node) / self.flops_per_s + cost_model.kernel_overhead_s
        return (
            matmul
            + per_element * elements / cost_model.bytes_per_s
            + kernels * cost_model.kernel_overhead_s
        )


def own_kernel_seconds(
    node: fx.Node,
    cost_model: CostModel,
    fused: bool,
    float8: Float8Matmuls | None = None,
    kernels: KernelModel | None = None,
    attention_scale: int = 1,
    masked: bool = False,
) -> float:
    """Seconds of a compute node that runs as a kernel of its own (a
    matmul, attention or embedding; any node of an unfused graph) as
    :func:`compute_time` prices it, its arguments as there."""
    if float8 is not None and float8.converts(node):
        return float8.seconds(node, cost_model, fused)
    attention = "scaled_dot_product" in str(node.target)
    scale = attention_scale if attention and _reaches_the_sequence(node) else 1
    masked = masked or (attention and _has_mask(node))
    if kernels is not None and attention and masked:
        return scale * _masked_attention_seconds(node, kernels, scale)
    if kernels is not None and _is_heavy(node):
        return scale * kernel_seconds(node, kernels, cost_model)
    # includes its kernel overhead; a masked kernel skips no block
    return scale * cost_model.node_time(node) * (2 if attention and masked else 1)


def compute_time(
    gm: fx.GraphModule,
    cost_model: CostModel,
    fused: bool,
    float8: Float8Matmuls | None = None,
    model: KernelModel | None = None,
    attention_scale: int = 1,
    masked: bool = False,
    loss_vocab: int = 0,
) -> dict[str, float]:
    """Seconds and FLOPs of the compute nodes of ``gm``.

    ``fused``: non-matmul compute nodes are grouped as Inductor would (Note:
    [Plan model]): such a node pays for the inputs it reads from outside the
    chain and for its output only if something outside the chain reads it;
    one kernel overhead per chain output. ``float8``: the matmuls it
    converts run in float8 (Note: [Float8 in the plan]). ``model``: matmuls
    and attention priced by their shapes (Note: [Kernel model]).
    ``attention_scale``: attention's keys are that many times the traced
    ones (context parallelism: local queries against every key, Note:
    [Context parallelism in the plan]). ``masked``: attention runs with a
    boolean mask (simplefsdp's ``allgather`` and ``ulysses`` backends): SDPA's
    memory-efficient kernel over every (query, key) pair, reading the
    mask's bf16 bias per head. ``loss_vocab`` (the logits' local
    vocabulary; ``fused`` false): the loss is compiled on its own, so the
    ops of its width (the logits' fp32 copy, log-softmax, their gradients)
    are grouped as ``fused`` groups every op.
    """
    flops = matmul_s = other_s = 0.0
    kernels = chains = 0

    def loss_op(node: fx.Node) -> bool:
        return any(
            len(d) >= 2 and d[-1] == loss_vocab for d in map(_dims, (node, *node.all_input_nodes))
        )

    # the nodes that run in fused groups
    grouped = {
        n
        for n in gm.graph.nodes
        if is_compute(n) and not _is_heavy(n) and (fused or (loss_vocab > 0 and loss_op(n)))
    }
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        converted = float8 is not None and float8.converts(node)
        if converted or node not in grouped:
            attention = not converted and "scaled_dot_product" in str(node.target)
            scaled = attention and _reaches_the_sequence(node)
            flops += (attention_scale if scaled else 1) * node_flops(node)
            matmul_s += own_kernel_seconds(
                node, cost_model, fused, float8, model, attention_scale, masked
            )
            kernels += 1
            continue
        moved = 0
        for source in node.all_input_nodes:
            if source not in grouped:
                moved += node_bytes(source)
        leaves = any(u not in grouped for u in node.users) or not node.users
        if leaves:
            moved += node_bytes(node)
            chains += 1
        other_s += moved / cost_model.bytes_per_s
    overhead = chains * cost_model.kernel_overhead_s
    kernels += chains
    return {"flops": flops, "seconds": matmul_s + other_s + overhead, "kernels": kernels}


@dataclass
class GraphMeasures:
    """Per-trace quantities, linear in the number of blocks."""

    fw_flops: float
    bw_flops: float
    fw_s: float
    bw_s: float
    param_bytes: float  # fp32 shards (graph parameter inputs)
    saved_bytes: float  # forward outputs kept for backward
    fw_peak: float
    bw_peak: float
    grad_bytes: float  # backward outputs (gradient shards)
    # Backward's peak beyond the gradients it has produced by then
    # (``transient_peak_bytes``): what it needs beside all of them.
    bw_transient: float
    rs_to_ag_ratio: float  # bytes reduced per byte gathered (fp32 reduce / bf16 gather)
    # Activations eager autograd saves beyond what the partitioned forward
    # saves (what the min-cut partitioner recomputes instead).
    eager_extra_saved_bytes: float = 0.0
    # Attention's local keys and values (bytes): over every attention node
    # of both graphs (what context parallelism gathers), and over the
    # forward graph's forward attention nodes (what it saves gathered).
    kv_bytes: float = 0.0
    kv_forward_bytes: float = 0.0
    attention_nodes: float = 0.0
    # ... of them those whose keys span the sequence (not a window in chunks)
    sequence_attention_nodes: float = 0.0
    # What Ulysses' all-to-alls move over every attention node: the queries,
    # the keys and values (repeated to the query heads where the CP degree
    # does not divide their heads) and the output; and the query heads.
    ulysses_bytes: float = 0.0
    attention_heads: float = 0.0
    # Non data-parallel (TP) collectives, seconds: the forward graph's as
    # the bucket planner prices them, and both graphs' as the plan runs
    # them (Note: [Tensor-parallel communication in the plan]).
    tp_forward_priced_s: float = 0.0
    tp_s: float = 0.0

    def extrapolate(self, other: GraphMeasures, blocks: float) -> GraphMeasures:
        """``self`` at 1 block, ``other`` at 2: the value at ``blocks``."""
        values = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = a if f.name == "rs_to_ag_ratio" else a + (blocks - 1) * (b - a)
        return GraphMeasures(**values)

    def per_block(self, other: GraphMeasures) -> GraphMeasures:
        return self.extrapolate(other, 2).minus(self)

    def excess(self, other: GraphMeasures) -> GraphMeasures:
        """``max(self - other, 0)``, field by field (``rs_to_ag_ratio``: ``self``'s)."""
        values = {
            f.name: max(getattr(self, f.name) - getattr(other, f.name), 0.0)
            for f in dataclasses.fields(self)
        }
        values["rs_to_ag_ratio"] = self.rs_to_ag_ratio
        return GraphMeasures(**values)

    def plus(self, other: GraphMeasures, weight: float = 1.0) -> GraphMeasures:
        """``self + weight * other``, field by field (``rs_to_ag_ratio``: ``self``'s)."""
        values = {
            f.name: getattr(self, f.name) + weight * getattr(other, f.name)
            for f in dataclasses.fields(self)
        }
        values["rs_to_ag_ratio"] = self.rs_to_ag_ratio
        return GraphMeasures(**values)

    def minus(self, other: GraphMeasures) -> GraphMeasures:
        values = {
            f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)
        }
        values["rs_to_ag_ratio"] = self.rs_to_ag_ratio
        return GraphMeasures(**values)


def blocks_of_kinds(
    ones: dict[Any, GraphMeasures], per_kind: dict[Any, GraphMeasures], kinds: tuple[Any, ...]
) -> tuple[GraphMeasures, GraphMeasures]:
    """The measures at 1 and 2 blocks of a model whose blocks are of
    ``kinds`` (one per block): ``ones[kind]`` a trace with one block of that
    kind, ``per_kind[kind]`` its block.

    Note: [Blocks of several kinds in the plan]
    A model whose blocks differ (sliding and full attention layers in turn,
    convolution or Mamba mixers beside attention) is traced with 1 and 2
    blocks of each kind. What lies outside the blocks (the embedding, the
    output, the loss, and what the model builds once for its blocks of a
    kind, such as that kind's attention mask) is the first block's kind's
    one-block trace less its block, plus what each other kind's adds to it
    (positive parts only: the shared ops cancel), and the traces at 1 and 2
    blocks are replaced by that plus the model's average block, once and
    twice: linear quantities extrapolate to the model's sum. The bucket plan
    and the allocator's simulation keep the first blocks' graphs, scaled to
    these times.
    """
    outsides = {kind: ones[kind].minus(per_kind[kind]) for kind in ones}
    outside = outsides[kinds[0]]
    for kind, other in outsides.items():
        if kind != kinds[0]:
            outside = outside.plus(other.excess(outsides[kinds[0]]))
    average = outside.plus(outside, -1.0)  # zero
    for kind in kinds:
        average = average.plus(per_kind[kind], 1.0 / len(kinds))
    one = outside.plus(average)
    return one, one.plus(average)


def measure(
    traced: Traced,
    cost_model: CostModel,
    fused: bool,
    float8: Float8Matmuls | None = None,
    kernels: KernelModel | None = None,
    attention_scale: int = 1,
    masked: bool = False,
    async_degree: int = 1,
    ring: bool = False,
    loss_vocab: int = 0,
) -> GraphMeasures:
    """``ring``: attention runs as torch's ring over ``attention_scale`` CP
    ranks (the ``torch`` backend), whose merges and copies outside the
    attention kernels are added (:func:`ring_attention_bytes`).
    ``loss_vocab``: the loss compiled apart from eager blocks
    (:func:`compute_time`)."""
    fw, bw = traced.forward, traced.backward
    fw_mem, bw_mem = estimate_memory(fw), estimate_memory(bw)
    timing = (cost_model, fused, float8, kernels, attention_scale, masked, loss_vocab)
    fw_t = compute_time(fw, *timing)
    bw_t = compute_time(bw, *timing)
    kv = kv_forward = nodes = sequence_nodes = ulysses = heads = 0.0
    local_share = 1.0  # a chunked window's local keys and values per byte it reads
    for gm, timed in ((fw, fw_t), (bw, bw_t)):
        for n in gm.graph.nodes:
            if n.op != "call_function" or "scaled_dot_product" not in str(n.target):
                continue
            backward = "backward" in str(n.target)
            q, k, v = n.args[1:4] if backward else n.args[0:3]
            pair = node_bytes(k) + node_bytes(v)
            if _reaches_the_sequence(n):
                sequence_nodes += 1
            elif pair and attention_scale > 1:  # the gathered bytes matter under CP only
                # A window in chunks reads its keys repeated to the query
                # heads and each chunk's reach again: what the layer gathers
                # across ranks is the keys and values it computed (Note:
                # [Sliding windows across ranks]).
                share = min(_source_bytes((k, v)) / pair, local_share)
                local_share = share if gm is fw else local_share
                pair *= share
            kv, nodes = kv + pair, nodes + 1
            if gm is fw and not backward:
                kv_forward += pair
            heads, kv_heads = q.meta["val"].shape[1], k.meta["val"].shape[1]
            repeat = heads / kv_heads if kv_heads % max(attention_scale, 1) else 1
            ulysses += 2 * node_bytes(q) + repeat * pair
            if ring:
                qv, kval, vval = (x.meta["val"] for x in (q, k, v))
                out = qv.numel() // qv.shape[-1] * vval.shape[-1]
                moved = ring_attention_bytes(
                    out,
                    kval.numel() + vval.numel(),
                    qv.element_size(),
                    attention_scale,
                    fused,
                    kval.is_contiguous() and vval.is_contiguous(),
                )[1 if backward else 0]
                timed["seconds"] += moved / cost_model.bytes_per_s
    tp = [
        tp_comm_seconds(gm, traced.groups, cost_model, fused, float8, kernels, async_degree)
        for gm in (fw, bw)
    ]
    params = traced.local_param_bytes
    # Data-parallel bytes reduced per byte gathered (fp32 reduce / bf16 gather).
    dp = traced.groups.is_data_parallel
    rs = sum(
        node_bytes(n.args[0])
        for n in bw.graph.nodes
        if collective_kind(n) == "reduce_scatter" and dp(n)
    )
    fw_ag = sum(
        node_bytes(n) for n in fw.graph.nodes if collective_kind(n) == "all_gather" and dp(n)
    )
    return GraphMeasures(
        fw_flops=fw_t["flops"],
        bw_flops=bw_t["flops"],
        fw_s=fw_t["seconds"],
        bw_s=bw_t["seconds"],
        param_bytes=params,
        saved_bytes=fw_mem.output_bytes,
        fw_peak=fw_mem.peak_bytes,
        bw_peak=bw_mem.peak_bytes,
        grad_bytes=bw_mem.output_bytes,
        bw_transient=bw_mem.transient_peak_bytes,
        rs_to_ag_ratio=(rs / fw_ag) if fw_ag and rs else 1.0,
        eager_extra_saved_bytes=max(traced.eager_saved_bytes - traced.compiled_saved_bytes, 0),
        kv_bytes=kv,
        kv_forward_bytes=kv_forward,
        attention_nodes=nodes,
        sequence_attention_nodes=sequence_nodes,
        ulysses_bytes=ulysses,
        attention_heads=heads,
        tp_forward_priced_s=tp[0][0],
        tp_s=tp[0][1] + tp[1][1],
    )


# ------------------------------------------------------------ prediction


_TRACES: dict[TraceKey, Traced] = {}


def traced(key: TraceKey) -> Traced:
    """``trace_step(key)``, cached for the process (a sweep reuses traces)."""
    if key not in _TRACES:
        _TRACES[key] = trace_step(key)
    return _TRACES[key]


def _units_for(
    t2: Traced, cost_model: CostModel, blocks: int, has_first: bool, has_last: bool
) -> list[GatherUnit]:
    """Gather units of a stage of ``blocks`` blocks, from the 2-block trace:
    the first block's units stand for every block but the last (the second's,
    which precede the norm and output)."""
    sites = find_sites(t2.forward.graph, t2.primal_names, {}, t2.groups)
    units = gather_units(t2.forward, sites, cost_model, t2.groups)
    before, block0, block1, after = [], [], [], []
    for u in units:
        index = _BLOCK_INDEX.match(u.fqn)
        if index and index.group(2) == "0":
            block0.append(u)
        elif index and index.group(2) == "1":
            block1.append(u)
        elif block0 or block1:
            after.append(u)
        else:
            before.append(u)
    result = list(before) if has_first else []
    for i in range(blocks - 1):
        result += [dataclasses.replace(u, fqn=_with_block_index(u.fqn, i)) for u in block0]
    result += [dataclasses.replace(u, fqn=_with_block_index(u.fqn, blocks - 1)) for u in block1]
    if has_last:
        result += after
    return result


#: A block's parameter: the blocks' container (``model.layers``; in a
#: ``transformers`` model ``model.model.layers``, ``model.transformer.h``, ...)
#: and the block's index, the name's first all-digit part.
_BLOCK_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


def _with_block_index(fqn: str, index: int) -> str:
    """``fqn`` with its block index replaced by ``index``."""
    return _BLOCK_INDEX.sub(lambda m: f"{m.group(1)}.{index}.", fqn, count=1)


def _block_of(fqn: str) -> str:
    """``model.layers.N`` (the container and index) for a block's parameter,
    else ``root``."""
    match = _BLOCK_INDEX.match(fqn)
    return f"{match.group(1)}.{match.group(2)}" if match else "root"


def _group_units(units: list[GatherUnit], how: str) -> list[list[GatherUnit]]:
    if how == "none":
        return [[u] for u in units]
    groups: dict[str, list[GatherUnit]] = {}
    for u in units:
        groups.setdefault(_block_of(u.fqn), []).append(u)
    root = groups.pop("root", [])
    blocks = list(groups.values())
    # FSDP2 (and our per-block plan) gathers the root's parameters (embedding,
    # norm, output) in one group at the start.
    return ([root] if root else []) + blocks


def fsdp2_gathered_bytes(units: list[GatherUnit], beside: float, root: str = "split") -> float:
    """FSDP2's gathered parameters at the step's peak, beyond the one the
    traced graph holds (Note: [Plan model]). With ``root`` ``whole`` its root
    group (embedding, final norm, output) stays gathered from its forward
    to the end of backward (FSDP2 does not reshard the root after forward),
    and as backward starts, where the activations (``beside``) peak, the
    last block is gathered again and copied out of its all-gather buffer
    (``2 * B_n``) with the one before it prefetched (``B_(n-1)``). With
    ``split`` (``FSDP2_ROOTS``) only the final norm and output (``R_out``)
    are kept from forward, and they are resharded when their backward ends,
    before the last block's backward prefetches the one before it:
    ``2 * B_n + max(R_out, B_(n-1))``. The first group's own copy-out as
    forward starts (``2 * R + B_1``, or ``2 * R_in + B_1`` for the embedding
    alone, no activations yet) is the peak only where it exceeds that and
    ``beside``."""
    ordered = _forward_order_blocks(units)
    roots = [g for g in ordered if _block_of(g[0].fqn) == "root"]
    blocks = [sum(u.gathered_bytes for u in g) for g in ordered if _block_of(g[0].fqn) != "root"]
    whole = float(sum(u.gathered_bytes for g in roots for u in g))
    if not blocks:
        return 2 * whole
    first = ordered[0]
    before = float(sum(u.gathered_bytes for u in first)) if roots and roots[0] is first else 0.0
    after = whole - before
    previous = blocks[-2] if len(blocks) > 1 else 0.0
    if root == "split":
        at_backward = 2 * blocks[-1] + max(after, previous)
        at_start = 2 * before + blocks[0]
    else:
        at_backward = whole + 2 * blocks[-1] + previous
        at_start = 2 * whole + blocks[0]
    return float(max(at_backward, at_start - beside))


def _forward_order_blocks(units: list[GatherUnit]) -> list[list[GatherUnit]]:
    """Per-block groups in forward order, the root's parameters split into
    those before the blocks (embedding) and after them (norm, output): the
    reference plan's buckets as the keep search reads them."""
    return [list(g) for _, g in itertools.groupby(units, key=lambda u: _block_of(u.fqn))]


def _in_block(fqn: str) -> str:
    """``fqn`` with its block index replaced by 0."""
    return _with_block_index(fqn, 0)


#: Ops between a tensor-parallel collective and the matmuls it feeds or
#: reads: the views, slices, splits and concatenations that gather or
#: scatter the sequence dimension (no transposes: a matmul reading the
#: gathered tokens transposed contracts over them).
_RESHAPES = frozenset(
    {"view", "_unsafe_view", "reshape", "slice", "split", "split_with_sizes", "getitem", "cat",
     "clone", "alias", "squeeze", "unsqueeze"}
)  # fmt: skip
_MATMULS = (aten.mm.default, aten.addmm.default)


def _op_name(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(node.target)


def tp_matmuls(collective: fx.Node) -> list[fx.Node]:
    """The matmuls a tensor-parallel collective can overlap under async TP
    (Note: [Tensor-parallel communication in the plan]): an all-gather's,
    those whose token operand (the left one) is the gathered tensor; a
    reduce-scatter's, those whose output it scatters; through reshapes
    only. Kept in the node's meta: a traced graph is predicted again for
    every layout that shares it."""
    cached = collective.meta.get(_TP_MATMULS_META)
    if cached is None:
        cached = collective.meta[_TP_MATMULS_META] = _find_tp_matmuls(collective)
    return list(cached)


_TP_MATMULS_META = "simplefsdp_plan_tp_matmuls"


def _find_tp_matmuls(collective: fx.Node) -> list[fx.Node]:
    kind = collective_kind(collective)
    gather = kind == "all_gather"
    if kind not in ("all_gather", "reduce_scatter"):
        return []
    start = (wait_of(collective) or collective) if gather else collective.args[0]
    if not isinstance(start, fx.Node):
        return []
    seen, frontier, found = {start}, [start], []
    while frontier:
        node = frontier.pop()
        if node.target in _MATMULS and node is not start:
            tokens = node.args[0] if node.target is aten.mm.default else node.args[1]
            if not gather or tokens in seen:
                found.append(node)
            continue
        if node is not start and _op_name(node) not in _RESHAPES:
            continue
        for other in node.users if gather else node.all_input_nodes:
            if other not in seen:
                seen.add(other)
                frontier.append(other)
    return found


def tp_comm_seconds(
    gm: fx.GraphModule,
    groups: Any,
    cost_model: CostModel,
    fused: bool,
    float8: Float8Matmuls | None = None,
    kernels: KernelModel | None = None,
    async_degree: int = 1,
) -> tuple[float, float]:
    """``(as priced, as run)``: seconds of ``gm``'s non data-parallel
    collectives as the bucket planner prices them (each at its bytes), and
    as the plan runs them (Note: [Tensor-parallel communication in the
    plan]): all-gathers feeding float8 matmuls at one byte per element,
    and with ``async_degree`` (the TP degree under async TP) each
    collective less what its matmuls hide."""
    priced = run = 0.0
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None or groups.is_data_parallel(node):
            continue
        role = groups.role(node)
        seconds = cost_model.collective_time(node, role)
        priced += seconds
        matmuls = tp_matmuls(node)
        if float8 is not None and kind == "all_gather" and matmuls:
            if all(float8.converts(m) for m in matmuls):
                size = collective_group_size(node)
                seconds = cost_model.comm_time(kind, size, node_bytes(node) // 2, role)
        if async_degree > 1 and matmuls:
            whole = sum(own_kernel_seconds(m, cost_model, fused, float8, kernels) for m in matmuls)
            split = whole + sum(
                _chunking_seconds(m, float8, kernels, async_degree) for m in matmuls
            )
            # the overlap, and what the matmuls lose run as ``tp`` chunks
            seconds = max(seconds + split / async_degree - split, 0.0) + (split - whole)
        run += seconds
    return priced, run


def _chunking_seconds(
    node: fx.Node, float8: Float8Matmuls | None, kernels: KernelModel | None, chunks: int
) -> float:
    """What a matmul loses run as ``chunks`` matmuls of ``1 / chunks`` of
    its rows (async TP), by the kernel model (0 without one)."""
    dims = _gemm_dims(node)
    if kernels is None or dims is None:
        return 0.0
    batch, m, n, k = dims
    dtype = "float8" if float8 is not None and float8.converts(node) else _dtype_name(node)
    whole = kernels.gemm_seconds(m, n, k, dtype, batch)
    return chunks * kernels.gemm_seconds(-(-m // chunks), n, k, dtype, batch) - whole


def float8_matmuls(config: Any, layout: Layout, hw: HardwareProfile) -> Float8Matmuls:
    """The float8 matmuls of ``layout`` on ``hw`` (Note: [Float8 in the plan]).

    Raises:
        ValueError: ``hw`` has no float8 peak.
    """
    check_float8(hw)
    efficiency = hw.fp8_matmul_efficiency or hw.matmul_efficiency
    probe = cost_model_for(hw, layout, 1.0)
    return Float8Matmuls(
        flops_per_s=hw.peak_fp8_flops * efficiency,
        tokens=(layout.batch // layout.microbatches) * (layout.seq // layout.cp),
        skip_dim=config.vocab_size // layout.tp,
        kernels=kernel_model(hw, probe.bytes_per_s),
    )


def _cached_bytes(
    t2: Traced,
    allocated: float,
    usable: float,
    streams: bool,
    fused_vocab: int,
    expandable: bool = False,
) -> tuple[float, int]:
    """Reserved minus allocated bytes at the caching allocator's peaks over
    two steps of ``t2``'s graphs, and its allocation retries, on a device
    of ``usable`` bytes of which the plan's ``allocated`` bytes beyond the
    simulated tensors are taken; ``streams``: the collectives' buffers on
    streams of their own, as eager FSDP2 allocates them; ``fused_vocab``:
    the local vocabulary of a fused loss (0: eager); ``expandable``: the
    allocator's expandable segments (Note: [Plan model])."""
    kw = dict(
        collective_streams=streams, fused_loss_vocab=fused_vocab, expandable_segments=expandable
    )
    free = simulate_traced(t2, **kw)
    capacity = usable - max(allocated - free.allocated_peak_bytes, 0.0)
    if capacity <= 0 or free.reserved_peak_bytes <= capacity:
        return float(free.cached_bytes), 0
    capped = simulate_traced(t2, capacity_bytes=int(capacity), **kw)
    # Released at capacity: the reserved peak is the device's usable memory
    # at most, whenever in the step the cache was largest.
    cached = min(max(capped.cached_bytes, 0), max(usable - allocated, 0.0))
    return float(cached), capped.retries


def predict(spec: Any, config: Any, layout: Any, hw: HardwareProfile) -> Prediction:
    """Predict ``layout`` of ``config`` (a flavor of the family ``spec``) on
    ``hw`` by the spec's ``plan_method``: traced graphs (``"trace"``,
    :func:`predict_traced`, ``layout`` a :class:`Layout`) or the config's
    shapes (``"analytic"``, ``layout`` an
    :class:`~simplefsdp.plan.analytic.ExpertLayout`).

    Raises:
        ValueError: an invalid layout (one line naming the value).
    """
    if spec.plan_method == "analytic":
        from simplefsdp.plan.analytic import predict_analytic

        return predict_analytic(spec, config, layout, hw)
    return predict_traced(spec, config, layout, hw)


def predict_traced(spec: Any, config: Any, layout: Layout, hw: HardwareProfile) -> Prediction:
    """Predict ``layout`` of ``config`` on ``hw`` from traced graphs (Note:
    [Plan model]; with ``layout.float8``, Note: [Float8 in the plan]).

    Raises:
        ValueError: an invalid layout, or ``--float8`` on a profile without
            a float8 peak (one line naming the value).
    """
    validate(config, layout)
    fp8 = float8_matmuls(config, layout, hw) if layout.float8 else None
    mb = layout.batch // layout.microbatches
    blocks_of_stage = stage_blocks(spec, config, layout.pp, layout.stages_of_rank)

    def trace_key(variant: Any) -> TraceKey:
        return TraceKey(
            spec.family,
            variant,
            layout.fsdp,  # FSDP shards over dp x cp
            layout.tp,
            mb,
            layout.seq // layout.cp,  # each CP rank's part of the sequence
            layout.ac,
            layout.reshard_after_forward,
            layout.dtype,
            layout.loss_parallel and layout.tp > 1,
            layout.attention_saved,
        )

    keys = [trace_key(layer_variant(spec, config, n)) for n in (1, 2)]
    kinds = spec.layer_kinds(config) if spec.layer_kinds is not None else None
    if kinds is not None and len(set(kinds)) < 2:
        kinds = None
    try:
        t1, t2 = traced(keys[0]), traced(keys[1])
        # every kind's blocks (Note: [Blocks of several kinds in the plan])
        kind_traces = {
            kind: [traced(trace_key(spec.with_layer_kind(config, kind, n))) for n in (1, 2)]
            for kind in dict.fromkeys(kinds or ())
        }
    except Exception as exc:
        if isinstance(exc, ValueError) or not getattr(spec.hf_adapter, "any_model_type", False):
            raise
        # a model's own code (transformers'), not ours: one line, as bad input
        from torch._dynamo.exc import Unsupported

        first = (str(exc).strip().splitlines() or [""])[0]
        code = f"transformers' code for model_type {getattr(config, 'model_type', '?')!r}"
        if isinstance(exc, Unsupported):
            raise ValueError(
                f"{code} breaks the graph ({first}); simplefsdp plan traces a step as one "
                "graph (simplefsdp train compiles around breaks with --compile.fullgraph false)"
            ) from exc
        raise ValueError(
            f"{code} does not trace on the meta device, as simplefsdp plan runs it "
            f"({type(exc).__name__}: {first}); valid: a model whose code traces there "
            f"(e.g. 'llama', 'mistral', 'qwen2', 'gemma', 'phi3')"
        ) from exc
    fused = layout.compiled
    probe = cost_model_for(hw, layout, 1.0)
    kernels = kernel_model(hw, probe.bytes_per_s)
    mask_queries = cp_mask_queries(layout.seq, layout.cp, layout.cp_backend)
    masked = mask_queries > 0
    async_degree = layout.tp if layout.async_tp else 1
    ring = layout.cp > 1 and layout.cp_backend == "torch"
    # the logits' local vocabulary (split over TP with loss parallelism)
    parallel_loss = layout.loss_parallel and layout.tp > 1
    local_vocab = config.vocab_size // (layout.tp if parallel_loss else 1)
    # the loss compiled on its own (--fused-loss) beside eager blocks
    loss_vocab = local_vocab if layout.fused_loss and not fused else 0
    how = (probe, fused, fp8, kernels, layout.cp, masked, async_degree, ring, loss_vocab)
    if kinds is None:
        m1, m2 = measure(t1, *how), measure(t2, *how)
    else:  # the first kind's one-block trace is t1
        ones = {kind: measure(k1, *how) for kind, (k1, _) in kind_traces.items()}
        per_kind = {
            kind: ones[kind].per_block(measure(k2, *how)) for kind, (_, k2) in kind_traces.items()
        }
        m1, m2 = blocks_of_kinds(ones, per_kind, kinds)
    cost_model = cost_model_for(hw, layout, m1.rs_to_ag_ratio)
    per_block = m1.per_block(m2)
    kv_per_block = per_block.kv_forward_bytes
    # Pipeline stages: the blocks of the most loaded stage plus all the rest
    # (embedding, norm, output, loss; the last stage holds the costly part of
    # it): conservative by the embedding.
    stage = m1.extrapolate(m2, blocks_of_stage)
    sums = stage.param_bytes * layout.fsdp if layout.microbatches > 1 else 0.0
    inflight, sums_alive = pipeline_peak(
        layout, per_block.saved_bytes * blocks_of_stage, float(sums)
    )
    # What the forward saves outside the blocks (the loss's log-probabilities,
    # the embedding's output) is held once, beside the blocks' activations of
    # every microbatch in flight (conservative under pipelining: the first
    # stage holds the most microbatches, the last the loss).
    outside_saved = max(stage.saved_bytes - per_block.saved_bytes * blocks_of_stage, 0.0)
    first_stage_saved = per_block.saved_bytes * blocks_of_stage * inflight + outside_saved
    notes = []

    # Bucket plan and communication replay for one microbatch of the stage.
    units = _units_for(t2, cost_model, blocks_of_stage, True, True)
    compute_s = stage.fw_s + stage.bw_s
    fw_window = sum(u.compute_s for u in units)
    scale = compute_s / (3 * fw_window) if fw_window else 0.0
    # The units' TP communication is their forward's, priced at its bytes
    # and mirrored in backward: scaled to both graphs' as the plan runs them
    # (Note: [Tensor-parallel communication in the plan]).
    tp_scale = stage.tp_s / (2 * stage.tp_forward_priced_s) if stage.tp_forward_priced_s else 1.0
    units = [
        dataclasses.replace(
            u, compute_s=u.compute_s * scale, fixed_comm_s=u.fixed_comm_s * tp_scale
        )
        for u in units
    ]
    fsdp2 = get_engine(layout.engine).fsdp2_runtime
    if fsdp2 and not layout.reshard_after_forward and inflight > 1:
        # Kept gathered from forward to backward, the blocks' parameters are
        # among what each microbatch's forward saves; FSDP2 keeps one set for
        # every microbatch in flight (the compiled engine gathers each
        # microbatch's own), counted as gathered below.
        blocks_gathered = sum(u.gathered_bytes for u in units if _block_of(u.fqn) != "root")
        first_stage_saved -= inflight * min(
            blocks_gathered, per_block.saved_bytes * blocks_of_stage
        )
    float8_units = 0
    if fp8 is not None:
        # Converted weights gather in float8, 1 byte per parameter; gradients
        # are still reduced in fp32, so the reduce-scatter's bytes per
        # gathered byte grow by what the gathers shrank (Note: [Float8 in
        # the plan]).
        converted = {_in_block(f) for f in t2.float8_fqns}
        bf16_bytes = sum(u.gathered_bytes for u in units)
        units = [
            dataclasses.replace(u, gathered_bytes=u.gathered_bytes // 2)
            if _in_block(u.fqn) in converted
            else u
            for u in units
        ]
        float8_units = sum(_in_block(u.fqn) in converted for u in units)
        fp8_bytes = sum(u.gathered_bytes for u in units)
        if fp8_bytes:
            ratio = m1.rs_to_ag_ratio * bf16_bytes / fp8_bytes
            cost_model = cost_model_for(hw, layout, ratio)
    param_bytes = stage.param_bytes
    grad_bytes = param_bytes
    optimizer_bytes = 2 * param_bytes
    resident = param_bytes + grad_bytes + optimizer_bytes
    usable = hw.memory_bytes * hw.usable_memory_fraction
    base_peak = max(stage.fw_peak, stage.saved_bytes + stage.bw_transient)
    kept: set[str] = set()  # gathered once, kept from forward to backward
    kept_spent = 0.0  # their bytes beyond the buckets gathered at the boundary anyway
    # torchtitan's groups, as the fsdp2 engine's; one root group where the
    # model ties its embeddings (the engine keeps them together)
    split_root = (
        get_engine(layout.engine).fsdp2_runtime and layout.fsdp2_root == "split" and t2.outer_split
    )
    if split_root:
        # torchtitan's groups in forward order: the embedding, the blocks,
        # the final norm and output (kept from forward into backward)
        buckets = _forward_order_blocks(units)
        if len(buckets) > 1 and _block_of(buckets[-1][0].fqn) == "root":
            kept = {u.fqn for u in buckets[-1]}
    elif not _compiled(layout.engine) or layout.bucketing == "per_block":
        buckets = _group_units(units, "per_block")
    elif layout.bucketing == "none":
        buckets = _group_units(units, "none")
    else:
        budget = usable - resident - max(first_stage_saved - stage.saved_bytes, 0)
        # The compiler's default budget (Note: [Keeping what eager FSDP2 would
        # hold]): the per-block plan plus the activations eager autograd
        # would save beyond the compiled step's, that slack spent first on
        # keeping the last blocks gathered for backward (beyond the ones
        # gathered at the boundary anyway), the rest on larger buckets.
        per_block = step_extra_bytes(_group_units(units, "per_block"))
        slack = max(stage.eager_extra_saved_bytes, 0.0)
        free_bytes = 0.0
        if layout.reshard_after_forward:
            reference = _forward_order_blocks(units)
            sizes = [sum(u.gathered_bytes for u in b) for b in reference]
            free = min(free_keep_count(1, True), len(sizes))  # prefetch distance 1
            count, spent = choose_kept(sizes, free, int(slack))
            kept = {u.fqn for b in reference[len(reference) - count :] for u in b}
            free_bytes, kept_spent = float(sum(sizes[len(sizes) - free :])), float(spent)
        budget = min(budget, base_peak + free_bytes + per_block + slack)
        try:
            buckets = greedy_buckets(
                units,
                cost_model,
                reshard_after_forward=layout.reshard_after_forward,
                base_peak_bytes=int(base_peak + free_bytes + kept_spent),
                memory_budget_bytes=int(budget),
                kept=kept,
            )
        except ValueError:  # not even one parameter at a time fits: the tightest plan
            buckets = _group_units(units, "none")
    if not units:
        buckets = []
    pipe_s = pipeline_time_s(buckets, cost_model, layout.reshard_after_forward, kept)
    # TP's collectives, on the critical path: the units carry them, scaled
    # to both graphs' as run; without data-parallel sharding there are no
    # units and they are the stage's own.
    fixed_s = 2.0 * sum(u.fixed_comm_s for u in units) if units else stage.tp_s
    dp_comm_s = sum(
        bucket_comm_s(b, cost_model, layout.reshard_after_forward, kept) for b in buckets
    )
    if layout.fsdp == 1:
        pipe_s, dp_comm_s = compute_s + fixed_s, 0.0
    # Bucket copies on the compute stream (Note: [Plan model]).
    copy_s = 0.0
    if not _compiled(layout.engine) and hw.fsdp2_copy_s_per_byte > 0:
        dtype_bytes = 2 if layout.dtype == "bf16" else 4
        # Without buckets (world size 1) the shards are the whole parameters.
        copy_s = fsdp2_copy_seconds(
            buckets, hw, layout.reshard_after_forward, param_bytes * dtype_bytes / 4
        )
    elif layout.fsdp > 1:
        copy_s = copy_seconds(
            buckets, cost_model, layout.reshard_after_forward, hw.copy_bytes_per_byte, kept
        )
    # Eager FSDP2's hooks, per group: one per block and the root's (the
    # embedding apart with a split root) (Note: [Plan model]). Host time on
    # the compute stream, at any world size.
    group_s = hw.fsdp2_group_s
    if layout.fsdp > 1 and hw.fsdp2_sharded_group_s > 0:
        group_s = hw.fsdp2_sharded_group_s  # measured sharding, with collectives
    outer_groups = 2 if split_root else 1
    hooks_s = (blocks_of_stage + outer_groups) * group_s if not _compiled(layout.engine) else 0.0
    # The replay counts communication competing with compute for the CPU
    # (hw.comm_overlap < 1) as compute-stream time: it is exposed too.
    # Context parallelism: every attention gathers its keys and values from
    # the CP ranks (backward: reduce-scatters their gradients), exposed
    # (Note: [Context parallelism in the plan]).
    cp_s = 0.0
    ulysses = layout.cp > 1 and layout.cp_backend == "ulysses"
    if ulysses and stage.attention_heads % layout.cp:
        raise ValueError(
            f"--cp-backend ulysses needs the {int(stage.attention_heads)} attention heads of a "
            f"rank to divide by --cp {layout.cp}; valid: --cp-backend allgather or torch"
        )
    if ulysses:
        # Four all-to-alls per attention node (queries, keys, values to head
        # shards, the output back; backward the same of their gradients).
        span = layout.cp * layout.tp
        latency = hw.comm_seconds("all_to_all", layout.cp, 0.0, span)
        cp_s = (4 * stage.attention_nodes - 1) * latency
        cp_s += hw.comm_seconds("all_to_all", layout.cp, stage.ulysses_bytes, span)
    elif layout.cp > 1:
        span = layout.cp * layout.tp
        cp_s = stage.attention_nodes * hw.comm_seconds("all_gather", layout.cp, 0.0, span)
        cp_s += hw.comm_seconds("all_gather", layout.cp, layout.cp * stage.kv_bytes, span)
        cp_s -= hw.comm_seconds("all_gather", layout.cp, 0.0, span)
    # simplefsdp's masked backends: per attention a (T/cp x T), for ulysses
    # (T x T), boolean mask from the positions and SDPA's bf16 bias of it,
    # written and read once (Note: [Context parallelism in the plan]).
    # Windows in chunks build their own masks, in the traces.
    mask_bytes = float(mask_queries * layout.seq) if stage.sequence_attention_nodes else 0.0
    if masked:
        compute_s += stage.sequence_attention_nodes * 4 * mask_bytes / cost_model.bytes_per_s
    mb_s = max(pipe_s, compute_s) + copy_s + hooks_s + cp_s
    compute_s += copy_s + hooks_s
    exposed_s = mb_s - compute_s
    slots = pipeline_slots(layout)
    m = layout.microbatches
    if fsdp2 and layout.pp > 1 and not layout.reshard_after_forward and layout.fsdp > 1:
        # FSDP2 under a pipeline, not resharding: it gathers at the step's first
        # forward and reduces at its last backward; the other slots run without
        # data-parallel collectives and their copies (Note: [Pipeline
        # schedules in the plan]).
        free_compute = compute_s - copy_s
        free_s = free_compute + fixed_s + cp_s
        step_mb_s = (slots - 1) * free_s + mb_s
        bubble_s = (slots - m) * free_s
        compute_total = m * free_compute + copy_s
        exposed_total = (m - 1) * (free_s - free_compute) + exposed_s
        copies_total, dp_total = copy_s, dp_comm_s
    else:
        step_mb_s = slots * mb_s
        bubble_s = (slots - m) * mb_s
        compute_total, exposed_total = m * compute_s, m * exposed_s
        copies_total, dp_total = m * copy_s, m * dp_comm_s
    optimizer_s = (param_bytes / 4) * (
        hw.adamw_s_per_param or ADAMW_BYTES_PER_PARAM / cost_model.bytes_per_s
    )
    # gradient clipping: the norm's passes and its all-reduce
    optimizer_s += (param_bytes / 4) * CLIP_BYTES_PER_PARAM / cost_model.bytes_per_s
    optimizer_s += hw.comm_seconds("all_reduce", layout.gpus, 4, layout.gpus)
    if float8_units:
        # The amaxes of the converted weights, one all-reduce per step.
        span = layout.fsdp * layout.tp
        optimizer_s += hw.comm_seconds("all_reduce", layout.fsdp, 4 * float8_units, span)
    step_s = step_mb_s + optimizer_s
    gathered = prefetch_extra_bytes(buckets, kept) if layout.fsdp > 1 else 0.0
    activations = first_stage_saved
    if not layout.compiled:
        # Eager autograd saves what the derivative formulas need, where the
        # compiled step's partitioner recomputes cheap ops (Note: [Plan model]).
        activations += max(stage.eager_extra_saved_bytes, 0.0) * inflight
    elif not _compiled(layout.engine):
        # FSDP2 with its blocks compiled: what lies outside the blocks (the
        # final norm, the output layer, the loss) runs eager and saves what
        # eager autograd saves (the loss's fp32 log-probabilities where the
        # partitioner would keep the bf16 logits and recompute them).
        outside_extra = 2 * m1.eager_extra_saved_bytes - m2.eager_extra_saved_bytes
        activations += max(outside_extra, 0.0)
    temporary = max(base_peak - stage.saved_bytes, 0.0)
    if layout.fused_loss:
        # The traced loss runs eager: it saves the fp32 log-probabilities (4
        # bytes per logit) and its backward holds their gradient and the
        # logits' fp32 gradient (8) at the step's peak. Fused, it saves the
        # bf16 logits (2) and writes their bf16 gradient (2) in one kernel
        # (Note: [Plan model]).
        logits = mb * (layout.seq // layout.cp) * local_vocab
        activations = max(activations - 2 * logits, 0.0)
        # the vocabulary-parallel backward holds 4 bytes per logit more (a
        # zero gradient, the probabilities, their sum)
        temporary = max(temporary - (10 if parallel_loss else 6) * logits, 0.0)
    if mask_bytes:
        # The mask and its bf16 bias while an attention runs; without AC the
        # bias is saved for backward, per block and microbatch in flight.
        temporary += 3 * mask_bytes
        if layout.ac == "none":
            share = stage.sequence_attention_nodes / max(stage.attention_nodes, 1.0)
            activations += 2 * mask_bytes * blocks_of_stage * inflight * share
    if layout.cp > 1 and not ulysses:
        # Gathered keys and values: saved for backward, or under full AC one
        # block's at a time (Note: [Context parallelism in the plan]).
        gathered_kv = (layout.cp - 1) * kv_per_block
        if layout.ac == "full":
            temporary += gathered_kv
        else:
            activations += gathered_kv * blocks_of_stage * inflight
    if fsdp2 and layout.fsdp > 1 and layout.reshard_after_forward:
        gathered = fsdp2_gathered_bytes(
            units, activations + temporary, "split" if split_root else "whole"
        )
    # Unreduced gradient sums (Note: [Gradient accumulation in the plan]):
    # fp32, the stage's parameters whole (TP-local), those alive at the peak.
    accumulated = float(sums_alive * sums)
    if fsdp2 and layout.fsdp > 1 and layout.pp > 1:
        # FSDP2 under a pipeline holds the stage's parameters whole: kept from
        # the first forward on without resharding, else from the first
        # backward on (torch's pipeline stages keep its groups gathered after
        # every backward but the step's last).
        gathered = max(gathered, float(sum(u.gathered_bytes for u in units)))
    memory = {
        "parameters": param_bytes,
        "gradients": grad_bytes,
        "optimizer": optimizer_bytes,
        "activations": activations,
        "accumulated": accumulated,
        "gathered": gathered,
        "temporary": temporary,
    }
    if hw.caching_allocator:
        # What the caching allocator holds free at its reserved peak, from the
        # 2-block trace's steps (Note: [Plan model]).
        fused_vocab = local_vocab if layout.fused_loss else 0
        streams = get_engine(layout.engine).fsdp2_runtime  # compiled blocks too
        cached, retries = _cached_bytes(
            t2, sum(memory.values()), usable, streams, fused_vocab, layout.expandable_segments
        )
        memory["cached"] = cached
        notes.append(
            f"peak is the caching allocator's reserved memory: {cached / 2**30:.1f} GiB cached "
            f"beyond the tensors' {(sum(memory.values()) - cached) / 2**30:.1f} GiB"
            + (f"; {retries} allocation retries (cache released at capacity)" if retries else "")
        )
    peak = sum(memory.values())
    tokens = layout.batch * layout.seq * layout.dp
    tps = tokens / step_s / layout.gpus
    mfu = tps * spec.flops_per_token(config, layout.seq) / hw.peak_bf16_flops
    time = {
        "compute": compute_total,
        # Part of compute: the copies around the collectives (Note: [Plan model]).
        "copies": copies_total,
        # Part of compute: eager FSDP2's hooks (Note: [Plan model]).
        "hooks": layout.microbatches * hooks_s,
        "exposed_comm": exposed_total,
        "bubble": bubble_s,
        "optimizer": optimizer_s,
        "dp_comm_total": dp_total,
        "tp_comm_total": layout.microbatches * fixed_s,
        "cp_comm_total": layout.microbatches * cp_s,
        "flops": layout.microbatches * (stage.fw_flops + stage.bw_flops),
    }
    if layout.pp > 1:
        notes.append(pipeline_note(layout, inflight, sums_alive if sums else None))
    if layout.cp > 1:
        how = (
            "queries, keys, values and output all-to-all'd per attention"
            if ulysses
            else "keys and values all-gathered per attention"
        )
        notes.append(
            f"context parallel {layout.cp}: {layout.seq // layout.cp} tokens per rank, {how} "
            f"({layout.microbatches * cp_s:.3f} s, exposed)"
        )
        if mask_bytes:
            notes.append(cp_mask_note(layout.seq, mask_queries, layout.cp_backend))
        elif masked and stage.attention_nodes:  # every attention a window in chunks
            notes.append(
                f"context parallel attention ({layout.cp_backend}): every layer's sliding "
                "window runs in chunks of the keys it reaches, no sequence-wide mask"
            )
        refusal = spec.sequence_context_error(config) if spec.sequence_context_error else None
        if not spec.supports("cp"):
            notes.append(
                f"family {spec.family!r} does not declare context parallelism: simplefsdp "
                "train refuses this layout"
            )
        elif refusal:
            notes.append(
                f"the model cannot take a sequence context ({refusal}): simplefsdp "
                "train refuses this layout"
            )
    if layout.tp > 1:
        notes.append(
            f"tensor parallel {layout.tp}: {layout.microbatches * fixed_s:.3f} s of its collectives"
            + (" beyond what async TP overlaps with their matmuls" if layout.async_tp else "")
            + " (exposed)"
            + (
                "; simplefsdp train runs them whole (async TP: torchtitan's)"
                if layout.async_tp
                else ""
            )
        )
    if t2.dropout:
        notes.append("dropout: planned without it (its masks and random numbers are left out)")
    if t2.eager_attention:
        notes.append(
            "attention: the model's code has no SDPA path; its eager attention is planned "
            "(the scores materialized, as simplefsdp train runs it)"
        )
    if fp8 is not None:
        notes.append(
            f"float8: {float8_units} weights gathered and multiplied in float8 at "
            f"{fp8.flops_per_s / 1e12:,.0f} TFLOP/s; MFU against the bf16 peak"
        )
    return Prediction(
        layout=layout,
        hardware=hw.name,
        memory=memory,
        peak_bytes=peak,
        usable_bytes=usable,
        time=time,
        step_s=step_s,
        tokens_per_s_per_gpu=tps,
        mfu=mfu,
        buckets=[[u.fqn for u in b] for b in buckets],
        notes=notes,
        kept=[u.fqn for u in units if u.fqn in kept],
    )
