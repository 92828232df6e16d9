"""The DeepSeek-V3 family against transformers' ``DeepseekV3ForCausalLM``:
logits of our model loaded from a Hugging Face folder (query compression or
not, interleaved rotary rows or not, tied embeddings, block-scaled float8
weights), the export read back by ``from_pretrained``, parameter counts,
group-limited routing, and one-line errors for what the model cannot take.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from simplefsdp.checkpoint.hf import HFCheckpoint, load_hf_weights, save_hf_checkpoint
from simplefsdp.models.deepseek_v3 import DEEPSEEK_V3_CONFIGS, DeepSeekV3Args
from simplefsdp.models.deepseek_v3.hf_adapter import config_from_hf, config_to_hf
from simplefsdp.models.registry import get_spec

transformers = pytest.importorskip("transformers")

SPEC = get_spec("deepseek_v3")
VOCAB = 128
# Two tiny models: A has query compression, groups of experts, YaRN rotary
# scaling (its softmax scale too) and the interleaved rotary rows DeepSeek
# publishes; B a plain query projection, rotate-half rotary rows and tied
# embeddings.
YARN = dict(type="yarn", factor=4.0, beta_fast=32, beta_slow=1, mscale=0.707,
            mscale_all_dim=0.707, original_max_position_embeddings=16)  # fmt: skip
VARIANTS = {
    "A": dict(q_lora_rank=48, n_group=4, topk_group=2, rope_interleave=True, rope_scaling=YARN),
    "B": dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
              tie_word_embeddings=True),
}  # fmt: skip


def _hf_config(**overrides):
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=16,
        v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**fields, **overrides})


def _hf_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)  # decisive routing
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(0, 0.1)
    return model


def _ours(folder):
    ckpt = HFCheckpoint(folder)
    model = SPEC.build(ckpt.args)
    load_hf_weights(model, ckpt)
    return model.eval()


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    """(transformers model, its folder, our model loaded from it)."""
    hf = _hf_model(_hf_config(**VARIANTS[request.param]))
    folder = tmp_path_factory.mktemp(f"dsv3_{request.param}")
    hf.save_pretrained(folder)
    return hf, folder, _ours(folder), request.param


def test_logits_match_transformers(saved):
    hf, _, ours, variant = saved
    assert (ours.args.rope_scaling is not None) == ("rope_scaling" in VARIANTS[variant])
    with torch.no_grad():
        want, got = hf(TOKENS).logits, ours(TOKENS)
    diff = (got - want).abs().max().item()
    print(f"max |logits - transformers| = {diff:.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_loads_in_transformers_with_our_logits(saved, tmp_path):
    ours = saved[2]
    save_hf_checkpoint(ours.state_dict(), ours.args, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" not in config and config["rope_interleave"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want, got = ours(TOKENS), back(TOKENS).logits
    diff = (got - want).abs().max().item()
    print(f"max |exported logits - ours| = {diff:.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert HFCheckpoint(tmp_path).args == ours.args


def _quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8 (DeepSeek's published format): ``(float8 weight,
    weight_scale_inv)`` with ``weight ~= float8 * scale`` per block."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(nr, block, nc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # (nr, nc)
    q = (blocks / scale[:, None, :, None]).reshape(nr * block, nc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def test_block_scaled_float8_checkpoint_reads_dequantized(tmp_path):
    from safetensors.torch import save_file

    block = 32  # hidden 64, latent 32 + 16 = 48 rows: full and partial blocks
    hf = _hf_model(_hf_config(**VARIANTS["A"]))
    stored, dequantized = {}, {}
    for name, value in hf.state_dict().items():
        quantize = name.startswith("model.layers.") and value.dim() == 2
        if quantize and not name.endswith("mlp.gate.weight"):
            q, scale = _quantize(value.float(), block)
            stored[name], stored[f"{name}_scale_inv"] = q, scale
            dequantized[name] = (
                q.float()
                * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[
                    : value.shape[0], : value.shape[1]
                ]
            )
        else:
            stored[name] = dequantized[name] = value.contiguous()
    save_file(stored, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(dequantized)
    ours = _ours(tmp_path)
    with torch.no_grad():
        want, got = hf(TOKENS).logits, ours(TOKENS)
    print(
        f"float8 checkpoint: max |logits - dequantized reference| = {(got - want).abs().max():.2e}"
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wq_b = ours.layers["0"].attention.wq_b.weight
    assert torch.equal(wq_b, dequantized["model.layers.0.self_attn.q_b_proj.weight"])


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("deepseek_v3_16b", 15.7e9, 2.7e9), ("deepseek_v3_671b", 671e9, 37e9)],
)
def test_published_param_counts(name: str, total: float, active: float) -> None:
    args = SPEC.flavors[name]
    assert abs(SPEC.num_params(args) - total) / total < 0.015, SPEC.num_params(args)
    assert abs(SPEC.active_params(args) - active) / active < 0.03, SPEC.active_params(args)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_counted_matches_built(q_lora_rank: int) -> None:
    args = DEEPSEEK_V3_CONFIGS["deepseek_v3_debug"].replace(q_lora_rank=q_lora_rank)
    with torch.device("meta"):
        model = SPEC.build(args)
    assert SPEC.num_params(model) == SPEC.num_params(args)


def test_routing_is_limited_to_the_best_groups() -> None:
    from simplefsdp.models.common.moe import TokenChoiceRouter

    torch.manual_seed(0)
    router = TokenChoiceRouter(16, 8, 3, num_groups=4, num_limited_groups=2)
    x = torch.randn(64, 16)
    bias = torch.randn(8) * 0.1
    _, experts, scores = router(x, bias)
    groups = (scores + bias).view(64, 4, 2).sum(-1)  # two experts per group: top-2 sum
    best = groups.topk(2, dim=-1).indices
    assert all(set((experts[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(64))
    free = TokenChoiceRouter(16, 8, 3)
    free.gate.weight = router.gate.weight
    assert not torch.equal(free(x, bias)[1].sort().values, experts.sort().values)  # it limits


def test_bad_configs_are_one_line() -> None:
    base = _hf_config(**VARIANTS["A"]).to_dict()
    cases = [
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy' is not"),
        ({"n_group": 3}, "num_expert_groups=3 does not divide num_experts=8"),
        ({"model_type": "deepseek_v2"}, "model_type 'deepseek_v2' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "type 'dynamic' is not supported"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            config_from_hf({**base, **overrides})
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="score_func='softmax' has no DeepseekV3ForCausalLM"):
        config_to_hf(DEEPSEEK_V3_CONFIGS["deepseek_v3_16b"])
    with pytest.raises(ValueError, match="num_limited_groups=3 exceeds num_expert_groups=2"):
        DeepSeekV3Args(num_experts=8, top_k=2, num_expert_groups=2, num_limited_groups=3)


def test_layouts_the_model_cannot_take_are_one_line() -> None:
    args = DEEPSEEK_V3_CONFIGS["deepseek_v3_debug"]  # 8 heads, 8 experts, 4 layers
    errors = SPEC.validate(args, SimpleNamespace(tp=3, pp=8, ep=3), model_name="deepseek_v3_debug")
    for needle in ("tp 3 does not divide", "8 stages but", "does not divide the 8 experts",
                   "ep 3 with tp 3"):  # fmt: skip
        assert any(needle in e for e in errors), (needle, errors)
    assert all("\n" not in e for e in errors)
    assert SPEC.validate(args, SimpleNamespace(tp=2, pp=2, ep=1), seq_len=512) == []


def test_tensor_parallel_plan_splits_the_heads() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from simplefsdp.models.deepseek_v3.tensor_parallel import deepseek_v3_plan

    with torch.device("meta"):
        model = SPEC.build(DEEPSEEK_V3_CONFIGS["deepseek_v3_debug"])
    plan = deepseek_v3_plan(model)
    assert isinstance(plan["layers.0.attention.wq_b"], ColwiseParallel)
    assert isinstance(plan["layers.0.attention.wkv_b"], ColwiseParallel)
    assert isinstance(plan["layers.0.attention.wo"], RowwiseParallel)
    assert not [n for n in plan if n.endswith(("wq_a", "wkv_a", "wk", "wv", "kv_norm"))]
    assert "layers.1.moe" in plan and "layers.0.feed_forward.w1" in plan


def test_a_shard_reads_only_its_region(saved):
    # What a rank of a sharded model reads: row ranges cutting through heads
    # (rotary rows permuted in variant B), a range of experts, column ranges.
    _, folder, ours, _ = saved
    ckpt = HFCheckpoint(folder)
    full = ours.state_dict()
    query = "layers.0.attention." + ("wq_b" if ours.args.q_lora_rank else "wq") + ".weight"
    cols = full[query].shape[1]  # 64, or the query rank 48
    cases = [
        (query, [5, 0], [70, cols]),
        (query, [0, 16], [128, 16]),
        ("layers.1.attention.wkv_a.weight", [20, 0], [28, 64]),
        ("layers.2.moe.experts.w1", [3, 8, 0], [4, 16, 64]),
        ("layers.2.moe.experts.w2", [0, 0, 16], [2, 64, 16]),
        ("output.weight", [64, 0], [64, 64]),
    ]
    for name, offsets, sizes in cases:
        region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        assert torch.equal(ckpt.read(name, offsets, sizes), full[name][region]), name
