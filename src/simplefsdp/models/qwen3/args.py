"""Qwen3 model arguments (dense and mixture-of-experts), and parameter and
FLOP counts from them.

No tensors are built here; :mod:`.model` builds the module from a
:class:`Qwen3Args` or a :class:`Qwen3MoEArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from simplefsdp.models.common.config import (
    DecoderArgs,
    check_positive_int,
    check_positive_number,
    count_params,
)

LOAD_BALANCE_MODES = ("aux_loss", "bias", "none")


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    """Hyper-parameters of a dense Qwen3 model: the shared decoder fields
    (:class:`~simplefsdp.models.common.DecoderArgs`) plus an explicit head
    size and the feed-forward width.

    Qwen3 normalises each query and key head (RMSNorm over ``head_dim``,
    the "QK-norm") before the rotary embedding; there are no attention
    biases.

    Attributes:
        head_dim: size of one attention head, independent of
            ``dim / n_heads`` (Qwen3-0.6B: ``dim`` 1024, 16 heads of 128);
            ``None`` means ``dim // n_heads``.
        hidden_dim: hidden size of the SwiGLU feed-forward network
            (Hugging Face's ``intermediate_size``).

    Raises:
        ValueError: from ``__post_init__``, naming the offending value.
    """

    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    vocab_size: int = 151936
    max_seq_len: int = 40960
    head_dim: int | None = None  # shadows DecoderArgs.head_dim (a property there)
    hidden_dim: int = 3072

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        if self.head_dim is None:
            check_positive_int("n_heads", self.n_heads)
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        check_positive_int("head_dim", self.head_dim)
        super().__post_init__()
        check_positive_int("hidden_dim", self.hidden_dim)

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has a mixture-of-experts layer (never, dense)."""
        return False


@dataclass(frozen=True)
class Qwen3MoEArgs(Qwen3Args):
    """Hyper-parameters of a Qwen3 mixture-of-experts model: :class:`Qwen3Args`
    plus the experts.

    Block ``i`` has a MoE layer unless ``i`` is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0`` (Hugging Face's rule); other
    blocks have a dense SwiGLU network of width ``hidden_dim``. A MoE layer
    routes each token to ``top_k`` of ``num_experts`` experts by a softmax
    over all experts' gate logits, the chosen scores renormalised to sum to
    one when ``route_norm`` (``norm_topk_prob``); there is no shared expert.

    Attributes:
        num_experts: routed experts per MoE layer.
        top_k: experts each token is routed to (``num_experts_per_tok``).
        moe_hidden_dim: hidden size of one expert (``moe_intermediate_size``).
        route_norm: renormalise the chosen scores (``norm_topk_prob``).
        decoder_sparse_step: every ``decoder_sparse_step``-th block is MoE.
        mlp_only_layers: blocks with a dense network regardless.
        load_balance: ``"aux_loss"`` (a switch-style auxiliary loss, Hugging
            Face's ``router_aux_loss_coef``, added to the gradient only),
            ``"bias"`` (DeepSeek-V3's auxiliary-loss-free routing bias,
            updated after each optimizer step; not part of a Hugging Face
            export, which starts it at zero on load) or ``"none"``.
        aux_loss_coeff: weight of the auxiliary loss (``"aux_loss"``).
        bias_update_rate: step of the routing-bias update (``"bias"``).

    Raises:
        ValueError: from ``__post_init__``, naming the offending value.
    """

    num_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    route_norm: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coeff: float = 1e-3
    bias_update_rate: float = 1e-3

    # What the shared MoE layer (simplefsdp.models.common.moe.MoE) and the
    # analytic planner read, fixed for Qwen3: softmax routing without a
    # scale, no shared experts, grouped-query attention.
    score_func: ClassVar[str] = "softmax"
    route_scale: ClassVar[float] = 1.0
    num_shared_experts: ClassVar[int] = 0
    attention: ClassVar[str] = "gqa"

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        super().__post_init__()
        for name in ("num_experts", "top_k", "moe_hidden_dim", "decoder_sparse_step"):
            check_positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not isinstance(self.route_norm, bool):
            raise ValueError(f"route_norm must be a bool, got {self.route_norm!r}")
        layers = tuple(self.mlp_only_layers)
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in layers if isinstance(i, int) and not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(
                f"mlp_only_layers {list(layers)} must hold layer indices in "
                f"0..{self.n_layers - 1}; bad: {bad}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))
        if self.load_balance not in LOAD_BALANCE_MODES:
            raise ValueError(
                f"load_balance must be one of {LOAD_BALANCE_MODES}, got {self.load_balance!r}"
            )
        check_positive_number("aux_loss_coeff", self.aux_loss_coeff)
        check_positive_number("bias_update_rate", self.bias_update_rate)

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has a mixture-of-experts layer."""
        return (
            layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def n_moe_layers(self) -> int:
        """Number of blocks with a MoE layer."""
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    @property
    def n_dense_layers(self) -> int:
        """Number of blocks with a dense feed-forward network."""
        return self.n_layers - self.n_moe_layers

    @property
    def dense_hidden_dim(self) -> int:
        """Hidden size of the dense blocks' network (``hidden_dim``)."""
        return self.hidden_dim


# --------------------------------------------------------------------------- #
# Parameter and FLOP accounting
# --------------------------------------------------------------------------- #


def _count(args: Qwen3Args, experts_counted: int, exclude_embeddings: bool) -> int:
    """Parameters of ``Transformer(args)`` from the shapes, ``experts_counted``
    routed experts per MoE layer."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * q_dim + 2 * args.dim * kv_dim + 2 * args.head_dim  # + q/k norms
    per_layer = attention + 2 * args.dim  # + attention_norm, ffn_norm
    n_moe = getattr(args, "n_moe_layers", 0)
    dense = (args.n_layers - n_moe) * 3 * args.dim * args.hidden_dim
    moe = 0
    if n_moe:
        expert = 3 * args.dim * args.moe_hidden_dim
        moe = n_moe * (args.dim * args.num_experts + experts_counted * expert)
    total = args.n_layers * per_layer + dense + moe + args.dim + args.vocab_size * args.dim
    if not exclude_embeddings:
        total += args.vocab_size * args.dim
    return total


def num_params(model_or_args: nn.Module | Qwen3Args, exclude_embeddings: bool = False) -> int:
    """Count parameters of a Qwen3 model or of the model a config describes.

    The output projection is counted on its own (our model does not tie it
    to the embedding, see docs/models/qwen3.md).

    Args:
        model_or_args: a module (global ``numel`` of each distinct parameter,
            so meta and DTensor models count correctly) or a
            :class:`Qwen3Args` / :class:`Qwen3MoEArgs`.
        exclude_embeddings: leave out the input token embedding.

    Returns:
        The number of parameters (all experts).
    """
    if isinstance(model_or_args, Qwen3Args):
        experts = getattr(model_or_args, "num_experts", 0)
        return _count(model_or_args, experts, exclude_embeddings)
    return count_params(model_or_args, exclude_embeddings)


def num_active_params(args: Qwen3Args, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses: ``top_k`` routed experts per MoE layer.

    Args:
        args: model arguments.
        exclude_embeddings: leave out the input token embedding.
    """
    return _count(args, getattr(args, "top_k", 0), exclude_embeddings)


def flops_per_token(args: Qwen3Args, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the parameters
    one token uses (no input embedding) plus attention's
    ``12 * n_layers * n_heads * head_dim * seq_len`` (not halved for the
    causal mask).

    Raises:
        ValueError: ``seq_len`` is not a positive int.
    """
    check_positive_int("seq_len", seq_len)
    n = num_active_params(args, exclude_embeddings=True)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
