"""Mixture-of-experts decoder as a plain ``nn.Module``.

The shared decoder (:mod:`simplefsdp.models.common`) with the feed-forward
network of blocks ``n_dense_layers ..`` replaced by a
:class:`~simplefsdp.models.common.moe.MoE` layer (token-choice router,
grouped routed experts, shared experts). There is no parallelism code here:
expert parallelism is applied from the outside to the ``experts`` modules
(:mod:`simplefsdp.frontend.expert_parallel`).

Parameter FQNs follow torchtitan: ``layers.1.moe.router.gate.weight``,
``layers.1.moe.experts.w1`` (3-D, ``(num_experts, hidden, dim)``),
``layers.1.moe.shared_experts.w1.weight``.
"""

from __future__ import annotations

from simplefsdp.models.common.decoder import Decoder, DecoderBlock
from simplefsdp.models.common.moe import (  # noqa: F401 (re-exported for the moe package)
    GroupedExperts,
    MoE,
    TokenChoiceRouter,
    grouped_mm_supported,
)

from .args import MoEArgs


class TransformerBlock(DecoderBlock):
    """Pre-norm block: attention, then a dense feed-forward network of width
    ``dense_hidden_dim`` (``layer_id < n_dense_layers``) or a MoE layer."""

    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__(
            layer_id,
            args,
            ffn_hidden_dim=args.dense_hidden_dim,
            moe=layer_id >= args.n_dense_layers,
        )


class Transformer(Decoder):
    """Mixture-of-experts decoder-only language model (the shared
    :class:`~simplefsdp.models.common.Decoder` over :class:`TransformerBlock`
    layers).

    Builds on the meta device like :class:`simplefsdp.models.llama3.Transformer`
    (``to_empty`` then :meth:`init_weights`); ``init_weights`` also restarts
    the routing bias and token counts at zero.

    Args:
        args: model arguments.
    """

    block_type = TransformerBlock
