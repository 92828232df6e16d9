"""The Qwen3 families' Hugging Face adapters: ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` names, tensors and ``config.json`` to and from ours.

:mod:`simplefsdp.checkpoint.hf` does the generic sliced safetensors I/O and
asks the family's adapter (``ModelSpec.hf_adapter``) for each tensor.

Note: [Qwen3 Hugging Face layout]
    Names map one to one as for Llama (``self_attn.q_proj`` is
    ``attention.wq``, ``mlp.gate_proj``/``down_proj``/``up_proj`` are
    ``feed_forward.w1``/``w2``/``w3``, ...), plus ``self_attn.q_norm`` and
    ``self_attn.k_norm`` (``attention.q_norm``/``k_norm``), the router
    ``mlp.gate`` (``moe.router.gate``) and one tensor per expert,
    ``mlp.experts.{j}.gate_proj``/``up_proj``/``down_proj``, which are
    expert ``j`` of our stacked ``moe.experts.w1``/``w3``/``w2``. A rank
    reads only the experts (and the rows and columns) its shard covers. The
    routing bias of ``load_balance="bias"`` has no Hugging Face counterpart:
    it starts at zero on load and is left out of exports.

    Our rotary embedding rotates adjacent channel pairs ``(2i, 2i + 1)`` of a
    head; Hugging Face's rotates channel ``i`` with ``i + head_dim / 2``. So
    within each head our channel ``2i + j`` is Hugging Face's channel
    ``j * head_dim / 2 + i``: the rows of ``wq`` and ``wk`` are permuted that
    way, and so is the QK-norm weight (it scales the channels before the
    rotary embedding). An RMSNorm over a head does not depend on the channel
    order, so the model computes the same function.

    A checkpoint with tied embeddings (``tie_word_embeddings``, the 0.6B,
    1.7B and 4B models) fills our ``output`` from the embedding; exports are
    untied (our model has its own ``output``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from simplefsdp.models.common import hf_adapter as hf_common

from .args import Qwen3Args, Qwen3MoEArgs

_NAMES = hf_common.NameMap(
    "Qwen3",
    {
        **hf_common.ATTENTION_NAMES,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        **hf_common.FEED_FORWARD_NAMES,
        **hf_common.NORM_NAMES,
        "moe.router.gate.weight": "mlp.gate.weight",
    },
)
_EXPERTS = hf_common.StackedExperts()
# The routing bias of load_balance="bias" (a persistent buffer of ours).
_ROUTING_BIAS = ".moe.expert_bias"
# Rows (or channels) permuted within each head (see the note).
_ROTARY = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
)


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face name (for the stacked experts,
    the per-expert name with ``*`` for the expert index).

    Raises:
        ValueError: ``name`` is not a Qwen3 parameter name.
    """
    located = _EXPERTS.locate(name)
    if located is not None:
        return _EXPERTS.hf_name(*located, "*")
    return _NAMES.to_hf_name(name)


def from_hf_name(name: str) -> str:
    """A Hugging Face Qwen3 / Qwen3-MoE name -> our state-dict name (an
    expert's tensor -> the stacked tensor holding it).

    Raises:
        ValueError: ``name`` is not a Qwen3 tensor name.
    """
    return _EXPERTS.from_hf(name) or _NAMES.from_hf_name(name)


_UNSUPPORTED_TRUE = {
    "attention_bias": "the model has no attention biases",
    "use_sliding_window": "sliding-window attention is not built",
}


def config_from_hf(
    config: Mapping[str, Any], source: str = "config.json", *, moe: bool
) -> Qwen3Args:
    """Our configuration from the ``config.json`` of a Hugging Face Qwen3
    (``moe=False``) or Qwen3-MoE (``moe=True``) model.

    Raises:
        ValueError: another model type, a missing key, or a feature our model
            lacks (attention biases, sliding windows, rope scaling, another
            activation, no experts); one line naming the key and its value.
    """
    want = "qwen3_moe" if moe else "qwen3"
    model_type = config.get("model_type", want)
    if model_type != want:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (only {want!r})")
    for key, why in _UNSUPPORTED_TRUE.items():
        if config.get(key):
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported ({why})")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    rope = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type")
    if rope_type not in (None, "default"):
        raise ValueError(
            f"{source}: rope scaling {rope_type!r} is not supported (only none/'default')"
        )
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    keys += ["intermediate_size"] + (
        ["num_experts", "num_experts_per_tok", "moe_intermediate_size"] if moe else []
    )
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    fields: dict[str, Any] = {
        "dim": dim,
        "n_layers": int(config["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
        "head_dim": int(config.get("head_dim") or dim // n_heads),
        "hidden_dim": int(config["intermediate_size"]),
        "vocab_size": int(config["vocab_size"]),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "max_seq_len": int(config.get("max_position_embeddings", 40960)),
    }
    if not moe:
        return _build(Qwen3Args, fields, source)
    if int(config["num_experts"]) <= 0:
        raise ValueError(
            f"{source}: num_experts={config['num_experts']!r} is not supported for "
            "model_type 'qwen3_moe' (a model without experts is a 'qwen3' model)"
        )
    fields.update(
        num_experts=int(config["num_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        moe_hidden_dim=int(config["moe_intermediate_size"]),
        route_norm=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
        aux_loss_coeff=float(config.get("router_aux_loss_coef") or 1e-3),
    )
    return _build(Qwen3MoEArgs, fields, source)


def _build(cls: type, fields: dict[str, Any], source: str) -> Any:
    try:
        return cls(**fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_to_hf(args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
    equal to our model with ``args`` (untied output projection)."""
    moe = isinstance(args, Qwen3MoEArgs)
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if moe:
        config.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_hidden_dim,
            norm_topk_prob=args.route_norm,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=args.aux_loss_coeff,
            output_router_logits=False,
        )
    return config


# Fields that only size a buffer or shape training, not the function computed.
_NOT_ARCHITECTURE = ("max_seq_len", "load_balance", "aux_loss_coeff", "bias_update_rate")


def config_differences(ours: Qwen3Args, theirs: Qwen3Args) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two
    configurations differ (``max_seq_len`` and the load-balancing settings
    are left out)."""
    if type(ours) is not type(theirs):
        return [f"configuration {type(ours).__name__} vs {type(theirs).__name__}"]
    import dataclasses

    return [
        f"{f.name}={getattr(ours, f.name)!r} vs {getattr(theirs, f.name)!r}"
        for f in dataclasses.fields(ours)
        if f.name not in _NOT_ARCHITECTURE and getattr(ours, f.name) != getattr(theirs, f.name)
    ]


class Qwen3HFAdapter(hf_common.HFAdapter):
    """Converts Qwen3 models to and from Hugging Face ``Qwen3ForCausalLM``
    (``moe=False``) or ``Qwen3MoeForCausalLM`` (``moe=True``); the
    ``ModelSpec.hf_adapter`` of the ``qwen3`` and ``qwen3_moe`` families.
    See [Qwen3 Hugging Face layout] and
    :class:`~simplefsdp.models.common.hf_adapter.HFAdapter`.
    """

    to_hf_name = staticmethod(to_hf_name)
    from_hf_name = staticmethod(from_hf_name)
    config_to_hf = staticmethod(config_to_hf)
    config_differences = staticmethod(config_differences)

    def __init__(self, *, moe: bool) -> None:
        self.moe = moe
        self.model_types: tuple[str, ...] = ("qwen3_moe",) if moe else ("qwen3",)

    def config_from_hf(self, config: Mapping[str, Any], source: str = "config.json") -> Qwen3Args:
        """Our configuration from a ``config.json`` (see :func:`config_from_hf`)."""
        return config_from_hf(config, source, moe=self.moe)

    def to_hf(
        self, name: str, tensor: torch.Tensor, args: Qwen3Args
    ) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)``, or one
        pair per expert for a stacked expert tensor."""
        experts = _EXPERTS.to_hf(name, tensor)
        if experts is not None:
            return experts
        if name.endswith(_ROUTING_BIAS):
            return []  # training state with no Hugging Face counterpart
        if name.endswith(_ROTARY):
            tensor = hf_common.pairs_to_halves(tensor, args.head_dim)
        return to_hf_name(name), tensor

    def read_region(
        self,
        name: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        args: Qwen3Args,
        checkpoint: Any,
    ) -> torch.Tensor:
        """Region ``offsets``/``sizes`` of our tensor ``name``, read from
        ``checkpoint`` (a :class:`simplefsdp.checkpoint.hf.HFCheckpoint`):
        only the experts, heads, rows and columns the region covers.

        Raises:
            ValueError: the checkpoint lacks a tensor or its shape does not
                hold the region.
        """
        offsets, sizes = list(offsets), list(sizes)
        experts = _EXPERTS.read(name, offsets, sizes, checkpoint)
        if experts is not None:
            return experts
        if name.endswith(_ROUTING_BIAS):
            return torch.zeros(sizes)  # not in Hugging Face checkpoints: starts at zero
        if checkpoint.tied and name in self.tied:
            return checkpoint.read_hf(self.tied[name], offsets, sizes)
        hf_name = to_hf_name(name)
        if not name.endswith(_ROTARY):
            return checkpoint.read_hf(hf_name, offsets, sizes)
        hf_offsets, hf_sizes, convert = hf_common.rotary_rows_region(offsets, sizes, args.head_dim)
        return convert(checkpoint.read_hf(hf_name, hf_offsets, hf_sizes))


#: The adapter of the dense ``qwen3`` family.
QWEN3_HF_ADAPTER = Qwen3HFAdapter(moe=False)
#: The adapter of the ``qwen3_moe`` family.
QWEN3_MOE_HF_ADAPTER = Qwen3HFAdapter(moe=True)
