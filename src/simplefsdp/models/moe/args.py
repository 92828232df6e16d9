"""Mixture-of-experts transformer arguments, and parameter counts from them.

No tensors are built here; :mod:`.model` builds the module from a
:class:`MoEArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from simplefsdp.models.common.config import (
    DecoderArgs,
    attention_params,
    check_positive_int,
    check_positive_number,
    count_params,
)
from simplefsdp.models.common.feed_forward import ffn_hidden_dim

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE_MODES = ("bias", "aux_loss", "none")


@dataclass(frozen=True)
class MoEArgs(DecoderArgs):
    """Hyper-parameters of a mixture-of-experts decoder: the shared decoder
    fields (:class:`~simplefsdp.models.common.DecoderArgs`: ``dim``,
    ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``, ``norm_eps``,
    ``rope_theta``, ``rope_scaling``, ``max_seq_len``) plus the experts'.

    Blocks ``0 .. n_dense_layers - 1`` use a dense SwiGLU feed-forward network
    of width ``dense_hidden_dim``; every later block uses a :class:`~.model.MoE`
    layer: a token-choice top-``top_k`` router over ``num_experts`` routed
    experts (SwiGLU of width ``moe_hidden_dim`` each) plus
    ``num_shared_experts`` shared experts that every token uses.

    Attributes:
        n_dense_layers: leading blocks with a dense feed-forward network.
        dense_hidden_dim: hidden size of those; ``None`` computes it the Llama
            way from ``dim`` (``multiple_of`` 256).
        num_experts: routed experts per MoE layer.
        top_k: experts each token is routed to.
        moe_hidden_dim: hidden size of one routed (and one shared) expert.
        num_shared_experts: shared experts (one SwiGLU of width
            ``num_shared_experts * moe_hidden_dim``); 0 for none.
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
        route_norm: renormalise the top-k scores of a token to sum to one.
        route_scale: multiplier on the routing scores.
        load_balance: ``"bias"`` (DeepSeek-V3's auxiliary-loss-free score
            bias, updated after each optimizer step by
            :func:`~.load_balance.update_expert_bias`), ``"aux_loss"`` (a
            switch-style auxiliary loss whose gradient is added in backward)
            or ``"none"``.
        bias_update_rate: step of the score bias update (``"bias"``).
        aux_loss_coeff: weight of the auxiliary loss (``"aux_loss"``).

    Raises:
        ValueError: from ``__post_init__`` naming the offending value.
    """

    n_dense_layers: int = 1
    dense_hidden_dim: int | None = None
    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256
    num_shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance: Literal["bias", "aux_loss", "none"] = "bias"
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 1e-2

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        super().__post_init__()
        for name in ("num_experts", "top_k", "moe_hidden_dim"):
            check_positive_int(name, getattr(self, name))
        if self.dense_hidden_dim is None:
            object.__setattr__(self, "dense_hidden_dim", ffn_hidden_dim(self.dim, 256, None))
        check_positive_int("dense_hidden_dim", self.dense_hidden_dim)
        for name in ("n_dense_layers", "num_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.load_balance not in LOAD_BALANCE_MODES:
            raise ValueError(
                f"load_balance must be one of {LOAD_BALANCE_MODES}, got {self.load_balance!r}"
            )
        for name in ("route_scale", "bias_update_rate", "aux_loss_coeff"):
            check_positive_number(name, getattr(self, name))

    @property
    def n_moe_layers(self) -> int:
        """Number of blocks with a MoE layer."""
        return self.n_layers - self.n_dense_layers


def _count(args: MoEArgs, experts_counted: int, exclude_embeddings: bool) -> int:
    expert = 3 * args.dim * args.moe_hidden_dim
    dense_block = 3 * args.dim * args.dense_hidden_dim
    moe_block = args.dim * args.num_experts + expert * (experts_counted + args.num_shared_experts)
    per_layer = attention_params(args) + 2 * args.dim
    total = (
        args.n_layers * per_layer
        + args.n_dense_layers * dense_block
        + args.n_moe_layers * moe_block
        + args.dim
        + args.vocab_size * args.dim
    )
    if not exclude_embeddings:
        total += args.vocab_size * args.dim
    return total


def num_params(model_or_args: nn.Module | MoEArgs, exclude_embeddings: bool = False) -> int:
    """Count parameters of a MoE model or of the model a :class:`MoEArgs` describes.

    Args:
        model_or_args: a module (global ``numel`` of each distinct parameter,
            so meta and DTensor models count correctly) or a :class:`MoEArgs`.
        exclude_embeddings: leave out the input token embedding.

    Returns:
        The number of parameters (all experts).
    """
    if isinstance(model_or_args, MoEArgs):
        return _count(model_or_args, model_or_args.num_experts, exclude_embeddings)
    return count_params(model_or_args, exclude_embeddings)


def num_active_params(args: MoEArgs, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses: ``top_k`` routed experts per MoE layer.

    Args:
        args: model arguments.
        exclude_embeddings: leave out the input token embedding.

    Returns:
        The activated parameter count (the one MoE FLOP estimates use).
    """
    return _count(args, args.top_k, exclude_embeddings)
