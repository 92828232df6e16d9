"""``simplefsdp plan`` from a model's shapes: the analytic model for families
whose ``ModelSpec.plan_method`` is ``"analytic"`` (expert-parallel decoders).

Note: [Analytic plan model]
    Decoders with routed experts are planned from their config's shapes
    (``dim``, ``n_layers``, ``num_experts``, ``top_k``, ``moe_hidden_dim``,
    attention's head dims (multi-head latent attention where the config has
    ``kv_lora_rank``), ...), not from traced graphs. Parameter counts and FLOPs per token come from the
    family's ``ModelSpec``.
    The layout is torchtitan's: ``gpus`` ranks (no TP), ``pp`` pipeline
    stages of ``gpus / pp`` data-parallel ranks, experts split over ``ep``
    ranks (``num_experts / ep`` each) and sharded over the ``dp / ep`` ranks
    that hold the same experts (``dp_shard_mod_ep``); everything else
    (attention, dense feed-forward, router, shared experts, embedding,
    output) sharded over all ``dp`` ranks of a stage.

    Pipeline and accumulation (``pp``, ``microbatches``): the model below is
    one microbatch of a pipeline rank, its blocks as the family's
    ``pipeline_split`` places them (``stage_config``: the config cut to
    them, the embedding and the output kept, with the first rank's
    microbatches in flight: conservative, as traced plans), for each rank
    that may be the most loaded (``stage_compositions``: a model's leading
    dense blocks on the first, only routed-expert blocks on others): the
    memory the highest peak's, the step the slowest rank's; scaled as
    traced plans scale theirs (Note: [Pipeline schedules
    in the plan] in ``plan/predict.py``): the activations of the
    microbatches in flight where the first rank peaks, beside the fp32
    gradient sums of its parameters, whole (Note: [Gradient accumulation in
    the plan]); FSDP2 under a pipeline holding its parameters gathered; a
    step of ``m + (p - 1) / v`` slots, FSDP2 without resharding talking in
    one of them, the compiled engine in every one. Send/recv between
    stages is not modelled.

    Memory per GPU (bytes):
      parameters, gradients, optimizer
                   fp32 shards, 4 + 4 + 8 bytes per parameter: dense / dp,
                   experts / ep / (dp / ep) = experts / dp;
      activations  what backward needs per token and layer (bf16), by AC
                   mode (``activation_elements``): ``none`` every tensor a
                   block's backward reads; ``selective`` the engines'
                   policy (matmul and attention outputs, every other matmul
                   recomputed, the all-to-all outputs and the grouped
                   matmuls' outputs kept) as the block input, half of the
                   linears' outputs, attention's output, the experts' three
                   grouped matmul outputs (none with ``recompute_experts``)
                   and with ``ep > 1`` the dispatched and combined tokens
                   (within 5% of what the family's own model saves per MoE
                   block, recorded on the meta device, without EP);
                   ``full`` the block input;
      gathered     the bf16 parameters of the gathered blocks: two blocks
                   (one computing, one prefetched) and the one copied out,
                   ``2 * B_i + B_(i+1)`` as the compiler's own model, a
                   block's experts being its ``num_experts / ep`` local ones;
                   without resharding after forward every block, kept from
                   its forward to its backward, and one block's unsharded
                   gradients; for FSDP2 its final norm and output group
                   too (with ``fsdp2_root`` ``whole`` the embeddings with
                   them), gathered from its forward into backward;
      temporary    the loss's logits (bf16), fp32 logits and their
                   gradient, ``10 * vocab`` bytes per token (``4`` with
                   ``fused_loss``: the bf16 logits and their bf16 gradient,
                   the loss compiled into kernels that hold no fp32 copy),
                   and for full AC one block's recomputed activations;
      cached       eager engines, where the profile's memory comes from the
                   CUDA caching allocator: what it holds free at its
                   reserved peak, the allocator simulated (Note: [Caching
                   allocator simulation]) over two eager steps of the
                   family's own ops at the layout's shapes, two MoE blocks
                   past the dense ones (each storage allocated when an op
                   creates it and freed when nothing holds it, autograd's
                   saved tensors included; :func:`eager_step_events`),
                   taken whole as the traced plans take theirs; for
                   eager FSDP2 with its collective buffers on streams of
                   their own (Note: [FSDP2's collective buffers] in
                   ``plan/host.py``). Not modelled: compiled engines'
                   cache.

    Step time:
      compute      matmul FLOPs of the dense activated parameters at the
                   profile's large-GEMM rate; the routed experts (``top_k``
                   per token, times ``imbalance`` on the most loaded rank)
                   as grouped GEMMs of ``tokens * top_k * ep / num_experts``
                   rows per local expert, priced by the kernel model (Note:
                   [Kernel model]) where the profile has one; attention
                   (causal, fused) at the FlashAttention rates (SDPA's
                   memory-efficient kernel's where MLA's value head dim
                   differs from the query's, Note: [Kernel model]); AC's
                   recomputation (full: one more forward of the blocks;
                   selective: half the blocks' non-expert matmuls and the
                   token permutation, the experts' grouped matmuls saved);
                   elementwise work as three passes over the no-AC
                   activations compiled, six eager, at the achievable
                   bandwidth. MoE terms: the router's matmul; the token
                   permutation and un-permutation (each routed row read
                   and written, forward, backward, recomputation).
      host         eager engines on a GPU: the compute above is the
                   compiled step's; an eager step is the family's own
                   kernels at the layout's shapes (recorded on the meta
                   device, each priced by the kernel model, every op its
                   own kernel) issued by the host at the profile's cost per
                   op and simulated against one device stream, with the
                   token-count syncs of expert parallelism (Note:
                   [Host-bound steps] in ``plan/host.py``; each block's
                   forward all-gather issued as the host reaches it): the
                   simulated end is the step's compute, and only backward's
                   FSDP collectives are weighed against the blocks' (two
                   thirds of their compute). Compiled engines are taken
                   as device bound; each sync idles the GPU for a
                   device-to-host copy and the next launch.
      all-to-all   per MoE layer, dispatch and combine in forward and again
                   in backward (and once more under full AC's
                   recomputation), each moving ``tokens * top_k * dim`` bf16
                   bytes per rank (times ``imbalance``), ``(ep - 1) / ep``
                   of them to other ranks, on NVLink when the ``ep``
                   consecutive ranks of an EP group sit in one node, else on
                   the NIC; on the critical path (the token counts are data
                   the next kernels wait for), so exposed.
      FSDP comm    per block, the all-gathers (forward, and backward again
                   with resharding) and fp32 reduce-scatters of its dense
                   part over ``dp`` and its experts over ``dp / ep``;
                   exposed only where a block's communication exceeds its
                   compute (prefetch distance 1).
      copies       around those collectives, on the compute stream, as the
                   traced plans count them: per all-gather the shards in
                   and the gathered block out, per reduce-scatter the
                   gradients in, ``copy_bytes_per_byte`` bytes moved per
                   byte written at the achievable bandwidth.
      optimizer    gradient-norm clipping (12 bytes per fp32 parameter
                   shard and the norm's all-reduce), then AdamW (28 bytes).
    MFU: the spec's ``flops_per_token`` (torchtitan's count: ``6 *`` the
    activated parameters plus attention by head dims, not halved for the
    causal mask) over the bf16 peak.
    Load imbalance: ``imbalance`` (default 1.0, perfectly balanced routing)
    is the ratio of the most loaded EP rank's routed tokens to the mean; the
    step waits for that rank. Not modelled: TP.

    Context parallelism (``cp``, torchtitan's layout as for traced plans):
    FSDP and EP over all ``gpus`` ranks (``ep`` a multiple of ``cp``), each
    CP rank ``seq / cp`` tokens of every sequence (load-balanced causal
    attention: each rank's queries meet ``seq / 2`` keys on average, so
    attention's work per local token is the full sequence's). Every
    attention all-gathers its keys and values from the CP ranks (forward,
    AC's recomputation; backward reduce-scatters their gradients), exposed
    (the attention waits for them); the gathered keys and values are saved
    per block under ``none``/``selective`` AC, one block's at a time under
    ``full``. With ``cp_backend`` ``allgather`` (simplefsdp's) the attention
    runs with a boolean mask, as for traced plans (Note: [Context
    parallelism in the plan] in ``plan/predict.py``): its bf16 bias held
    while an attention runs, the memory-efficient kernel over every
    query-key pair; with ``torch`` (torch's ring) the ring's merges and
    copies outside the kernels are added as for traced plans, per layer
    for each forward (AC's recomputation included) and backward, the keys
    and values repeated to the query heads as attention reads them.

Note: [Float8 of a model with experts]
    ``float8`` plans ``simplefsdp train --float8.enable`` (torchao's
    tensorwise recipe, float8 all-gathers) as it converts a model with
    routed experts: the ``nn.Linear`` layers of its blocks (attention, the
    dense and shared feed-forward networks) whose dims are multiples of 16,
    not the output layer, the router (the family's ``float8_skip_fqns``) or
    the routed experts (grouped GEMMs, not linears), found on the family's
    model built on the meta device (:func:`float8_linears`). As the traced
    plans price them (Note: [Float8 in the plan] in ``plan/predict.py``):
      matmuls      a converted linear's forward, both backward matmuls and
                   AC's share of its forward again at the profile's
                   ``peak_fp8_flops * fp8_matmul_efficiency``;
      casts        the activation operands (the forward's input, the
                   gradient for the input's matmul, the gradient and the
                   input for the weight's; the input again where AC
                   recomputes) cast at 3 bytes per element moved (the amax
                   fused into the producer; compiled engines only: an eager
                   step's kernels are recorded in bf16, so ``--float8`` with
                   an eager engine is refused);
      all-gathers  the converted weights gather one byte per parameter (the
                   gathered blocks in memory, the collectives and the copies
                   around them); gradients are still reduced in fp32;
      scales       one all-reduce of the converted weights' amaxes per step.
    Activations are as bf16's (torchao saves the bf16 inputs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from simplefsdp.engines.activation import check_recompute_experts
from simplefsdp.engines.kinds import get_engine
from simplefsdp.layout.pipeline import num_stages, pipeline_errors
from simplefsdp.models.common.attention import attention_keys
from simplefsdp.plan.allocator import cached_bytes
from simplefsdp.plan.costs import (
    ADAMW_BYTES_PER_PARAM,
    CLIP_BYTES_PER_PARAM,
    ring_attention_bytes,
)
from simplefsdp.plan.hardware import HardwareProfile, check_float8
from simplefsdp.plan.host import (
    EagerStep,
    Fsdp2Buffers,
    HostStep,
    device_bound,
    eager_step_events,
    timeline_step,
    token_syncs,
)
from simplefsdp.plan.kernels import MEMORY_EFFICIENT_FRACTION, kernel_model
from simplefsdp.plan.layout import (
    AC_MODES,
    CP_BACKENDS,
    check_engine,
    check_fsdp2_root,
    cp_describe,
    cp_mask_note,
    cp_mask_queries,
    pipeline_describe,
)
from simplefsdp.plan.pipeline import (
    pipeline_note,
    pipeline_peak,
    pipeline_slots,
    stage_compositions,
)
from simplefsdp.plan.prediction import Prediction
from simplefsdp.plan.trace import layer_variant


@dataclass(frozen=True)
class ExpertLayout:
    """A layout of the analytic model: ``gpus`` ranks, ``pp`` pipeline
    stages of ``gpus / pp`` data-parallel ranks each, experts over ``ep``;
    ``imbalance`` is the most loaded EP rank's routed tokens over the mean.
    ``batch`` is per data-parallel rank per step, split into
    ``microbatches`` (a pipeline's, or gradient accumulation's)."""

    gpus: int
    batch: int
    seq: int
    ep: int = 1
    ac: str = "selective"
    engine: str = "simplefsdp"
    reshard_after_forward: bool = True
    imbalance: float = 1.0
    cp: int = 1
    recompute_experts: bool = False
    fused_loss: bool = False
    cp_backend: str = "allgather"  # as the traced Layout's
    pp: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"  # as the traced Layout's
    stages_per_rank: int | None = None
    expandable_segments: bool = False  # as the traced Layout's
    fsdp2_root: str = "split"  # as the traced Layout's (FSDP2_ROOTS)
    float8: bool = False  # the blocks' dense linears (Note: [Float8 of a model with experts])

    @property
    def dp(self) -> int:
        """Ranks that read different batches: the GPUs over ``pp`` and ``cp``."""
        return self.gpus // (self.pp * self.cp)

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards over (``dp x cp``: every GPU of a stage)."""
        return self.gpus // self.pp

    @property
    def stages_of_rank(self) -> int:
        """The pipeline stages each rank holds (1 without a pipeline)."""
        if self.pp == 1:
            return 1
        return self.num_stages // self.pp

    @property
    def num_stages(self) -> int:
        """The pipeline's stages (``pp`` times the stages of a rank)."""
        return num_stages(self.pp, self.pp_schedule, self.stages_per_rank) if self.pp > 1 else 1

    # What the analytic method does not vary, under the traced Layout's
    # names (``--measure`` runs either layout): no TP, bf16, per-block
    # groups, the vocabulary whole for the loss.
    tp = 1
    dtype = "bf16"
    bucketing = "per_block"
    loss_parallel = False

    @property
    def compiled(self) -> bool:
        """The step's kernels are compiled: the engine fuses them."""
        return get_engine(self.engine).fused_buckets

    def describe(self) -> str:
        """One line naming the layout, as in ``--sweep`` tables."""
        parts = [f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(cp_describe(self.cp, self.cp_backend))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += pipeline_describe(self)
        parts += [
            f"ac={self.ac}" + ("+experts" if self.recompute_experts else ""),
            "per_block",
            "reshard" if self.reshard_after_forward else "no-reshard",
        ]
        if self.fused_loss:
            parts.append("fused-loss")
        if self.float8:
            parts.append("float8")
        if self.expandable_segments:
            parts.append("expandable")
        if get_engine(self.engine).fsdp2_runtime and self.fsdp2_root != "split":
            parts.append(f"{self.fsdp2_root}-root")
        return " ".join(parts)


#: How ``simplefsdp plan`` spells the pipeline's settings.
_PIPELINE_NAMES = {
    "pp": "--pp",
    "microbatches": "--microbatches",
    "batch": "--batch",
    "pp_schedule": "--pp-schedule",
    "stages_per_rank": "--stages-per-rank",
}


def stage_config(spec: Any, config: Any, blocks: int, moe_blocks: int | None = None) -> Any:
    """``config`` cut to the ``blocks`` of a pipeline rank (all of them:
    ``config``), ``moe_blocks`` of them with routed experts (``None``: the
    model's leading dense blocks kept where the rank holds as many)."""
    if blocks >= config.n_layers:
        return config
    if moe_blocks is not None:
        dense = blocks - moe_blocks
        fields = {f.name for f in dataclasses.fields(config)}
        variant = None
        if "n_dense_layers" in fields:
            variant = dataclasses.replace(config, n_layers=blocks, n_dense_layers=dense)
        elif "mlp_only_layers" in fields:
            variant = dataclasses.replace(
                config, n_layers=blocks, mlp_only_layers=tuple(range(dense)), decoder_sparse_step=1
            )
        if variant is not None and getattr(variant, "n_moe_layers", None) == moe_blocks:
            return variant
    try:
        return layer_variant(spec, config, blocks)
    except ValueError:  # fewer blocks than the model's leading dense ones
        return dataclasses.replace(config, n_layers=blocks, n_dense_layers=blocks)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_analytic(spec: Any, config: Any, layout: ExpertLayout) -> None:
    """One-line ``ValueError`` naming the bad value and what would be valid:
    the options here, the model against the layout by ``spec.validate``."""
    check_engine(layout.engine)
    check_fsdp2_root(layout.fsdp2_root, layout.engine)
    if layout.ac not in AC_MODES:
        raise ValueError(f"unknown --ac {layout.ac!r}; valid: {', '.join(AC_MODES)}")
    for flag, value in (("--gpus", layout.gpus), ("--batch", layout.batch), ("--seq", layout.seq)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--ep", layout.ep), ("--cp", layout.cp), ("--pp", layout.pp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if layout.gpus % layout.pp:
        raise ValueError(
            f"--pp {layout.pp} does not divide the {layout.gpus} GPUs; "
            f"valid --pp: {', '.join(map(str, _divisors(layout.gpus)))}"
        )
    if layout.pp == 1 and (layout.pp_schedule != "1f1b" or layout.stages_per_rank is not None):
        flag = "--stages-per-rank" if layout.stages_per_rank is not None else "--pp-schedule"
        raise ValueError(f"{flag} schedules a pipeline; it needs --pp > 1")
    errors = pipeline_errors(
        layout.pp,
        layout.pp_schedule,
        layout.microbatches,
        layout.stages_per_rank,
        batch=layout.batch,
        names=_PIPELINE_NAMES,
    )
    if errors:
        raise ValueError(errors[0])
    planned = tuple(b for b in CP_BACKENDS if b != "ulysses")
    if layout.cp_backend not in planned:
        raise ValueError(
            f"--cp-backend {layout.cp_backend!r} is not planned for a model planned from its "
            f"shapes; valid: {', '.join(planned)}"
        )
    if layout.fsdp % layout.cp:
        valid = _divisors(layout.fsdp)
        over = f" over --pp {layout.pp}" if layout.pp > 1 else ""
        raise ValueError(
            f"--cp {layout.cp} does not divide the {layout.gpus} GPUs{over}; "
            f"valid --cp: {', '.join(map(str, valid))}"
        )
    if layout.cp > 1 and layout.seq % (2 * layout.cp):
        raise ValueError(
            f"--seq {layout.seq} does not split over --cp {layout.cp} (load-balanced causal "
            f"attention needs a multiple of 2 * cp = {2 * layout.cp})"
        )
    if not layout.imbalance >= 1.0:
        raise ValueError(f"--expert-imbalance must be >= 1 (1: balanced), got {layout.imbalance}")
    check_recompute_experts(layout.ac, layout.recompute_experts, "--recompute-experts")
    if layout.float8 and not get_engine(layout.engine).fused_buckets:
        raise ValueError(
            f"--float8 with --engine {layout.engine} is not planned for a model with routed "
            "experts (its eager step is recorded in bf16); valid: --engine simplefsdp"
        )
    errors = spec.validate(config, layout, build=False)  # planned, not built
    if errors:
        raise ValueError(errors[0])
    if layout.fsdp % layout.ep or (layout.ep > 1 and layout.ep % layout.cp):
        valid = [
            e
            for e in _divisors(math.gcd(config.num_experts, layout.fsdp))
            if e == 1 or e % layout.cp == 0
        ]
        why = (
            f"does not divide the {layout.fsdp} FSDP ranks (dp x cp)"
            if layout.fsdp % layout.ep
            else f"is not a multiple of --cp {layout.cp} (an EP group spans whole CP groups)"
        )
        raise ValueError(f"--ep {layout.ep} {why}; valid --ep: {', '.join(map(str, valid))}")


def expert_params(args: Any) -> int:
    """Parameters of the routed experts (all MoE layers)."""
    return args.n_moe_layers * args.num_experts * 3 * args.dim * args.moe_hidden_dim


_FLOAT8_LINEARS: dict[tuple, dict[str, tuple[tuple[int, int], ...]]] = {}


def float8_linears(spec: Any, config: Any) -> dict[str, tuple[tuple[int, int], ...]]:
    """``(in_features, out_features)`` of the linears ``simplefsdp train
    --float8.enable`` converts in a block without routed experts
    (``"dense"``) and in one with them (``"moe"``): every ``nn.Linear`` of
    the block whose name holds none of ``output`` and the family's
    ``float8_skip_fqns`` (the router) and whose dims are multiples of 16,
    the family's model built on the meta device. The routed experts (not
    linears) stay bf16."""
    key = (spec.family, config)
    if key not in _FLOAT8_LINEARS:
        import torch
        import torch.nn as nn

        from simplefsdp.bucket_plan import repeated_blocks
        from simplefsdp.policies import float8_converts

        n_dense = min(getattr(config, "n_dense_layers", 0), 1)
        small = dataclasses.replace(
            config, n_layers=n_dense + 1, **({"n_dense_layers": n_dense} if n_dense else {})
        )
        with torch.device("meta"):
            model = spec.build(small)
        skip = ("output", *spec.float8_skip_fqns)
        found: dict[str, tuple[tuple[int, int], ...]] = {"dense": (), "moe": ()}
        for index, (fqn, block) in enumerate(repeated_blocks(model)):
            kind = "dense" if index < n_dense else "moe"
            found[kind] = tuple(
                (sub.in_features, sub.out_features)
                for name, sub in block.named_modules()
                if isinstance(sub, nn.Linear) and float8_converts(f"{fqn}.{name}", sub, skip)
            )
        _FLOAT8_LINEARS[key] = found
    return _FLOAT8_LINEARS[key]


def _latent_attention(args: Any) -> bool:
    """The configuration describes multi-head latent attention (it has a
    key/value compression rank), else grouped-query attention."""
    return hasattr(args, "kv_lora_rank")


def _attention_elements(args: Any) -> dict[str, float]:
    """Per token, the bf16 elements of attention's tensors backward reads:
    ``inputs`` (norm input and output), ``linear_out`` (the projections'
    outputs), ``sdpa`` (its query, key, value inputs and output), ``kv``
    (its keys and values: what context parallelism gathers)."""
    if not _latent_attention(args):
        q = args.n_heads * args.head_dim
        kv = args.n_kv_heads * args.head_dim
        linear_out = q + 2 * kv  # wq, wk, wv
        sdpa = 2 * q + 2 * kv  # q, k, v, out
        keys_values = 2 * kv
    else:
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        q = args.n_heads * qk
        kv_a = args.kv_lora_rank + args.qk_rope_head_dim
        kv_b = args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        low = args.q_lora_rank + (args.q_lora_rank if args.q_lora_rank else 0)
        linear_out = q + kv_a + kv_b + low + args.kv_lora_rank  # kv norm output too
        sdpa = 2 * q + args.n_heads * args.v_head_dim * 2  # q, k, v, out
        keys_values = q + args.n_heads * args.v_head_dim
    return {
        "inputs": 2 * args.dim,
        "linear_out": linear_out,
        "sdpa": sdpa,
        "kv": keys_values,
    }


def activation_elements(
    args: Any, ac: str, imbalance: float = 1.0, recompute_experts: bool = False, ep: int = 1
) -> dict[str, float]:
    """bf16 elements saved for backward per token, summed over the blocks
    (Note: [Analytic plan model]); ``layer_none`` is one block's at ``none``
    (what full AC recomputes at once); with ``recompute_experts`` selective
    AC keeps none of the experts' grouped matmul outputs; with ``ep > 1``
    it keeps both all-to-alls' outputs.

    Returns:
        ``{"saved": ..., "layer_none": ..., "none": ...}``.
    """
    attn = _attention_elements(args)
    attn_none = attn["inputs"] + attn["linear_out"] + attn["sdpa"]
    routed = args.top_k * imbalance
    shared = args.num_shared_experts * args.moe_hidden_dim
    moe_none = (
        2 * args.dim  # norm input and output
        + 2 * args.num_experts  # router scores, fp32
        + routed * args.dim  # dispatched tokens
        + routed * 3 * args.moe_hidden_dim  # w1, w3 outputs and their product
        + routed * args.dim  # experts' outputs (scaled by the scores)
        + 3 * shared
        + args.dim  # combined output
    )
    dense_none = 2 * args.dim + 3 * args.dense_hidden_dim
    none = args.n_layers * attn_none + args.n_moe_layers * moe_none
    none += args.n_dense_layers * dense_none
    if ac == "full":
        saved = args.n_layers * args.dim
    elif ac == "selective":
        v_head_dim = args.v_head_dim if _latent_attention(args) else args.head_dim
        attn_sel = args.dim + attn["linear_out"] / 2 + args.n_heads * v_head_dim
        moe_sel = 1.5 * shared + 2 * args.num_experts  # half the shared experts' matmuls
        if not recompute_experts:  # the grouped matmuls' outputs (w1, w3, w2)
            moe_sel += routed * (2 * args.moe_hidden_dim + args.dim)
        if ep > 1:  # the dispatched and the combined tokens (the all-to-alls' outputs)
            moe_sel += 2 * routed * args.dim
        dense_sel = 1.5 * args.dense_hidden_dim
        saved = args.n_layers * attn_sel + args.n_moe_layers * moe_sel
        saved += args.n_dense_layers * dense_sel
    else:
        saved = none
    layer_none = attn_none + (moe_none if args.n_moe_layers else dense_none)
    return {"saved": saved, "layer_none": layer_none, "none": none}


def _host_step(
    layout: ExpertLayout,
    hw: HardwareProfile,
    *,
    eager: bool,
    device_s: float,
    gather_s: dict[str, float],
    recording: EagerStep,
) -> HostStep:
    """The step's compute as host against device (Note: [Host-bound steps]):
    for an eager engine on a GPU (``recording.kernels``, the profile's
    kernel model, not ``None``), the family's own kernels at the layout's
    shapes, each priced by the kernel model and issued at the profile's
    host cost per op,
    simulated (``timeline_step``: its device time is the eager kernels'
    own); compiled on a GPU device bound, each sync costing its copy and
    one launch; on a CPU host and device are one.

    ``device_s``: the device's seconds of the step (the compiled
    kernels', all-to-alls included); ``gather_s``: each block kind's
    forward all-gather, which the eager timeline issues as the block's
    forward starts; ``recording``: the eager step the timeline records."""
    n_moe = recording.config.n_moe_layers
    sync_s = hw.kernel_overhead_s + hw.host_forward_op_s
    gpu = recording.kernels is not None
    syncs = token_syncs(n_moe, layout.ac, layout.ep) if gpu else 0
    if not (gpu and eager):
        return device_bound(device_s, syncs=syncs, sync_s=sync_s)
    return timeline_step(recording, hw, gather_s, get_engine(layout.engine).fsdp2_runtime)


def _host_note(host: HostStep, *, eager: bool) -> str:
    """One line: whether the step waits for the host (Note: [Host-bound steps])."""
    if not eager:
        return (
            "host: device bound assumed (compiled kernels, or host and device one CPU); "
            f"syncs {host.sync_s:.3f} s"
        )
    verdict = "host bound" if host.host_bound else "device bound"
    return (
        f"host: {verdict}: {host.host_s:.3f} s launching eager ops against "
        f"{host.device_s:.3f} s on the device; waits {host.wait_s:.3f} s for the host "
        f"(syncs {host.sync_s:.3f} s)"
    )


def predict_analytic(
    spec: Any, config: Any, layout: ExpertLayout, hw: HardwareProfile
) -> Prediction:
    """Predict ``layout`` of ``config`` (a flavor of ``spec``) on ``hw`` from
    its shapes (Note: [Analytic plan model]).

    Under a pipeline each rank that may be the most loaded is planned
    (``stage_compositions``): the memory is the highest peak's, the step the
    slowest rank's (the pipeline runs at its pace).

    Raises:
        ValueError: a bad layout (``validate_analytic``).
    """
    validate_analytic(spec, config, layout)
    if layout.float8:
        check_float8(hw)
    ranks = stage_compositions(spec, config, layout.pp, layout.stages_of_rank)
    plans = [_predict_rank(spec, config, layout, hw, rank) for rank in ranks]
    if len(plans) == 1:
        return plans[0]
    heaviest = max(range(len(plans)), key=lambda i: plans[i].peak_bytes)
    slowest = max(range(len(plans)), key=lambda i: plans[i].step_s)

    def rank_words(i: int) -> str:
        blocks, moe = ranks[i]
        return f"{blocks} block{'s' * (blocks != 1)}, {moe} with routed experts"

    note = (
        f"pipeline ranks planned: {len(ranks)} ({'; '.join(map(rank_words, range(len(ranks))))}); "
        f"memory of the one with {rank_words(heaviest)}, step of the one with "
        f"{rank_words(slowest)}"
    )
    plan = plans[slowest]
    return dataclasses.replace(
        plan,
        memory=plans[heaviest].memory,
        peak_bytes=plans[heaviest].peak_bytes,
        notes=[*plan.notes, note],
    )


def _predict_rank(
    spec: Any, config: Any, layout: ExpertLayout, hw: HardwareProfile, rank: tuple[int, int]
) -> Prediction:
    """:func:`predict_analytic` of one pipeline rank holding ``rank``'s
    ``(blocks, blocks with routed experts)``."""
    m = layout.microbatches
    # A pipeline rank's blocks (its stages'), with the embedding and the
    # output: conservative by the embedding, as traced plans (Note:
    # [Pipeline schedules in the plan] in plan/predict.py).
    blocks_of_stage, moe_of_stage = rank
    args = stage_config(spec, config, blocks_of_stage, moe_of_stage)
    dp, ep, cp = layout.fsdp, layout.ep, layout.cp
    tokens = (layout.batch // m) * layout.seq // cp  # this rank's, per microbatch
    total = spec.num_params(args)
    experts = expert_params(args)
    dense = total - experts
    active_blocks = spec.active_params(args, exclude_embeddings=True)
    flops_per_token = spec.flops_per_token(args, layout.seq)

    # ---- memory
    shard_params = dense / dp + experts / dp
    embed = args.vocab_size * args.dim
    per_expert = 3 * args.dim * args.moe_hidden_dim
    block_dense = (dense - 2 * embed - args.dim) / args.n_layers
    moe_block = block_dense + args.num_experts // ep * per_expert
    biggest = 2 * (moe_block if args.n_moe_layers else block_dense)  # bf16 bytes
    local_expert_params = args.num_experts // ep * per_expert
    engine = get_engine(layout.engine)
    # Float8 (Note: [Float8 of a model with experts]): the converted weights
    # of a block, which gather one byte per parameter
    f8 = float8_linears(spec, config) if layout.float8 else {"dense": (), "moe": ()}
    f8_params = {kind: sum(i * o for i, o in shapes) for kind, shapes in f8.items()}
    f8_biggest = f8_params["moe"] if args.n_moe_layers else f8_params["dense"]
    f8_blocks = args.n_moe_layers * f8_params["moe"] + args.n_dense_layers * f8_params["dense"]
    acts = activation_elements(args, layout.ac, layout.imbalance, layout.recompute_experts, ep)
    activations = 2 * acts["saved"] * tokens
    temporary = (4 if layout.fused_loss else 10) * args.vocab_size * tokens
    if layout.ac == "full":
        temporary += 2 * acts["layer_none"] * tokens
    # Context parallelism: the other CP ranks' keys and values, gathered per
    # attention (bf16), saved per block unless full AC recomputes them.
    kv_bytes = 2 * _attention_elements(args)["kv"] * tokens  # this rank's, per block
    gathered_kv = (cp - 1) * kv_bytes
    if layout.ac == "full":
        temporary += gathered_kv
    else:
        activations += args.n_layers * gathered_kv
    # simplefsdp's allgather backend: a (T/cp x T) boolean mask per attention
    # and SDPA's bf16 bias of it (Note: [Context parallelism in the plan] in
    # plan/predict.py).
    queries = cp_mask_queries(layout.seq, cp, layout.cp_backend)
    masked = queries > 0
    # The masks (CP's, sliding windows', sinks'): SDPA over a boolean mask
    # per such layer, each over its keys (a short window in chunks of its
    # reach, sinks as one more key and head-dim columns; Note: [Sinks as one
    # more key]); under a masked CP backend every layer is masked.
    layer_keys, sink_columns = attention_keys(args, layout.seq, cp, layout.cp_backend)
    own = [keys for keys in layer_keys if keys is not None]
    mask_layers = len(own)
    rows = queries if masked else layout.seq  # the mask's query rows per call
    mask_bytes = float(rows * max(own, default=0))  # the largest, while it runs
    all_mask_bytes = float(rows * sum(own))  # every layer's
    temporary += 3 * mask_bytes
    if layout.ac == "none":
        activations += 2 * all_mask_bytes
        # SDPA's padded inputs and output, the keys and values repeated to
        # the query heads, beside the unpadded ones counted above
        activations += 2 * mask_layers * tokens * 4 * args.n_heads * sink_columns
    # Microbatches (a pipeline's, or accumulation's): the activations of
    # those in flight where the first rank peaks, beside the unreduced fp32
    # gradient sums of the rank's parameters, whole (Note: [Gradient
    # accumulation in the plan] in plan/predict.py).
    local_params = dense + experts / ep
    sums = 4 * local_params if m > 1 else 0.0
    inflight, sums_alive = pipeline_peak(layout, activations, sums)
    activations *= inflight
    blocks = dense - 2 * embed - args.dim + args.n_moe_layers * local_expert_params
    if dp == 1:
        gathered = 0.0
    elif layout.reshard_after_forward:
        gathered = 3 * (biggest - f8_biggest)
    elif engine.fsdp2_runtime:  # every block kept from its forward to its backward
        gathered = 2 * blocks - f8_blocks + biggest  # one's gradients beside
    else:  # the compiled engine gathers each microbatch's own
        gathered = (2 * blocks - f8_blocks) * inflight + biggest
    split_root = layout.fsdp2_root == "split"
    if dp > 1 and engine.fsdp2_runtime:
        # FSDP2 does not reshard its root group after forward: the final norm
        # and output, or with the embedding in one group, all three
        gathered += 2 * ((1 if split_root else 2) * embed + args.dim)
        if layout.pp > 1:
            # torch's pipeline stages keep its groups gathered after every
            # backward but the step's last: the rank's parameters whole
            gathered = max(gathered, 2 * local_params)
    memory = {
        "parameters": 4 * shard_params,
        "gradients": 4 * shard_params,
        "optimizer": 8 * shard_params,
        "activations": activations,
        "accumulated": sums_alive * sums,
        "gathered": gathered,
        "temporary": temporary,
    }
    usable = hw.memory_bytes * hw.usable_memory_fraction
    fused = engine.fused_buckets
    rate = hw.peak_bf16_flops * hw.matmul_efficiency
    bw = hw.memory_bandwidth * hw.memory_efficiency
    kernels = kernel_model(hw, bw)
    # eager FSDP2's groups as its collective buffers see them (Note: [FSDP2's
    # collective buffers] in plan/host.py): a block, its experts apart, the root
    buffers = None
    if engine.fsdp2_runtime and not fused and dp > 1:

        def group(params: float, over: int) -> tuple[int, int]:
            return (int(2 * params), int(4 * params / over))

        buffers = Fsdp2Buffers(
            dense=(group(block_dense + 3 * args.dim * args.dense_hidden_dim, dp),),
            moe=(group(block_dense, dp), group(local_expert_params, max(dp // ep, 1))),
            root=(group((1 if split_root else 2) * embed + args.dim, dp),),
            reshard_after_forward=layout.reshard_after_forward,
            embedding=(group(embed, dp),) if split_root else (),
        )
    recording = EagerStep(spec, args, layout.ac, ep, layout.batch // m, layout.seq // cp, kernels,
                          layout.imbalance, cp, buffers, layout.recompute_experts,
                          layout.fused_loss, split_root and engine.fsdp2_runtime)  # fmt: skip
    cache_note = []
    if hw.caching_allocator and not fused:
        # What the caching allocator holds free at its reserved peak, over two
        # eager steps of the family's own ops (Note: [Analytic plan model]).
        events = eager_step_events(recording)
        cached, retries = cached_bytes(
            events, sum(memory.values()), usable, expandable=layout.expandable_segments
        )
        memory["cached"] = cached
        cache_note = [
            f"peak is the caching allocator's reserved memory: {cached / 2**30:.1f} GiB cached"
            + (f"; {retries} allocation retries (cache released at capacity)" if retries else "")
        ]
    peak = sum(memory.values())

    # ---- compute
    attn_flops = flops_per_token - 6.0 * active_blocks
    routed = 6.0 * args.n_moe_layers * args.top_k * per_expert  # per token, fwd + bwd
    linear = 6.0 * active_blocks - routed
    routed *= layout.imbalance  # the most loaded rank's routed tokens
    # AC's recomputation: full recomputes the blocks' forward; selective half
    # their non-expert matmuls (every second one), not the experts' grouped
    # matmuls (saved, unless recompute_experts), but the token permutation
    # (index ops, not saved) (Note: [Selective activation checkpointing])
    dense_share = {"full": 1.0, "selective": 0.5, "none": 0.0}[layout.ac]
    selective_experts = layout.ac == "selective" and layout.recompute_experts
    routed_share = 1.0 if layout.ac == "full" or selective_experts else 0.0
    permute_share = 0.0 if layout.ac == "none" else 1.0
    dense_recompute = dense_share * (linear - 6.0 * embed) / 3  # the blocks' non-expert matmuls
    recompute = dense_recompute + routed_share * routed / 3
    # Float8: the converted linears' matmuls (forward, both backward ones and
    # AC's share of the forward again) at the float8 rate, and the casts of
    # their activation operands (Note: [Float8 of a model with experts])
    f8_flops = 6.0 * f8_blocks  # per token
    f8_recompute = dense_share * f8_flops / 3
    f8_io = sum(
        count * sum(2 * (i + o) + dense_share * i for i, o in f8[kind])
        for kind, count in (("moe", args.n_moe_layers), ("dense", args.n_dense_layers))
    )
    f8_linears = args.n_moe_layers * len(f8["moe"]) + args.n_dense_layers * len(f8["dense"])
    float8_s = 0.0
    if layout.float8:
        rate8 = hw.peak_fp8_flops * (hw.fp8_matmul_efficiency or hw.matmul_efficiency)
        float8_s = tokens * (f8_flops + f8_recompute) / rate8
        float8_s += 3.0 * f8_io * tokens / bw  # amax fused into the producer, then the cast
        float8_s += f8_linears * (4 + dense_share) * hw.kernel_overhead_s
    bf16_linear = linear - f8_flops
    bf16_recompute = dense_recompute - f8_recompute
    # Routed experts as grouped GEMMs at the per-expert token count (Note:
    # [Analytic plan model]: MoE terms); forward (3), backward (6) per layer.
    local_experts = args.num_experts // ep
    per_expert_tokens = max(int(tokens * args.top_k * layout.imbalance * ep / args.num_experts), 1)
    if kernels is not None and args.n_moe_layers:
        d, h, rows = args.dim, args.moe_hidden_dim, per_expert_tokens
        fwd = 2 * kernels.gemm_seconds(rows, h, d, "bfloat16", local_experts)
        fwd += kernels.gemm_seconds(rows, d, h, "bfloat16", local_experts)
        # input and weight gradients: the same FLOPs, transposed shapes
        bwd = (
            2 * kernels.gemm_seconds(rows, d, h, "bfloat16", local_experts)
            + kernels.gemm_seconds(rows, h, d, "bfloat16", local_experts)
            + 2 * kernels.gemm_seconds(h, d, rows, "bfloat16", local_experts)
            + kernels.gemm_seconds(d, h, rows, "bfloat16", local_experts)
        )
        matmul_s = tokens * (bf16_linear + bf16_recompute) / rate
        matmul_s += args.n_moe_layers * ((1 + routed_share) * fwd + bwd)
    else:
        matmul_s = tokens * (bf16_linear + routed + recompute - f8_recompute) / rate
    matmul_s += float8_s

    def kernel_s(masked: bool) -> float:
        """Attention's seconds over every layer, all of them causal or all masked."""
        seconds = tokens * attn_flops / (rate * hw.attention_efficiency)
        if kernels is not None:
            # FlashAttention rates, causal halving (Note: [Kernel model]).
            forward = tokens * attn_flops / 3 / 2  # the spec counts 1 + 2 forwards; causal half
            tensor_peak = hw.peak_bf16_flops * hw.clock_fraction
            efficient = masked
            if _latent_attention(args):
                qk = args.qk_nope_head_dim + args.qk_rope_head_dim
                efficient = efficient or qk != args.v_head_dim
            if efficient:  # the memory-efficient kernel (Note: [Kernel model])
                tensor_peak *= MEMORY_EFFICIENT_FRACTION
            seconds = forward / (tensor_peak * hw.flash_fwd_efficiency)
            seconds += 2.5 * forward / (tensor_peak * hw.flash_bwd_efficiency)
        if masked:  # a masked kernel skips no causal block
            seconds *= 2
        return seconds

    # the layers over a mask (all of them under a masked CP backend), each
    # over its keys, their head dims widened for sinks
    share = mask_layers / args.n_layers
    pairs = sum(own) / layout.seq / args.n_layers  # of every layer's full square
    widened = (args.head_dim + sink_columns) / args.head_dim if not _latent_attention(args) else 1
    attention_s = (1 - share) * kernel_s(False) + pairs * widened * kernel_s(True)
    if layout.ac == "full":
        attention_s *= 4 / 3  # its forward again
    # the masks and their biases written and read, per attention call
    passes = (3 if layout.ac == "full" else 2) * 4
    attention_s += passes * all_mask_bytes / bw
    # Elementwise work: three passes over the no-AC activations where the
    # compiler fuses them, one read and one write per op's output unfused
    # (eager FSDP2, aot_eager): about twice the bytes.
    elementwise_s = (3 if fused else 6) * 2 * acts["none"] * tokens / bw
    # Router (scores over the experts, top-k) and the token permutation and
    # un-permutation: each routed token's row read and written, forward and
    # backward (Note: [Analytic plan model]: MoE terms).
    moe_tokens = tokens * args.top_k * layout.imbalance
    router_s = args.n_moe_layers * tokens * (2 * args.dim * args.num_experts) * 3 / rate
    permute_fw = args.n_moe_layers * 2 * (2 * 2 * moe_tokens * args.dim) / bw
    permute_s = 2 * permute_fw * (1 + permute_share)
    # torch's ring (the ``torch`` CP backend): its merges and copies outside
    # the attention kernels, per forward (and recomputed forward) and
    # backward (Note: [Context parallelism in the plan] in plan/predict.py);
    # attention reads the keys and values repeated to the query heads
    ring_s = 0.0
    if cp > 1 and layout.cp_backend == "torch":
        if _latent_attention(args):
            k_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
            v_dim = args.v_head_dim
        else:
            k_dim = v_dim = args.head_dim
        out = tokens * args.n_heads * v_dim
        keys_values = tokens * args.n_heads * (k_dim + v_dim)
        forward, backward = ring_attention_bytes(out, keys_values, 2, cp, fused, False)
        forwards = 2 if layout.ac == "full" else 1
        ring_s = args.n_layers * (forwards * forward + backward) / bw
    device_s = matmul_s + attention_s + elementwise_s + router_s + permute_s + ring_s

    # ---- all-to-all
    intra = ep <= hw.gpus_per_node
    link = hw.intra_bandwidth if intra else hw.inter_bandwidth
    latency = hw.intra_latency_s if intra else hw.inter_latency_s
    a2a_bytes = 2 * tokens * args.top_k * args.dim * layout.imbalance
    per_a2a = latency + (ep - 1) / ep * a2a_bytes / link if ep > 1 else 0.0
    a2a_count = args.n_moe_layers * (6 if layout.ac == "full" else 4)
    a2a_s = a2a_count * per_a2a

    # ---- FSDP collectives, per block, overlapped with the block's compute
    span = dp  # the dp / ep ranks holding the same experts are ep apart
    gathers = 2 if layout.reshard_after_forward else 1

    def block_comm(
        dense_p: float, expert_p: float, f8_p: float = 0.0, gathers: int = gathers
    ) -> float:
        # ``f8_p`` of the dense parameters gather in float8, one byte each
        seconds = 0.0
        for count, group, f8_count in ((dense_p, dp, f8_p), (expert_p, dp // ep, 0.0)):
            if count <= 0 or group <= 1:
                continue
            seconds += gathers * hw.comm_seconds("all_gather", group, 2 * count - f8_count, span)
            seconds += hw.comm_seconds("reduce_scatter", group, 4 * count, span)
        return seconds

    def block_gather(dense_p: float, expert_p: float, f8_p: float = 0.0) -> float:
        return block_comm(dense_p, expert_p, f8_p, 1) - block_comm(dense_p, expert_p, f8_p, 0)

    moe_params = (block_dense, args.num_experts // ep * per_expert, f8_params["moe"])
    dense_params = (block_dense + 3 * args.dim * args.dense_hidden_dim, 0, f8_params["dense"])

    # ---- host: an eager step's kernels as the host issues them against the
    # device, each block's forward gather issued as its forward starts (Note:
    # [Host-bound steps])
    host = _host_step(
        layout, hw,
        eager=not fused,
        device_s=device_s + a2a_s,
        gather_s={"moe": block_gather(*moe_params), "dense": block_gather(*dense_params)},
        recording=recording,
    )  # fmt: skip
    eager_timeline = kernels is not None and not fused
    # the eager timeline holds the step's kernels and forward gathers, not
    # its all-to-alls
    compute_s = host.step_s + ring_s if eager_timeline else device_s + host.wait_s

    blocks = args.n_layers
    block_compute = (compute_s - tokens * 6.0 * embed / rate) / blocks
    moe_comm = block_comm(*moe_params)
    dense_comm = block_comm(*dense_params)
    dp_comm_s = args.n_moe_layers * moe_comm + args.n_dense_layers * dense_comm
    dp_comm_s += block_comm(2 * embed + args.dim, 0)
    if eager_timeline:
        # the forward's gathers are in the timeline; backward's gathers and
        # reduce-scatters against the block's backward (two thirds of it)
        moe_comm -= block_gather(*moe_params)
        dense_comm -= block_gather(*dense_params)
        block_compute *= 2 / 3
    exposed = args.n_moe_layers * max(moe_comm - block_compute, 0.0)
    exposed += args.n_dense_layers * max(dense_comm - block_compute, 0.0)
    exposed += block_comm(embed, 0) / gathers  # the first gather, before any compute
    # Context parallelism: one all-gather of every attention's keys and
    # values per forward (and recomputation under full AC), one
    # reduce-scatter of their gradients in backward; exposed.
    cp_passes = 3 if layout.ac == "full" else 2
    cp_s = args.n_layers * cp_passes * hw.comm_seconds("all_gather", cp, cp * kv_bytes, cp)
    exposed_s = exposed + a2a_s + cp_s

    # gradient clipping's passes and all-reduce, then AdamW (Note: [Plan model])
    optimizer_s = shard_params * (ADAMW_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM) / bw
    optimizer_s += hw.comm_seconds("all_reduce", layout.gpus, 4, layout.gpus)
    if f8_linears and dp > 1:
        # the converted weights' amaxes, one all-reduce per step
        optimizer_s += hw.comm_seconds("all_reduce", dp, 4 * f8_linears, dp)
    # The copies around FSDP's collectives on the compute stream, as the
    # traced plans count them (``copy_written_bytes``): per all-gather the
    # shards in and the gathered block out, per reduce-scatter the
    # gradients in, each byte written moving ``copy_bytes_per_byte``.
    written = 0.0
    for count, (dense_p, expert_p, f8_p) in (
        (args.n_moe_layers, moe_params),
        (args.n_dense_layers, dense_params),
        (1, (2 * embed + args.dim, 0, 0.0)),
    ):
        for params, group, f8_count in ((dense_p, dp, f8_p), (expert_p, dp // ep, 0.0)):
            if params > 0 and group > 1:
                size = 2 * params - f8_count  # gathered bytes (bf16, float8 one)
                reduced = 2 * params  # the bf16 gradients in
                written += count * (gathers * (size + size / group) + reduced)
    copies_s = hw.copy_bytes_per_byte * written / bw
    # A microbatch's slot; under a pipeline ``m + (p - 1) / v`` slots per
    # step (Note: [Pipeline schedules in the plan] in plan/predict.py).
    slot_s = compute_s + copies_s + exposed_s
    slots = pipeline_slots(layout)
    if engine.fsdp2_runtime and layout.pp > 1 and not layout.reshard_after_forward and dp > 1:
        # FSDP2 under a pipeline, not resharding: it gathers at the step's first
        # forward and reduces at its last backward; the other slots run without
        # data-parallel collectives and their copies.
        free_s = compute_s + a2a_s + cp_s
        step_s = (slots - 1) * free_s + slot_s
        bubble_s = (slots - m) * free_s
        copies_total, dp_total = copies_s, dp_comm_s
        exposed_total = (m - 1) * (a2a_s + cp_s) + exposed_s
    else:
        step_s = slots * slot_s
        bubble_s = (slots - m) * slot_s
        copies_total, dp_total = m * copies_s, m * dp_comm_s
        exposed_total = m * exposed_s
    step_s += optimizer_s
    tps = layout.batch * layout.seq * layout.dp / step_s / layout.gpus
    mfu = tps * spec.flops_per_token(config, layout.seq) / hw.peak_bf16_flops
    model_experts = expert_params(config)
    notes = [
        *cache_note,
        f"parameters: {spec.num_params(config) / 1e9:.2f}B total, "
        f"{spec.active_params(config) / 1e9:.2f}B activated per token "
        f"({model_experts / 1e9:.2f}B in routed experts, {args.num_experts // ep} of "
        f"{args.num_experts} per EP rank)",
        f"MoE: grouped GEMMs of {per_expert_tokens} tokens per local expert; router "
        f"{m * router_s:.3f} s, permutation {m * permute_s:.3f} s, host syncs "
        f"{m * host.sync_s:.3f} s",
        _host_note(host, eager=kernels is not None and not fused),
        (
            f"all-to-all: {m * a2a_count} per step of {a2a_bytes / 2**20:.1f} MiB per rank "
            f"({'NVLink' if intra else 'NIC'}), exposed"
            if ep > 1
            else "all-to-all: none (--ep 1)"
        )
        + f"; expert load imbalance {layout.imbalance:g} (1: balanced)",
        *(
            [
                f"context parallel {cp}: {layout.seq // cp} tokens per rank, keys and "
                f"values all-gathered per attention ({m * cp_s:.3f} s, exposed)"
            ]
            if cp > 1
            else []
        ),
        *([cp_mask_note(layout.seq, queries, layout.cp_backend)] if masked else []),
        *(
            [
                f"attention: {mask_layers} of {args.n_layers} layers run SDPA over a boolean "
                f"mask (sliding windows{', sinks as one more key' if sink_columns else ''}), "
                f"the memory-efficient kernel over {min(own)}-{max(own)} keys per query"
            ]
            if mask_layers and (not masked or min(own) < max(own))
            else []
        ),
        *(
            [pipeline_note(layout, inflight, sums_alive if sums else None, blocks_of_stage)]
            if layout.pp > 1
            else []
        ),
        "planned from the model's shapes (docs/scale.md, expert parallelism): per-block "
        "FSDP groups for both engines; TP not modelled, Float8 converts no routed expert",
    ]
    return Prediction(
        layout=layout,
        hardware=hw.name,
        memory=memory,
        peak_bytes=peak,
        usable_bytes=usable,
        time={
            # the copies included, as traced plans report
            "compute": m * compute_s + copies_total,
            "copies": copies_total,
            "hooks": 0.0,
            "exposed_comm": exposed_total,
            "bubble": bubble_s,
            "optimizer": optimizer_s,
            "dp_comm_total": dp_total,
            "tp_comm_total": 0.0,
            "ep_comm_total": m * a2a_s,
            "cp_comm_total": m * cp_s,
            "flops": m * tokens * (linear + routed + recompute + attn_flops),
            "host": m * host.host_s,
            "host_wait": m * host.wait_s,
        },
        step_s=step_s,
        tokens_per_s_per_gpu=tps,
        mfu=mfu,
        buckets=None,
        notes=notes,
        params={
            "total": spec.num_params(config),
            "activated": spec.active_params(config),
            "routed_experts": model_experts,
        },
    )
