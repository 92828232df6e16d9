"""Model families as specs: flavor names and aliases, the model-against-layout
rules of ``validate``, and what a checkpoint records about its model."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from simplefsdp.models.registry import canonical_flavor, get_spec, resolve_flavor


def test_aliases_resolve_to_canonical_flavors():
    assert canonical_flavor("8B") == "llama3_8b"
    assert resolve_flavor("debug")[1] == resolve_flavor("llama3_debug")[1]
    spec, config = resolve_flavor("debug", n_layers=2)
    assert spec.family == "llama3" and config.n_layers == 2
    with pytest.raises(ValueError, match="Did you mean 'llama3_8b'") as exc:
        canonical_flavor("llama3_8B")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="unknown ModelArgs field"):
        resolve_flavor("llama3_debug", n_expert=2)


def test_validate_owns_the_model_rules():
    spec, config = resolve_flavor("moe_debug")  # 8 heads, 4 kv heads, 8 experts, 4 layers
    layout = SimpleNamespace(tp=3, pp=8, ep=3)
    errors = spec.validate(config, layout, seq_len=1000, sequence_parallel=True)
    assert len(errors) == 6 and all("\n" not in e for e in errors), errors
    for needle in ("exceeds max_seq_len 512", "tp 3 does not divide", "not divisible by tp 3",
                   "8 stages but", "does not divide the 8 experts", "ep 3 with tp 3"):  # fmt: skip
        assert any(needle in e for e in errors), (needle, errors)
    assert spec.validate(config, SimpleNamespace(tp=2, pp=2, ep=1), seq_len=512) == []
    llama, args = resolve_flavor("llama3_debug")
    assert "has none" in llama.validate(args, SimpleNamespace(ep=2))[0]
    deepseek, args = resolve_flavor("deepseek_v3_16b")  # 16 heads, 64 experts
    assert deepseek.validate(args, SimpleNamespace(tp=2, ep=1)) == []
    assert (
        "ep 3 does not divide the 64 experts" in deepseek.validate(args, SimpleNamespace(ep=3))[0]
    )


def test_tp_must_divide_the_routed_experts_hidden_dim():
    # Tensor parallelism splits every routed expert's hidden dim, for every
    # family with routed experts; heads that divide do not hide it.
    for flavor in ("moe_debug", "gpt_oss_debug", "qwen3_moe_debug", "deepseek_v3_debug"):
        spec, config = resolve_flavor(flavor, moe_hidden_dim=36)
        (line,) = spec.validate(config, SimpleNamespace(tp=8, ep=1))
        assert "routed-experts hidden dim 36" in line, (flavor, line)
        assert "valid tensor-parallel sizes" in line and "\n" not in line
        assert spec.validate(config, SimpleNamespace(tp=2, ep=1)) == []


def test_checkpoint_records_family_flavor_and_config():
    from simplefsdp.models.record import model_from_record, model_record

    for flavor in ("llama3_debug", "moe_debug"):
        spec, config = resolve_flavor(flavor, max_seq_len=64)
        record = model_record(spec, config, flavor)
        assert record["family"] == spec.family and record["flavor"] == flavor
        assert model_from_record({"model": record}) == (spec, config)
        # an older checkpoint: the fields only, the family inferred from them
        old = {"model_args": dataclasses.asdict(config)}
        assert model_from_record(old) == (spec, config)
    with pytest.raises(ValueError, match="records no model"):
        model_from_record({"job": {}})


def test_hf_format_is_the_family_adapters():
    from simplefsdp.checkpoint.hf import hf_adapter_for, model_args_from_hf_config

    llama, args = resolve_flavor("llama3_debug")
    adapter = hf_adapter_for(args)
    assert adapter is llama.hf_adapter and llama.supports("hf")
    assert model_args_from_hf_config(adapter.config_to_hf(args)) == args
    moe = get_spec("moe")
    assert moe.hf_adapter is None and not moe.supports("hf")
    with pytest.raises(ValueError, match="'moe' model family has no Hugging Face format"):
        hf_adapter_for(moe.flavors["moe_debug"])
    # a model_type no family reads is transformers' own, which must know it
    with pytest.raises(ValueError, match="model_type 'not_a_model' is unknown to the installed"):
        model_args_from_hf_config({"model_type": "not_a_model", "vocab_size": 8})
