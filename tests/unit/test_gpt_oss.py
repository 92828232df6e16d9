"""GPT-OSS against Hugging Face transformers: logits of a loaded checkpoint,
the export round trip, the configuration, and one-line refusals."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pytest
import torch

from simplefsdp.checkpoint.hf import load_hf_weights, save_hf_checkpoint
from simplefsdp.models.gpt_oss.args import num_params
from simplefsdp.models.gpt_oss.configs import GPT_OSS_CONFIGS
from simplefsdp.models.gpt_oss.hf_adapter import GPT_OSS_HF_ADAPTER
from simplefsdp.models.registry import get_spec

transformers = pytest.importorskip("transformers")

# Sequence longer than the debug sliding window (8), so windows matter.
SEQ = 24
# The trainer's default balancing: a routing bias that starts at zero.
CONFIG = GPT_OSS_CONFIGS["gpt_oss_debug"].replace(vocab_size=64, load_balance="bias")


def _hf_model(config) -> torch.nn.Module:
    hf_config = transformers.GptOssConfig(**GPT_OSS_HF_ADAPTER.config_to_hf(config))
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("gate_up_proj_bias"):
                param.normal_(0, 4.0)  # large enough that the clamps at +-7 act
            elif name.endswith("router.weight"):
                param.normal_(0, 1.0)  # decisive routing
            else:
                param.normal_(0, 0.1 if "embed" not in name else 1.0)
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny transformers GPT-OSS saved to a folder, with its logits."""
    model = _hf_model(CONFIG)
    folder = tmp_path_factory.mktemp("gpt_oss_hf")
    model.save_pretrained(folder)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        logits = model(tokens).logits
    return folder, tokens, logits


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
    folder, tokens, _ = hf_checkpoint
    spec = get_spec("gpt_oss")
    with torch.device("meta"):
        model = spec.build(CONFIG)
    model.to_empty(device="cpu")
    spec.init_weights(model, "cpu")
    load_hf_weights(model, folder)
    model.eval()
    with torch.no_grad():
        logits = model(tokens)
    return model, logits


def test_logits_match_transformers(hf_checkpoint, ours) -> None:
    _, _, expected = hf_checkpoint
    _, logits = ours
    diff = (logits - expected).abs().max().item()
    print(f"gpt_oss logit parity max abs diff: {diff:.3e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_export_round_trip(hf_checkpoint, ours, tmp_path) -> None:
    _, tokens, _ = hf_checkpoint
    model, logits = ours
    save_hf_checkpoint(model.state_dict(), CONFIG, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    with torch.no_grad():
        again = reloaded.eval()(tokens).logits
    diff = (again - logits).abs().max().item()
    print(f"gpt_oss export round trip max abs diff: {diff:.3e}")
    torch.testing.assert_close(again, logits, rtol=1e-4, atol=1e-4)
    assert GPT_OSS_HF_ADAPTER.config_from_hf(config) == CONFIG.replace(load_balance="none")


def test_nonzero_routing_bias_is_not_exported(ours, tmp_path) -> None:
    model, _ = ours
    state = dict(model.state_dict())
    state["layers.2.moe.expert_bias"] = torch.full((CONFIG.num_experts,), 0.5)
    with pytest.raises(ValueError, match="layers.2.moe.expert_bias is nonzero") as info:
        save_hf_checkpoint(state, CONFIG, tmp_path)
    assert "\n" not in str(info.value)


def test_sliced_read_matches_whole(hf_checkpoint, ours) -> None:
    """A shard of heads / experts reads the same values as the whole tensor."""
    from simplefsdp.checkpoint.hf import HFCheckpoint

    folder, _, _ = hf_checkpoint
    model, _ = ours
    state = model.state_dict()
    ckpt = HFCheckpoint(folder)
    for name, offsets, sizes in [
        ("layers.1.attention.wq.weight", [32, 0], [64, CONFIG.dim]),
        ("layers.1.attention.wk.bias", [32], [32]),
        ("layers.0.moe.experts.mlp1_weight", [4, 0, 8], [4, 128, 16]),
        ("layers.0.moe.experts.mlp2_weight", [2, 16, 0], [2, 32, 64]),
    ]:
        region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        assert torch.equal(ckpt.read(name, offsets, sizes), state[name][region])


def test_published_configs() -> None:
    spec = get_spec("gpt_oss")
    twenty = spec.flavors["gpt_oss_20b"]
    assert (twenty.n_layers, twenty.num_experts, twenty.top_k, twenty.dim) == (24, 32, 4, 2880)
    assert twenty.resolved_layer_types()[:2] == ("sliding_attention", "full_attention")
    assert CONFIG.replace(layer_types=["full_attention"] * 4).sliding_window_of(0) is None
    assert spec.flavors["gpt_oss_120b"].num_experts == 128
    # The published configuration (transformers' GptOssConfig defaults are the 120B).
    hf = transformers.GptOssConfig().to_dict()
    assert GPT_OSS_HF_ADAPTER.config_from_hf(hf) == spec.flavors["gpt_oss_120b"]
    # Counts equal the built module's (20.9B total, 3.6B active without embedding).
    assert round(num_params(twenty) / 1e9, 1) == 20.9
    assert round(spec.active_params(twenty, exclude_embeddings=True) / 1e9, 1) == 3.6
    small = CONFIG.replace(n_layers=2)
    assert num_params(spec.build(small)) == num_params(small)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "convert the checkpoint to bf16"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
        ({"model_type": "llama"}, "only 'gpt_oss'"),
    ],
)
def test_bad_hf_configs(change, needle) -> None:
    config = {**GPT_OSS_HF_ADAPTER.config_to_hf(CONFIG), **change}
    with pytest.raises(ValueError, match=needle) as info:
        GPT_OSS_HF_ADAPTER.config_from_hf(config)
    assert "\n" not in str(info.value)


def test_bad_configs_and_layouts() -> None:
    for change, needle in [
        ({"layer_types": ("full_attention",)}, "layer_types has 1 entries"),
        ({"num_shared_experts": 1}, "no shared experts"),
        ({"sliding_window": 0}, "sliding_window"),
    ]:
        with pytest.raises(ValueError, match=needle):
            dataclasses.replace(CONFIG, **change)

    @dataclasses.dataclass
    class Layout:
        tp: int = 1
        ep: int = 1
        pp: int = 1

    spec = get_spec("gpt_oss")
    assert spec.validate(CONFIG, Layout(tp=2)) == []
    assert spec.validate(CONFIG, Layout(ep=2)) == []
    (error,) = spec.validate(CONFIG, Layout(ep=3))
    assert "does not divide the 8 experts" in error
    errors = spec.validate(CONFIG, Layout(tp=2, ep=2))
    assert any("do not compose" in e for e in errors)
    (error,) = spec.validate(CONFIG, Layout(tp=4))
    assert "n_kv_heads 2" in error


def test_mxfp4_experts_dequantize_like_transformers(hf_checkpoint, tmp_path) -> None:
    """A folder whose experts are MXFP4 (as the published checkpoints) reads
    as transformers' dequantization, also region by region."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from simplefsdp.checkpoint.hf import HFCheckpoint

    folder, _, _ = hf_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    expected = {}
    for name in list(tensors):
        if name.endswith(("gate_up_proj", "down_proj")):
            e, d_in, d_out = tensors.pop(name).shape
            blocks = torch.randint(
                0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8
            )
            scales = torch.randint(120, 132, (e, d_out, d_in // 32), generator=g, dtype=torch.uint8)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            # transformers' (E, in, out) -> ours (E, out, in); on the CPU even
            # where CUDA is visible (it moves the blocks to a GPU then)
            with mock.patch.object(torch.cuda, "is_available", return_value=False):
                expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = HFCheckpoint(tmp_path)
    for layer, (hf, ours) in enumerate(
        [("gate_up_proj", "mlp1_weight"), ("down_proj", "mlp2_weight")] * 2
    ):
        want = expected[f"model.layers.{layer}.mlp.experts.{hf}"].transpose(1, 2)
        name = f"layers.{layer}.moe.experts.{ours}"
        assert torch.equal(ckpt.read(name, [0, 0, 0], list(want.shape)), want)
        region = ([3, 5, 40], [2, 7, 20])  # columns 40..59 cross a 32-block edge
        got = ckpt.read(name, *region)
        assert torch.equal(got, want[3:5, 5:12, 40:60])
    assert torch.equal(
        ckpt.read("layers.0.attention.wv.bias", [0], [64]),
        tensors["model.layers.0.self_attn.v_proj.bias"],
    )


def test_grouped_experts_equal_the_loop() -> None:
    """The grouped-matmul path (biases repeated per token) and the loop over
    experts give the same outputs and gradients, with an expert left empty."""
    from simplefsdp.models.common.moe import grouped_mm_supported
    from simplefsdp.models.gpt_oss.model import GptOssExperts

    torch.manual_seed(0)
    experts = GptOssExperts(CONFIG)
    experts.init_weights(0.02)
    with torch.no_grad():
        experts.mlp1_bias.normal_(0, 4.0)  # the clamps act
        experts.mlp2_bias.normal_(0, 1.0)
    counts = torch.tensor([3, 0, 5, 1, 0, 2, 4, 1])
    x = torch.randn(int(counts.sum()), CONFIG.dim, requires_grad=True)
    if not grouped_mm_supported(x, experts.mlp1_weight, experts.mlp2_weight):
        pytest.skip("torch._grouped_mm does not run here")
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        out = experts(x, counts)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in (x, *experts.parameters())]
        results.append((out.detach(), grads))
        x.grad = None
        experts.zero_grad()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
