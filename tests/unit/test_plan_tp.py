"""``simplefsdp plan`` and tensor parallelism's collectives: the backward's own
(a recomputed forward's among them), float8 all-gathers, async TP.

One-block traces of the debug Llama at TP 2 on a fake process group (a
second or two each), shared by the module.
"""

from __future__ import annotations

import pytest

from simplefsdp.compiler.cost_model import CostModel, LinearFit
from simplefsdp.compiler.patterns import collective_kind, node_bytes
from simplefsdp.models.registry import resolve_flavor
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.predict import Float8Matmuls, tp_comm_seconds, tp_matmuls
from simplefsdp.plan.reference import REFERENCE_ROWS
from simplefsdp.plan.trace import TraceKey, layer_variant, trace_step

BATCH, SEQ = 2, 64
TOKENS = BATCH * SEQ
PER_BYTE = 1e-9  # seconds per byte of every TP collective, no latency


@pytest.fixture(scope="module")
def traces():
    spec, config = resolve_flavor("debug")
    one_block = layer_variant(spec, config, 1)
    out = {
        ac: trace_step(TraceKey(spec.family, one_block, 2, 2, BATCH, SEQ, ac, True, "bf16", True))
        for ac in ("none", "full")
    }
    return config, out


def _cost_model(
    flops_per_s: float, bytes_per_s: float = 1e12, per_byte: float = PER_BYTE
) -> CostModel:
    fit = LinearFit(0.0, per_byte)
    comm = {f"tp:{kind}/2": fit for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    return CostModel(
        comm=comm, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, kernel_overhead_s=0.0
    )


def _tp_collectives(traced, gm):
    return [
        n
        for n in gm.graph.nodes
        if collective_kind(n) is not None and not traced.groups.is_data_parallel(n)
    ]


def _comm_bytes(node) -> int:
    return node_bytes(node) if collective_kind(node) == "all_gather" else node_bytes(node.args[0])


def test_each_sequence_parallel_collective_pairs_with_its_matmuls(traces) -> None:
    _, by_ac = traces
    traced = by_ac["none"]
    forward = _tp_collectives(traced, traced.forward)
    pairs = [(collective_kind(n), len(tp_matmuls(n))) for n in forward]
    # the embedding's reduce-scatter (no matmul), attention (wq, wk, wv; wo),
    # feed-forward (w1, w3; w2), the output layer's all-gather
    assert pairs == [
        ("reduce_scatter", 0),
        ("all_gather", 3),
        ("reduce_scatter", 1),
        ("all_gather", 2),
        ("reduce_scatter", 1),
        ("all_gather", 1),
    ]
    # Every pairing matmul runs over the tokens; in backward the weight
    # gradients (which contract over the gathered tokens) are left out.
    for gm in (traced.forward, traced.backward):
        for node in _tp_collectives(traced, gm):
            for mm in tp_matmuls(node):
                assert mm.meta["val"].shape[0] == TOKENS, (node.name, mm.name)
    backward = [tp_matmuls(n) for n in _tp_collectives(traced, traced.backward)]
    assert sum(len(m) for m in backward) >= 3


def test_full_ac_backward_runs_the_recomputed_forwards_collectives(traces) -> None:
    _, by_ac = traces
    cm = _cost_model(1e12)
    (fw_none, _), (bw_none, _) = (
        tp_comm_seconds(g, by_ac["none"].groups, cm, True)
        for g in (by_ac["none"].forward, by_ac["none"].backward)
    )
    (fw_full, _), (bw_full, _) = (
        tp_comm_seconds(g, by_ac["full"].groups, cm, True)
        for g in (by_ac["full"].forward, by_ac["full"].backward)
    )
    assert fw_full == pytest.approx(fw_none)
    # The block's two all-gathers and two reduce-scatters run again in
    # backward: every forward collective but the embedding's and the
    # output layer's (neither in the checkpointed block).
    block = [
        n for n in _tp_collectives(by_ac["full"], by_ac["full"].forward) if len(tp_matmuls(n)) > 1
    ]
    block += [
        n
        for n in _tp_collectives(by_ac["full"], by_ac["full"].forward)
        if collective_kind(n) == "reduce_scatter" and tp_matmuls(n)
    ]
    assert len(block) == 4
    recomputed = sum(_comm_bytes(n) for n in block) * PER_BYTE
    assert bw_full == pytest.approx(bw_none + recomputed)


def test_float8_gathers_one_byte_and_async_tp_hides_under_matmuls(traces) -> None:
    config, by_ac = traces
    traced = by_ac["none"]
    gm = traced.forward
    collectives = _tp_collectives(traced, gm)
    cm = _cost_model(1e12)
    priced, run = tp_comm_seconds(gm, traced.groups, cm, True)
    assert run == pytest.approx(priced)
    assert priced == pytest.approx(sum(_comm_bytes(n) for n in collectives) * PER_BYTE)

    # Float8: the block's two all-gathers feed converted linears (half the
    # bytes); the output layer's (vocabulary-sized, bf16) does not.
    fp8 = Float8Matmuls(flops_per_s=1e12, tokens=TOKENS, skip_dim=config.vocab_size // 2)
    _, run8 = tp_comm_seconds(gm, traced.groups, cm, True, fp8)
    halved = [
        n for n in collectives if collective_kind(n) == "all_gather" and len(tp_matmuls(n)) > 1
    ]
    assert len(halved) == 2
    assert run8 == pytest.approx(priced - sum(node_bytes(n) // 2 for n in halved) * PER_BYTE)

    # Async TP: with matmuls far longer than the collectives everything that
    # pairs with a matmul hides, and only the embedding's reduce-scatter is
    # left; with matmuls far shorter, almost nothing hides.
    slow = _cost_model(1e3)
    _, hidden = tp_comm_seconds(gm, traced.groups, slow, True, async_degree=2)
    lonely = [n for n in collectives if not tp_matmuls(n)]
    assert len(lonely) == 1
    assert hidden == pytest.approx(_comm_bytes(lonely[0]) * PER_BYTE)
    fast = _cost_model(1e30, 1e30)
    _, exposed = tp_comm_seconds(gm, traced.groups, fast, True, async_degree=2)
    assert exposed == pytest.approx(priced, rel=1e-6)


def test_async_tp_errors_are_one_line(capsys) -> None:
    small = ["--model", "debug", "--batch", "2", "--seq", "64", "--async-tp"]
    cases = [
        (["--gpus", "2"], "--async-tp overlaps tensor-parallel collectives; it needs --tp > 1"),
        (["--gpus", "4", "--tp", "2", "--engine", "fsdp2"], "--async-tp is a compiler pass"),
    ]
    for argv, message in cases:
        assert plan_cli.main(small + argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_async_tp_needs_a_sequence_parallel_tp_plan(tmp_path, capsys) -> None:
    # transformers' own TP plans all-reduce: nothing for async TP to overlap.
    import json

    spec, config = resolve_flavor("llama3_debug")
    fields = spec.hf_adapter.config_to_hf(config)
    fields |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps({**fields, "sliding_window": None}))
    argv = ["--model", str(tmp_path), "--gpus", "4", "--tp", "2", "--batch", "2", "--seq", "64"]
    assert plan_cli.main([*argv, "--async-tp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the transformers family's TP plan has none (it all-reduces)" in err
    assert "\n" not in err


def test_reference_async_tp_rows_are_planned_with_it() -> None:
    rows = [r for r in REFERENCE_ROWS if "AsyncTP" in r.note]
    assert len(rows) == 11 and all(r.async_tp and r.modelled and r.tp > 1 for r in rows)
    assert not any(r.async_tp for r in REFERENCE_ROWS if "AsyncTP" not in r.note)


def test_async_tp_prices_what_chunked_matmuls_lose(traces) -> None:
    # On a GPU profile each paired matmul runs as tp matmuls of 1/tp of its
    # rows: never faster than whole, so async TP exposes at least that.
    from simplefsdp.plan.hardware import PROFILES
    from simplefsdp.plan.kernels import kernel_model
    from simplefsdp.plan.predict import _chunking_seconds

    _, by_ac = traces
    traced = by_ac["none"]
    hw = PROFILES["h100"]
    kernels = kernel_model(hw, hw.memory_bandwidth * hw.memory_efficiency)
    pairs = [m for n in _tp_collectives(traced, traced.forward) for m in tp_matmuls(n)]
    lost = [_chunking_seconds(m, None, kernels, 2) for m in pairs]
    assert all(x > 0 for x in lost)  # a second kernel launch at least
    # Free communication: all that async TP exposes is what the chunks lose.
    free = _cost_model(1e12, per_byte=0.0)
    _, exposed = tp_comm_seconds(
        traced.forward, traced.groups, free, True, kernels=kernels, async_degree=2
    )
    assert exposed == pytest.approx(sum(lost))


def test_tp_without_data_parallel_sharding_still_communicates() -> None:
    # All GPUs in TP (dp 1): nothing for FSDP to gather, but TP's collectives
    # run all the same; they were dropped with the (empty) bucket plan.
    from simplefsdp.plan.hardware import PROFILES
    from simplefsdp.plan.layout import Layout
    from simplefsdp.plan.predict import predict

    spec, config = resolve_flavor("debug")
    hw = PROFILES["h100"]
    alone = predict(spec, config, Layout(gpus=2, batch=BATCH, seq=SEQ, tp=2), hw)
    sharded = predict(spec, config, Layout(gpus=4, batch=BATCH, seq=SEQ, tp=2), hw)
    assert alone.time["dp_comm_total"] == 0.0
    assert alone.time["tp_comm_total"] > 0.0
    assert alone.time["tp_comm_total"] == pytest.approx(sharded.time["tp_comm_total"], rel=0.25)
    assert alone.time["exposed_comm"] >= alone.time["tp_comm_total"] * 0.99
