"""The mixture-of-experts family's :class:`~simplefsdp.models.spec.ModelSpec`."""

from __future__ import annotations

from typing import Any

from simplefsdp.models.llama3.spec import cross_entropy
from simplefsdp.models.moe.args import MoEArgs, num_active_params, num_params
from simplefsdp.models.moe.configs import MOE_CONFIGS
from simplefsdp.models.moe.load_balance import update_expert_bias
from simplefsdp.models.moe.model import Transformer
from simplefsdp.models.spec import ModelSpec

__all__ = ["SPEC", "flops_per_token"]


def flops_per_token(args: MoEArgs, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the parameters
    one token uses (``top_k`` routed experts per layer, no input embedding)
    plus attention's ``6 * n_layers * n_heads * (qk + v head dims) * seq_len``
    (``12 * n_layers * dim * seq_len`` for grouped-query attention)."""
    n = num_active_params(args, exclude_embeddings=True)
    if args.attention == "gqa":
        qk = v = args.dim // args.n_heads
    else:
        qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    return 6 * n + 6 * args.n_layers * args.n_heads * (qk + v) * seq_len


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _after_optimizer_step(model: Any) -> dict[str, float]:
    loads = update_expert_bias(model)
    if not loads:
        return {}
    return {"expert_imbalance": max(load.imbalance for load in loads)}


def validate(config: MoEArgs, layout: Any) -> list[str]:
    """Experts against ep."""
    ep = getattr(layout, "ep", 1)
    if ep > 1 and config.num_experts % ep:
        valid = [d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]
        return [
            f"ep {ep} does not divide the {config.num_experts} experts of the model (each "
            f"rank holds num_experts / ep); valid: {', '.join(map(str, valid))}"
        ]
    return []


SPEC = ModelSpec(
    family="moe",
    description="mixture-of-experts decoder (token-choice routing, shared experts)",
    config_type=MoEArgs,
    flavors=MOE_CONFIGS,
    build=Transformer,
    init_weights=_init_weights,
    loss=cross_entropy,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"ep"}),
    fullgraph=False,
    plan_method="analytic",
    after_optimizer_step=_after_optimizer_step,
)
