"""The helpers model families share: Hugging Face names and rotary layouts
(``models/common/hf_adapter.py``), the validate factories and ``decoder_spec``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from simplefsdp.models.common import hf_adapter as hf_common
from simplefsdp.models.common.decoder_spec import decoder_spec, init_weights
from simplefsdp.models.common.validate import dense_decoder_validate, moe_decoder_validate

NAMES = hf_common.NameMap("Toy", {**hf_common.ATTENTION_NAMES, **hf_common.NORM_NAMES})


def test_name_map_round_trip_and_errors() -> None:
    ours = ["tok_embeddings.weight", "layers.3.attention.wk.weight", "layers.0.ffn_norm.weight"]
    hf = [NAMES.to_hf_name(n) for n in ours]
    assert hf == [
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ]
    assert [NAMES.from_hf_name(n) for n in hf] == ours
    with pytest.raises(ValueError, match="no Hugging Face name for Toy parameter 'layers.0.x'"):
        NAMES.to_hf_name("layers.0.x")
    with pytest.raises(ValueError, match="unknown Hugging Face Toy tensor 'model.layers.0.mlp'"):
        NAMES.from_hf_name("model.layers.0.mlp")


def test_rotary_layouts_and_region() -> None:
    head_dim, heads = 4, 3
    ours = torch.arange(heads * head_dim * 2.0).reshape(heads * head_dim, 2)
    theirs = hf_common.pairs_to_halves(ours, head_dim)
    # our channel 2i + j of a head is Hugging Face's channel j * head_dim / 2 + i
    assert torch.equal(theirs[1], ours[2]) and torch.equal(theirs[2], ours[1])
    assert torch.equal(hf_common.halves_to_pairs(theirs, head_dim), ours)
    offsets, sizes = [5, 1], [6, 1]  # rows 5..10: parts of heads 1 and 2
    hf_offsets, hf_sizes, convert = hf_common.rotary_rows_region(offsets, sizes, head_dim)
    assert (hf_offsets, hf_sizes) == ([4, 1], [8, 1])
    block = theirs[4:12, 1:2]
    assert torch.equal(convert(block), ours[5:11, 1:2])


def test_stacked_experts() -> None:
    experts = hf_common.StackedExperts()
    stacked = torch.arange(24.0).reshape(3, 2, 4)  # (E, out, in)
    pairs = experts.to_hf("layers.1.moe.experts.w2", stacked)
    assert [n for n, _ in pairs] == [
        f"model.layers.1.mlp.experts.{j}.down_proj.weight" for j in range(3)
    ]
    assert experts.from_hf(pairs[2][0]) == "layers.1.moe.experts.w2"
    assert experts.to_hf("layers.1.moe.router.gate.weight", stacked) is None
    stored = dict(pairs)
    checkpoint = SimpleNamespace(
        read_hf=lambda n, o, s: stored[n][o[0] : o[0] + s[0], o[1] : o[1] + s[1]]
    )
    region = experts.read("layers.1.moe.experts.w2", [1, 1, 2], [2, 1, 2], checkpoint)
    assert torch.equal(region, stacked[1:3, 1:2, 2:4])


def test_adapter_defaults() -> None:
    adapter = type("ToyAdapter", (hf_common.HFAdapter,), {"names": NAMES})()
    weight = torch.ones(2)
    assert adapter.to_hf("norm.weight", weight, None) == ("model.norm.weight", weight)
    assert adapter.hf_region("norm.weight", [1], [1], None)[:2] == ([1], [1])
    assert sorted(["lm_head.weight", "model.layers.1.a", "model.embed_tokens.weight"],
                  key=adapter.hf_sort_key) == [
        "model.embed_tokens.weight", "model.layers.1.a", "lm_head.weight"
    ]  # fmt: skip
    with pytest.raises(NotImplementedError, match="sets no names"):
        hf_common.HFAdapter().to_hf_name("norm.weight")


def test_validate_factories_and_decoder_spec() -> None:
    def sizes(config: object, *, loss_parallel: bool = False) -> dict[str, int]:
        return {"n_heads": 4}

    config = SimpleNamespace(max_seq_len=64, n_layers=2, num_experts=4)
    dense = dense_decoder_validate(sizes, unnamed="this toy", with_experts="a toy with experts")
    assert dense(config, SimpleNamespace(tp=2)) == []
    (error,) = dense(config, SimpleNamespace(ep=2), names={"ep": "--ep"})
    assert error == (
        "--ep 2: expert parallelism needs a model with experts and this toy has none; "
        "valid: 1, or a toy with experts"
    )
    (error,) = dense(config, SimpleNamespace(tp=3), seq_len=8)
    assert error.startswith("tp 3 does not divide the n_heads 4")
    moe = moe_decoder_validate(sizes)
    assert moe(config, SimpleNamespace(ep=2)) == []
    assert "does not divide the 4 experts" in moe(config, SimpleNamespace(ep=3))[0]

    fields = dict(
        family="toy", description="", config_type=object, flavors={}, build=object,
        num_params=len, flops_per_token=len,
    )  # fmt: skip
    dense_spec, moe_spec = decoder_spec(**fields), decoder_spec(experts=True, **fields)
    assert dense_spec.init_weights is init_weights and dense_spec.fullgraph
    assert not moe_spec.fullgraph and moe_spec.plan_method == "analytic"
    assert moe_spec.float8_skip_fqns == ("router.gate",) and moe_spec.after_optimizer_step
    assert decoder_spec(experts=True, fullgraph=True, **fields).fullgraph
