"""The Qwen3 families (dense ``qwen3``, mixture-of-experts ``qwen3_moe``)
against ``transformers``' own Qwen3 and Qwen3-MoE models.

Tiny random transformers models (QK-norm weights randomised, since ones
would hide a wrong rotary permutation of them) are saved with
``save_pretrained``; our model loaded with ``load_hf_weights`` gives their
logits, and our export read back by ``from_pretrained`` gives ours. A
region of our tensor reads only the experts and heads it covers. The
published flavors count the published parameters; bad configurations and
layouts are one line.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from simplefsdp.models.registry import get_spec, resolve_flavor

transformers = pytest.importorskip("transformers")

VOCAB = 96
TINY = dict(
    hidden_size=48,  # head_dim 32 != hidden_size / heads = 12
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)
TINY_MOE = dict(
    TINY,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    mlp_only_layers=[1],  # blocks 0 and 2 MoE, block 1 dense
    tie_word_embeddings=False,
)


def _hf_model(model_type: str, **config):
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                param.mul_(20)  # decisive routing: no near-ties between experts
    return model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def saved(request, tmp_path_factory):
    """(family, transformers model, its folder, our model loaded from it)."""
    from simplefsdp.checkpoint.hf import HFCheckpoint, load_hf_weights

    family = request.param
    config = TINY if family == "qwen3" else TINY_MOE
    hf = _hf_model(family, **config, **({"tie_word_embeddings": True} if family == "qwen3" else {}))
    folder = tmp_path_factory.mktemp(family)
    hf.save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    spec = get_spec(family)
    assert type(ckpt.args) is spec.config_type
    ours = spec.build(ckpt.args)
    load_hf_weights(ours, ckpt)
    return family, hf, folder, ours.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers(saved):
    family, hf, _, ours = saved
    with torch.no_grad():
        want, got = hf(_tokens()).logits, ours(_tokens())
    diff = (want - got).abs().max().item()
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_loads_in_transformers_with_our_logits(saved, tmp_path):
    from simplefsdp.checkpoint.hf import load_hf_weights, save_hf_checkpoint

    family, _, _, ours = saved
    save_hf_checkpoint(ours.state_dict(), ours.args, tmp_path, max_shard_size=60_000)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want, got = ours(_tokens()), back(_tokens()).logits
    diff = (want - got).abs().max().item()
    print(f"{family}: export round trip max |logits diff| = {diff:.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    back_ours = get_spec(family).build(ours.args)
    load_hf_weights(back_ours, tmp_path)  # ours -> Hugging Face -> ours: bitwise
    for name, value in back_ours.state_dict().items():
        assert torch.equal(value, ours.state_dict()[name]), name


def test_a_region_reads_only_what_it_covers(saved):
    from simplefsdp.checkpoint.hf import HFCheckpoint

    family, _, folder, ours = saved
    full = ours.state_dict()
    ckpt = HFCheckpoint(folder)
    read: list[str] = []
    original = ckpt.read_hf

    def spy(name, offsets=None, sizes=None):
        read.append(name)
        return original(name, offsets, sizes)

    ckpt.read_hf = spy
    # Heads 1..2 of wq (rows 32..95), part of a head of wk, the q-norm's second half.
    for name, offsets, sizes in (
        ("layers.1.attention.wq.weight", [32, 8], [64, 20]),
        ("layers.1.attention.wk.weight", [40, 0], [10, 48]),
        ("layers.1.attention.q_norm.weight", [16], [16]),
    ):
        region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        assert torch.equal(ckpt.read(name, offsets, sizes), full[name][region]), name
    if family == "qwen3_moe":
        read.clear()
        got = ckpt.read("layers.2.moe.experts.w2", [1, 0, 4], [2, 48, 8])
        assert torch.equal(got, full["layers.2.moe.experts.w2"][1:3, :, 4:12])
        assert read == [f"model.layers.2.mlp.experts.{j}.down_proj.weight" for j in (1, 2)]
    else:  # tied: the output projection is the embedding
        assert torch.equal(full["output.weight"], full["tok_embeddings.weight"])


def test_configs_convert_both_ways():
    from simplefsdp.checkpoint.hf import hf_config_from_model_args, model_args_from_hf_config

    for family in ("qwen3", "qwen3_moe"):
        spec = get_spec(family)
        assert spec.supports("hf")
        for name, config in spec.flavors.items():
            assert model_args_from_hf_config(hf_config_from_model_args(config)) == config, name
            assert spec.hf_adapter.config_differences(config, config) == []
    dense, moe = resolve_flavor("qwen3_8b")[1], resolve_flavor("qwen3_30b_a3b")[1]
    differ = get_spec("qwen3").hf_adapter.config_differences(dense, dense.replace(head_dim=64))
    assert differ == ["head_dim=128 vs 64"]
    assert "Qwen3MoEArgs" in get_spec("qwen3").hf_adapter.config_differences(dense, moe)[0]


def test_published_sizes():
    # Hugging Face's model cards: 8.2B, 14.8B, 32.8B, 30.5B (3.3B activated),
    # 235B (22B activated); our output projection is untied, so the tied
    # small models count their embedding twice (0.6B + 0.16B).
    def billions(flavor: str, active: bool = False) -> float:
        spec, config = resolve_flavor(flavor)
        count = spec.active_params(config) if active else spec.num_params(config)
        return round(count / 1e9, 1)

    assert billions("qwen3_8b") == 8.2 and billions("qwen3_14b") == 14.8
    assert billions("qwen3_32b") == 32.8 and billions("qwen3_0_6b") == 0.8
    # 3.35B activated here: the embedding and the output projection both count.
    assert billions("qwen3_30b_a3b") == 30.5 and billions("qwen3_30b_a3b", True) == 3.4
    assert billions("qwen3_235b_a22b") == 235.1 and billions("qwen3_235b_a22b", True) == 22.2
    for flavor in ("qwen3_debug", "qwen3_moe_debug", "qwen3_0_6b"):
        spec, config = resolve_flavor(flavor)
        with torch.device("meta"):
            model = spec.build(config)
        assert spec.num_params(model) == spec.num_params(config), flavor


@pytest.mark.parametrize(
    "model_type, change, needle",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ("qwen3_moe", {"num_experts": 0}, "num_experts=0 is not supported"),
        ("qwen3_moe", {"mlp_only_layers": [5]}, "mlp_only_layers [5] must hold layer indices"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "top_k=9 exceeds num_experts=4"),
    ],
)
def test_unsupported_hf_configs_are_one_line(model_type, change, needle):
    from simplefsdp.checkpoint.hf import model_args_from_hf_config

    config = {**(TINY if model_type == "qwen3" else TINY_MOE), "model_type": model_type, **change}
    with pytest.raises(ValueError, match="^config.json: ") as exc:
        model_args_from_hf_config(config)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_layouts_the_model_cannot_take_are_one_line():
    spec, config = resolve_flavor("qwen3_debug")  # 8 heads, 4 kv heads, 4 layers
    errors = spec.validate(config, SimpleNamespace(tp=3, pp=8, ep=2), seq_len=1024)
    assert len(errors) == 4 and all("\n" not in e for e in errors), errors
    for needle in ("exceeds max_seq_len 512", "tp 3 does not divide", "8 stages but",
                   "ep 2: expert parallelism needs a model with experts"):  # fmt: skip
        assert any(needle in e for e in errors), (needle, errors)
    assert spec.validate(config, SimpleNamespace(tp=2, pp=2, ep=1), seq_len=512) == []
    assert "ep" not in spec.capabilities
    spec, config = resolve_flavor("qwen3_moe_debug")  # 8 experts
    errors = spec.validate(config, SimpleNamespace(tp=2, ep=3))
    assert any("ep 3 does not divide the 8 experts" in e for e in errors), errors
    assert any("ep 3 with tp 2" in e for e in errors), errors
    assert spec.validate(config, SimpleNamespace(ep=8)) == []
    with pytest.raises(ValueError, match="load_balance must be one of"):
        config.replace(load_balance="switch")


def test_moe_layers_follow_sparse_step_and_mlp_only_layers():
    config = resolve_flavor("qwen3_moe_debug", decoder_sparse_step=2, mlp_only_layers=[3])[1]
    assert [config.moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (config.n_moe_layers, config.n_dense_layers) == (1, 3)
    spec = get_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.build(config)
    assert [b.moe_enabled for b in model.layers.values()] == [False, True, False, False]
    assert spec.num_params(model) == spec.num_params(config)


def test_plan_command_plans_expert_parallel_moe(capsys):
    from simplefsdp.plan import cli as plan_cli

    argv = ["--model", "qwen3_30b_a3b", "--ep", "8", "--gpus", "16", "--seq", "4096", "--json"]
    assert plan_cli.main(argv) == 0
    prediction = json.loads(capsys.readouterr().out)["predictions"][0]
    assert "16 of 128 per EP rank" in " ".join(prediction["notes"])


def test_routing_bias_starts_at_zero_and_is_not_exported(saved, tmp_path):
    from simplefsdp.checkpoint.hf import load_hf_weights, save_hf_checkpoint

    family, _, folder, ours = saved
    if family != "qwen3_moe":
        pytest.skip("no experts")
    spec = get_spec(family)
    biased = spec.build(ours.args.replace(load_balance="bias"))
    with torch.no_grad():
        for layer in biased.layers.values():
            if layer.moe_enabled:
                layer.moe.expert_bias.fill_(1.0)
    load_hf_weights(biased, folder)
    state = biased.state_dict()
    assert "layers.0.moe.expert_bias" in state and not state["layers.0.moe.expert_bias"].any()
    save_hf_checkpoint(state, biased.args, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if "bias" in n]


def test_checkpoint_record_round_trips():
    from simplefsdp.models.record import model_from_record, model_record

    for flavor in ("qwen3_debug", "qwen3_moe_debug"):
        spec, config = resolve_flavor(flavor, max_seq_len=64)
        if flavor == "qwen3_moe_debug":
            config = config.replace(mlp_only_layers=(2,), load_balance="bias")
        record = json.loads(json.dumps(model_record(spec, config, flavor)))  # as stored
        assert model_from_record({"model": record}) == (spec, config)
