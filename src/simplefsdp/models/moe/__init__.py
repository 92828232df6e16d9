"""Mixture-of-experts model family: a plain ``nn.Module`` with no parallelism code.

Example::

    from simplefsdp.models.moe import Transformer, get_config, update_expert_bias

    model = Transformer(get_config("moe_debug"))
    logits = model(tokens)  # (B, T) -> (B, T, vocab_size)
    ...  # backward, optimizer.step()
    update_expert_bias(model)  # auxiliary-loss-free balancing, once per step
"""

from .args import MoEArgs, num_active_params, num_params
from .configs import MOE_CONFIGS, get_config
from .load_balance import ExpertLoad, expert_load, update_expert_bias
from .model import (
    GroupedExperts,
    MoE,
    TokenChoiceRouter,
    Transformer,
    TransformerBlock,
    grouped_mm_supported,
)

__all__ = [
    "MoEArgs",
    "Transformer",
    "get_config",
    "update_expert_bias",
]
