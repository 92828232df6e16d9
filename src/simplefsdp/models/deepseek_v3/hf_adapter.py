"""The DeepSeek-V3 family's Hugging Face adapter: ``DeepseekV3ForCausalLM``
names, tensors and ``config.json`` to and from ours.

Note: [DeepSeek-V3 Hugging Face names and layouts]
    Per layer ``model.layers.{i}.``: ``self_attn.q_proj`` (no query
    compression) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` are our
    ``attention.wq`` or ``wq_a``, ``q_norm``, ``wq_b``;
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``
    are ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``; dense layers' ``mlp.gate_proj``/
    ``down_proj``/``up_proj`` are ``feed_forward.w1``/``w2``/``w3``;
    ``mlp.gate.weight`` is ``moe.router.gate.weight``,
    ``mlp.gate.e_score_correction_bias`` our routing bias ``moe.expert_bias``,
    ``mlp.shared_experts.*`` ``moe.shared_experts.w1``/``w2``/``w3``, and
    expert ``j``'s ``mlp.experts.{j}.gate_proj``/``down_proj``/``up_proj``
    row ``j`` of our stacked ``moe.experts.w1``/``w2``/``w3``
    (``(num_experts, ...)``): a rank reads only the experts its shard covers.

    Rotary layout: our rotary rotates adjacent channel pairs ``(2i, 2i + 1)``
    of the ``qk_rope_head_dim`` channels. DeepSeek's checkpoints store them
    that way too (``rope_interleave: true``, transformers' default for this
    model type), which needs no conversion. A checkpoint with
    ``rope_interleave: false`` pairs channel ``i`` with ``i + d/2``; its rows
    of the rotary part (the last ``qk_rope_head_dim`` rows of each head in
    ``q_proj``/``q_b_proj``, the last ``qk_rope_head_dim`` rows of
    ``kv_a_proj_with_mqa``) are permuted into ours on reading. Exports write
    ``rope_interleave: true``.

    Published checkpoints store block-scaled float8 weights
    (``weight_scale_inv``); :meth:`HFCheckpoint.read_hf` returns them
    dequantized. Exports are in the state's dtype, without
    ``quantization_config``, and untied (a tied checkpoint fills our
    ``output`` from the embedding). The multi-token-prediction layer of the
    published checkpoints is not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from simplefsdp.models.common import hf_adapter as hf_common
from simplefsdp.models.common.config import YarnScaling, rope_scaling_from_mapping

from .args import DeepSeekV3Args

_NAMES = hf_common.NameMap(
    "DeepSeek-V3",
    {
        **hf_common.FEED_FORWARD_NAMES,
        **hf_common.NORM_NAMES,
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    },
)
_EXPERTS = hf_common.StackedExperts()


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face name (a stacked expert tensor
    -> the name of expert 0's part).

    Raises:
        ValueError: ``name`` is not a DeepSeek-V3 tensor name.
    """
    located = _EXPERTS.locate(name)
    if located is not None:
        return _EXPERTS.hf_name(*located, 0)
    return _NAMES.to_hf_name(name)


def from_hf_name(name: str) -> str:
    """A Hugging Face name -> our state-dict name (an expert's tensor -> our
    stacked tensor holding it).

    Raises:
        ValueError: ``name`` is not a DeepSeek-V3 tensor name.
    """
    return _EXPERTS.from_hf(name) or _NAMES.from_hf_name(name)


def config_from_hf(config: Mapping[str, Any], source: str = "config.json") -> DeepSeekV3Args:
    """Our :class:`DeepSeekV3Args` from a ``DeepseekV3ForCausalLM`` ``config.json``.

    Raises:
        ValueError: another ``model_type``, a missing key, or a feature our
            model lacks (biases, another activation or scoring function,
            rotary scaling other than YaRN); one line naming the key and its
            value.
    """

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key, default)
        return default if value is None else value

    model_type = get("model_type")
    if model_type != "deepseek_v3":
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported (only 'deepseek_v3')"
        )
    if get("attention_bias", False):
        raise ValueError(
            f"{source}: attention_bias=true is not supported (the model has no biases)"
        )
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    scoring = get("scoring_func", "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"{source}: scoring_func {scoring!r} is not supported (sigmoid, softmax)")
    # noaux_tc: group-limited by the top-2 sums (transformers' only routing);
    # greedy: no group limit.
    topk_method = get("topk_method", "noaux_tc")
    if topk_method not in ("noaux_tc", "greedy"):
        raise ValueError(
            f"{source}: topk_method {topk_method!r} is not supported (noaux_tc, greedy)"
        )
    groups = (1, 1) if topk_method == "greedy" else (get("n_group", 1), get("topk_group", 1))
    rope = dict(get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type"))
    scaling = None
    if rope_type == "yarn":
        rope.setdefault("original_max_position_embeddings", get("max_position_embeddings", 4096))
        try:
            scaling = rope_scaling_from_mapping(rope)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    elif rope_type not in (None, "default"):
        raise ValueError(
            f"{source}: rope_scaling type {rope_type!r} is not supported (only 'yarn' or none)"
        )
    hf_common.require_keys(config, source)
    try:
        return DeepSeekV3Args(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=int(get("max_position_embeddings", 4096)),
            n_dense_layers=int(get("first_k_dense_replace", 3)),
            dense_hidden_dim=int(get("intermediate_size", 18432)),
            num_experts=int(get("n_routed_experts", 256)),
            top_k=int(get("num_experts_per_tok", 8)),
            moe_hidden_dim=int(get("moe_intermediate_size", 2048)),
            num_shared_experts=int(get("n_shared_experts", 1)),
            score_func=scoring,
            route_norm=bool(get("norm_topk_prob", True)),
            route_scale=float(get("routed_scaling_factor", 1.0)),
            load_balance="bias",
            q_lora_rank=int(get("q_lora_rank", 0)),
            kv_lora_rank=int(get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
            v_head_dim=int(get("v_head_dim", 128)),
            num_expert_groups=int(groups[0]),
            num_limited_groups=int(groups[1]),
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_to_hf(args: DeepSeekV3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a ``DeepseekV3ForCausalLM`` equal to our model.

    Raises:
        ValueError: a configuration transformers' model cannot express
            (softmax scores, rotary scaling other than YaRN).
    """
    if args.score_func != "sigmoid":
        raise ValueError(
            f"score_func={args.score_func!r} has no DeepseekV3ForCausalLM equivalent "
            "(it routes with sigmoid scores); export with --format simplefsdp"
        )
    scaling = args.rope_scaling
    if scaling is not None and not isinstance(scaling, YarnScaling):
        raise ValueError(
            f"rope_scaling={scaling!r} has no DeepseekV3ForCausalLM equivalent (only YaRN); "
            "export with --format simplefsdp"
        )
    rope_scaling = None
    if scaling is not None:
        rope_scaling = {"type": "yarn", "rope_type": "yarn", **dataclasses.asdict(scaling)}
        if scaling.attention_factor is None:
            del rope_scaling["attention_factor"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "max_position_embeddings": args.max_seq_len,
        "first_k_dense_replace": args.n_dense_layers,
        "intermediate_size": args.dense_hidden_dim,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_shared_experts": args.num_shared_experts,
        "norm_topk_prob": args.route_norm,
        "routed_scaling_factor": args.route_scale,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": args.num_expert_groups,
        "topk_group": args.num_limited_groups,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


_ARCH_FIELDS = (
    "dim", "n_layers", "n_heads", "vocab_size", "norm_eps", "rope_theta", "rope_scaling",
    "n_dense_layers", "dense_hidden_dim", "num_experts", "top_k", "moe_hidden_dim",
    "num_shared_experts", "score_func", "route_norm", "route_scale", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_expert_groups", "num_limited_groups",
)  # fmt: skip


def config_differences(ours: DeepSeekV3Args, theirs: DeepSeekV3Args) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two
    configurations differ (``max_seq_len`` and the load-balancing settings
    are left out: they do not change the weights)."""
    return [
        f"{f}={getattr(ours, f)!r} vs {getattr(theirs, f)!r}"
        for f in _ARCH_FIELDS
        if getattr(ours, f) != getattr(theirs, f)
    ]


class DeepSeekV3HFAdapter(hf_common.HFAdapter):
    """Converts DeepSeek-V3 models to and from Hugging Face
    ``DeepseekV3ForCausalLM`` (see [DeepSeek-V3 Hugging Face names and
    layouts] and :class:`~simplefsdp.models.common.hf_adapter.HFAdapter`);
    the ``ModelSpec.hf_adapter`` of the family.
    """

    model_types: tuple[str, ...] = ("deepseek_v3",)
    to_hf_name = staticmethod(to_hf_name)
    from_hf_name = staticmethod(from_hf_name)
    config_from_hf = staticmethod(config_from_hf)
    config_to_hf = staticmethod(config_to_hf)
    config_differences = staticmethod(config_differences)

    def to_hf(
        self, name: str, tensor: torch.Tensor, args: DeepSeekV3Args
    ) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)``, or one
        pair per expert for a stacked routed-expert tensor."""
        experts = _EXPERTS.to_hf(name, tensor)
        return super().to_hf(name, tensor, args) if experts is None else experts

    def read_region(
        self,
        name: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        args: DeepSeekV3Args,
        checkpoint: Any,
    ) -> torch.Tensor:
        """Region ``offsets``/``sizes`` of our tensor ``name`` from ``checkpoint``
        (an :class:`~simplefsdp.checkpoint.hf.HFCheckpoint`): the stacked
        experts from the per-expert tensors the region covers, the rotary
        rows converted where the checkpoint pairs channels ``i`` and
        ``i + d/2``, the output from the embedding where tied."""
        offsets, sizes = list(offsets), list(sizes)
        experts = _EXPERTS.read(name, offsets, sizes, checkpoint)
        if experts is not None:
            return experts
        hf_name = to_hf_name(name)
        if checkpoint.tied and name in self.tied:
            hf_name = self.tied[name]
        interleaved = checkpoint.config.get("rope_interleave", True)
        rope = args.qk_rope_head_dim
        if interleaved is False and name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
            head = args.qk_head_dim
            first, last = offsets[0] // head, -(-(offsets[0] + sizes[0]) // head)
            block = checkpoint.read_hf(
                hf_name, [first * head, offsets[1]], [(last - first) * head, sizes[1]]
            )
            block = block.reshape(last - first, head, -1).clone()
            for h in range(last - first):
                block[h, head - rope :] = hf_common.halves_to_pairs(block[h, head - rope :], rope)
            start = offsets[0] - first * head
            return block.reshape(-1, sizes[1])[start : start + sizes[0]]
        if interleaved is False and name.endswith("attention.wkv_a.weight"):
            rows = args.kv_lora_rank + rope
            block = checkpoint.read_hf(hf_name, [0, offsets[1]], [rows, sizes[1]]).clone()
            block[args.kv_lora_rank :] = hf_common.halves_to_pairs(block[args.kv_lora_rank :], rope)
            return block[offsets[0] : offsets[0] + sizes[0]]
        return checkpoint.read_hf(hf_name, offsets, sizes)


#: The adapter object of the DeepSeek-V3 family's spec.
DEEPSEEK_V3_HF_ADAPTER = DeepSeekV3HFAdapter()
