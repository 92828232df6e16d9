"""YaRN rotary scaling against Hugging Face transformers' reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from simplefsdp.models.common.config import DecoderArgs, RopeScaling, YarnScaling
from simplefsdp.models.common.rotary import precompute_freqs_cis, rope_frequencies

CASES = [
    # GPT-OSS: no truncation, attention factor from ``factor`` alone.
    dict(
        head_dim=64,
        theta=150000.0,
        rope={
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    # DeepSeek-V3: truncated ramp, ``mscale`` / ``mscale_all_dim`` attention factor.
    dict(
        head_dim=64,
        theta=10000.0,
        rope={
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    dict(
        head_dim=128,
        theta=1000000.0,
        rope={
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    # An explicit attention factor wins.
    dict(
        head_dim=32,
        theta=10000.0,
        rope={"factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25},
    ),
]


def _reference(head_dim: int, theta: float, rope: dict) -> tuple[torch.Tensor, float]:
    config = PretrainedConfig(
        rope_theta=theta,
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=rope["original_max_position_embeddings"] * int(rope["factor"]),
        rope_scaling={"rope_type": "yarn", **rope},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return inv_freq, float(attention_factor)


@pytest.mark.parametrize("case", CASES, ids=["gpt_oss", "deepseek_v3", "mscale", "explicit"])
def test_yarn_matches_transformers(case: dict) -> None:
    expected_freqs, expected_factor = _reference(case["head_dim"], case["theta"], case["rope"])
    scaling = YarnScaling(**case["rope"])
    freqs = rope_frequencies(case["head_dim"], case["theta"], scaling)
    # transformers computes in float32, we in float64.
    torch.testing.assert_close(freqs.float(), expected_freqs, rtol=1e-6, atol=0)
    assert scaling.scale == pytest.approx(expected_factor, rel=1e-12)
    unscaled = rope_frequencies(case["head_dim"], case["theta"])
    assert not torch.allclose(freqs, unscaled)  # the scaling does something

    table = precompute_freqs_cis(case["head_dim"], 16, case["theta"], scaling)
    angles = torch.outer(torch.arange(16, dtype=torch.float64), freqs)
    torch.testing.assert_close(table[..., 0], (angles.cos() * expected_factor).float())
    torch.testing.assert_close(table[..., 1], (angles.sin() * expected_factor).float())


def test_yarn_from_mapping_and_errors() -> None:
    args = DecoderArgs(
        dim=64,
        n_layers=1,
        n_heads=4,
        vocab_size=8,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16},
    )
    assert args.rope_scaling == YarnScaling(32.0, 16)
    assert args.rope_scaling.scale == pytest.approx(0.1 * math.log(32.0) + 1.0)
    # A saved configuration (dataclasses.asdict) reads back as the same type.
    assert DecoderArgs(**dataclasses.asdict(args)) == args
    llama = DecoderArgs(dim=64, n_layers=1, n_heads=4, vocab_size=8, rope_scaling={"factor": 2.0})
    assert llama.rope_scaling == RopeScaling(factor=2.0)
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        DecoderArgs(dim=64, n_layers=1, n_heads=4, vocab_size=8, rope_scaling={"type": "dynamic"})
    with pytest.raises(ValueError, match="beta_fast"):
        YarnScaling(4.0, 16, beta_fast=-1.0)
    with pytest.raises(ValueError, match="truncate"):
        YarnScaling(4.0, 16, truncate="no")
    with pytest.raises(ValueError, match="bogus"):
        DecoderArgs(
            dim=64,
            n_layers=1,
            n_heads=4,
            vocab_size=8,
            rope_scaling={
                "type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
                "bogus": 1,
            },
        )
