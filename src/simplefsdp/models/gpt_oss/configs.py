"""Named GPT-OSS configurations.

* ``gpt_oss_20b``: openai/gpt-oss-20b (24 layers, 32 experts, top 4),
  20.9B parameters, 3.6B active;
* ``gpt_oss_120b``: openai/gpt-oss-120b (36 layers, 128 experts, top 4),
  116.8B parameters, 5.1B active;
* ``gpt_oss_debug``: 4 layers of width 96 with 8 experts and the 260-token
  byte vocabulary, a sliding window of 8 and YaRN scaling; builds and trains
  on a CPU in seconds.

The published values are those of the models' Hugging Face ``config.json``:
hidden and expert size 2880, 64 query heads and 8 key/value heads of size
64, a 128-token sliding window on even layers, vocabulary 201088, RMSNorm
epsilon 1e-5, rotary base 150000 with YaRN (factor 32 over 4096 positions,
beta_fast 32, beta_slow 1, not truncated) up to 131072 positions, SwiGLU
clamp 7.0.
"""

from __future__ import annotations

from simplefsdp.models.common.config import YarnScaling
from simplefsdp.models.llama3.configs import BYTE_VOCAB_SIZE

from .args import GptOssArgs

#: The published models' YaRN rotary scaling.
GPT_OSS_YARN = YarnScaling(
    factor=32.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
)

GPT_OSS_CONFIGS: dict[str, GptOssArgs] = {
    "gpt_oss_debug": GptOssArgs(
        dim=96,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=BYTE_VOCAB_SIZE,
        rope_theta=150000.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64, truncate=False),
        max_seq_len=256,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=64,
        sliding_window=8,
    ),
    "gpt_oss_20b": GptOssArgs(rope_scaling=GPT_OSS_YARN),
    "gpt_oss_120b": GptOssArgs(n_layers=36, num_experts=128, rope_scaling=GPT_OSS_YARN),
}
