"""The Llama 3 family's Hugging Face adapter: ``LlamaForCausalLM`` names,
tensors and ``config.json`` to and from ours.

:mod:`simplefsdp.checkpoint.hf` does the generic sliced safetensors I/O and
asks the family's adapter (``ModelSpec.hf_adapter``) for each name, region
and configuration.

Note: [Hugging Face names and the q/k layout]
    Names map one to one (``model.layers.{i}.self_attn.q_proj.weight`` is our
    ``layers.{i}.attention.wq.weight``, ``mlp.gate_proj``/``down_proj``/``up_proj``
    are ``feed_forward.w1``/``w2``/``w3``, ``input_layernorm`` and
    ``post_attention_layernorm`` are ``attention_norm`` and ``ffn_norm``,
    ``model.embed_tokens``, ``model.norm`` and ``lm_head`` are
    ``tok_embeddings``, ``norm`` and ``output``). Our rotary embedding rotates
    adjacent channel pairs ``(2i, 2i + 1)`` of each head (Meta's layout);
    Hugging Face's rotates channel ``i`` with ``i + head_dim / 2``. The rows of
    ``wq`` and ``wk`` are therefore permuted within each head: our row
    ``2i + j`` of a head is Hugging Face's row ``j * head_dim / 2 + i``. The
    permutation stays inside a head, so a shard that covers part of the heads
    reads only the heads it overlaps. A checkpoint with tied embeddings
    (``tie_word_embeddings``, or no ``lm_head.weight``) fills ``output`` from
    the embedding; exports are untied (our model has its own ``output``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from simplefsdp.models.common.config import RopeScaling
from simplefsdp.models.common.feed_forward import ffn_hidden_dim

from .args import ModelArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_FROM_TOP = {v: k for k, v in _TOP_NAMES.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# (multiple_of, ffn_dim_multiplier) pairs of published Llama models, tried first
# so that a converted config reads like the original one.
_FFN_CANDIDATES = ((1024, 1.3), (4096, 1.3), (256, None), (1024, None), (256, 1.3), (1024, 1.5))


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face ``LlamaForCausalLM`` name.

    Raises:
        ValueError: ``name`` is not a Llama 3 parameter name.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _OURS_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"no Hugging Face name for parameter {name!r}")


def from_hf_name(name: str) -> str:
    """A Hugging Face ``LlamaForCausalLM`` name -> our state-dict name.

    Raises:
        ValueError: ``name`` is not a Llama parameter name.
    """
    if name in _FROM_TOP:
        return _FROM_TOP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _FROM_LAYER:
        return f"layers.{match.group(1)}.{_FROM_LAYER[match.group(2)]}"
    raise ValueError(f"unknown Hugging Face Llama tensor {name!r}")


def _heads_of(name: str, args: Any) -> int | None:
    """Number of heads whose rows are permuted in tensor ``name`` (ours), or None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def _hf_rows_to_ours(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of whole heads in Hugging Face's rotary layout -> ours (see the note)."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def _our_rows_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of whole heads in our rotary layout -> Hugging Face's (see the note)."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def _ffn_args(dim: int, intermediate: int) -> tuple[int, float | None]:
    """``(multiple_of, ffn_dim_multiplier)`` giving the hidden size ``intermediate``."""
    for multiple_of, multiplier in _FFN_CANDIDATES:
        if ffn_hidden_dim(dim, multiple_of, multiplier) == intermediate:
            return multiple_of, multiplier
    base = int(2 * (4 * dim) / 3)
    # multiple_of == intermediate rounds any hidden size in (0, intermediate] up to it.
    multiplier = None if base <= intermediate else intermediate / base
    if ffn_hidden_dim(dim, intermediate, multiplier) != intermediate:  # pragma: no cover
        raise ValueError(f"cannot express intermediate_size={intermediate} for dim={dim}")
    return intermediate, multiplier


def model_args_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> Any:
    """Our ``ModelArgs`` from the ``config.json`` of a Hugging Face Llama model.

    Args:
        config: the parsed ``config.json``.
        source: the file's name, for error messages.

    Returns:
        A :class:`~simplefsdp.models.llama3.ModelArgs`; ``max_seq_len`` is
        ``max_position_embeddings``.

    Raises:
        ValueError: not a Llama model, or one with a feature our model lacks
            (biases, another activation, a head size other than
            ``hidden_size / num_attention_heads``, an unknown rope type); the
            message names the key and its value.
    """

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, default)

    model_type = get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (only 'llama')")
    for key in ("attention_bias", "mlp_bias"):
        if get(key, False):
            raise ValueError(f"{source}: {key}=true is not supported (the model has no biases)")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if k not in config
    ]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = get("head_dim")
    if head_dim is not None and n_heads and int(head_dim) * n_heads != dim:
        raise ValueError(
            f"{source}: head_dim {head_dim} is not hidden_size/num_attention_heads "
            f"({dim}/{n_heads}); such models are not supported"
        )
    rope = dict(get("rope_parameters") or {})
    scaling_cfg = get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    theta = get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = (scaling_cfg or rope).get("rope_type", (scaling_cfg or rope).get("type"))
    scaling = None
    if scaling_cfg:
        if rope_type != "llama3":
            raise ValueError(
                f"{source}: rope_scaling type {rope_type!r} is not supported "
                "(only 'llama3' or none)"
            )
        scaling = RopeScaling(
            factor=float(scaling_cfg["factor"]),
            low_freq_factor=float(scaling_cfg["low_freq_factor"]),
            high_freq_factor=float(scaling_cfg["high_freq_factor"]),
            original_max_position_embeddings=int(scaling_cfg["original_max_position_embeddings"]),
        )
    elif rope_type not in (None, "default"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported")
    intermediate = int(get("intermediate_size", 0)) or None
    multiple_of, multiplier = (256, None) if intermediate is None else _ffn_args(dim, intermediate)
    return ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(get("num_key_value_heads") or n_heads),
        vocab_size=int(config["vocab_size"]),
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_seq_len=int(get("max_position_embeddings", 2048)),
    )


def hf_config_from_model_args(args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to our model with ``args``.

    Args:
        args: our :class:`~simplefsdp.models.llama3.ModelArgs`.
        dtype: the dtype the weights are stored in.
    """
    scaling = args.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_args_differences(ours: Any, theirs: Any) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two ModelArgs differ.

    ``max_seq_len`` is left out: it sizes the rotary table only.
    """
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta")
    out = [
        f"{f}={getattr(ours, f)!r} vs {getattr(theirs, f)!r}"
        for f in fields
        if getattr(ours, f) != getattr(theirs, f)
    ]
    if ours.ffn_hidden_dim != theirs.ffn_hidden_dim:
        out.append(f"ffn_hidden_dim={ours.ffn_hidden_dim} vs {theirs.ffn_hidden_dim}")
    if ours.rope_scaling != theirs.rope_scaling:
        out.append(f"rope_scaling={ours.rope_scaling!r} vs {theirs.rope_scaling!r}")
    return out


class LlamaHFAdapter:
    """Converts Llama 3 models to and from Hugging Face ``LlamaForCausalLM``.

    The object ``ModelSpec.hf_adapter`` of the Llama 3 family; see
    [Hugging Face names and the q/k layout].

    Attributes:
        model_types: the ``config.json`` ``model_type`` values it reads.
        tied: our tensor -> the Hugging Face tensor that fills it when the
            checkpoint ties the output projection to the embedding.
    """

    model_types: tuple[str, ...] = ("llama",)
    tied: Mapping[str, str] = {"output.weight": "model.embed_tokens.weight"}

    def to_hf_name(self, name: str) -> str:
        """Our state-dict name -> the Hugging Face name (see :func:`to_hf_name`)."""
        return to_hf_name(name)

    def from_hf_name(self, name: str) -> str:
        """A Hugging Face name -> our state-dict name (see :func:`from_hf_name`)."""
        return from_hf_name(name)

    def config_from_hf(self, config: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
        """Our :class:`ModelArgs` from a ``config.json`` (see :func:`model_args_from_hf_config`)."""
        return model_args_from_hf_config(config, source)

    def config_to_hf(self, args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The ``config.json`` of our model (see :func:`hf_config_from_model_args`)."""
        return hf_config_from_model_args(args, dtype)

    def config_differences(self, ours: ModelArgs, theirs: ModelArgs) -> list[str]:
        """Architecture fields in which two configurations differ (see
        :func:`model_args_differences`)."""
        return model_args_differences(ours, theirs)

    def to_hf(self, name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)``."""
        heads = _heads_of(name, args)
        value = tensor if heads is None else _our_rows_to_hf(tensor, heads)
        return to_hf_name(name), value

    def hf_region(
        self, name: str, offsets: Sequence[int], sizes: Sequence[int], args: ModelArgs
    ) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
        """Which region of the Hugging Face tensor holds region ``offsets``/``sizes``
        of our tensor ``name``, and how to turn it into ours.

        Returns:
            ``(hf_offsets, hf_sizes, convert)``: for ``wq``/``wk`` the whole
            heads the region overlaps, permuted and cut by ``convert``; for
            every other tensor the same region and the identity.
        """
        heads = _heads_of(name, args)
        if heads is None or len(sizes) != 2:
            return list(offsets), list(sizes), lambda t: t
        head_dim = args.head_dim
        first, last = offsets[0] // head_dim, -(-(offsets[0] + sizes[0]) // head_dim)
        start = offsets[0] - first * head_dim

        def convert(block: torch.Tensor) -> torch.Tensor:
            return _hf_rows_to_ours(block, last - first)[start : start + sizes[0]]

        hf_offsets = [first * head_dim, offsets[1]]
        hf_sizes = [(last - first) * head_dim, sizes[1]]
        return hf_offsets, hf_sizes, convert

    def hf_sort_key(self, hf_name: str) -> tuple[int, str]:
        """Order in the written shards: embeddings, layer by layer, norm and head."""
        match = _HF_LAYER.match(hf_name)
        if match:
            return int(match.group(1)) + 1, match.group(2)
        return (0 if "embed_tokens" in hf_name else 1 << 30), hf_name


#: The adapter object of the Llama 3 family's spec.
LLAMA3_HF_ADAPTER = LlamaHFAdapter()
