"""Unit tests for the mixture-of-experts model family (single process, CPU)."""

from __future__ import annotations

import pytest
import torch

from simplefsdp.models.moe import (
    MOE_CONFIGS,
    GroupedExperts,
    MoE,
    MoEArgs,
    Transformer,
    expert_load,
    get_config,
    num_active_params,
    num_params,
    update_expert_bias,
)

TINY = MoEArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=37,
    max_seq_len=32,
    n_dense_layers=1,
    num_experts=4,
    top_k=2,
    moe_hidden_dim=16,
    num_shared_experts=1,
)


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("llama4_scout", 109e9, 17e9),
    ],
)
def test_published_param_counts(name: str, total: float, active: float | None) -> None:
    args = get_config(name)
    # Llama 4 Scout's published 109B includes its vision encoder (~1B).
    assert abs(num_params(args) - total) / total < 0.015, num_params(args)
    if active is not None:
        assert abs(num_active_params(args) - active) / active < 0.02, num_active_params(args)


@pytest.mark.parametrize("name", ["moe_debug", "moe_small", "llama4_scout"])
def test_counted_matches_built(name: str) -> None:
    args = get_config(name, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    assert num_params(model) == num_params(args) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"top_k": 9}, "top_k=9 exceeds num_experts=8"),
        ({"score_func": "relu"}, "score_func"),
        ({"load_balance": "x"}, "load_balance"),
        ({"n_dense_layers": 5}, "n_dense_layers=5"),
    ],
)
def test_bad_args(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_config("moe_debug", **overrides)
    with pytest.raises(ValueError, match="valid names"):
        get_config("nope")


def test_forward_shapes_and_experts_are_3d() -> None:
    torch.manual_seed(0)
    model = Transformer(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (3, 8))
    assert model(tokens).shape == (3, 8, TINY.vocab_size)
    experts = model.layers["1"].moe.experts
    assert experts.w1.shape == (4, 16, 32) and experts.w2.shape == (4, 32, 16)
    assert "feed_forward" in dict(model.layers["0"].named_children())
    assert set(model.state_dict()) >= {
        "layers.1.moe.expert_bias",
        "layers.1.moe.router.gate.weight",
    }


def _loop_vs_grouped(counts: list[int]) -> None:
    torch.manual_seed(0)
    grouped = GroupedExperts(8, 12, len(counts), use_grouped_mm=True)
    grouped.init_weights(0.1)
    loop = GroupedExperts(8, 12, len(counts), use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(sum(counts), 8)
    n = torch.tensor(counts)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = grouped(xa, n), loop(xb, n)
    torch.testing.assert_close(ya, yb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(grouped, name).grad, getattr(loop, name).grad)
    for expert, count in enumerate(counts):
        if count == 0:  # an expert without tokens gets a zero gradient
            assert grouped.w1.grad[expert].abs().max() == 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 4, 0], [2, 2, 2, 0]])
def test_grouped_mm_matches_loop_with_empty_experts(counts: list[int]) -> None:
    _loop_vs_grouped(counts)


def test_router_choice_uses_bias_but_weights_do_not() -> None:
    torch.manual_seed(0)
    moe = MoE(TINY)
    x = torch.randn(10, TINY.dim)
    scores_plain, experts_plain, _ = moe.router(x)
    bias = torch.tensor([10.0, 10.0, 0.0, 0.0])  # force experts 0 and 1
    scores_biased, experts_biased, full = moe.router(x, bias)
    assert set(experts_biased.flatten().tolist()) == {0, 1}
    # Gating weights are the unbiased scores of the chosen experts, renormalised.
    chosen = full.gather(-1, experts_biased)
    torch.testing.assert_close(scores_biased, chosen / chosen.sum(-1, keepdim=True))


def test_bias_update_follows_load_and_resets_counts() -> None:
    torch.manual_seed(0)
    model = Transformer(TINY)
    moe = model.layers["1"].moe
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] += 5.0  # expert 0 takes (almost) every token
    model(torch.randint(0, TINY.vocab_size, (2, 8))).sum().backward()
    counts = moe.tokens_per_expert.clone()
    assert counts.sum() == 2 * 8 * TINY.top_k
    (load,) = expert_load(model)
    assert load.tokens_per_expert == tuple(counts.tolist()) and load.imbalance > 1
    (load,) = update_expert_bias(model)
    assert load.tokens_per_expert == tuple(counts.tolist())
    over = counts > counts.mean()
    assert (moe.expert_bias[over] < 0).all() and (moe.expert_bias[~over] > 0).all()
    assert abs(moe.expert_bias.sum().item()) < 1e-6
    assert moe.tokens_per_expert.sum() == 0


def test_eval_does_not_count() -> None:
    model = Transformer(TINY).eval()
    model(torch.randint(0, TINY.vocab_size, (1, 4)))
    assert model.layers["1"].moe.tokens_per_expert.sum() == 0


def test_aux_loss_trains_the_router_without_changing_outputs() -> None:
    torch.manual_seed(0)
    plain = Transformer(TINY.replace(load_balance="none"))
    aux = Transformer(TINY.replace(load_balance="aux_loss"))
    aux.load_state_dict(plain.state_dict(), strict=False)
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    out_plain, out_aux = plain(tokens), aux(tokens)
    torch.testing.assert_close(out_plain, out_aux)
    out_plain.sum().backward()
    out_aux.sum().backward()
    gate = "layers.1.moe.router.gate.weight"
    grads = {n: p.grad for n, p in aux.named_parameters()}
    assert not torch.allclose(dict(plain.named_parameters())[gate].grad, grads[gate])
    torch.testing.assert_close(
        dict(plain.named_parameters())["output.weight"].grad, grads["output.weight"]
    )


def test_debug_config_builds_on_meta_and_inits() -> None:
    assert set(MOE_CONFIGS) >= {"moe_debug", "moe_small", "llama4_scout"}
    with torch.device("meta"):
        model = Transformer(get_config("moe_debug"))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.layers["1"].moe.expert_bias.abs().sum() == 0
    assert torch.isfinite(model(torch.randint(0, 260, (1, 8)))).all()
