"""Named mixture-of-experts configurations.

* ``moe_debug``: about 6M parameters (8 experts, top 2, one shared expert)
  with the 260-token byte vocabulary; trains on a CPU in minutes.
* ``moe_small``: about 0.4B parameters (16 experts, top 2) with the byte
  vocabulary.
* ``llama4_scout``: Llama 4 Scout's text model (16 experts, top 1, one shared
  expert, every block MoE), 108B parameters (109B published with the vision
  encoder), 17B activated.

DeepSeek-V3 (multi-head latent attention, group-limited routing) is its own
family, :mod:`simplefsdp.models.deepseek_v3`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from simplefsdp.models.llama3.configs import BYTE_VOCAB_SIZE

from .args import MoEArgs

MOE_CONFIGS: dict[str, MoEArgs] = {
    "moe_debug": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=BYTE_VOCAB_SIZE,
        rope_theta=500000.0,
        max_seq_len=512,
        n_dense_layers=1,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        num_shared_experts=1,
    ),
    "moe_small": MoEArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=BYTE_VOCAB_SIZE,
        rope_theta=500000.0,
        max_seq_len=2048,
        n_dense_layers=1,
        num_experts=16,
        top_k=2,
        moe_hidden_dim=1024,
        num_shared_experts=1,
    ),
    "llama4_scout": MoEArgs(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        vocab_size=202048,
        rope_theta=500000.0,
        max_seq_len=8192,
        n_dense_layers=0,
        num_experts=16,
        top_k=1,
        moe_hidden_dim=8192,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=False,
    ),
}


def get_config(name: str, **overrides: Any) -> MoEArgs:
    """Return the named MoE configuration, optionally with fields overridden.

    Args:
        name: one of the keys of :data:`MOE_CONFIGS`.
        **overrides: :class:`MoEArgs` fields to replace.

    Returns:
        A validated :class:`MoEArgs`.

    Raises:
        ValueError: unknown ``name`` or field (the message lists the valid
            ones), or an invalid resulting configuration.
    """
    from simplefsdp.models.registry import ALIASES

    try:
        base = MOE_CONFIGS[ALIASES.get(name, name)]
    except KeyError:
        valid = ", ".join(repr(k) for k in MOE_CONFIGS)
        raise ValueError(f"unknown MoE config {name!r}; valid names: {valid}") from None
    fields = {f.name for f in dataclasses.fields(MoEArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown MoEArgs field(s) {unknown}; valid fields: {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(base, **overrides)
