"""The mixture-of-experts layer: router, grouped experts, shared experts.

A :class:`MoE` layer replaces a block's feed-forward network. Its forward
sorts the (token, choice) pairs by expert and hands :class:`GroupedExperts`
the tokens and the token count of each expert (torchtitan's
``GroupedExperts`` convention). Expert parallelism is applied from the outside
to the module named ``experts`` (:mod:`simplefsdp.frontend.expert_parallel`);
under tensor parallelism the shared experts are sharded like a dense
feed-forward network and the routed experts over their hidden dim, as the
experts module declares in ``tp_shard_dims``
(:func:`simplefsdp.models.common.tensor_parallel.moe_plan`).

Parameter FQNs follow torchtitan: ``moe.router.gate.weight``,
``moe.experts.w1`` (3-D, ``(num_experts, hidden, dim)``),
``moe.shared_experts.w1.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from .feed_forward import FeedForward
from .norms import trunc_normal_


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x`` against these expert weights.

    It needs the op (torch >= 2.8), row strides that are multiples of 16
    bytes, and bfloat16 on CUDA or under ``torch.compile`` (whose shape
    function of the op accepts bfloat16 only, although the CPU kernel runs
    float32); otherwise :class:`GroupedExperts` loops over the experts.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    bf16_only = x.device.type == "cuda" or torch.compiler.is_compiling()
    if bf16_only and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    align = 16 // x.element_size()
    return all(w.shape[-1] % align == 0 and w.shape[-2] % align == 0 for w in weights)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous
    (``torch._grouped_mm``'s backward rejects expanded gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _as_local(weight: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor weight (expert parallelism shards the
    experts dim; token counts are data-dependent, so the math is local)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def partial_output_bias(bias: torch.Tensor, weight: torch.Tensor, dim: int) -> torch.Tensor:
    """The local part of ``bias``, added to the output of a matmul by
    ``weight``: the whole bias when that output is whole; under tensor
    parallelism, when ``weight`` is split on its input dim ``dim`` (so the
    output is a partial sum over the TP ranks), the bias on the first TP rank
    and zeros on the others, with its gradient summed over them (the bias is
    added once, and every rank's copy trains alike)."""
    if not (isinstance(weight, DTensor) and isinstance(bias, DTensor)):
        return _as_local(bias)
    if weight.device_mesh.ndim != 1 or weight.placements[0] != Shard(dim % weight.ndim):
        return _as_local(bias)
    keep = 1.0 if weight.device_mesh.get_local_rank() == 0 else 0.0
    return bias.to_local(grad_placements=(Partial(),)) * keep


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as 3-D parameters.

    ``w1``, ``w3``: ``(num_experts, hidden_dim, dim)``; ``w2``:
    ``(num_experts, dim, hidden_dim)``. All experts run as one grouped matmul
    (``torch._grouped_mm``) where supported (see
    :func:`grouped_mm_supported`), else as a loop over experts; both give the
    same result.

    Args:
        dim: model width.
        hidden_dim: hidden size of one expert.
        num_experts: number of experts.
        use_grouped_mm: ``None`` picks automatically; ``False`` forces the loop.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Expert tensor parallelism splits the hidden dim.
        self.tp_shard_dims = {"w1": 1, "w2": 2, "w3": 1}

    def init_weights(self, init_std: float) -> None:
        """Initialise in place: ``w1`` with std 0.02, ``w2``/``w3`` with ``init_std``."""
        trunc_normal_(self.w1, 0.02)
        trunc_normal_(self.w2, init_std)
        trunc_normal_(self.w3, init_std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous run of tokens.

        Args:
            x: tokens sorted by expert, ``(R, dim)``.
            num_tokens_per_expert: ``(num_local_experts,)`` integer counts
                summing to ``R``; an expert may receive none.

        Returns:
            ``(R, dim)``: expert ``e``'s output for each of its tokens.
        """
        w1, w2, w3 = _as_local(self.w1), _as_local(self.w2), _as_local(self.w3)
        use_grouped = self.use_grouped_mm
        if use_grouped is None:
            use_grouped = grouped_mm_supported(x, w1, w2)
        if use_grouped:
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            x = _ContiguousGrad.apply(x)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))  # (R, F)
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)  # (R, F)
            out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)  # (R, D)
            return _ContiguousGrad.apply(out)
        return _expert_loop(x, num_tokens_per_expert, w1, w2, w3)


# Compiled, the loop's split sizes would be traced as this step's values and
# recompile per step; the loop runs uncompiled (Note: [Expert parallelism
# under torch.compile] in simplefsdp/frontend/expert_parallel.py).
@torch.compiler.disable
def _expert_loop(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """:class:`GroupedExperts` as a loop over experts: ``(R, dim) -> (R, dim)``."""
    outputs = []
    counts = num_tokens_per_expert.tolist()
    for expert, chunk in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(chunk @ w1[expert].T) * (chunk @ w3[expert].T)  # (r, F)
        outputs.append(h @ w2[expert].T)  # (r, D)
    return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, x.shape[-1])


class TokenChoiceRouter(nn.Module):
    """Token-choice top-k router: each token picks its ``top_k`` experts.

    Scores are ``softmax`` or ``sigmoid`` of a linear gate computed in
    float32. An optional per-expert bias (auxiliary-loss-free balancing) is
    added for the choice only; the gating weights are the unbiased scores,
    optionally renormalised over the chosen experts and scaled. With
    ``num_groups > 1`` (DeepSeek-V3's group-limited routing) the experts form
    equal groups, each scored by the sum of its two best biased scores, and a
    token chooses only among the experts of its ``num_limited_groups`` best
    groups.

    Args:
        dim: model width.
        num_experts: routed experts.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        route_norm: renormalise the chosen scores to sum to one.
        route_scale: multiplier on the gating weights.
        num_groups: expert groups (1: no group limit).
        num_limited_groups: groups a token's experts come from.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "sigmoid",
        route_norm: bool = True,
        route_scale: float = 1.0,
        num_groups: int = 1,
        num_limited_groups: int = 1,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_groups = num_groups
        self.num_limited_groups = num_limited_groups
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` of shape ``(N, dim)``.

        Returns:
            ``(top_scores (N, K) float32, top_experts (N, K) int64, scores (N, E) float32)``.
        """
        logits = F.linear(x.float(), self.gate.weight.float())  # (N, E)
        if self.score_func == "softmax":
            scores = F.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_groups > 1:
            grouped = choice.view(choice.shape[0], self.num_groups, -1)  # (N, G, E/G)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
            best = group_scores.topk(self.num_limited_groups, dim=-1).indices  # (N, g)
            excluded = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, best, False)
            choice = grouped.masked_fill(excluded.unsqueeze(-1), float("-inf")).flatten(1)
        _, top_experts = torch.topk(choice, k=self.top_k, dim=-1)  # (N, K)
        top_scores = scores.gather(-1, top_experts)  # (N, K)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores * self.route_scale, top_experts, scores


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``x``; backward also sends gradient 1 into ``aux_loss`` so the
    auxiliary loss trains the router without changing the model's output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class MoE(nn.Module):
    """Routed experts plus shared experts, with load balancing.

    Buffers:
        expert_bias: ``(E,)`` float32 routing bias (persistent; only with
            ``load_balance="bias"``), changed only by
            :func:`~simplefsdp.models.common.load_balance.update_expert_bias`.
        tokens_per_expert: ``(E,)`` float32 tokens routed to each expert since
            the last bias update (not persistent), counted in training.

    Args:
        args: the configuration's MoE fields (duck-typed: ``dim``,
            ``num_experts``, ``top_k``, ``moe_hidden_dim``,
            ``num_shared_experts``, ``score_func``, ``route_norm``,
            ``route_scale``, ``load_balance``, ``bias_update_rate``,
            ``aux_loss_coeff``; see
            :class:`simplefsdp.models.moe.MoEArgs`; optionally
            ``num_expert_groups`` and ``num_limited_groups`` for
            group-limited routing).
    """

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.load_balance = args.load_balance
        self.bias_update_rate = args.bias_update_rate
        self.aux_loss_coeff = args.aux_loss_coeff
        self.router = TokenChoiceRouter(
            args.dim,
            args.num_experts,
            args.top_k,
            args.score_func,
            args.route_norm,
            args.route_scale,
            num_groups=getattr(args, "num_expert_groups", 1),
            num_limited_groups=getattr(args, "num_limited_groups", 1),
        )
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_hidden_dim * args.num_shared_experts)
            if args.num_shared_experts
            else None
        )
        bias = torch.zeros(args.num_experts) if args.load_balance == "bias" else None
        self.register_buffer("expert_bias", bias, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def init_weights(self, init_std: float, buffer_device: torch.device | str | None) -> None:
        """Initialise parameters in place and zero the buffers."""
        trunc_normal_(self.router.gate.weight, init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = self.tokens_per_expert.device if buffer_device is None else buffer_device
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(B, T, D)``; returns ``(B, T, D)``."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, D)
        top_scores, top_experts, scores = self.router(tokens, self.expert_bias)
        flat_experts = top_experts.reshape(-1)  # (N*K,)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat_experts, torch.ones_like(flat_experts))  # (E,)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        # Sort the (token, choice) pairs by expert; ties keep token order.
        order = torch.argsort(flat_experts, stable=True)  # (N*K,)
        token_index = order // self.top_k  # (N*K,)
        routed = tokens[token_index]  # (N*K, D), sorted by expert
        out = self.experts(routed, counts)  # (N*K, D)
        weights = top_scores.reshape(-1)[order].unsqueeze(-1)  # (N*K, 1)
        out = (out.float() * weights).to(tokens.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_index, out)  # (N, D)
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(tokens)
        if self.load_balance == "aux_loss" and self.training:
            combined = _AddAuxLoss.apply(combined, self._aux_loss(scores, counts))
        return combined.reshape(shape)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch-style balance loss ``coeff * E * sum_e f_e * p_e`` over this batch:
        ``f_e`` the fraction of routed slots, ``p_e`` the mean normalised score."""
        probs = scores / scores.sum(dim=-1, keepdim=True)  # (N, E)
        fraction = counts.float() / counts.sum().clamp(min=1)  # (E,)
        return self.aux_loss_coeff * self.num_experts * (fraction * probs.mean(dim=0)).sum()
