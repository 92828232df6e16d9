"""Tensor parallelism of a ``transformers`` causal LM: the model's own ``base_model_tp_plan``.

``transformers`` declares for many models which linear layers split by
output (``"colwise"``) and which by input (``"rowwise"``), Megatron style:
attention heads and feed-forward columns are split over the TP ranks, each
block's output is all-reduced. :func:`apply_tensor_parallel` applies that
plan with torch's ``parallelize_module`` (``ColwiseParallel`` /
``RowwiseParallel``, local tensors in between, so the attention runs on the
rank's heads); embeddings, norms and the output projection stay replicated.
The sequence is not sharded (no sequence parallelism) and the logits are
whole (no loss parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The plan styles applied; others (``colwise_rep``, ``local_colwise``,
#: ``gather``, expert styles, ...) are refused.
STYLES = ("colwise", "rowwise")


def tp_plan(config: Any) -> Mapping[str, str]:
    """The ``base_model_tp_plan`` of a :class:`TransformersConfig`'s model
    (empty when ``transformers`` declares none)."""
    from simplefsdp.models.hf_transformers.model import _hf_config

    return dict(getattr(_hf_config(config), "base_model_tp_plan", None) or {})


def tp_errors(config: Any, tp: int, flag: str = "tp") -> list[str]:
    """Why ``config``'s model cannot split over ``tp`` ranks, one line each."""
    plan = tp_plan(config)
    if not plan:
        return [
            f"{flag} {tp}: the {config.model_type!r} model declares no tensor-parallel "
            f"plan (base_model_tp_plan) in transformers; use {flag} 1"
        ]
    other = sorted({style for style in plan.values() if style not in STYLES})
    if other:
        return [
            f"{flag} {tp}: the {config.model_type!r} model's tensor-parallel plan uses "
            f"{', '.join(other)}, which is not applied (valid: {', '.join(STYLES)}); "
            f"use {flag} 1"
        ]
    heads = config.get("num_attention_heads")
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "intermediate_size": config.get("intermediate_size"),
    }
    return [
        f"{flag} {tp} does not divide the {key} {value} of the {config.model_type!r} model; "
        f"valid: a divisor of {value}"
        for key, value in sizes.items()
        if isinstance(value, int) and value % tp
    ]


def apply_tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> None:
    """Split ``model``'s linear layers over ``tp_mesh`` as its ``base_model_tp_plan`` says.

    Args:
        model: a :class:`~simplefsdp.models.hf_transformers.TransformersCausalLM`.
        tp_mesh: the 1-D tensor-parallel mesh.
        sequence_parallel / loss_parallel: must be ``False`` (refused before
            training by the family's ``validate``).

    Raises:
        ValueError: no plan, or a style other than colwise/rowwise.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    errors = tp_errors(model.config, tp_mesh.size())
    if errors:
        raise ValueError(errors[0])
    assert not sequence_parallel and not loss_parallel, "refused by validate"
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = model.causal_lm.base_model_prefix
    plan = {f"{prefix}.{pattern}": styles[s]() for pattern, s in tp_plan(model.config).items()}
    parallelize_module(model, tp_mesh, plan)
