"""Tensor parallelism of the Llama 3 model (``simplefsdp.models.llama3.tensor_parallel``).

Parity: 2 ranks, TP size 2, train the TP model 4 SGD steps on one batch, with
sequence and loss parallelism both on and both off (one spawn for both); every
rank also trains the plain model (same seed) on the same full batch in-process,
and losses and parameters (``full_tensor()``) must agree to fp32 precision.
SGD rather than Adam: Adam's normalisation turns rounding noise in near-zero
gradients into update-sized differences. Validation runs in one process on a
fake 2-rank process group (no communication).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

STEPS, BATCH, SEQ, LR = 4, 2, 16, 1.0


def _model(**overrides):
    from simplefsdp.models.llama3 import Transformer, get_config

    torch.manual_seed(0)
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    return Transformer(get_config("debug", **{**base, **overrides}))


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _parity_body(sequence_parallel: bool, loss_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from simplefsdp.models.llama3 import apply_tensor_parallel, loss_parallel_context

    ref, tp = _model(), _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    apply_tensor_parallel(
        tp, mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    assert tp.layers["0"].attention.wq.weight.placements == (Shard(0),)
    assert tp.layers["0"].attention.wo.weight.placements == (Shard(1),)
    assert tp.tok_embeddings.weight.placements == (Shard(0),)
    tokens = torch.randint(
        0, ref.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    tp_opt = torch.optim.SGD(tp.parameters(), lr=LR)
    ref_losses, tp_losses = [], []
    for _ in range(STEPS):
        loss = _loss(ref(tokens[:, :-1]), tokens)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        with loss_parallel_context(loss_parallel):
            logits = tp(tokens[:, :-1])
            loss = _loss(logits, tokens)
            loss.backward()
        tp_opt.step()
        tp_opt.zero_grad()
        tp_losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    assert isinstance(logits, DTensor) == loss_parallel
    initial = _model()
    for (name, want), (_, got), (_, start) in zip(
        ref.named_parameters(), tp.named_parameters(), initial.named_parameters(), strict=True
    ):
        got = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert not torch.equal(want, start), f"{name} did not train"
    uneven_error = ""
    if sequence_parallel:
        try:
            tp(tokens[:, : SEQ - 1])
        except ValueError as exc:
            uneven_error = str(exc)
    return {"ref": ref_losses, "tp": tp_losses, "uneven": uneven_error}


COMBOS = [(True, True), (False, False)]  # (sequence_parallel, loss_parallel)


def _all_combos_body() -> list[dict]:
    return [_parity_body(sp, lp) for sp, lp in COMBOS]


@pytest.fixture(scope="module")
def parity_runs() -> list[list[dict]]:
    """Each rank's results for every combination, from one spawn of 2 ranks."""
    return run_distributed(_all_combos_body, 2)


@pytest.mark.parametrize("combo", range(len(COMBOS)), ids=["sp-lp", "plain"])
def test_tp_matches_single_process(parity_runs, combo):
    sequence_parallel, _ = COMBOS[combo]
    for ranks in parity_runs:
        out = ranks[combo]
        assert out["tp"] == pytest.approx(out["ref"], rel=1e-5, abs=1e-5)
        assert out["ref"][-1] < out["ref"][0]
        if sequence_parallel:
            assert "sequence length 15 is not divisible by the TP size 2" in out["uneven"]


@pytest.fixture
def fake_mesh():
    """A 2-rank fake process group and a 1-D "cpu" mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("overrides", "loss_parallel", "match"),
    [
        (
            {"dim": 48, "n_heads": 3, "n_kv_heads": 3},
            False,
            r"n_heads=3 is not divisible by the TP size 2",
        ),
        ({"n_kv_heads": 1}, False, r"n_kv_heads=1 is not divisible by the TP size 2"),
        ({"multiple_of": 5}, False, r"ffn hidden dim .*=85 is not divisible by the TP size 2"),
        ({"vocab_size": 261}, True, r"vocab_size=261 .* \(required with loss_parallel=True\)"),
    ],
    ids=["n_heads", "n_kv_heads", "ffn", "vocab"],
)
def test_indivisible_sizes_are_refused(fake_mesh, overrides, loss_parallel, match):
    from simplefsdp.models.llama3 import apply_tensor_parallel

    with pytest.raises(ValueError, match=match):
        apply_tensor_parallel(_model(**overrides), fake_mesh, loss_parallel=loss_parallel)


def test_bad_mesh_and_dtensor_params_are_refused(fake_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.models.llama3 import apply_tensor_parallel

    with pytest.raises(ValueError, match=r"must be a 1-D DeviceMesh, got a 2-D mesh"):
        apply_tensor_parallel(_model(), init_device_mesh("cpu", (1, 2)))
    with pytest.raises(ValueError, match=r"must be a 1-D DeviceMesh, got int"):
        apply_tensor_parallel(_model(), 2)
    # An uneven vocabulary is fine without loss parallelism (DTensor shards it unevenly).
    model = apply_tensor_parallel(_model(vocab_size=261), fake_mesh)
    with pytest.raises(ValueError, match=r"'tok_embeddings.weight' is already a DTensor"):
        apply_tensor_parallel(model, fake_mesh)


def test_plan_is_plain_data():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from simplefsdp.models.llama3 import llama3_tp_plan

    model = _model()
    plan = llama3_tp_plan(model, loss_parallel=True)
    assert len(plan) == 3 + 2 * 11  # tok_embeddings, norm, output + 11 per block
    assert isinstance(plan["layers.1.ffn_norm"], SequenceParallel)
    assert isinstance(plan["layers.1.attention"], PrepareModuleInput)
    assert isinstance(plan["layers.1.feed_forward.w3"], ColwiseParallel)
    assert isinstance(plan["layers.1.attention.wo"], RowwiseParallel)
    assert plan["output"].output_layouts == (Shard(-1),)
    assert not plan["output"].use_local_output
    plain = llama3_tp_plan(model, sequence_parallel=False)
    assert not any(isinstance(style, SequenceParallel) for style in plain.values())
    assert plain["tok_embeddings"].output_layouts == (Replicate(),)
    assert plain["output"].use_local_output
