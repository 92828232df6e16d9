"""What the specs of decoders built on these components share.

:func:`decoder_spec` is a :class:`~simplefsdp.models.spec.ModelSpec` with
the defaults every such decoder has (its own ``init_weights``, the token
cross-entropy, the shared pipeline split) and, for one with
mixture-of-experts layers, those of :class:`~.moe.MoE` (graph breaks at
the token counts, planned from shapes, the load-balancing hooks, the router
gate left in high precision). A family's ``spec.py`` states only what
differs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from simplefsdp.models.common.load_balance import after_optimizer_step, discard_step_state
from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.spec import ModelSpec


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean token cross-entropy of ``(B, T, V)`` logits, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def init_weights(model: Any, buffer_device: Any = None) -> None:
    """Initialise a built decoder (or one of its pipeline stages) in place:
    its own ``init_weights``."""
    model.init_weights(buffer_device=buffer_device)


def decoder_spec(*, experts: bool = False, **fields: Any) -> ModelSpec:
    """A :class:`~simplefsdp.models.spec.ModelSpec` of a decoder built on
    :mod:`simplefsdp.models.common`.

    Args:
        experts: the decoder has mixture-of-experts layers.
        **fields: the spec's fields; each replaces its default. Defaults:
            ``init_weights`` (:func:`init_weights`), ``loss``
            (:func:`cross_entropy`), ``pipeline_split`` (the shared
            decoder split) and with ``experts`` also ``fullgraph=False`` (a
            MoE layer reads its token counts to the host),
            ``plan_method="analytic"``, the load-balancing
            ``after_optimizer_step`` and ``discard_step_state`` hooks and
            ``float8_skip_fqns=("router.gate",)`` (the router computes in
            float32).
    """
    defaults: dict[str, Any] = {
        "init_weights": init_weights,
        "loss": cross_entropy,
        "pipeline_split": pipeline_split,
    }
    if experts:
        defaults.update(
            fullgraph=False,
            plan_method="analytic",
            after_optimizer_step=after_optimizer_step,
            discard_step_state=discard_step_state,
            float8_skip_fqns=("router.gate",),
        )
    return ModelSpec(**{**defaults, **fields})
