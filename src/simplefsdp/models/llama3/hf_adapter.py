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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from simplefsdp.models.common import hf_adapter as hf_common
from simplefsdp.models.common.config import RopeScaling
from simplefsdp.models.common.feed_forward import ffn_hidden_dim

from .args import ModelArgs

_NAMES = hf_common.NameMap(
    "Llama", {**hf_common.ATTENTION_NAMES, **hf_common.FEED_FORWARD_NAMES, **hf_common.NORM_NAMES}
)
_ROTARY = ("attention.wq.weight", "attention.wk.weight")

# (multiple_of, ffn_dim_multiplier) pairs of published Llama models, tried first
# so that a converted config reads like the original one.
_FFN_CANDIDATES = ((1024, 1.3), (4096, 1.3), (256, None), (1024, None), (256, 1.3), (1024, 1.5))


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face ``LlamaForCausalLM`` name.

    Raises:
        ValueError: ``name`` is not a Llama 3 parameter name.
    """
    return _NAMES.to_hf_name(name)


def from_hf_name(name: str) -> str:
    """A Hugging Face ``LlamaForCausalLM`` name -> our state-dict name.

    Raises:
        ValueError: ``name`` is not a Llama parameter name.
    """
    return _NAMES.from_hf_name(name)


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
    hf_common.require_keys(config, source)
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


class LlamaHFAdapter(hf_common.HFAdapter):
    """Converts Llama 3 models to and from Hugging Face ``LlamaForCausalLM``.

    The object ``ModelSpec.hf_adapter`` of the Llama 3 family; see
    [Hugging Face names and the q/k layout] and
    :class:`~simplefsdp.models.common.hf_adapter.HFAdapter`.
    """

    model_types: tuple[str, ...] = ("llama",)
    names = _NAMES
    config_from_hf = staticmethod(model_args_from_hf_config)
    config_to_hf = staticmethod(hf_config_from_model_args)
    config_differences = staticmethod(model_args_differences)

    def to_hf(self, name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)``."""
        if name.endswith(_ROTARY):
            tensor = hf_common.pairs_to_halves(tensor, args.head_dim)
        return to_hf_name(name), tensor

    def hf_region(
        self, name: str, offsets: Sequence[int], sizes: Sequence[int], args: ModelArgs
    ) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
        """For ``wq``/``wk`` the whole heads the region overlaps, permuted
        and cut by ``convert``; for every other tensor the same region."""
        if name.endswith(_ROTARY):
            return hf_common.rotary_rows_region(offsets, sizes, args.head_dim)
        return super().hf_region(name, offsets, sizes, args)


#: The adapter object of the Llama 3 family's spec.
LLAMA3_HF_ADAPTER = LlamaHFAdapter()
