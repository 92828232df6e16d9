"""Hugging Face Llama checkpoints in and out (``simplefsdp.checkpoint.hf``).

Without ``transformers``: our weights written as a sharded Hugging Face
checkpoint and read back are bitwise equal; a region read (what a sharded
rank reads) equals the same region of the whole tensor; tied embeddings fill
``output``; unsupported configs are one-line errors. With ``transformers``
(skipped otherwise): a random ``LlamaForCausalLM`` saved with
``save_pretrained`` gives our model the same logits, and our export loads
with ``from_pretrained`` to the same logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from simplefsdp.checkpoint.hf import (
    HFCheckpoint,
    hf_config_from_model_args,
    load_hf_weights,
    model_args_differences,
    model_args_from_hf_config,
    save_hf_checkpoint,
)
from simplefsdp.models.llama3 import ModelArgs, RopeScaling, Transformer
from simplefsdp.models.llama3.hf_adapter import from_hf_name, to_hf_name

ARGS = ModelArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=80,
    multiple_of=16,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16),
    max_seq_len=32,
)


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_names_map_both_ways():
    for name in _model(0).state_dict():
        assert from_hf_name(to_hf_name(name)) == name
    assert to_hf_name("layers.3.feed_forward.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="unknown Hugging Face Llama tensor 'model.foo'"):
        from_hf_name("model.foo")


def test_round_trip_is_bitwise_and_sharded(tmp_path):
    source = _model(0)
    files = save_hf_checkpoint(_state(source), ARGS, tmp_path, max_shard_size=20_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(shards) <= set(files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {to_hf_name(n) for n in source.state_dict()}
    config = json.loads((tmp_path / "config.json").read_text())
    assert model_args_differences(model_args_from_hf_config(config), ARGS) == []
    target = _model(1)
    assert load_hf_weights(target, tmp_path) == sum(p.numel() for p in source.parameters())
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_q_and_k_rows_are_permuted_within_heads(tmp_path):
    """The stored q/k layout is Hugging Face's: reading the file directly differs from ours."""
    source = _model(0)
    save_hf_checkpoint(_state(source), ARGS, tmp_path)
    from safetensors.torch import load_file

    stored = load_file(str(next(tmp_path.glob("model-*.safetensors"))))
    wq = source.state_dict()["layers.0.attention.wq.weight"]
    hf_wq = stored["model.layers.0.self_attn.q_proj.weight"]
    half = ARGS.head_dim // 2
    assert not torch.equal(hf_wq, wq)
    assert torch.equal(hf_wq[0], wq[0]) and torch.equal(hf_wq[half], wq[1])
    assert torch.equal(hf_wq[1], wq[2])  # our row 2i + j is their row j * half + i
    assert torch.equal(
        stored["model.layers.1.mlp.down_proj.weight"], source.layers["1"].feed_forward.w2.weight
    )


@pytest.mark.parametrize(
    "name", ["layers.0.attention.wq.weight", "layers.1.attention.wk.weight", "output.weight"]
)
def test_region_read_equals_region_of_whole(tmp_path, name):
    save_hf_checkpoint(_state(_model(0)), ARGS, tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    whole = ckpt.read(name)
    for offsets, sizes in (
        ([3, 0], [5, 32]),
        ([0, 7], [whole.shape[0], 9]),
        ([whole.shape[0] - 5, 2], [5, 3]),
    ):
        part = ckpt.read(name, offsets, sizes)
        assert torch.equal(
            part, whole[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        )


def test_tied_embeddings_fill_output(tmp_path):
    from safetensors.torch import save_file

    source = _model(0)
    hf = {to_hf_name(k): v for k, v in _state(source).items() if k != "output.weight"}
    for name in list(hf):  # these are read back through the permutation, so keep them consistent
        if "q_proj" in name or "k_proj" in name:
            hf[name] = torch.zeros_like(hf[name])
    save_file(hf, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config_from_model_args(ARGS), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = _model(1)
    load_hf_weights(target, tmp_path)
    assert torch.equal(target.output.weight, source.tok_embeddings.weight)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"head_dim": 4}, "head_dim 4 is not hidden_size/num_attention_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_config_is_one_line(change, message):
    config = {**hf_config_from_model_args(ARGS), **change}
    with pytest.raises(ValueError, match=message) as info:
        model_args_from_hf_config(config)
    assert "\n" not in str(info.value)


def test_llama31_8b_config_reads_like_the_original():
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    config = {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": scaling, "tie_word_embeddings": False,
    }  # fmt: skip
    from simplefsdp.models.llama3 import get_config

    assert model_args_from_hf_config(config) == get_config("8B", max_seq_len=131072)


def test_missing_folder_and_files_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        HFCheckpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model_args(ARGS)))
    with pytest.raises(ValueError, match="has neither model.safetensors.index.json nor"):
        HFCheckpoint(tmp_path)


# --------------------------------------------------------------------------- transformers


def _hf_model(tie: bool = False):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from one, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


TOKENS = torch.tensor([[1, 5, 9, 33, 2, 79, 40, 7, 11, 3, 60, 0]])


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_checkpoint_gives_the_same_logits(tmp_path, tie):
    hf = _hf_model(tie)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = HFCheckpoint(tmp_path)
    with torch.device("meta"):
        ours = Transformer(ckpt.args)
    ours.to_empty(device="cpu")
    ours.init_weights()
    load_hf_weights(ours, ckpt)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        got = ours(TOKENS)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = _model(0).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    save_hf_checkpoint(_state(ours), ARGS, tmp_path, max_shard_size=20_000)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 dtype")
def test_block_scaled_float8_weights_read_dequantized(tmp_path):
    """A float8 weight with ``weight_scale_inv`` (DeepSeek-V3's published
    format) reads as each block times its scale, also for a region that
    starts and ends inside blocks."""
    import safetensors.torch as st

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 7, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.5  # blocks of 4 x 4
    st.save_file(
        {"model.embed_tokens.weight": weight, "model.embed_tokens.weight_scale_inv": scale},
        str(tmp_path / "model.safetensors"),
    )
    config = {**hf_config_from_model_args(ModelArgs(dim=8, n_layers=1, n_heads=2))}
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [4, 4]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    full = weight.float() * scale.repeat_interleave(4, 0)[:10].repeat_interleave(4, 1)[:, :7]
    ckpt = HFCheckpoint(tmp_path)
    assert torch.equal(ckpt.read_hf("model.embed_tokens.weight"), full)
    assert torch.equal(ckpt.read_hf("model.embed_tokens.weight", [3, 2], [6, 5]), full[3:9, 2:7])
    assert torch.equal(ckpt.read("tok_embeddings.weight", [5, 0], [5, 7]), full[5:10])
