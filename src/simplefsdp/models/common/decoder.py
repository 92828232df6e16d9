"""The decoder every family builds on: embeddings, blocks, norm, output.

:class:`Decoder` holds ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``
keyed by layer index, so a pipeline stage keeps a subset under their original
names; see :mod:`.stages`), ``norm`` and ``output`` (untied from the
embedding), and the rotary table ``freqs_cis``. A family subclasses it and
names its block type; a :class:`DecoderBlock` is pre-norm attention followed
by a dense SwiGLU feed-forward network (``feed_forward``) or a
mixture-of-experts layer (``moe``).

There is no parallelism code here: parallelism wraps the parameters from the
outside, so :meth:`Decoder.init_weights` only ever modifies parameters in
place. Parameter FQNs match torchtitan, e.g. ``layers.0.attention.wq.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import Attention
from .config import DecoderArgs
from .feed_forward import FeedForward
from .moe import MoE
from .norms import RMSNorm, trunc_normal_
from .rotary import precompute_freqs_cis


class DecoderBlock(nn.Module):
    """Pre-norm block: attention then a feed-forward network, each with a residual.

    Construction order (and so the default-initialised values under a seed)
    is ``attention_norm``, ``attention``, ``ffn_norm``, then ``moe`` or
    ``feed_forward``.

    Args:
        layer_id: Index of the block, used for depth-scaled initialisation.
        args: the decoder's configuration (a :class:`DecoderArgs`; with
            ``moe=True`` also the MoE fields :class:`~.moe.MoE` reads).
        ffn_hidden_dim: hidden size of the dense feed-forward network.
        moe: the block's feed-forward network is a :class:`~.moe.MoE` layer.
    """

    def __init__(
        self, layer_id: int, args: DecoderArgs, *, ffn_hidden_dim: int, moe: bool = False
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = moe
        if moe:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, ffn_hidden_dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise all parameters of the block in place.

        Norms get ones; ``wo``, ``w2`` and ``w3`` (and a MoE layer's router
        and experts) use the depth-scaled std ``0.02 / sqrt(2 * (layer_id +
        1))``; other projections use 0.02. A MoE layer's buffers restart at
        zero on ``buffer_device``.
        """
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, context: Any = None
    ) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(B, T, D)``.
            freqs_cis: Rotary table of shape ``(>= T, head_dim // 2, 2)`` (or
                one per row, ``(B, T, head_dim // 2, 2)``).
            context: the batch's sequence context (see :meth:`Decoder.forward`).

        Returns:
            Output of shape ``(B, T, D)``.
        """
        h = x + self.attention(self.attention_norm(x), freqs_cis, context=context)  # (B, T, D)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))  # (B, T, D)


class Decoder(nn.Module):
    """Decoder-only language model over :class:`DecoderBlock` layers.

    Subclasses set :attr:`block_type` (called ``block_type(layer_id, args)``).
    The module can be built on the meta device and materialised later::

        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device="cpu")
        model.init_weights()

    A pipeline stage (:func:`~.stages.pipeline_split`) may lack
    ``tok_embeddings`` (it then takes hidden states ``(B, T, D)``) or
    ``norm``/``output`` (it then returns hidden states).

    Args:
        args: the model's configuration.

    Attributes:
        freqs_cis: Non-persistent float32 buffer of shape
            ``(max_seq_len, head_dim // 2, 2)`` holding rotary cos/sin.
    """

    block_type: Any = None
    freqs_cis: torch.Tensor

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index: a pipeline stage keeps a subset of the
        # layers under their original names (``layers.7.…`` stays ``layers.7.…``),
        # so checkpoints move between pipeline layouts.
        self.layers = nn.ModuleDict(
            {str(i): self.block_type(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(None), persistent=False)
        self.init_weights()

    def _precompute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        """Rotary table for this model's configuration on ``device``."""
        return precompute_freqs_cis(
            self.args.head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter in place and recompute the buffers.

        torchtitan-style initialisation:

        * ``tok_embeddings``: normal, std 1.0;
        * ``wq``/``wk``/``wv``/``w1``: truncated normal, std 0.02;
        * ``wo``/``w2``/``w3`` of block ``i`` (and a MoE layer's router gate
          and experts): truncated normal, std ``0.02 / sqrt(2 * (i + 1))``;
        * ``output``: truncated normal, std ``dim ** -0.5`` (as in torchtitan);
        * all RMSNorm weights: ones; a MoE layer's routing bias and token
          counts: zeros.

        Truncation is at three standard deviations. Parameters are only
        modified in place (never replaced), so this works on parameters that
        another library has wrapped, e.g. as DTensors. The rotary buffer is
        recomputed (and re-registered in float32) because a model materialised
        with :meth:`~torch.nn.Module.to_empty` holds uninitialised memory there.
        A pipeline stage initialises only what it holds.

        Args:
            buffer_device: Device for the buffers; defaults to the device the
                rotary buffer is currently on.
        """
        device = self.freqs_cis.device if buffer_device is None else buffer_device
        self.freqs_cis = self._precompute_freqs_cis(device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights(device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, context: Any = None) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: Token ids of shape ``(B, T)`` with ``T <= max_seq_len``
                (a stage without the embedding: hidden states ``(B, T, D)``).
            context: a :class:`simplefsdp.context_parallel.SequenceContext`
                for packed documents or a sequence split over
                context-parallel ranks (``tokens`` is then this rank's share):
                the rotary table is indexed by the context's positions and
                the context reaches every layer's attention. ``None``: one
                sequence per row, positions ``0 .. T - 1``.

        Returns:
            Logits of shape ``(B, T, vocab_size)`` in the dtype of the
            computation (the dtype of the output projection); a stage
            without the head returns hidden states ``(B, T, D)``.

        Raises:
            ValueError: If ``T`` exceeds ``max_seq_len``.
        """
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds max_seq_len={self.args.max_seq_len}"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)
        # The whole table: a pipeline stage's input may be a sequence shard
        # (sequence parallelism); attention slices it to the sequence it sees.
        freqs_cis = self.freqs_cis  # (max_seq_len, hd/2, 2)
        if context is None:
            for layer in self.layers.values():
                h = layer(h, freqs_cis)  # (B, T, D)
        else:
            freqs_cis = context.rotary(freqs_cis)  # (T, hd/2, 2) or (B, T, hd/2, 2)
            for layer in self.layers.values():
                h = layer(h, freqs_cis, context=context)  # (B, T, D)
        h = self.norm(h) if self.norm is not None else h  # (B, T, D)
        return self.output(h) if self.output is not None else h  # (B, T, V)
