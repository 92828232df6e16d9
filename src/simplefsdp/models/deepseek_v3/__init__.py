"""DeepSeek-V3 model family: multi-head latent attention and a
mixture-of-experts decoder with group-limited routing, as a plain
``nn.Module`` with no parallelism code.

Example::

    from simplefsdp.models.deepseek_v3 import DEEPSEEK_V3_CONFIGS, Transformer

    model = Transformer(DEEPSEEK_V3_CONFIGS["deepseek_v3_debug"])
    logits = model(tokens)  # (B, T) -> (B, T, vocab_size)
"""

from .args import DeepSeekV3Args, num_active_params, num_params
from .configs import DEEPSEEK_V3_CONFIGS
from .model import MultiHeadLatentAttention, Transformer, TransformerBlock
