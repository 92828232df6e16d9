"""Named Qwen3 configurations: the published sizes and two debug sizes.

The published values are those of each model's Hugging Face ``config.json``
(``Qwen/Qwen3-0.6B`` ... ``Qwen/Qwen3-32B``, ``Qwen/Qwen3-30B-A3B``,
``Qwen/Qwen3-235B-A22B``): vocabulary 151936, ``rope_theta`` 1e6,
``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 40960, head size 128.
The 0.6B, 1.7B and 4B checkpoints tie the output projection to the
embedding; our model holds its own ``output``, so their parameter counts
here count the vocabulary matrix twice.

* ``qwen3_debug`` / ``qwen3_moe_debug``: 4 blocks of width 256 with heads of
  64 (not ``dim / n_heads`` = 32) and the 260-token byte vocabulary; they
  train on a CPU in minutes.
"""

from __future__ import annotations

from simplefsdp.models.llama3.configs import BYTE_VOCAB_SIZE

from .args import Qwen3Args, Qwen3MoEArgs


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int) -> Qwen3Args:
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
    )


QWEN3_CONFIGS: dict[str, Qwen3Args] = {
    "qwen3_debug": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=512,
        vocab_size=BYTE_VOCAB_SIZE,
        max_seq_len=512,
    ),
    "qwen3_0_6b": _dense(1024, 28, 16, 3072),
    "qwen3_1_7b": _dense(2048, 28, 16, 6144),
    "qwen3_4b": _dense(2560, 36, 32, 9728),
    "qwen3_8b": _dense(4096, 36, 32, 12288),
    "qwen3_14b": _dense(5120, 40, 40, 17408),
    "qwen3_32b": _dense(5120, 64, 64, 25600),
}

QWEN3_MOE_CONFIGS: dict[str, Qwen3MoEArgs] = {
    "qwen3_moe_debug": Qwen3MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=512,
        vocab_size=BYTE_VOCAB_SIZE,
        max_seq_len=512,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
    ),
    "qwen3_30b_a3b": Qwen3MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=768,
    ),
    "qwen3_235b_a22b": Qwen3MoEArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=12288,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=1536,
    ),
}
