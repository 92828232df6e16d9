"""DeepSeek-V3 arguments, and parameter counts from them.

No tensors are built here; :mod:`.model` builds the module from a
:class:`DeepSeekV3Args`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from simplefsdp.models.common.config import check_positive_int, count_params
from simplefsdp.models.moe.args import MoEArgs


@dataclass(frozen=True)
class DeepSeekV3Args(MoEArgs):
    """Hyper-parameters of a DeepSeek-V3 decoder: the mixture-of-experts
    fields (:class:`~simplefsdp.models.moe.MoEArgs`: blocks
    ``0 .. n_dense_layers - 1`` dense, the others routed plus shared
    experts) with multi-head latent attention and group-limited routing.

    Hugging Face ``config.json`` names in brackets.

    Attributes:
        q_lora_rank: query compression rank [``q_lora_rank``]; 0 for a plain
            query projection ``wq`` (``null`` in Hugging Face).
        kv_lora_rank: key/value compression rank [``kv_lora_rank``].
        qk_nope_head_dim: per-head query/key size without rotary embedding.
        qk_rope_head_dim: per-head query/key size with rotary embedding; the
            key's rotary part is one vector shared by every head.
        v_head_dim: per-head value size.
        num_expert_groups: routed experts form this many equal groups
            [``n_group``]; 1: no group limit.
        num_limited_groups: a token's experts come from its best this many
            groups [``topk_group``], a group scored by the sum of its two
            best (biased) scores.

    ``n_kv_heads`` is always ``n_heads`` (every head has its own keys and
    values). The other DeepSeek-V3 fields are :class:`MoEArgs`'s: ``n_dense_layers``
    [``first_k_dense_replace``], ``dense_hidden_dim`` [``intermediate_size``],
    ``num_experts`` [``n_routed_experts``], ``top_k``
    [``num_experts_per_tok``], ``moe_hidden_dim`` [``moe_intermediate_size``],
    ``num_shared_experts`` [``n_shared_experts``], ``route_norm``
    [``norm_topk_prob``], ``route_scale`` [``routed_scaling_factor``] and
    ``load_balance="bias"`` (the auxiliary-loss-free routing bias
    [``e_score_correction_bias``]).

    Raises:
        ValueError: from ``__post_init__`` naming the offending value.
    """

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_expert_groups: int = 1
    num_limited_groups: int = 1

    def __post_init__(self) -> None:
        """Resolve defaults and validate the configuration."""
        # Latent attention gives every head its own keys and values.
        object.__setattr__(self, "n_kv_heads", self.n_heads)
        super().__post_init__()
        value = self.q_lora_rank
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"q_lora_rank must be an int >= 0 (0: no query compression), got {value!r}"
            )
        for name in (
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "num_expert_groups",
            "num_limited_groups",
        ):
            check_positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings"
            )
        groups = self.num_expert_groups
        if self.num_experts % groups:
            raise ValueError(
                f"num_expert_groups={groups} does not divide num_experts={self.num_experts}"
            )
        if groups > 1 and self.num_experts // groups < 2:
            raise ValueError(
                f"num_expert_groups={groups} leaves fewer than 2 of the {self.num_experts} "
                "experts per group (a group scores by its two best experts)"
            )
        if self.num_limited_groups > groups:
            raise ValueError(
                f"num_limited_groups={self.num_limited_groups} exceeds num_expert_groups={groups}"
            )
        if self.top_k > self.num_limited_groups * (self.num_experts // groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.num_limited_groups * (self.num_experts // groups)} "
                f"experts of num_limited_groups={self.num_limited_groups} groups"
            )

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def attention_params(args: DeepSeekV3Args) -> int:
    """Parameters of one multi-head latent attention (norms included)."""
    if args.q_lora_rank == 0:
        query = args.dim * args.n_heads * args.qk_head_dim
    else:
        query = (
            args.dim * args.q_lora_rank
            + args.q_lora_rank
            + args.q_lora_rank * args.n_heads * args.qk_head_dim
        )
    key_value = (
        args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
        + args.kv_lora_rank
        + args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    )
    return query + key_value + args.n_heads * args.v_head_dim * args.dim


def _count(args: DeepSeekV3Args, experts_counted: int, exclude_embeddings: bool) -> int:
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


def num_params(model_or_args: nn.Module | DeepSeekV3Args, exclude_embeddings: bool = False) -> int:
    """Count parameters of a DeepSeek-V3 model or of the one a
    :class:`DeepSeekV3Args` describes.

    Args:
        model_or_args: a module (global ``numel`` of each distinct parameter,
            so meta and DTensor models count correctly) or a configuration.
        exclude_embeddings: leave out the input token embedding.

    Returns:
        The number of parameters (all experts; no multi-token-prediction
        module).
    """
    if isinstance(model_or_args, DeepSeekV3Args):
        return _count(model_or_args, model_or_args.num_experts, exclude_embeddings)
    return count_params(model_or_args, exclude_embeddings)


def num_active_params(args: DeepSeekV3Args, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses: ``top_k`` routed experts per MoE layer.

    Args:
        args: model arguments.
        exclude_embeddings: leave out the input token embedding.
    """
    return _count(args, args.top_k, exclude_embeddings)


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the parameters
    one token uses (no input embedding) plus attention's
    ``6 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len``."""
    n = num_active_params(args, exclude_embeddings=True)
    return 6 * n + 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
