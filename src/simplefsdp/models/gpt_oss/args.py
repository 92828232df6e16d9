"""GPT-OSS configuration: :class:`GptOssArgs`, and parameter counts from it.

No tensors are built here; :mod:`.model` builds the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from simplefsdp.models.common.config import check_positive_int, check_positive_number, count_params
from simplefsdp.models.moe.args import MoEArgs

#: The attention kinds of ``layer_types`` (Hugging Face's names).
LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """The published pattern: sliding-window attention on even layers, full on odd ones."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


@dataclass(frozen=True)
class GptOssArgs(MoEArgs):
    """Hyper-parameters of a GPT-OSS decoder.

    The mixture-of-experts fields of :class:`~simplefsdp.models.moe.MoEArgs`
    (every block is a MoE layer: ``n_dense_layers`` 0, no shared experts,
    softmax over the ``top_k`` largest router logits) plus:

    Attributes:
        head_dim: attention head size (GPT-OSS: 64, independent of ``dim``).
        sliding_window: keys a query of a ``"sliding_attention"`` layer sees,
            itself included.
        layer_types: ``"sliding_attention"`` or ``"full_attention"`` per
            layer; ``None`` alternates, starting with a sliding layer (as
            the published models; that pattern given explicitly is stored
            as ``None``). See :meth:`resolved_layer_types`.
        swiglu_limit: clamp of the experts' gate (above) and up projection
            (both sides) before the gated activation.
        swiglu_alpha: slope of the sigmoid in the experts' gate
            ``g * sigmoid(alpha * g)``.

    Raises:
        ValueError: from ``__post_init__`` naming the offending value.
    """

    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int | None = 8
    vocab_size: int = 201088
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    n_dense_layers: int = 0
    num_experts: int = 32
    top_k: int = 4
    moe_hidden_dim: int = 2880
    num_shared_experts: int = 0
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    load_balance: Literal["bias", "aux_loss", "none"] = "none"
    head_dim: int = 64
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        """Resolve ``layer_types`` and validate the GPT-OSS fields."""
        check_positive_int("head_dim", self.head_dim)
        super().__post_init__()
        check_positive_int("sliding_window", self.sliding_window)
        check_positive_number("swiglu_limit", self.swiglu_limit)
        check_positive_number("swiglu_alpha", self.swiglu_alpha)
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if types == default_layer_types(self.n_layers):
                types = None  # stays right when n_layers changes
            object.__setattr__(self, "layer_types", types)
            if types is not None and len(types) != self.n_layers:
                raise ValueError(
                    f"layer_types has {len(types)} entries but n_layers={self.n_layers}"
                )
            bad = sorted(set(types or ()) - set(LAYER_TYPES))
            if bad:
                raise ValueError(
                    f"layer_types {bad} are not supported; valid: {', '.join(LAYER_TYPES)}"
                )
        if self.n_dense_layers != 0:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers}: every GPT-OSS block is a MoE layer; use 0"
            )
        if self.num_shared_experts != 0:
            raise ValueError(
                f"num_shared_experts={self.num_shared_experts}: GPT-OSS has no shared experts; "
                "use 0"
            )

    attention_sinks: ClassVar[bool] = True

    def resolved_layer_types(self) -> tuple[str, ...]:
        """The attention kind of every layer."""
        return self.layer_types or default_layer_types(self.n_layers)

    def sliding_window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (``None``: full attention)."""
        sliding = self.resolved_layer_types()[layer_id] == "sliding_attention"
        return self.sliding_window if sliding else None


def attention_params(args: GptOssArgs) -> int:
    """Parameters of one attention: q/k/v/o projections with biases, and the sinks."""
    q = args.n_heads * args.head_dim
    kv = args.n_kv_heads * args.head_dim
    return (args.dim + 1) * (q + 2 * kv) + (q + 1) * args.dim + args.n_heads


def expert_params(args: GptOssArgs) -> int:
    """Parameters of one expert: gate/up (``2 * moe_hidden_dim``) and down, with biases."""
    hidden = args.moe_hidden_dim
    return (args.dim + 1) * 2 * hidden + (hidden + 1) * args.dim


def _count(args: GptOssArgs, experts_counted: int, exclude_embeddings: bool) -> int:
    router = (args.dim + 1) * args.num_experts
    per_layer = (
        attention_params(args) + 2 * args.dim + router + experts_counted * expert_params(args)
    )
    total = args.n_layers * per_layer + args.dim + args.vocab_size * args.dim
    if not exclude_embeddings:
        total += args.vocab_size * args.dim
    return total


def num_params(model_or_args: nn.Module | GptOssArgs, exclude_embeddings: bool = False) -> int:
    """Parameters of a GPT-OSS model or of the model a :class:`GptOssArgs` describes.

    Args:
        model_or_args: a module (global ``numel`` of each distinct parameter)
            or a :class:`GptOssArgs`.
        exclude_embeddings: leave out the input token embedding.
    """
    if isinstance(model_or_args, GptOssArgs):
        return _count(model_or_args, model_or_args.num_experts, exclude_embeddings)
    return count_params(model_or_args, exclude_embeddings)


def num_active_params(args: GptOssArgs, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses (``top_k`` experts per layer).

    Args:
        args: model arguments.
        exclude_embeddings: leave out the input token embedding.
    """
    return _count(args, args.top_k, exclude_embeddings)


def flops_per_token(args: GptOssArgs, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the active
    parameters without the input embedding, plus attention's
    ``6 * n_layers * n_heads * 2 * head_dim * seq_len`` (every layer counted
    over the whole sequence, as the kernel computes it)."""
    n = num_active_params(args, exclude_embeddings=True)
    return 6 * n + 6 * args.n_layers * args.n_heads * 2 * args.head_dim * seq_len
