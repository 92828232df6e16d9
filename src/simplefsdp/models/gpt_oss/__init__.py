"""GPT-OSS model family: a plain ``nn.Module`` with no parallelism code.

Example::

    from simplefsdp.models.gpt_oss import GPT_OSS_CONFIGS, Transformer

    model = Transformer(GPT_OSS_CONFIGS["gpt_oss_debug"])
    logits = model(tokens)  # (B, T) -> (B, T, vocab_size)
"""

from .args import GptOssArgs, num_active_params, num_params
from .configs import GPT_OSS_CONFIGS
from .model import GptOssAttention, GptOssExperts, GptOssMoE, GptOssRouter, Transformer
