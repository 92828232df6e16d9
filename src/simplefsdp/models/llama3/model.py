"""Llama 3 / 3.1 decoder-only transformer as a plain ``nn.Module``.

The architecture follows Meta's reference implementation and torchtitan, from
the shared components of :mod:`simplefsdp.models.common`: pre-norm blocks with
RMSNorm, grouped-query attention with rotary position embeddings (optionally
with the Llama 3.1 frequency scaling), and a SwiGLU feed-forward network. The
output projection is not tied to the token embedding.

There is deliberately no parallelism code here. Parameter FQNs match
torchtitan, e.g. ``layers.0.attention.wq.weight``.
"""

from __future__ import annotations

from simplefsdp.models.common.attention import Attention, repeat_kv  # noqa: F401 (re-exported for the llama3 package)
from simplefsdp.models.common.decoder import Decoder, DecoderBlock
from simplefsdp.models.common.feed_forward import FeedForward  # noqa: F401 (re-exported for the llama3 package)
from simplefsdp.models.common.norms import RMSNorm  # noqa: F401 (re-exported for the llama3 package)
from simplefsdp.models.common.rotary import (  # noqa: F401 (re-exported for the llama3 package)
    apply_rope_scaling,
    apply_rotary_emb,
    precompute_freqs_cis,
    rope_frequencies,
)

from .args import ModelArgs


class TransformerBlock(DecoderBlock):
    """Llama 3 block: attention then a SwiGLU feed-forward network of width
    ``args.ffn_hidden_dim``, each pre-normed with a residual.

    Args:
        layer_id: Index of the block, used for depth-scaled initialisation.
        args: Model hyper-parameters.
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__(layer_id, args, ffn_hidden_dim=args.ffn_hidden_dim)


class Transformer(Decoder):
    """Llama 3 decoder-only language model (:class:`~simplefsdp.models.common.Decoder`
    over :class:`TransformerBlock` layers).

    The module can be built on the meta device and materialised later::

        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device="cpu")
        model.init_weights()

    Args:
        args: Model hyper-parameters.
    """

    block_type = TransformerBlock
