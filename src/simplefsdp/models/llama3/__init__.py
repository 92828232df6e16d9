"""Llama 3 model family: a plain ``nn.Module`` with no parallelism code.

Example::

    from simplefsdp.models.llama3 import Transformer, get_config

    model = Transformer(get_config("debug"))
    logits = model(tokens)  # (B, T) -> (B, T, vocab_size)
"""

from .args import ModelArgs, RopeScaling, ffn_hidden_dim, flops_per_token, num_params
from .configs import BYTE_VOCAB_SIZE, LLAMA3_CONFIGS, LLAMA31_ROPE_SCALING, get_config
from .model import (
    Attention,
    FeedForward,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rope_scaling,
    apply_rotary_emb,
    precompute_freqs_cis,
    repeat_kv,
    rope_frequencies,
)
from .stages import layer_ranges, pipeline_split, stage_ids_for_rank
from .tensor_parallel import (
    apply_tensor_parallel,
    llama3_tp_plan,
    loss_parallel_context,
    tp_split_sizes,
)

__all__ = [
    "ModelArgs",
    "Transformer",
    "apply_tensor_parallel",
    "get_config",
    "loss_parallel_context",
    "pipeline_split",
]
