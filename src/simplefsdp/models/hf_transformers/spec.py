"""The ``transformers`` family's :class:`~simplefsdp.models.spec.ModelSpec`:
any causal LM ``transformers`` builds, from a Hugging Face folder.

It has no flavors: ``simplefsdp train --checkpoint.init_from_hf DIR`` picks
it for a folder whose ``model_type`` no native family reads. What composes:
every data-parallel mode, tensor parallelism through the model's own
``base_model_tp_plan`` (without sequence or loss parallelism), activation
checkpointing of its decoder layers, compilation, Hugging Face weights in
and out; what does not (pipeline, expert and context parallelism, float8)
is refused before any process starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from simplefsdp.models.hf_transformers.config import TransformersConfig
from simplefsdp.models.hf_transformers.hf_adapter import TRANSFORMERS_HF_ADAPTER
from simplefsdp.models.spec import ModelSpec


def _build(config: TransformersConfig) -> Any:
    from simplefsdp.models.hf_transformers.model import TransformersCausalLM

    return TransformersCausalLM(config)


def _sequence_context_error(config: TransformersConfig) -> str | None:
    from simplefsdp.models.hf_transformers.model import sequence_context_refusal

    return sequence_context_refusal(config)


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> None:
    from simplefsdp.models.hf_transformers.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )


def cross_entropy(logits: Any, targets: Any) -> Any:
    """The training loss: mean token cross-entropy of ``(B, T, V)`` logits, in fp32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _count(config: TransformersConfig, exclude_embeddings: bool, active: bool) -> int:
    import torch

    with torch.device("meta"):
        model = _build(config)
    count = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        embedding = model.causal_lm.get_input_embeddings()
        count -= sum(p.numel() for p in embedding.parameters())
    routing = routed_experts(config) if active else None
    if routing is not None:
        experts, top_k = routing
        routed = sum(p.numel() for p in _routed_parameters(model))
        count -= routed - routed * top_k // experts
    return count


def num_params(config: TransformersConfig, exclude_embeddings: bool = False) -> int:
    """Parameters of the model (counted on a meta-device build; tied ones once)."""
    return _count(config, exclude_embeddings, active=False)


def num_active_params(config: TransformersConfig, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses: all of them but the routed experts, of
    which ``top_k`` of ``experts`` (:func:`routed_experts`); every parameter
    where the ``config.json`` names no routing."""
    return _count(config, exclude_embeddings, active=True)


def flops_per_token(config: TransformersConfig, seq_len: int) -> int:
    """Training FLOPs per token: ``6 N`` (the non-embedding parameters one
    token uses: :func:`num_active_params`) plus the attention scores,
    ``12 * layers * hidden * seq_len`` (PaLM's estimate)."""
    hidden = int(config.get("hidden_size") or 0)
    n = num_active_params(config, exclude_embeddings=True)
    return 6 * n + 12 * config.n_layers * hidden * seq_len


def validate(
    config: TransformersConfig,
    layout: Any,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    build: bool = True,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """The sequence against ``max_seq_len``; with ``tp > 1`` the model's
    tensor-parallel plan, its sizes against tp, and neither sequence nor loss
    parallelism. The degrees the family lacks are refused by its
    capabilities. See :class:`~simplefsdp.models.spec.ModelSpec`."""
    n = {
        "seq_len": "seq_len",
        "tp": "tp",
        "sequence_parallel": "sequence_parallel",
        "loss_parallel": "loss_parallel",
        **(names or {}),
    }
    errors = []
    if seq_len is not None and seq_len > config.max_seq_len:
        errors.append(
            f"{n['seq_len']} {seq_len} exceeds max_position_embeddings {config.max_seq_len} "
            f"of the {config.model_type!r} model; valid: at most {config.max_seq_len}"
            + (f" (or raise {n['max_seq_len']})" if "max_seq_len" in n else "")
        )
    tp = getattr(layout, "tp", 1)
    if isinstance(tp, int) and tp > 1:
        from simplefsdp.models.hf_transformers.tensor_parallel import tp_errors

        errors += tp_errors(config, tp, n["tp"])
        for key, on in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if on and "." not in n[key]:  # a switch (simplefsdp plan), not a config key
                errors.append(
                    f"{n[key]} with {n['tp']} {tp}: the transformers family's tensor "
                    f"parallelism keeps whole sequences and logits; valid: without {n[key]}"
                )
            elif on:
                flag = n[key].lstrip("-")
                errors.append(
                    f"{flag} true with {n['tp']} {tp}: the transformers family's tensor "
                    f"parallelism keeps whole sequences and logits; use --{flag} false"
                )
    return errors


#: ``config.json`` keys giving a mixture-of-experts model's routed experts
#: (Mixtral; Qwen2-MoE, OLMoE; DeepSeek; Aria, ERNIE; DBRX under ``ffn_config``).
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: ... and the experts each token is routed to (not ``top_k``: that is the
#: generation's sampling setting).
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k")


def _positive_int(config: TransformersConfig, keys: tuple[str, ...], nested: bool) -> int | None:
    """The first positive integer under ``keys`` of the ``config.json``
    (with ``nested``, also one level down: DBRX's ``ffn_config``)."""
    places = [config.hf_config]
    if nested:
        places += [v for v in config.hf_config.values() if isinstance(v, Mapping)]
    for place in places:
        for key in keys:
            value = place.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def routed_experts(config: TransformersConfig) -> tuple[int, int] | None:
    """``(experts, top_k)`` of a model whose ``config.json`` names routed
    experts (more than one) and how many each token uses; ``None`` for a
    dense model (or ``is_moe: false``, Doge) or one whose routing it does
    not state as integers."""
    if config.hf_config.get("is_moe") is False:
        return None
    experts = _positive_int(config, _EXPERT_KEYS, nested=True)
    top_k = _positive_int(config, _TOP_K_KEYS, nested=True)
    if experts is None or experts < 2 or top_k is None or top_k > experts:
        return None
    return experts, top_k


def _routed_parameters(model: Any) -> list[Any]:
    """The parameters of the routed experts of a built model, each once:
    those under a module named ``experts`` (a ``ModuleList`` of experts, or
    one holding them stacked) or of a class named ``...Experts`` (Granite's
    and JetMoE's ``ParallelExperts``); shared experts (``shared_experts``,
    ``shared_expert``) not included."""
    seen: dict[int, Any] = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if "shared" not in last.lower() and (
            last == "experts" or type(module).__name__.endswith("Experts")
        ):
            for param in module.parameters():
                seen.setdefault(id(param), param)
    return list(seen.values())


def _index_keys(config: TransformersConfig) -> list[str]:
    """The ``config.json`` keys listing the indices of the layers of one
    kind (Bamba's ``attn_layer_indices``, older LFM2's ``full_attn_idxs``,
    ``mlp_only_layers``): named so, a list of increasing layer indices."""
    layers = config.n_layers
    return sorted(
        key
        for key, value in config.hf_config.items()
        if re.search(r"(_indices|_idxs|_layers|_layer_ids)$", key)
        and isinstance(value, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value)
        and all(a < b for a, b in zip(value, value[1:]))  # not per-layer flags (no_rope_layers)
    )


def _per_layer_keys(config: TransformersConfig) -> list[str]:
    """The ``config.json`` keys holding one entry per decoder layer (a list
    of ``num_hidden_layers`` values: ``layer_types``, ``layers_block_type``,
    ``no_rope_layers``, ...; not an index list, see :func:`_index_keys`)."""
    layers = config.n_layers
    indices = set(_index_keys(config))
    return sorted(
        key
        for key, value in config.hf_config.items()
        if isinstance(value, list)
        and layers
        and len(value) == layers
        and key != "architectures"
        and key not in indices
    )


def with_layers(config: TransformersConfig, n: int) -> TransformersConfig:
    """``config`` with ``n`` decoder layers (``num_hidden_layers``, or the
    model's own key for it), its per-layer lists (``layer_types``, ...) cut
    to their first ``n`` and its lists of layer indices to those under
    ``n``; a variant of fewer layers keeps the whole model's attention
    masks (see Note: [Causal attention without a mask under compile])."""
    layers = config.n_layers
    hf = dict(config.hf_config)
    for key in _per_layer_keys(config):
        hf[key] = hf[key][:n]
    for key in _index_keys(config):
        hf[key] = [i for i in hf[key] if i < n]
    hf[config.key("num_hidden_layers")] = n
    if n != layers:  # its attention masks as the whole model's (a planning variant)
        from simplefsdp.models.hf_transformers.model import MASK_CHECKED, _mask_reaches_only_sdpa

        hf[MASK_CHECKED] = _mask_reaches_only_sdpa(config)
    return config.replace(hf_config=hf)


def layer_kinds(config: TransformersConfig) -> tuple[Any, ...] | None:
    """Per decoder layer, its entries of the per-layer lists and whether
    each index list names it (its attention kind, mixer, ...; see
    :func:`_per_layer_keys` and :func:`_index_keys`): layers of one kind
    run the same code. ``None`` where there are no such lists or an entry
    is not hashable."""
    keys, index_keys = _per_layer_keys(config), _index_keys(config)
    if not keys and not index_keys:
        return None
    hf = config.hf_config
    kinds = tuple(
        tuple((key, hf[key][i]) for key in keys) + tuple((key, i in hf[key]) for key in index_keys)
        for i in range(config.n_layers)
    )
    try:
        hash(kinds)
    except TypeError:
        return None
    return kinds


def with_layer_kind(config: TransformersConfig, kind: Any, n: int) -> TransformersConfig:
    """``config`` with ``n`` decoder layers, each of ``kind`` (one of
    :func:`layer_kinds`), whose attention masks are as the whole model's
    (see Note: [Causal attention without a mask under compile])."""
    from simplefsdp.models.hf_transformers.model import MASK_CHECKED, _mask_reaches_only_sdpa

    index_keys = set(_index_keys(config))
    hf = dict(with_layers(config, n).hf_config)
    hf[MASK_CHECKED] = _mask_reaches_only_sdpa(config)  # also where n is the model's
    for key, value in kind:
        hf[key] = (list(range(n)) if value else []) if key in index_keys else [value] * n
    return config.replace(hf_config=hf)


def routes_to_experts(config: TransformersConfig) -> bool:
    """The model has routed experts that run only when their tokens picked
    them: ``transformers``' mixture-of-experts blocks loop over their
    experts and skip those no token picked (data-dependent reads; DBRX's
    too, its experts stacked in one parameter under ``ffn_config``).
    ``is_moe: false`` (Doge) is dense."""
    if config.hf_config.get("is_moe") is False:
        return False
    experts = _positive_int(config, _EXPERT_KEYS, nested=True)
    return experts is not None and experts > 1


SPEC = ModelSpec(
    family="transformers",
    description="any causal LM of transformers, through its own modeling code",
    config_type=TransformersConfig,
    flavors={},
    build=_build,
    init_weights=_init_weights,
    loss=cross_entropy,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "cp", "hf"}),
    tensor_parallel=_tensor_parallel,
    data_dependent_reads=routes_to_experts,
    hf_adapter=TRANSFORMERS_HF_ADAPTER,
    sequence_parallel=False,
    with_layers=with_layers,
    layer_kinds=layer_kinds,
    with_layer_kind=with_layer_kind,
    sequence_context_error=_sequence_context_error,
)
