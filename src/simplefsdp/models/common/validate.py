"""The model-against-layout rules every decoder shares (torch-free).

A family's ``validate(config, layout, **inputs)`` (see
:class:`~simplefsdp.models.spec.ModelSpec`) returns :func:`decoder_errors`
plus its own rules: :func:`dense_decoder_validate` and
:func:`moe_decoder_validate` build it from the sizes the family's TP plan
splits. Each error is one line naming the value, the flag that set it and
what would be valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

#: How a degree or input is spelled in messages by default; a command line
#: passes its own flags (``names={"tp": "--tp"}``).
_NAMES = {"tp": "tp", "pp": "pp", "ep": "ep", "seq_len": "seq_len"}


def flag_names(names: Mapping[str, str] | None) -> dict[str, str]:
    """The default spellings overridden by ``names``."""
    return {**_NAMES, **(names or {})}


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def decoder_errors(
    config: Any,
    layout: Any,
    *,
    tp_sizes: Mapping[str, int],
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Sequence length, tensor-parallel splits and pipeline stages of a decoder.

    Args:
        config: the model's configuration (``max_seq_len``, ``n_layers``).
        layout: the degrees (``tp``, ``pp``; ``num_stages`` if it has one,
            else ``pp``).
        tp_sizes: the model sizes the family's TP plan splits over ``tp``.
        seq_len: the training sequence length, if known.
        sequence_parallel: the TP plan shards the sequence over ``tp``.
        model_name: the flavor's name, for the messages.
        names: how the caller spells each degree (its flags).
    """
    n = flag_names(names)
    model = f"model {model_name!r}" if model_name else "the model"
    errors = []
    if seq_len is not None and seq_len > config.max_seq_len:
        # where the caller names how to raise it (``names["max_seq_len"]``)
        raise_it = f" or raise {n['max_seq_len']}" if "max_seq_len" in n else ""
        errors.append(
            f"{n['seq_len']} {seq_len} exceeds max_seq_len {config.max_seq_len} of {model}; "
            f"use {n['seq_len']} <= {config.max_seq_len}{raise_it}"
        )
    tp = getattr(layout, "tp", 1)
    if tp > 1:
        bad = {name: size for name, size in tp_sizes.items() if size % tp}
        if bad:
            found = ", ".join(f"{name} {size}" for name, size in bad.items())
            valid = divisors(math.gcd(*tp_sizes.values()))
            errors.append(
                f"{n['tp']} {tp} does not divide the {found} of {model}; "
                f"valid tensor-parallel sizes for this model: {valid}"
            )
        if sequence_parallel and seq_len is not None and seq_len % tp:
            errors.append(
                f"{n['seq_len']} {seq_len} is not divisible by {n['tp']} {tp} "
                "(sequence parallelism shards the sequence over the TP ranks)"
            )
    pp = getattr(layout, "pp", 1)
    stages = getattr(layout, "num_stages", None) or pp
    if pp > 1 and stages > config.n_layers:
        errors.append(
            f"{n['pp']} {pp} x {stages // pp} stages per rank = {stages} stages but "
            f"{model} has {config.n_layers} layers; use at most {config.n_layers} stages"
        )
    return errors


def expert_errors(
    num_experts: int,
    layout: Any,
    *,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """The rules of a mixture-of-experts decoder (with
    :class:`~simplefsdp.models.common.moe.MoE` layers) against the layout:
    ``ep`` divides the routed experts, and expert parallelism does not combine
    with tensor parallelism (tp splits every expert's hidden dim instead).

    Args:
        num_experts: routed experts per MoE layer.
        layout: anything with ``ep`` and ``tp`` (missing ones count as 1).
        model_name / names: as for :func:`decoder_errors`.
    """
    n = flag_names(names)
    model = f"model {model_name!r}" if model_name else "the model"
    ep, tp = getattr(layout, "ep", 1), getattr(layout, "tp", 1)
    errors = []
    if ep > 1 and num_experts % ep:
        valid = divisors(num_experts)
        errors.append(
            f"{n['ep']} {ep} does not divide the {num_experts} experts of {model} (each "
            f"rank holds num_experts / {n['ep']}); valid: {', '.join(map(str, valid))}"
        )
    if ep > 1 and tp > 1:
        errors.append(
            f"{n['ep']} {ep} with {n['tp']} {tp}: expert and tensor parallelism do not compose "
            f"for mixture-of-experts models (tp splits every routed expert instead); use "
            f"{n['ep']} 1 or {n['tp']} 1"
        )
    return errors


def moe_decoder_errors(
    config: Any, layout: Any, *, tp_sizes: Mapping[str, int], **inputs: Any
) -> list[str]:
    """:func:`decoder_errors` and :func:`expert_errors` of a decoder with
    mixture-of-experts layers (``config.num_experts`` routed experts each).

    Args:
        config / layout / tp_sizes: as for :func:`decoder_errors`.
        **inputs: ``seq_len``, ``sequence_parallel``, ``model_name``,
            ``names`` (as for :func:`decoder_errors`).
    """
    errors = decoder_errors(config, layout, tp_sizes=tp_sizes, **inputs)
    return errors + expert_errors(
        config.num_experts, layout, model_name=inputs.get("model_name"), names=inputs.get("names")
    )


def dense_decoder_validate(
    tp_split_sizes: Callable[..., Mapping[str, int]], *, unnamed: str, with_experts: str
) -> Callable[..., list[str]]:
    """The ``ModelSpec.validate`` of a decoder without experts:
    :func:`decoder_errors`, and expert parallelism refused.

    Args:
        tp_split_sizes: ``tp_split_sizes(config, *, loss_parallel) -> {name:
            size}``, the sizes the family's TP plan splits over ``tp``.
        unnamed: how the refusal names the model when the caller gives no
            ``model_name`` (``"this Llama 3 model"``).
        with_experts: the valid choice the refusal offers (``"a
            mixture-of-experts model (e.g. moe_debug)"``).
    """

    def validate(
        config: Any, layout: Any, *, loss_parallel: bool = False, build: bool = True, **inputs: Any
    ) -> list[str]:
        """A dense decoder against the layout: sequence vs ``max_seq_len``,
        the TP-split sizes vs tp, layers vs stages, no experts for ep (see
        :class:`~simplefsdp.models.spec.ModelSpec` for the arguments)."""
        tp_sizes = tp_split_sizes(config, loss_parallel=loss_parallel)
        errors = decoder_errors(config, layout, tp_sizes=tp_sizes, **inputs)
        model_name, names = inputs.get("model_name"), inputs.get("names")
        ep = getattr(layout, "ep", 1)
        if ep > 1:
            model = f"model {model_name!r}" if model_name else unnamed
            errors.append(
                f"{flag_names(names)['ep']} {ep}: expert parallelism needs a model with experts "
                f"and {model} has none; valid: 1, or {with_experts}"
            )
        return errors

    return validate


def moe_decoder_validate(
    tp_split_sizes: Callable[..., Mapping[str, int]],
) -> Callable[..., list[str]]:
    """The ``ModelSpec.validate`` of a decoder with mixture-of-experts
    layers: :func:`moe_decoder_errors` with the sizes ``tp_split_sizes(config,
    *, loss_parallel)`` names (as for :func:`dense_decoder_validate`)."""

    def validate(
        config: Any, layout: Any, *, loss_parallel: bool = False, build: bool = True, **inputs: Any
    ) -> list[str]:
        """A mixture-of-experts decoder against the layout: the decoder's
        rules, experts vs ep, ep with tp refused (see
        :class:`~simplefsdp.models.spec.ModelSpec` for the arguments)."""
        tp_sizes = dict(tp_split_sizes(config, loss_parallel=loss_parallel))
        hidden = getattr(config, "moe_hidden_dim", 0)
        if hidden and getattr(config, "n_moe_layers", 1):
            tp_sizes.setdefault("routed-experts hidden dim", hidden)
        return moe_decoder_errors(config, layout, tp_sizes=tp_sizes, **inputs)

    return validate
