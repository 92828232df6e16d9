"""Attention with a sliding window, learned sinks or documents, without scores in memory.

``attend`` runs these through SDPA over a boolean mask, a sink as one more
key (Note: [Sinks as one more key]). Against the explicit softmax over
materialized scores: outputs and the gradients of queries, keys, values and
sinks, in float32 and bfloat16; and what autograd saves holds no
``(B, H, T, T)`` tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from simplefsdp.context_parallel.attention import allowed_keys, masked_attention
from simplefsdp.models.common.attention import attend


def _explicit(q, k, v, allowed, scale, sinks):
    """The softmax over materialized float32 scores, a sink logit per head."""
    scores = (q @ k.transpose(-2, -1)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v


def _leaves(dtype, b=2, h=4, t=48, d=16, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g) * 3
    return [x.requires_grad_() for x in (q, k, v, sinks)]


def _run(fn, leaves, allowed, scale, with_sinks):
    q, k, v, sinks = leaves
    out = fn(q, k, v, allowed, scale, sinks if with_sinks else None)
    weights = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
    (out * weights).sum().backward()
    grads = [x.grad.clone() for x in leaves[: 4 if with_sinks else 3]]
    for x in leaves:
        x.grad = None
    return [out.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("window", [None, 8])
def test_masked_attention_equals_the_explicit_softmax(dtype, with_sinks, window) -> None:
    leaves = _leaves(dtype, dv=24)  # a value width other than the keys'
    t = leaves[0].shape[2]
    pos = torch.arange(t)
    docs = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])  # row 0 packs two documents
    allowed = allowed_keys(pos, pos, docs, docs, window)
    scale = 16**-0.5
    got = _run(masked_attention, leaves, allowed, scale, with_sinks)
    want = _run(_explicit, leaves, allowed, scale, with_sinks)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        # bf16: the explicit reference rounds its probabilities to bf16 for
        # the value product, the fused kernel does not; both differ from
        # float64 by about that much
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max().item())


def test_the_sink_logit_keeps_its_precision_in_bfloat16() -> None:
    """A sink of 7.3 in one bfloat16 column would round to 7.3125 / scale;
    split into two it stays exact: with no key to see but one of logit 0,
    the output is that key's value times ``1 / (1 + e^(sink))``."""
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    v = torch.ones(1, 1, 1, 16, dtype=torch.bfloat16)
    sinks = torch.tensor([7.3])
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    out = masked_attention(q.float(), k.float(), v.float(), allowed, 0.25, sinks)
    exact = 1 / (1 + torch.exp(torch.tensor(7.3, dtype=torch.float64)))
    assert abs(out[0, 0, 0, 0].item() - exact.item()) < 1e-9
    bf16 = masked_attention(q, k, v, allowed, 0.25, sinks)
    # the output itself rounds to bf16; the logit error would show as 1.3%
    torch.testing.assert_close(bf16[0, 0, 0, 0].double(), exact, rtol=4e-3, atol=0)


def _saved_shapes(fn) -> list[torch.Size]:
    shapes = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


@pytest.mark.parametrize("window", [None, 32])
def test_attend_with_sinks_saves_no_scores(window) -> None:
    """What backward keeps of ``attend`` with sinks (GPT-OSS's attention) is
    the inputs, the output and a boolean mask: nothing of ``H x T x T``."""
    b, h, hkv, t, d = 1, 8, 2, 512, 32
    q = torch.randn(b, h, t, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, requires_grad=True) for _ in range(2))
    sinks = torch.randn(h, requires_grad=True)
    shapes = _saved_shapes(lambda: attend(q, k, v, sliding_window=window, sinks=sinks))
    assert shapes
    assert max(s.numel() for s in shapes) < h * t * t / 4, shapes
    out = attend(q, k, v, sliding_window=window, sinks=sinks)
    pos = torch.arange(t)
    rep = [x.repeat_interleave(h // hkv, dim=1) for x in (k, v)]
    want = _explicit(q, *rep, allowed_keys(pos, pos, sliding_window=window), d**-0.5, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_window_without_sinks_is_sdpa_over_its_mask() -> None:
    """A window of half the sequence or more: one SDPA call over its mask."""
    q, k, v, _ = _leaves(torch.float32, b=1)
    t = q.shape[2]
    pos = torch.arange(t)
    mask = allowed_keys(pos, pos, sliding_window=t // 2)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attend(q, k, v, sliding_window=t // 2), want, rtol=0, atol=0)


@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("t", [64, 53])  # whole chunks, and a ragged last one
def test_a_short_window_runs_in_chunks_as_the_whole_mask(with_sinks, t) -> None:
    """A window under half the sequence: queries in chunks of the window,
    each against the two chunks of keys it reaches; equal to the whole mask,
    output and gradients (what it saves: the sinks test above, window 32)."""
    window = 8
    leaves = _leaves(torch.float32, t=t, dv=24)
    pos = torch.arange(t)
    scale = 16**-0.5

    def chunked(q, k, v, allowed, scale, sinks):
        return attend(q, k, v, scale=scale, sliding_window=window, sinks=sinks)

    got = _run(chunked, leaves, None, scale, with_sinks)
    allowed = allowed_keys(pos, pos, sliding_window=window)
    want = _run(_explicit, leaves, allowed, scale, with_sinks)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_attention_keys_say_how_each_layer_runs() -> None:
    """GPT-OSS: sliding layers over two chunks of the window, full ones over
    every key, both with the sink key padded to 16; Llama: the causal kernel."""
    from simplefsdp.models.common.attention import attention_keys
    from simplefsdp.models.registry import resolve_flavor

    _, gpt_oss = resolve_flavor("gpt_oss_20b", n_layers=4)
    assert attention_keys(gpt_oss, 8192) == ([272, 8208, 272, 8208], 8)
    assert attention_keys(gpt_oss, 256) == ([272, 272, 272, 272], 8)  # 2 x 128 is not under 256
    _, llama = resolve_flavor("llama3_debug")
    assert attention_keys(llama, 8192) == ([None] * llama.n_layers, 0)
    # context parallel 8 (allgather): runs of 131072 / 16 = 8192 queries,
    # chunks of the window against two; runs of 64 at 1024 tokens, chunks
    # of the run against the 128 positions before (reach) and their own;
    # full layers over every key; torch's ring causal
    cp8 = attention_keys(gpt_oss, 131072, 8, "allgather")
    assert cp8 == ([272, 131088, 272, 131088], 8)
    assert attention_keys(gpt_oss, 1024, 8, "allgather")[0] == [208, 1040, 208, 1040]
    assert attention_keys(gpt_oss, 131072, 8, "ulysses")[0] == [272, 131088, 272, 131088]
    assert attention_keys(gpt_oss, 131072, 8, "torch")[0] == [None] * 4
    assert attention_keys(llama, 8192, 2)[0] == [8192] * llama.n_layers


def _gpt_oss_plan(monkeypatch, keys_of, **layout) -> tuple[float, list[str]]:
    """Compute seconds and notes of GPT-OSS 20B's plan on 8 H100s (full AC)
    with ``keys_of`` in place of ``attention_keys``."""
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan import analytic
    from simplefsdp.plan.hardware import get_profile
    from simplefsdp.plan.predict import predict

    spec, config = resolve_flavor("gpt_oss_20b")
    monkeypatch.setattr(analytic, "attention_keys", keys_of)
    plan = predict(spec, config, analytic.ExpertLayout(gpus=8, batch=1, ac="full", **layout),
                   get_profile("h100"))  # fmt: skip
    return plan.time["compute"], plan.notes


def test_the_plan_prices_gpt_oss_attention_as_it_runs(monkeypatch) -> None:
    """GPT-OSS 20B at 8,192 tokens on H100s: its attention costs more than
    causal flash attention would, its sliding layers less than flash over
    the sequence; the plan's note says how they run."""
    from simplefsdp.models.common import attention as common_attention

    def compute(keys_of) -> tuple[float, list[str]]:
        return _gpt_oss_plan(monkeypatch, keys_of, seq=8192)

    as_run, notes = compute(common_attention.attention_keys)
    flash, _ = compute(lambda args, seq, *_: ([None] * args.n_layers, 0))
    every_key, _ = compute(lambda args, seq, *_: ([seq + 16] * args.n_layers, 8))
    assert flash < as_run < every_key
    # half the layers over every key, the other half (sliding, 272 keys)
    # cheaper than causal flash attention over 8,192 tokens
    assert as_run < (flash + every_key) / 2
    assert any("24 of 24 layers run SDPA over a boolean mask" in n for n in notes), notes


def test_a_short_window_over_packed_documents_runs_in_chunks() -> None:
    """One process, documents packed in each row, a window under half the
    sequence: chunks (the sequence context's attention) equal the whole
    mask, output and gradients."""
    from simplefsdp.context_parallel import SequenceOptions

    t, window = 45, 6
    leaves = _leaves(torch.float32, t=t)
    tokens = torch.randint(1, 9, (2, t), generator=torch.Generator().manual_seed(2))
    tokens[0, [7, 30]] = 0
    tokens[1, 19] = 0
    context = SequenceOptions(eos_id=0).prepare(tokens)[2]
    docs = context.document_ids
    pos = torch.arange(t)
    scale = 16**-0.5

    def chunked(q, k, v, allowed, scale, sinks):
        return attend(q, k, v, scale=scale, sliding_window=window, sinks=sinks, context=context)

    for with_sinks in (True, False):
        got = _run(chunked, leaves, None, scale, with_sinks)
        allowed = allowed_keys(pos, pos, docs, docs, window)
        want = _run(_explicit, leaves, allowed, scale, with_sinks)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_a_window_of_one_key_is_each_query_alone() -> None:
    """A window of 1 (each query sees itself): chunks that reach back none."""
    q, k, v, _ = _leaves(torch.float32, t=16)
    got = attend(q, k, v, sliding_window=1)
    torch.testing.assert_close(got, v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk", [3, 5, 8])
@pytest.mark.parametrize("start", [0, 12])
def test_chunks_shorter_than_the_window_reach_back_several(chunk, start) -> None:
    """``chunked_attention`` as context parallelism calls it for a run of a
    rank's queries (``start .. start + 17`` of 40 positions): chunks shorter
    than the window meet the keys of the several chunks before them; keys
    before position 0 are not seen. Against the whole mask, output and
    gradients, with packed documents and sinks."""
    from simplefsdp.context_parallel.attention import chunked_attention, window_reach

    t_all, run, window = 40, 17, 8
    leaves = _leaves(torch.float32, t=t_all, dv=24)
    g = torch.Generator().manual_seed(4)
    docs = torch.cat([torch.zeros(2, 1, dtype=torch.long), torch.rand(2, t_all - 1, generator=g)
                      .lt(0.15).long()], dim=1).cumsum(dim=1)  # fmt: skip
    pos = torch.arange(t_all)
    scale = 16**-0.5
    reach = window_reach(window, chunk)
    assert reach >= window - 1 and reach % chunk == 0
    k_pos = torch.arange(start - reach, start + run)
    at = k_pos.clamp(min=0)
    queries = slice(start, start + run)

    def chunked(q, k, v, allowed, scale, sinks):
        return chunked_attention(
            q[:, :, queries], k[:, :, at], v[:, :, at], window, chunk, scale, sinks,
            docs[:, queries], docs[:, at], (k_pos >= 0)[None],
        )  # fmt: skip

    def whole(q, k, v, allowed, scale, sinks):
        return _explicit(q, k, v, allowed, scale, sinks)[:, :, queries]

    allowed = allowed_keys(pos, pos, docs, docs, window)
    for with_sinks in (True, False):
        got = _run(chunked, leaves, None, scale, with_sinks)
        want = _run(whole, leaves, allowed, scale, with_sinks)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_the_plan_prices_windows_across_ranks_in_chunks(monkeypatch) -> None:
    """GPT-OSS 20B at 131,072 tokens under CP 8 (allgather): the sliding
    half of the layers in chunks costs about half the attention of every
    layer over the whole mask, and the plan's note says so."""
    from simplefsdp.models.common import attention as common_attention

    def compute(keys_of) -> tuple[float, list[str]]:
        return _gpt_oss_plan(monkeypatch, keys_of, seq=131072, cp=8)

    chunked, notes = compute(common_attention.attention_keys)
    whole, _ = compute(lambda args, seq, *_: ([seq + 16] * args.n_layers, 8))
    assert 0.4 < chunked / whole < 0.6, (chunked, whole)
    assert any("over 272-131088 keys per query" in n for n in notes), notes
