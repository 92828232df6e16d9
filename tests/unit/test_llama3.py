"""Unit tests for the Llama 3 model family (single process, CPU)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from simplefsdp.models.llama3 import (
    LLAMA3_CONFIGS,
    ModelArgs,
    RopeScaling,
    Transformer,
    apply_rotary_emb,
    flops_per_token,
    get_config,
    num_params,
    precompute_freqs_cis,
    rope_frequencies,
)

TINY = ModelArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=37,
    multiple_of=16,
    max_seq_len=64,
)


def _build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


# --------------------------------------------------------------------------- #
# Configs and accounting
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("name", "expected"), [("8B", 8.03e9), ("70B", 70.6e9), ("405B", 405.9e9)])
def test_published_param_counts(name: str, expected: float) -> None:
    args = get_config(name)
    with torch.device("meta"):
        model = Transformer(args)
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - expected) / expected < 0.005, counted
    assert num_params(model) == counted
    assert num_params(args) == counted
    embedding = args.vocab_size * args.dim
    assert num_params(model, exclude_embeddings=True) == counted - embedding
    assert num_params(args, exclude_embeddings=True) == counted - embedding


def test_published_shapes() -> None:
    assert get_config("8B").ffn_hidden_dim == 14336
    assert get_config("70B").ffn_hidden_dim == 28672
    assert get_config("405B").ffn_hidden_dim == 53248
    for name in ("8B", "70B", "405B"):
        args = get_config(name)
        assert args.vocab_size == 128256
        assert args.rope_theta == 500000.0
        assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
        assert args.max_seq_len == 8192


def test_small_and_debug_sizes() -> None:
    assert 2e6 < num_params(get_config("debug")) < 5e6
    assert abs(num_params(get_config("small")) - 100e6) / 100e6 < 0.05


def test_flops_per_token_hand_count() -> None:
    args = TINY
    d, hd, n_kv = 32, 32 // 4, 2
    hidden = int(2 * 4 * d / 3)  # 85
    hidden = 16 * math.ceil(hidden / 16)  # 96
    assert hidden == 96
    attention = d * d + d * (n_kv * hd) + d * (n_kv * hd) + d * d  # wq, wk, wv, wo
    ffn = d * hidden + hidden * d + d * hidden  # w1, w2, w3
    per_layer = attention + ffn + 2 * d  # + two RMSNorms
    non_embedding = 2 * per_layer + d + 37 * d  # + final norm + output
    seq_len = 48
    expected = 6 * non_embedding + 12 * 2 * d * seq_len
    assert flops_per_token(args, seq_len) == expected
    model = _build(args)
    assert num_params(model, exclude_embeddings=True) == non_embedding
    assert num_params(model) == non_embedding + 37 * d


def test_get_config_overrides_and_errors() -> None:
    args = get_config("debug", vocab_size=300, max_seq_len=256)
    assert args.vocab_size == 300 and args.max_seq_len == 256
    assert args.dim == LLAMA3_CONFIGS["debug"].dim
    assert LLAMA3_CONFIGS["debug"].vocab_size == 260  # registry untouched
    with pytest.raises(ValueError, match="debug"):
        get_config("nope")
    with pytest.raises(ValueError, match="not_a_field"):
        get_config("debug", not_a_field=1)
    with pytest.raises(ValueError, match="n_heads"):
        get_config("debug", n_heads=7)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"dim": 30, "n_heads": 4}, "dim=30"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3"),
        ({"dim": 0}, "dim"),
        ({"n_layers": -1}, "n_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"multiple_of": 0}, "multiple_of"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier"),
        ({"dim": 12, "n_heads": 4}, "head_dim"),
        ({"rope_scaling": {"factor": -8.0}}, "factor"),
        ({"rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 1.0}}, "low_freq"),
        ({"rope_scaling": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_config_raises(overrides: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(TINY, **overrides)


def test_model_args_defaults() -> None:
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=10)
    assert args.n_kv_heads == 4
    scaled = dataclasses.replace(args, rope_scaling={"factor": 4.0})
    assert scaled.rope_scaling == RopeScaling(factor=4.0)


# --------------------------------------------------------------------------- #
# Rotary embeddings
# --------------------------------------------------------------------------- #


def test_rope_scaling_only_changes_long_wavelengths() -> None:
    scaling = RopeScaling()
    base = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    short = wavelen < 8192 / 4
    long = wavelen > 8192 / 1
    middle = ~(short | long)
    assert short.any() and long.any() and middle.any()
    torch.testing.assert_close(scaled[short], base[short], rtol=0, atol=0)
    torch.testing.assert_close(scaled[long], base[long] / 8)
    assert (scaled[middle] < base[middle]).all()
    assert (scaled[middle] > base[middle] / 8).all()
    # The published reference formula, element by element.
    for f, s in zip(base.tolist(), scaled.tolist()):
        w = 2 * math.pi / f
        if w < 2048:
            ref = f
        elif w > 8192:
            ref = f / 8
        else:
            smooth = (8192 / w - 1) / (4 - 1)
            ref = (1 - smooth) * f / 8 + smooth * f
        assert s == pytest.approx(ref, rel=1e-12)


def test_rope_buffer_and_complex_reference() -> None:
    model = _build(TINY)
    buf = model.freqs_cis
    assert buf.dtype == torch.float32 and not buf.is_complex()
    assert buf.shape == (TINY.max_seq_len, TINY.head_dim // 2, 2)
    assert "freqs_cis" not in model.state_dict()
    model.to(torch.bfloat16)
    model.init_weights(buffer_device="cpu")
    assert model.freqs_cis.dtype == torch.float32
    torch.testing.assert_close(model.freqs_cis, buf, rtol=0, atol=0)

    # Compare with Meta's complex formulation.
    torch.manual_seed(1)
    xq = torch.randn(2, 10, 4, 8)
    xk = torch.randn(2, 10, 2, 8)
    freqs = rope_frequencies(8, 500000.0).float()
    cis = torch.polar(torch.ones(10, 4), torch.outer(torch.arange(10).float(), freqs))

    def ref(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3)

    q, k = apply_rotary_emb(xq, xk, precompute_freqs_cis(8, 10, 500000.0))
    torch.testing.assert_close(q, ref(xq), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, ref(xk), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Forward behaviour
# --------------------------------------------------------------------------- #


def test_forward_shapes_and_dtype() -> None:
    model = _build(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))

    model_bf16 = _build(TINY).to(torch.bfloat16)
    out = model_bf16(tokens)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 11, TINY.vocab_size)


def test_fqns() -> None:
    names = set(dict(_build(TINY).named_parameters()))
    for fqn in (
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.attention.wo.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "layers.1.feed_forward.w3.weight",
        "norm.weight",
        "output.weight",
    ):
        assert fqn in names
    assert not any(n.endswith("bias") for n in names)


def test_causal() -> None:
    model = _build(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_matches_mha_with_repeated_kv_heads() -> None:
    gqa_args = TINY  # 4 query heads, 2 kv heads
    mha_args = dataclasses.replace(TINY, n_kv_heads=4)
    gqa, mha = _build(gqa_args), _build(mha_args)
    n_rep, hd = gqa_args.n_rep, gqa_args.head_dim
    assert n_rep == 2
    gqa_state = gqa.state_dict()
    mha_state = {}
    for key, value in gqa_state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = value.view(gqa_args.n_kv_heads, hd, gqa_args.dim)
            value = heads.repeat_interleave(n_rep, dim=0).reshape(-1, gqa_args.dim)
        mha_state[key] = value
    mha.load_state_dict(mha_state)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Initialisation
# --------------------------------------------------------------------------- #


def test_meta_init_matches_cpu_init() -> None:
    args = dataclasses.replace(TINY, rope_scaling=RopeScaling())
    cpu = _build(args)
    torch.manual_seed(123)
    cpu.init_weights()

    with torch.device("meta"):
        meta = Transformer(args)
    assert meta.freqs_cis.is_meta
    meta.to_empty(device="cpu")
    params_before = {n: p for n, p in meta.named_parameters()}
    torch.manual_seed(123)
    meta.init_weights()
    for name, param in meta.named_parameters():
        assert param is params_before[name], f"{name} was replaced"
        torch.testing.assert_close(param, dict(cpu.named_parameters())[name], rtol=0, atol=0)
    torch.testing.assert_close(meta.freqs_cis, cpu.freqs_cis, rtol=0, atol=0)

    tokens = torch.randint(0, args.vocab_size, (2, 12))
    with torch.no_grad():
        out = meta(tokens)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, cpu(tokens), rtol=0, atol=0)


def test_init_statistics_and_in_place() -> None:
    args = dataclasses.replace(TINY, dim=128, n_heads=4, n_kv_heads=4, n_layers=3, vocab_size=512)
    model = _build(args)
    params = {n: p for n, p in model.named_parameters()}
    for p in params.values():
        with torch.no_grad():
            p.fill_(7.0)
    torch.manual_seed(0)
    model.init_weights()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert (model.norm.weight == 1).all()
    assert (model.layers["2"].ffn_norm.weight == 1).all()
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    for i, layer in enumerate(model.layers.values()):
        std = 0.02 / math.sqrt(2 * (i + 1))
        for w in (layer.attention.wo.weight, layer.feed_forward.w2.weight):
            assert w.std().item() == pytest.approx(std, rel=0.1)
            assert w.abs().max().item() <= 3 * std + 1e-6
    assert model.output.weight.std().item() == pytest.approx(128**-0.5, rel=0.1)


# --------------------------------------------------------------------------- #
# torch.compile
# --------------------------------------------------------------------------- #


def test_compile_fullgraph_matches_eager() -> None:
    torch._dynamo.reset()
    args = get_config("debug")
    eager = _build(args)
    compiled_model = _build(args)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)

    tokens = torch.randint(0, args.vocab_size, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(inputs)  # (2, 16, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return logits.detach(), loss.detach()

    ref_logits, ref_loss = step(eager)
    out_logits, out_loss = step(compiled)
    torch.testing.assert_close(out_logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_grads = dict(eager.named_parameters())
    for name, param in compiled_model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
