"""Llama 3 / 3.1 model arguments, and parameter and FLOP counts from them.

No tensors are built here; :mod:`.model` builds the module from a
:class:`ModelArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from simplefsdp.models.common.config import (  # noqa: F401 (re-exported for the llama3 package)
    DecoderArgs,
    RopeScaling,
    attention_params,
    check_positive_int,
    check_positive_number,
    count_params,
)
from simplefsdp.models.common.feed_forward import ffn_hidden_dim


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    """Hyper-parameters of a Llama 3 model: the shared decoder fields
    (:class:`~simplefsdp.models.common.DecoderArgs`: ``dim``, ``n_layers``,
    ``n_heads``, ``n_kv_heads``, ``vocab_size``, ``norm_eps``, ``rope_theta``,
    ``rope_scaling``, ``max_seq_len``) plus the feed-forward sizing.

    The dataclass is frozen; derive variants with :func:`dataclasses.replace`
    (or :func:`simplefsdp.models.llama3.get_config` with keyword overrides).

    Attributes:
        multiple_of: The SwiGLU hidden size is rounded up to a multiple of this.
        ffn_dim_multiplier: Optional multiplier on the SwiGLU hidden size.

    Raises:
        ValueError: From ``__post_init__`` if a size is not positive, ``dim``
            is not divisible by ``n_heads``, ``n_heads`` is not divisible by
            ``n_kv_heads``, or the head dimension is odd. The message names the
            offending value.
    """

    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        super().__post_init__()
        check_positive_int("multiple_of", self.multiple_of)
        if self.ffn_dim_multiplier is not None:
            check_positive_number("ffn_dim_multiplier", self.ffn_dim_multiplier)

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the SwiGLU feed-forward network (see :func:`ffn_hidden_dim`)."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


# --------------------------------------------------------------------------- #
# Parameter and FLOP accounting
# --------------------------------------------------------------------------- #


def _num_params_from_args(args: ModelArgs, exclude_embeddings: bool) -> int:
    """Parameter count of ``Transformer(args)`` computed from the shapes."""
    attention = attention_params(args)  # wq, wo, wk, wv
    feed_forward = 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    norms = 2 * args.dim  # attention_norm, ffn_norm
    per_layer = attention + feed_forward + norms
    total = args.n_layers * per_layer + args.dim + args.vocab_size * args.dim  # + norm, output
    if not exclude_embeddings:
        total += args.vocab_size * args.dim  # tok_embeddings
    return total


def num_params(model_or_args: nn.Module | ModelArgs, exclude_embeddings: bool = False) -> int:
    """Count parameters of a model or of the model a :class:`ModelArgs` describes.

    For a module, the (global) ``numel`` of each distinct parameter is summed,
    so meta-device and DTensor-wrapped models are counted correctly. For a
    :class:`ModelArgs` the count is computed from the shapes without building
    anything.

    Args:
        model_or_args: A module (typically a :class:`Transformer`) or a
            :class:`ModelArgs`.
        exclude_embeddings: If true, leave out the input token embedding
            (``tok_embeddings.weight``). The untied ``output`` projection is
            always counted, since it costs matmul FLOPs.

    Returns:
        The number of parameters.
    """
    if isinstance(model_or_args, ModelArgs):
        return _num_params_from_args(model_or_args, exclude_embeddings)
    return count_params(model_or_args, exclude_embeddings)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM / torchtitan formula.

    ``6 * N + 12 * n_layers * dim * seq_len`` where ``N`` is the number of
    parameters excluding the input embedding but including the output
    projection (see :func:`num_params` with ``exclude_embeddings=True``).

    The ``6 * N`` term counts the dense matmuls (2 FLOPs per multiply-add,
    times three for forward, input-gradient and weight-gradient). The second
    term is the attention score and value matmuls ``2 * 2 * n_layers * seq_len
    * dim`` forward, times three; it is *not* halved for causal masking, which
    matches PaLM's appendix and torchtitan's MFU accounting.

    Args:
        args: Model hyper-parameters.
        seq_len: Training sequence length.

    Returns:
        FLOPs per trained token.

    Raises:
        ValueError: If ``seq_len`` is not a positive int.
    """
    check_positive_int("seq_len", seq_len)
    n = num_params(args, exclude_embeddings=True)
    return 6 * n + 12 * args.n_layers * args.dim * seq_len
