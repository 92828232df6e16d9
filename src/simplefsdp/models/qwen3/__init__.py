"""Qwen3 model families: dense (``qwen3``) and mixture-of-experts
(``qwen3_moe``), one set of plain ``nn.Module`` s with no parallelism code.

Example::

    from simplefsdp.models.registry import resolve_flavor

    spec, config = resolve_flavor("qwen3_debug")
    model = spec.build(config)
    logits = model(tokens)  # (B, T) -> (B, T, vocab_size)
"""

from .args import Qwen3Args, Qwen3MoEArgs, flops_per_token, num_active_params, num_params
from .configs import QWEN3_CONFIGS, QWEN3_MOE_CONFIGS
from .model import Qwen3Attention, Transformer, TransformerBlock
