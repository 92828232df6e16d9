"""The GPT-OSS family's Hugging Face adapter: ``GptOssForCausalLM`` names,
tensors and ``config.json`` to and from ours.

Note: [GPT-OSS Hugging Face layout]
    Names map one to one (``model.layers.{i}.self_attn.{q,k,v,o}_proj`` are
    ``layers.{i}.attention.w{q,k,v,o}`` with their biases,
    ``self_attn.sinks`` is ``attention.sinks``, ``mlp.router`` is
    ``moe.router.gate``, ``mlp.experts.gate_up_proj``/``down_proj`` (and
    their ``_bias``) are ``moe.experts.mlp1_weight``/``mlp2_weight`` (and
    ``mlp1_bias``/``mlp2_bias``), ``input_layernorm`` and
    ``post_attention_layernorm`` are ``attention_norm`` and ``ffn_norm``).
    Hugging Face stores the fused experts as ``(E, in, out)``, ours are
    ``(E, out, in)``: each expert's matrix is transposed (the gate/up
    interleaving of the ``2 * hidden`` dim is kept). Our rotary embedding
    rotates adjacent channel pairs; Hugging Face's rotates channel ``i`` with
    ``i + head_dim / 2``, so the rows of ``wq``/``wk`` and the entries of
    their biases are permuted within each head, as for Llama
    (:mod:`simplefsdp.models.llama3.hf_adapter`). A rank reads only the
    heads and experts its shard covers. Tied embeddings fill ``output`` from
    the embedding; exports are untied. The routing bias of
    ``load_balance="bias"`` starts at zero and is exported only while zero.
    The published checkpoints store the expert matrices in MXFP4
    (``<name>_blocks`` and ``<name>_scales``): they are dequantized on read
    (:func:`read_mxfp4`), block by block for the region a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from simplefsdp.models.common import hf_adapter as hf_common
from simplefsdp.models.common.config import YarnScaling

from .args import GptOssArgs

_NAMES = hf_common.NameMap(
    "GPT-OSS",
    {
        **hf_common.ATTENTION_NAMES,
        **hf_common.NORM_NAMES,
        "attention.wq.bias": "self_attn.q_proj.bias",
        "attention.wk.bias": "self_attn.k_proj.bias",
        "attention.wv.bias": "self_attn.v_proj.bias",
        "attention.wo.bias": "self_attn.o_proj.bias",
        "attention.sinks": "self_attn.sinks",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
        "moe.experts.mlp1_weight": "mlp.experts.gate_up_proj",
        "moe.experts.mlp1_bias": "mlp.experts.gate_up_proj_bias",
        "moe.experts.mlp2_weight": "mlp.experts.down_proj",
        "moe.experts.mlp2_bias": "mlp.experts.down_proj_bias",
    },
)
_ROUTING_BIAS = "moe.expert_bias"
_TRANSPOSED = ("moe.experts.mlp1_weight", "moe.experts.mlp2_weight")
#: The swiglu alpha transformers' GptOssExperts hard-codes.
_HF_SWIGLU_ALPHA = 1.702


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face ``GptOssForCausalLM`` name.

    Raises:
        ValueError: ``name`` is not a GPT-OSS parameter name.
    """
    return _NAMES.to_hf_name(name)


def from_hf_name(name: str) -> str:
    """A Hugging Face ``GptOssForCausalLM`` name -> our state-dict name.

    Raises:
        ValueError: ``name`` is not a GPT-OSS tensor name.
    """
    return _NAMES.from_hf_name(name)


def _is_rotary(name: str) -> bool:
    """Our tensor ``name``'s rows (or bias entries) are permuted per head."""
    return ".attention.wq." in name or ".attention.wk." in name


def _yarn_from_hf(scaling: Mapping[str, Any], source: str) -> YarnScaling:
    missing = [k for k in ("factor",) if k not in scaling]
    if missing:
        raise ValueError(f"{source}: rope_scaling lacks {', '.join(missing)}")
    extra = {}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if scaling.get(key) is not None:
            extra[key] = float(scaling[key])
    return YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
        **extra,
    )


def model_args_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> GptOssArgs:
    """Our :class:`GptOssArgs` from the ``config.json`` of a Hugging Face GPT-OSS model.

    Raises:
        ValueError: not a GPT-OSS model, a quantization other than MXFP4, or
            a feature our model lacks; one line naming the key and its value.
    """

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key)
        return default if value is None else value

    model_type = get("model_type", "gpt_oss")
    if model_type != "gpt_oss":
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (only 'gpt_oss')")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        if method != "mxfp4":
            raise ValueError(
                f"{source}: quantization_config.quant_method {method!r} is not read (only "
                "'mxfp4' or unquantized); convert the checkpoint to bf16 first"
            )
    if get("attention_bias", True) is not True:
        raise ValueError(f"{source}: attention_bias={config['attention_bias']!r} is not supported")
    hf_common.require_keys(config, source)
    scaling_cfg = get("rope_scaling")
    scaling = None
    if scaling_cfg:
        rope_type = scaling_cfg.get("rope_type", scaling_cfg.get("type"))
        if rope_type != "yarn":
            raise ValueError(
                f"{source}: rope_scaling type {rope_type!r} is not supported (only 'yarn' or none)"
            )
        scaling = _yarn_from_hf(scaling_cfg, source)
    layer_types = get("layer_types")
    n_heads = int(config["num_attention_heads"])
    dim = int(config["hidden_size"])
    return GptOssArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(get("num_key_value_heads", n_heads)),
        head_dim=int(get("head_dim", dim // n_heads)),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(get("rms_norm_eps", 1e-5)),
        rope_theta=float(get("rope_theta", 150000.0)),
        rope_scaling=scaling,
        max_seq_len=int(get("max_position_embeddings", 131072)),
        num_experts=int(get("num_local_experts", 128)),
        top_k=int(get("num_experts_per_tok", get("experts_per_token", 4))),
        moe_hidden_dim=int(get("intermediate_size", 2880)),
        sliding_window=int(get("sliding_window", 128)),
        layer_types=None if layer_types is None else tuple(layer_types),
        swiglu_limit=float(get("swiglu_limit", 7.0)),
    )


def hf_config_from_model_args(
    args: GptOssArgs, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The ``config.json`` of a ``GptOssForCausalLM`` equal to our model with ``args``.

    Raises:
        ValueError: ``swiglu_alpha`` other than transformers' fixed 1.702.
    """
    if args.swiglu_alpha != _HF_SWIGLU_ALPHA:
        raise ValueError(
            f"swiglu_alpha={args.swiglu_alpha} has no Hugging Face form "
            f"(GptOssForCausalLM uses {_HF_SWIGLU_ALPHA})"
        )
    scaling = args.rope_scaling
    rope = None
    if scaling is not None:
        if not isinstance(scaling, YarnScaling):
            raise ValueError(f"rope_scaling {scaling!r} has no GPT-OSS form (only YaRN)")
        rope = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate,
        }
        if scaling.mscale != 1.0 or scaling.mscale_all_dim != 0.0:
            rope.update(mscale=scaling.mscale, mscale_all_dim=scaling.mscale_all_dim)
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "experts_per_token": args.top_k,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.resolved_layer_types()),
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope,
        "swiglu_limit": args.swiglu_limit,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "router_aux_loss_coef": args.aux_loss_coeff,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


_COMPARED = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "vocab_size",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "num_experts",
    "top_k",
    "moe_hidden_dim",
    "sliding_window",
    "layer_types",
    "swiglu_limit",
    "swiglu_alpha",
)


def model_args_differences(ours: GptOssArgs, theirs: GptOssArgs) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two
    configurations differ (``max_seq_len`` only sizes the rotary table)."""
    return [
        f"{f}={getattr(ours, f)!r} vs {getattr(theirs, f)!r}"
        for f in _COMPARED
        if getattr(ours, f) != getattr(theirs, f)
    ]


#: The values of the 16 FP4 (E2M1) codes.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
#: Values per MXFP4 block (one shared power-of-two scale each).
MXFP4_BLOCK = 32


def read_mxfp4(
    checkpoint: Any, hf_name: str, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """Region ``offsets``/``sizes`` of one of our expert matrices
    (``(E, out, in)``) from the MXFP4 tensors ``<hf_name>_blocks``
    (``(E, out, in / 32, 16)`` bytes, two FP4 codes each, the low nibble
    first) and ``<hf_name>_scales`` (``(E, out, in / 32)``, exponents biased
    by 127), dequantized to float32; only the blocks the region overlaps are
    read. The stored ``(E, out, in)`` order is already ours.
    """
    (e0, r0, c0), (ne, nr, nc) = offsets, sizes
    first, last = c0 // MXFP4_BLOCK, -(-(c0 + nc) // MXFP4_BLOCK)
    half = MXFP4_BLOCK // 2
    blocks = checkpoint.read_hf(
        f"{hf_name}_blocks", [e0, r0, first, 0], [ne, nr, last - first, half]
    )  # (ne, nr, g, 16) uint8
    scales = checkpoint.read_hf(f"{hf_name}_scales", [e0, r0, first], [ne, nr, last - first])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (ne, nr, g, 16, 2)
    values = lut[codes].flatten(-2)  # (ne, nr, g, 32)
    exponents = scales.to(torch.int32) - 127  # (ne, nr, g)
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return values.flatten(-2).narrow(-1, c0 - first * MXFP4_BLOCK, nc)  # (ne, nr, nc)


class GptOssHFAdapter(hf_common.HFAdapter):
    """Converts GPT-OSS models to and from Hugging Face ``GptOssForCausalLM``
    (see [GPT-OSS Hugging Face layout] and
    :class:`~simplefsdp.models.common.hf_adapter.HFAdapter`).
    """

    model_types: tuple[str, ...] = ("gpt_oss",)
    architectures: tuple[str, ...] | None = ("GptOssForCausalLM",)
    names = _NAMES
    config_from_hf = staticmethod(model_args_from_hf_config)
    config_to_hf = staticmethod(hf_config_from_model_args)
    config_differences = staticmethod(model_args_differences)

    def to_hf(
        self, name: str, tensor: torch.Tensor, args: GptOssArgs
    ) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)`` (none
        for a zero routing bias).

        Raises:
            ValueError: a nonzero routing bias (``load_balance="bias"``),
                which ``GptOssForCausalLM`` cannot express.
        """
        if name.endswith(_ROUTING_BIAS):
            if torch.count_nonzero(tensor):
                raise ValueError(
                    f"{name} is nonzero: GptOssForCausalLM has no routing bias, so this model "
                    "(trained with model.load_balance 'bias') has no Hugging Face form; "
                    "train with --model.load_balance none or aux_loss to export it"
                )
            return []
        if _is_rotary(name):
            tensor = hf_common.pairs_to_halves(tensor, args.head_dim)
        elif name.endswith(_TRANSPOSED):
            tensor = tensor.transpose(-2, -1)
        return to_hf_name(name), tensor

    def hf_region(
        self, name: str, offsets: Sequence[int], sizes: Sequence[int], args: GptOssArgs
    ) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
        """The region of the Hugging Face tensor holding region
        ``offsets``/``sizes`` of our tensor ``name``, and its conversion:
        whole heads for ``wq``/``wk`` (weights and biases), the transposed
        region for the expert matrices, else the same region."""
        if name.endswith(_TRANSPOSED):
            hf_offsets = [offsets[0], offsets[2], offsets[1]]
            hf_sizes = [sizes[0], sizes[2], sizes[1]]
            return hf_offsets, hf_sizes, lambda t: t.transpose(-2, -1)
        if _is_rotary(name):
            return hf_common.rotary_rows_region(offsets, sizes, args.head_dim)
        return super().hf_region(name, offsets, sizes, args)

    def read_region(
        self,
        name: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        args: GptOssArgs,
        checkpoint: Any,
    ) -> torch.Tensor:
        """Region ``offsets``/``sizes`` of our tensor ``name``, read from
        ``checkpoint`` (a :class:`~simplefsdp.checkpoint.hf.HFCheckpoint`):
        only the Hugging Face region :meth:`hf_region` names, converted."""
        if name.endswith(_ROUTING_BIAS):  # not in Hugging Face checkpoints: starts at zero
            return torch.zeros(sizes)
        hf_name = to_hf_name(name)
        if name.endswith(_TRANSPOSED) and checkpoint.has(f"{hf_name}_blocks"):
            return read_mxfp4(checkpoint, hf_name, offsets, sizes)
        if name in self.tied and not checkpoint.has(hf_name):
            hf_name = self.tied[name]
        hf_offsets, hf_sizes, convert = self.hf_region(name, offsets, sizes, args)
        return convert(checkpoint.read_hf(hf_name, hf_offsets, hf_sizes))


#: The adapter object of the GPT-OSS family's spec.
GPT_OSS_HF_ADAPTER = GptOssHFAdapter()
