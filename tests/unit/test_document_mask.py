"""Document masks and sequence splits in one process.

A packed row with a document mask must give, for every document, the logits
of that document run alone (rotary attention is relative, so this holds for
positions that restart per document and for positions that count along the
row); the sequence context's attention must equal ``attend``'s own for one
document (sinks, sliding windows); splits must cover the sequence and
balance the work; bad settings are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from simplefsdp.context_parallel import (
    SequenceOptions,
    document_balanced_index,
    document_ids,
    document_positions,
    head_tail_index,
)
from simplefsdp.models.common.attention import attend

EOS = 0


@pytest.fixture(scope="module")
def model():
    from simplefsdp.models.registry import resolve_flavor

    spec, config = resolve_flavor(
        "llama3_debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64
    )
    torch.manual_seed(0)
    return spec.build(config).double()


def _packed() -> tuple[torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 64, (2, 32), generator=g)
    tokens[0, [9, 20]] = EOS
    tokens[1, 5] = EOS
    return tokens, [[0, 10, 21, 32], [0, 6, 32]]


@pytest.mark.parametrize("restart", [False, True])
def test_packed_documents_match_documents_alone(model, restart: bool) -> None:
    tokens, bounds = _packed()
    inputs, _, context = SequenceOptions(eos_id=EOS, restart_positions=restart).prepare(tokens)
    out = model(inputs, context=context)
    for row, cuts in enumerate(bounds):
        for start, end in zip(cuts, cuts[1:], strict=False):
            alone = model(tokens[row : row + 1, start:end])
            # rotary math is float32: shifted positions round differently
            atol = 1e-12 if restart else 1e-7
            torch.testing.assert_close(out[row : row + 1, start:end], alone, rtol=0, atol=atol)
    # without the mask, later documents see earlier ones
    plain = model(tokens)
    assert (plain[0, 10:] - out[0, 10:]).abs().max() > 1e-3


def test_no_document_is_plain_causal(model) -> None:
    tokens, _ = _packed()
    tokens[tokens == EOS] = 1
    inputs, _, context = SequenceOptions(eos_id=EOS).prepare(tokens)
    torch.testing.assert_close(model(inputs, context=context), model(tokens), rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_context_attention_matches_attend(window, with_sinks) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 16, 6, generator=g, dtype=torch.float64)  # d_v != d_qk
    sinks = torch.randn(4, generator=g, dtype=torch.float64) if with_sinks else None
    context = SequenceOptions(eos_id=EOS).prepare(torch.ones(2, 16, dtype=torch.long))[2]
    want = attend(q, k, v, sliding_window=window, sinks=sinks)
    got = attend(q, k, v, sliding_window=window, sinks=sinks, context=context)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_document_ids_and_positions() -> None:
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(document_ids(tokens, 0)).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def test_head_tail_index() -> None:
    assert head_tail_index(8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    index = head_tail_index(32, 4)
    assert sorted(index.flatten().tolist()) == list(range(32))
    work = (index + 1).sum(dim=1)  # keys seen by each rank's causal queries
    assert work.min() == work.max()


def test_document_balanced_index_balances_block_causal_work() -> None:
    docs = torch.zeros(1, 64, dtype=torch.long)
    docs[0, 48:] = 1  # one long document, then a short one
    index = document_balanced_index(docs, 2)
    assert sorted(index.flatten().tolist()) == list(range(64))
    assert all(row == sorted(row) for row in index.tolist())
    cost = (document_positions(docs)[0] + 1)[index].sum(dim=1)
    head_tail = (document_positions(docs)[0] + 1)[head_tail_index(64, 2)].sum(dim=1)
    assert (cost.max() - cost.min()) < (head_tail.max() - head_tail.min())


def test_refusals_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"^sequence length 12 is not divisible by 2 x cp = 8; "):
        head_tail_index(12, 4)
    with pytest.raises(ValueError, match=r"^cp_backend 'tree' is not one of allgather, ring, "):
        SequenceOptions(backend="tree")
    with pytest.raises(ValueError, match=r"^load_balance 'x' is not one of head_tail, documents"):
        SequenceOptions(load_balance="x")


def _job_errors(**kwargs) -> list[str]:
    from simplefsdp.engines.resolve import job_errors
    from simplefsdp.layout import Layout
    from simplefsdp.models.registry import resolve_flavor

    spec, config = resolve_flavor("llama3_debug", n_heads=4, n_kv_heads=2, max_seq_len=64)
    layout = Layout(cp=kwargs.pop("cp", 2), tp=kwargs.pop("tp", 1), pp=kwargs.pop("pp", 1))
    world = layout.cp * layout.tp * layout.pp
    return job_errors(spec, config, layout, world, "simplefsdp", **kwargs)


def test_resolve_refuses_bad_cp_jobs() -> None:
    assert _job_errors(seq_len=64) == []
    assert _job_errors(seq_len=64, cp_backend="ulysses") == []
    (line,) = _job_errors(seq_len=62)
    assert line.startswith("seq_len 62 is not divisible by 2 x cp = 4")
    (line,) = _job_errors(cp=4, tp=2, seq_len=64, cp_backend="ulysses")
    assert "the 4 attention heads" in line and "tp x cp = 8" in line
    assert _job_errors(pp=2, seq_len=64) == []  # pipeline stages run cp inside
    (line,) = _job_errors(cp=2, pp=2, seq_len=64, document_masks=True)
    assert "pipeline schedules split micro-batches by rows" in line


def test_context_parallel_losses_average_to_the_batch_mean() -> None:
    """Ranks hold different numbers of trained targets: their weighted losses
    average to the mean over the whole batch's trained targets."""
    import torch.nn.functional as F

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 16, 10, generator=g)
    targets = torch.randint(0, 10, (2, 16), generator=g)
    targets[0, :7] = -100  # most of rank 0's first chunk is not trained on
    want = loss_fn(logits, targets)
    losses, plain = [], []
    for rank in range(2):
        options = SequenceOptions(cp=2, rank=rank)
        local_logits, local_targets, _ = options.prepare(logits, targets)
        losses.append(options.local_loss(loss_fn, local_logits, local_targets, targets))
        plain.append(loss_fn(local_logits, local_targets))
    torch.testing.assert_close(sum(losses) / 2, want)
    assert abs(sum(plain) / 2 - want) > 1e-3  # unweighted means would not be the batch's
    targets[:] = -100
    targets[1, 4:12] = 3  # rank 0 (chunks 0 and 3) holds no trained target
    rank0 = SequenceOptions(cp=2, rank=0)
    local_logits, local_targets, _ = rank0.prepare(logits.requires_grad_(), targets)
    zero = rank0.local_loss(loss_fn, local_logits, local_targets, targets)
    zero.backward()
    assert zero.item() == 0.0 and logits.grad.abs().sum() == 0
