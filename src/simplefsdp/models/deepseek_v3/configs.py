"""Named DeepSeek-V3 configurations.

* ``deepseek_v3_debug``: about 5M parameters (multi-head latent attention
  with query compression, 8 experts in 4 groups, top 2 from 2 groups, one
  shared expert) with the 260-token byte vocabulary; trains on a CPU in
  minutes.
* ``deepseek_v3_16b``: torchtitan's ``deepseek_v3`` 16B shape (DeepSeek-V2-Lite:
  64 experts, top 6, two shared experts, softmax routing, no query
  compression), 15.7B parameters.
* ``deepseek_v3_671b``: DeepSeek-V3 (256 experts in 8 groups, top 8 from 4
  groups, one shared expert, sigmoid routing scaled by 2.5), 671B
  parameters without the multi-token-prediction module.

The published sizes keep their published context: YaRN rotary scaling by 40
from 4096 positions to ``max_seq_len`` 163840 (which also scales the
attention's softmax).
"""

from __future__ import annotations

from simplefsdp.models.common.config import YarnScaling
from simplefsdp.models.llama3.configs import BYTE_VOCAB_SIZE

from .args import DeepSeekV3Args


def _yarn(mscale: float) -> YarnScaling:
    """The published YaRN scaling: 40 x 4096 positions."""
    return YarnScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


DEEPSEEK_V3_CONFIGS: dict[str, DeepSeekV3Args] = {
    "deepseek_v3_debug": DeepSeekV3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        vocab_size=BYTE_VOCAB_SIZE,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=512,
        n_dense_layers=1,
        dense_hidden_dim=512,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_expert_groups=4,
        num_limited_groups=2,
    ),
    "deepseek_v3_16b": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=_yarn(0.707),
        max_seq_len=163840,
        n_dense_layers=1,
        dense_hidden_dim=10944,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        num_shared_experts=2,
        score_func="softmax",
        route_norm=False,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "deepseek_v3_671b": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=_yarn(1.0),
        max_seq_len=163840,
        n_dense_layers=3,
        dense_hidden_dim=18432,
        num_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_expert_groups=8,
        num_limited_groups=4,
    ),
}
