"""``simplefsdp plan``: traces, memory and time accounting, profiles, errors.

Traces run in this process with a fake process group (no communication) on
the meta device; small configurations keep them to a second or two each.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import plan_profiles
from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.models.llama3 import get_config, num_params
from simplefsdp.models.registry import get_spec
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.hardware import PROFILES, HardwareProfile, get_profile
from simplefsdp.plan.pipeline import first_rank_actions, pipeline_peak
from simplefsdp.plan.predict import (
    ADAMW_BYTES_PER_PARAM,
    Layout,
    compute_time,
    copy_seconds,
    measure,
    predict,
    traced,
    validate,
)
from simplefsdp.plan.trace import TraceKey

LLAMA = get_spec("llama3")

GiB = 2**30

FIXED = plan_profiles.FIXED  # round numbers for hand-computed checks


def _debug(**overrides):
    return get_config("debug", **overrides)


# ------------------------------------------------------------ profiles


def test_every_builtin_profile_is_complete_and_sourced() -> None:
    assert {"h100", "h200", "a100", "cpu-gloo"} <= set(PROFILES)
    for profile in PROFILES.values():
        assert profile.source, profile.name
        assert 0 < profile.matmul_efficiency <= 1 and 0 < profile.memory_efficiency <= 1
        assert HardwareProfile.from_dict(profile.to_dict()) == profile


def test_unknown_hardware_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown hardware 'h300'; valid: .*h100.*h200"):
        get_profile("h300")


def test_ring_collective_time_by_hand() -> None:
    # 4 ranks in one node: 10 us + 3/4 * 8e9 B / 1e10 B/s = 0.61001 s
    assert FIXED.comm_seconds("all_gather", 4, 8e9, span=4) == pytest.approx(1e-5 + 0.6)
    # 8 ranks span two nodes: inter-node link; all-reduce moves twice the bytes
    assert FIXED.comm_seconds("all_reduce", 8, 8e8, span=8) == pytest.approx(1e-4 + 2 * 7 / 8 * 0.8)
    assert FIXED.comm_seconds("all_gather", 1, 8e9, span=1) == 0.0


def test_profile_round_trips_through_json(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(FIXED.to_dict()))
    assert get_profile(str(path)) == FIXED


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            Layout(gpus=8, batch=2, seq=64, tp=3),
            r"--tp 3 does not divide --gpus 8; valid tensor-parallel sizes for 8 ranks: 1, 2, 4, 8",
        ),
        (
            Layout(gpus=6, batch=2, seq=64, tp=3),
            r"--tp 3 does not divide the n_heads 8, n_kv_heads 4 of the model",
        ),
        (
            Layout(gpus=8, batch=2, seq=64, pp=8, microbatches=8),
            r"--pp 8 x 1 stages per rank = 8 stages but the model has 4 layers",
        ),
        (Layout(gpus=4, batch=3, seq=64, pp=2, microbatches=2), r"--batch 3 is not divisible"),
        (Layout(gpus=2, batch=2, seq=4096), r"--seq 4096 exceeds max_seq_len 512 of the model"),
        (Layout(gpus=2, batch=2, seq=64, ac="most"), r"unknown --ac 'most'; valid: none"),
        (Layout(gpus=8, batch=2, seq=64, pp=0), r"--pp must be >= 1, got 0"),
        (Layout(gpus=8, batch=2, seq=64, tp=-2), r"--tp must be >= 1, got -2"),
        (Layout(gpus=2, batch=2, seq=64, microbatches=0), r"--microbatches must be >= 1, got 0"),
        # The divisors of the batch below pp are not offered.
        (
            Layout(gpus=4, batch=2, seq=64, pp=4, microbatches=4),
            r"--batch 2 is not divisible by --microbatches 4; use a --batch that is a multiple",
        ),
        (
            Layout(gpus=4, batch=12, seq=64, pp=4, microbatches=8),
            r"--microbatches 8; valid --microbatches: 4, 6, 12$",
        ),
        (
            Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2, pp_schedule="zigzag"),
            r"--pp-schedule: unknown pipeline schedule 'zigzag'; valid: gpipe, 1f1b",
        ),
        (
            Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2, stages_per_rank=2),
            r"schedule '1f1b' runs one stage per rank, got --stages-per-rank 2",
        ),
        (
            Layout(gpus=2, batch=4, seq=64, pp_schedule="interleaved_1f1b"),
            r"^--pp-schedule schedules a pipeline; it needs --pp > 1$",
        ),
    ],
)
def test_bad_layouts_name_the_value_and_what_is_valid(layout, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        validate(_debug(), layout)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------ graph measures


def test_fused_compute_time_by_hand() -> None:
    def f(x, w):
        h = x @ w  # 2*8*16*32 FLOPs
        return (torch.relu(h) * 2.0).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    cm = CostModel(flops_per_s=1e9, bytes_per_s=1e6, kernel_overhead_s=1e-3)
    unfused = compute_time(gm, cm, fused=False)
    h = 8 * 32 * 4  # bytes of the (8, 32) fp32 intermediates
    # each op a kernel: mm (max of FLOPs and bytes moved), relu, mul, sum
    mm_s = max(2 * 8 * 16 * 32 / 1e9, (8 * 16 + 16 * 32 + 8 * 32) * 4 / 1e6)
    expected = mm_s + (2 * h) / 1e6 + (2 * h) / 1e6 + (h + 4) / 1e6 + 4 * 1e-3
    assert unfused["seconds"] == pytest.approx(expected)
    fused = compute_time(gm, cm, fused=True)
    # relu, mul, sum fuse: the chain reads h once and writes the scalar; one
    # kernel overhead for the chain, one for the matmul.
    assert fused["seconds"] == pytest.approx(mm_s + 1e-3 + (h + 4) / 1e6 + 1e-3)
    assert fused["kernels"] == 2
    assert fused["flops"] == unfused["flops"] == 2 * 8 * 16 * 32


def test_a_loss_compiled_beside_eager_blocks_fuses_its_vocabulary_wide_ops() -> None:
    # --fused-loss with an eager engine: the ops of the logits' width (fp32
    # copy, log-softmax, the target's gather, their gradients) group as the
    # compiled engine groups them; the blocks' own ops stay one kernel each.
    vocab, hidden = 96, 16

    def step(x, w, o, target):
        h = torch.relu(x @ w) * 2.0  # a block's elementwise ops
        logits = (h @ o).float()
        return torch.nn.functional.cross_entropy(logits, target)

    args = (torch.randn(8, hidden), torch.randn(hidden, hidden), torch.randn(hidden, vocab))
    target = torch.randint(0, vocab, (8,))
    forward = make_fx(step, tracing_mode="fake")(*args, target)
    joint = make_fx(lambda *a: torch.autograd.grad(step(*a), a[:3]), tracing_mode="fake")(
        *(t.requires_grad_() for t in args), target
    )
    cm = CostModel(flops_per_s=1e9, bytes_per_s=1e6, kernel_overhead_s=1e-3)
    for gm in (forward, joint):
        eager = compute_time(gm, cm, fused=False)["seconds"]
        compiled = compute_time(gm, cm, fused=True)["seconds"]
        loss_fused = compute_time(gm, cm, fused=False, loss_vocab=vocab)
        assert compiled < loss_fused["seconds"] < eager
        # the blocks' relu and mul (and their gradients) keep their own kernels
        block = compute_time(gm, cm, fused=False, loss_vocab=vocab + 1)["seconds"]
        assert block == eager
        assert loss_fused["kernels"] < compute_time(gm, cm, fused=False)["kernels"]
    # A step: the eager FSDP2 step gains; the compiled engine's, fused
    # already, does not change.
    layout = Layout(gpus=2, batch=2, seq=64)
    for engine, faster in (("fsdp2", True), ("simplefsdp", False)):
        plain = predict(LLAMA, _debug(), dataclasses.replace(layout, engine=engine), FIXED)
        fused = predict(
            LLAMA, _debug(), dataclasses.replace(layout, engine=engine, fused_loss=True), FIXED
        )
        assert (fused.time["compute"] < plain.time["compute"]) is faster, engine
        if not faster:
            assert fused.time["compute"] == plain.time["compute"]


def test_a_matmuls_new_output_pays_its_first_touch() -> None:
    def f(x, w):
        return (x @ w).relu()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    mm, relu = (n for n in gm.graph.nodes if n.op == "call_function")
    touched = CostModel(flops_per_s=1e9, bytes_per_s=1e15, kernel_overhead_s=0.0)
    fresh = dataclasses.replace(touched, alloc_s_per_byte=1e-9)
    out_bytes = 8 * 32 * 4
    assert touched.node_time(mm) == pytest.approx(2 * 8 * 16 * 32 / 1e9)
    assert fresh.node_time(mm) == pytest.approx(2 * 8 * 16 * 32 / 1e9 + out_bytes * 1e-9)
    # elementwise ops: the measured bandwidth already includes their outputs
    assert fresh.node_time(relu) == touched.node_time(relu)
    from simplefsdp.plan.predict import cost_model_for

    profile = dataclasses.replace(FIXED, alloc_s_per_byte=7e-10)
    assert cost_model_for(profile, Layout(gpus=2, batch=2, seq=64)).alloc_s_per_byte == 7e-10
    legacy = touched.to_dict()
    del legacy["alloc_s_per_byte"]  # a cost-model cache written before it existed
    assert CostModel.from_dict(legacy).alloc_s_per_byte == 0.0


def test_attention_at_its_share_of_the_matmul_rate() -> None:
    import torch.nn.functional as F

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(2, 4, 64, 16)
    gm = make_fx(f, tracing_mode="fake")(q, q, q)
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    flops = 4 * 2 * 4 * 64 * 64 * 16
    fast = CostModel(flops_per_s=1e9, bytes_per_s=1e15, kernel_overhead_s=0.0)
    slow = dataclasses.replace(fast, attention_efficiency=0.25)
    assert fast.node_time(node) == pytest.approx(flops / 1e9)
    assert slow.node_time(node) == pytest.approx(4 * flops / 1e9)
    # a profile's share reaches the planner's cost model; profiles without it: 1
    from simplefsdp.plan.predict import cost_model_for

    half = dataclasses.replace(FIXED, attention_efficiency=0.5)
    assert cost_model_for(half, Layout(gpus=2, batch=2, seq=64)).attention_efficiency == 0.5
    assert (
        CostModel.from_dict({**fast.to_dict(), "attention_efficiency": 0.5}).attention_efficiency
        == 0.5
    )
    legacy = fast.to_dict()
    del legacy["attention_efficiency"]  # a cost-model cache written before it existed
    assert CostModel.from_dict(legacy).attention_efficiency == 1.0


def test_copies_around_collectives_by_hand() -> None:
    from simplefsdp.compiler.auto_bucketing import GatherUnit

    cm = CostModel(bytes_per_s=3e9, kernel_overhead_s=1e-3)
    # two 2-rank buckets of 1 GB and 2 GB gathered (2 and 1 parameters)
    buckets = [
        [GatherUnit("a", 5 * 10**8, 2, 0.0), GatherUnit("b", 5 * 10**8, 2, 0.0)],
        [GatherUnit("c", 2 * 10**9, 2, 0.0)],
    ]
    # resharded: 2 all-gathers (shards in, bucket out: 1.5x its bytes each)
    # and one reduce-scatter (gradients in: 1x) per bucket, each written
    # byte moving 3 bytes at 3e9 B/s (1 s per GB; a CPU whose new pages
    # fault in); one
    # kernel per parameter and copy (5 per parameter, 3 parameters)
    written = (2 * 1.5 + 1) * 3e9
    assert copy_seconds(buckets, cm, True, 3.0) == pytest.approx(written / 1e9 + 15e-3)
    # kept gathered: one all-gather each; a read and a write per byte (2)
    assert copy_seconds(buckets, cm, False) == pytest.approx((1.5 + 1) * 2 + 9e-3)


def test_fsdp2_holds_its_root_and_the_last_blocks_as_backward_starts() -> None:
    from simplefsdp.compiler.auto_bucketing import GatherUnit
    from simplefsdp.plan.predict import fsdp2_gathered_bytes

    def unit(fqn, size):
        return GatherUnit(fqn, size, 2, 0.0)

    # root (embedding 5, output 4), blocks of 3, 2 and 1 bytes, forward order
    units = [unit("_orig_mod.tok_embeddings.weight", 5)]
    units += [unit(f"_orig_mod.layers.{i}.w", size) for i, size in enumerate((3, 2, 1))]
    units += [unit("_orig_mod.output.weight", 4)]
    # as backward starts: the root (9), the last block copied out (2 * 1),
    # the one before it prefetched (2)
    assert fsdp2_gathered_bytes(units, beside=100.0, root="whole") == 9 + 2 * 1 + 2
    # the root's copy-out as forward starts (2 * 9 + 3) where nothing else is held
    assert fsdp2_gathered_bytes(units, beside=0.0, root="whole") == 2 * 9 + 3
    # torchtitan's split root: the output (4) kept from forward, resharded
    # before the last block's backward prefetches the one before it (2)
    assert fsdp2_gathered_bytes(units, beside=100.0, root="split") == 2 * 1 + max(4, 2)
    # the embedding alone copied out as forward starts (2 * 5 + 3)
    assert fsdp2_gathered_bytes(units, beside=0.0, root="split") == 2 * 5 + 3


def test_kept_parameters_are_held_once_beside_the_later_buckets() -> None:
    from simplefsdp.compiler.auto_bucketing import GatherUnit
    from simplefsdp.plan.predict import prefetch_extra_bytes

    # buckets of 4, 2 and 3 bytes; b2 (1 of bucket 1's 2) and c kept
    buckets = [
        [GatherUnit("a", 4, 2, 0.0)],
        [GatherUnit("b1", 1, 2, 0.0), GatherUnit("b2", 1, 2, 0.0)],
        [GatherUnit("c", 3, 2, 0.0)],
    ]
    assert prefetch_extra_bytes(buckets) == 2 * 4 + 2  # without keeping
    # forward: 8 + 2, 4 + 3, then b2 held + 6; when backward starts the 4
    # kept bytes beside bucket 1 gathered again and copied out (4 + 2 * 2)
    assert prefetch_extra_bytes(buckets, {"b2", "c"}) == 10
    # everything kept: the last bucket's 6 beside the 6 held before it; 9
    # when backward starts, nothing gathered again (the kept bytes are not
    # added on top of the worst bucket, as a sum would: 10 + 9)
    assert prefetch_extra_bytes(buckets, {"a", "b1", "b2", "c"}) == 12
    big = [[GatherUnit("a", 1, 2, 0.0)], [GatherUnit("b", 1, 2, 0.0)], [GatherUnit("c", 1, 2, 0.0)]]
    # 2 held + 2 * 1 at the last, 3 when backward starts: the forward's end
    assert prefetch_extra_bytes(big, {"a", "b", "c"}) == 4


def test_calibration_profile_carries_the_attention_share() -> None:
    from simplefsdp.plan.calibrate import profile_from

    raw = {
        "fits": {"all_gather/2": [1e-4, 1e-9], "reduce_scatter/2": [3e-4, 3e-9]},
        "flops": 1e11,
        "attention_flops": 4e10,
        "bytes_per_s": 5e9,
        "op_s": 1e-5,
        "overlap": 0.2,
        "copy_bytes_per_byte": 2.6,
        "adamw_s_per_param": 8e-9,
        "alloc_s_per_byte": 6e-10,
        "fsdp2_group_s": 2e-3,
        "fsdp2_copy_s_per_byte": 2e-9,
        "fsdp2_sharded_group_s": 4e-3,
    }
    profile = profile_from(raw, "t", "cpu")
    assert profile.attention_efficiency == pytest.approx(0.4)
    assert profile.copy_bytes_per_byte == 2.6
    assert profile.adamw_s_per_param == 8e-9
    assert profile.alloc_s_per_byte == 6e-10
    assert profile.fsdp2_group_s == 2e-3
    assert profile.fsdp2_copy_s_per_byte == 2e-9
    assert profile.fsdp2_sharded_group_s == 4e-3
    assert profile.intra_latency_s == pytest.approx(2e-4)
    assert profile.intra_bandwidth == pytest.approx(0.5 / 2e-9)
    del raw["attention_flops"], raw["copy_bytes_per_byte"]  # an older calibration
    del raw["adamw_s_per_param"], raw["alloc_s_per_byte"], raw["fsdp2_group_s"]
    del raw["fsdp2_copy_s_per_byte"], raw["fsdp2_sharded_group_s"]  # an older calibration
    old = profile_from(raw, "t", "cpu")
    assert (old.attention_efficiency, old.copy_bytes_per_byte) == (1.0, 2.0)
    assert old.adamw_s_per_param == 0.0  # the step from the memory bandwidth
    assert old.alloc_s_per_byte == 0.0  # matmuls at the one measured rate
    assert old.fsdp2_group_s == 0.0
    assert old.fsdp2_copy_s_per_byte == 0.0
    assert old.fsdp2_sharded_group_s == 0.0


def _key(n_layers: int, dp: int = 2, ac: str = "selective", **kw) -> TraceKey:
    return TraceKey("llama3", _debug(n_layers=n_layers), dp, kw.get("tp", 1), 2, 64, ac)


def test_parameter_gradient_optimizer_bytes_are_exact() -> None:
    args = _debug()
    pred = predict(LLAMA, args, Layout(gpus=2, batch=2, seq=64), FIXED)
    shard = 4 * num_params(args) / 2  # fp32, evenly sharded over 2 ranks
    assert pred.memory["parameters"] == shard
    assert pred.memory["gradients"] == shard
    assert pred.memory["optimizer"] == 2 * shard
    assert pred.peak_bytes == pytest.approx(sum(pred.memory.values()))


@pytest.mark.slow
def test_block_extrapolation_matches_a_full_trace() -> None:
    cm = CostModel()
    m1, m2, m4 = (measure(traced(_key(n)), cm, fused=True) for n in (1, 2, 4))
    guess = m1.extrapolate(m2, 4)
    for name in ("fw_flops", "bw_flops", "param_bytes", "saved_bytes", "grad_bytes"):
        assert getattr(guess, name) == pytest.approx(getattr(m4, name), rel=1e-9), name
    for name in ("fw_s", "bw_s", "fw_peak", "bw_peak", "bw_transient"):
        assert getattr(guess, name) == pytest.approx(getattr(m4, name), rel=0.02), name


def test_step_time_adds_up_by_hand() -> None:
    # step = traced compute + exposed communication + gradient clipping and
    # the AdamW step, which move 12 and 28 bytes per fp32 parameter at
    # 0.5 * 1e11 B/s, plus the gradient-norm all-reduce of one number
    # (intra-node: 10 us + 2 * 1/2 * 4 B / 1e10 B/s).
    args = _debug()
    pred = predict(LLAMA, args, Layout(gpus=2, batch=2, seq=64), FIXED)
    optimizer_s = num_params(args) / 2 * (12 + ADAMW_BYTES_PER_PARAM) / (0.5 * 1e11)
    optimizer_s += 1e-5 + 4 / 1e10
    assert pred.time["optimizer"] == pytest.approx(optimizer_s)
    assert pred.time["bubble"] == 0
    assert pred.step_s == pytest.approx(
        pred.time["compute"] + pred.time["exposed_comm"] + optimizer_s
    )
    assert pred.tokens_per_s_per_gpu == pytest.approx(2 * 64 * 2 / pred.step_s / 2)
    assert 0 <= pred.time["exposed_comm"] <= pred.time["dp_comm_total"]


def test_a_measured_adamw_rate_replaces_the_bandwidth_estimate() -> None:
    args = _debug()
    layout = Layout(gpus=2, batch=2, seq=64)
    base = predict(LLAMA, args, layout, FIXED)
    measured = predict(LLAMA, args, layout, dataclasses.replace(FIXED, adamw_s_per_param=3e-9))
    # the gradient norm's passes and all-reduce, as above
    norm_s = num_params(args) / 2 * 12 / (0.5 * 1e11) + 1e-5 + 4 / 1e10
    assert measured.time["optimizer"] == pytest.approx(num_params(args) / 2 * 3e-9 + norm_s)
    assert measured.step_s - base.step_s == pytest.approx(
        measured.time["optimizer"] - base.time["optimizer"]
    )


def test_eager_fsdp2_pays_its_hooks_per_group_and_the_compiled_engine_does_not() -> None:
    # 4 blocks: FSDP2 has 6 groups (the blocks, the embedding, the final norm
    # and output), 5 with one root group
    args = _debug()
    hooked = dataclasses.replace(FIXED, fsdp2_group_s=1e-3)
    for gpus, root, groups in ((1, "split", 6), (2, "split", 6), (2, "whole", 5)):
        layout = Layout(gpus=gpus, batch=2, seq=64, engine="fsdp2", fsdp2_root=root)
        base, pred = predict(LLAMA, args, layout, FIXED), predict(LLAMA, args, layout, hooked)
        assert base.time["hooks"] == 0
        assert pred.time["hooks"] == pytest.approx(groups * 1e-3)
        assert pred.time["compute"] - base.time["compute"] == pytest.approx(groups * 1e-3)
        assert pred.step_s - base.step_s == pytest.approx(groups * 1e-3)
    compiled = Layout(gpus=2, batch=2, seq=64, engine="simplefsdp")
    assert predict(LLAMA, args, compiled, hooked).time["hooks"] == 0
    assert (
        predict(LLAMA, args, compiled, hooked).step_s
        == predict(LLAMA, args, compiled, FIXED).step_s
    )


def test_full_ac_recomputes_and_saves_less() -> None:
    layout = Layout(gpus=2, batch=2, seq=64)
    preds = {
        ac: predict(LLAMA, _debug(), dataclasses.replace(layout, ac=ac), FIXED)
        for ac in ("selective", "full")
    }
    assert preds["full"].memory["activations"] < preds["selective"].memory["activations"]
    assert preds["full"].time["flops"] > preds["selective"].time["flops"]


def test_selective_ac_without_the_attention_recomputes_exactly_it() -> None:
    # An op list that does not name the run's attention kernel (torchtitan's
    # on a B200, where cuDNN's runs first): every block's attention output
    # and log-sum-exp are no longer saved, and its forward runs again.
    spec, args = get_spec("llama3"), get_config("debug")
    kept, recomputed = (
        predict(spec, args, Layout(gpus=2, batch=2, seq=64, attention_saved=saved), FIXED)
        for saved in (True, False)
    )
    batch, seq, heads, dim = 2, 64, args.n_heads, args.dim
    per_block = batch * seq * dim * 2 + batch * heads * seq * 4  # bf16 output, fp32 lse
    saved = kept.memory["activations"] - recomputed.memory["activations"]
    assert saved == args.n_layers * per_block
    attention_forward = 4 * batch * heads * seq * seq * (dim // heads)
    assert recomputed.time["flops"] - kept.time["flops"] == args.n_layers * attention_forward
    assert "attention-recomputed" in recomputed.layout.describe()


def test_eager_saved_activations_match_eager_autograd() -> None:
    # What the trace says eager autograd saves for backward, against what it
    # saves: the storages the saved-tensor hooks see in a real eager step of
    # the same model (the activations; parameters and the tokens left out).
    from simplefsdp.models.llama3 import Transformer

    args = _debug(n_layers=2)
    t = traced(TraceKey("llama3", args, 2, 1, 2, 64, "none", True, "fp32"))
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(tokens.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(tokens).float().log_softmax(-1).gather(-1, tokens[..., None]).mean()
    assert t.eager_saved_bytes == pytest.approx(sum(saved.values()), rel=0.02)
    # The min-cut partitioner recomputes cheap ops eager saves the inputs of.
    assert 0 < t.compiled_saved_bytes < t.eager_saved_bytes


def test_eager_engine_holds_eager_autograds_activations() -> None:
    args, layout = _debug(), Layout(gpus=2, batch=2, seq=64, ac="none", dtype="fp32")
    ours = predict(LLAMA, args, dataclasses.replace(layout, bucketing="per_block"), FIXED)
    eager = predict(LLAMA, args, dataclasses.replace(layout, engine="fsdp2"), FIXED)
    t1, t2 = (
        traced(TraceKey("llama3", _debug(n_layers=n), 2, 1, 2, 64, "none", True, "fp32"))
        for n in (1, 2)
    )
    extra1, extra2 = (t.eager_saved_bytes - t.compiled_saved_bytes for t in (t1, t2))
    extra = extra1 + (args.n_layers - 1) * (extra2 - extra1)
    assert extra > 0
    assert eager.memory["activations"] == pytest.approx(ours.memory["activations"] + extra)
    assert eager.memory["temporary"] == ours.memory["temporary"]


def test_fsdp2_with_compiled_blocks_fuses_kernels_and_keeps_its_groups() -> None:
    # torchtitan's FSDP + torch.compile: the compiled step's kernels and
    # activations, FSDP2's per-block groups, hooks and (no) keep.
    args = _debug()
    hooked = dataclasses.replace(FIXED, fsdp2_group_s=1e-3)
    layout = Layout(gpus=2, batch=2, seq=64, ac="none", dtype="fp32", engine="fsdp2")
    eager = predict(LLAMA, args, layout, hooked)
    blocks = predict(LLAMA, args, dataclasses.replace(layout, compile=True), hooked)
    ours = predict(LLAMA, args, dataclasses.replace(layout, engine="simplefsdp"), hooked)
    assert blocks.time["compute"] - blocks.time["hooks"] == pytest.approx(
        ours.time["compute"], rel=0.05
    )
    assert blocks.time["compute"] < eager.time["compute"]
    assert blocks.time["hooks"] == eager.time["hooks"] > 0
    # Outside the blocks (norm, output layer, loss) the step runs eager and
    # saves what eager autograd saves there; the blocks save the partitioner's.
    t1, t2 = (
        traced(TraceKey("llama3", _debug(n_layers=n), 2, 1, 2, 64, "none", True, "fp32"))
        for n in (1, 2)
    )
    extra1, extra2 = (t.eager_saved_bytes - t.compiled_saved_bytes for t in (t1, t2))
    assert 2 * extra1 - extra2 > 0
    assert blocks.memory["activations"] == pytest.approx(
        ours.memory["activations"] + 2 * extra1 - extra2
    )
    assert blocks.memory["activations"] < eager.memory["activations"]
    # torchtitan's groups: the final norm and output kept from forward
    assert blocks.buckets == eager.buckets
    assert set(blocks.kept) == {"model.norm.weight", "model.output.weight"}
    assert "compiled blocks" in blocks.layout.describe()


def test_compiled_engine_keeps_what_the_compiler_keeps_for_free() -> None:
    # The compiler's keep search keeps the buckets gathered at the
    # forward/backward boundary anyway (prefetch distance 1: the last two of
    # the per-block reference plan, the root's norm and output and the last
    # block); eager FSDP2 its final norm and output group (none with one root
    # group), a plan without resharding nothing.
    args = _debug()
    layout = Layout(gpus=2, batch=2, seq=64, ac="none", dtype="fp32")
    ours = predict(LLAMA, args, layout, FIXED)
    last = f"model.layers.{args.n_layers - 1}."
    assert {"model.norm.weight", "model.output.weight"} <= set(ours.kept)
    assert any(f.startswith(last) for f in ours.kept)
    assert not any(f.startswith("model.layers.0.") for f in ours.kept)
    assert ours.to_dict()["kept_gathered"] == ours.kept
    fsdp2 = dataclasses.replace(layout, engine="fsdp2")
    assert set(predict(LLAMA, args, fsdp2, FIXED).kept) == {
        "model.norm.weight",
        "model.output.weight",
    }
    assert predict(LLAMA, args, dataclasses.replace(fsdp2, fsdp2_root="whole"), FIXED).kept == []
    no_reshard = dataclasses.replace(layout, reshard_after_forward=False)
    assert predict(LLAMA, args, no_reshard, FIXED).kept == []


def test_pipeline_bubble_is_pp_minus_one_microbatch_slots() -> None:
    pred = predict(LLAMA, _debug(), Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2), FIXED)
    per_microbatch = (pred.time["compute"] + pred.time["exposed_comm"]) / 2
    assert pred.time["bubble"] == pytest.approx(per_microbatch)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 6), (8, 2, 8)])
def test_first_rank_actions_are_torchs_interleaved_order(p, v, m) -> None:
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _ComputationType,
    )

    rounds = max(1, m // p)
    fake = types.SimpleNamespace(
        pp_group_size=p,
        n_local_stages=v,
        _n_microbatches=m,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
    )
    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, 0)
    theirs = [
        ("F" if op.computation_type == _ComputationType.FORWARD else "B", op.stage_index // p)
        for op in ops
        if op is not None
    ]
    assert first_rank_actions("interleaved_1f1b", m, p, v) == theirs


def test_pipeline_peak_by_hand() -> None:
    # One microbatch's activations over the rank's blocks: 1 byte; the
    # rank's gradient sums: 3 bytes, each stage's from its first backward.
    def peak(schedule, m, p=2, v=None):
        layout = Layout(gpus=p, batch=m, seq=64, pp=p, microbatches=m, pp_schedule=schedule,
                        stages_per_rank=v)  # fmt: skip
        return pipeline_peak(layout, 1.0, 3.0)

    # 1F1B, m = p = 2: F F B B: after the first backward 1 + 3.
    assert peak("1f1b", 2) == (1.0, 1.0)
    # 1F1B, m = 4: two in flight beside all the sums (B then F).
    assert peak("1f1b", 4) == (2.0, 1.0)
    # GPipe, m = 4: F x 4 (4), then 3 + 3.
    assert peak("gpipe", 4) == (3.0, 1.0)
    # Interleaved, v = 2, m = 2: all four stage-forwards first, then the last
    # stage's two backwards (1.5 + 1.5, 1 + 1.5), then the first stage's
    # (0.5 + 3): the peak is 3.5, below 1F1B's 4.
    assert peak("interleaved_1f1b", 2, v=2) == (0.5, 1.0)
    # Without a pipeline: one microbatch, the sums where there are several.
    assert pipeline_peak(Layout(gpus=2, batch=4, seq=64, microbatches=2), 1.0, 3.0) == (1.0, 1.0)
    assert pipeline_peak(Layout(gpus=2, batch=4, seq=64), 1.0, 3.0) == (1.0, 0.0)


def test_interleaved_pipeline_shrinks_the_bubble_by_its_stages_per_rank() -> None:
    args = _debug()
    layout = Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2)
    plain = predict(LLAMA, args, layout, FIXED)
    interleaved = dataclasses.replace(layout, pp_schedule="interleaved_1f1b")
    pred = predict(LLAMA, args, interleaved, FIXED)
    slot = (pred.time["compute"] + pred.time["exposed_comm"]) / 2
    assert pred.time["bubble"] == pytest.approx(slot / 2)  # (p - 1) / v slots
    assert pred.step_s < plain.step_s
    assert "interleaved_1f1b v2" in pred.layout.describe()
    assert any("interleaved 1F1B, 2 stage(s) per rank" in n for n in pred.notes)
    assert pred.peak_bytes < plain.peak_bytes  # the last stage's backwards free first


def test_accumulation_holds_every_parameters_fp32_gradient_sum() -> None:
    # Both engines sum the micro-batches' unreduced gradients whole, in fp32
    # (simplefsdp.no_sync's accumulators, FSDP2's unsharded_accumulated_grad).
    args = _debug()
    for engine in ("simplefsdp", "fsdp2"):
        one = predict(LLAMA, args, Layout(gpus=2, batch=2, seq=64, engine=engine), FIXED)
        accum = Layout(gpus=2, batch=4, seq=64, microbatches=2, engine=engine)
        two = predict(LLAMA, args, accum, FIXED)
        assert one.memory["accumulated"] == 0
        assert two.memory["accumulated"] == 4 * num_params(args)  # fp32, whole, at dp 2
        assert two.peak_bytes == pytest.approx(sum(two.memory.values()))


def test_a_pipeline_holds_the_sums_beside_its_microbatches_in_flight() -> None:
    args = _debug()
    layout = Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2)
    pred = predict(LLAMA, args, layout, FIXED)
    whole = pred.memory["parameters"] * layout.fsdp  # the stage's fp32 parameters
    assert pred.memory["accumulated"] == pytest.approx(whole)
    # No more microbatches than stages: the first stage's sums appear with
    # its first backward, which has freed one of its two microbatches; with
    # four, two are in flight beside them (the same microbatch size).
    more = predict(LLAMA, args, dataclasses.replace(layout, batch=8, microbatches=4), FIXED)
    assert more.memory["accumulated"] == pytest.approx(whole)
    assert more.memory["activations"] > pred.memory["activations"]
    assert more.peak_bytes > pred.peak_bytes


def test_fsdp2_under_a_pipeline_holds_the_stage_gathered_once() -> None:
    # torch's pipeline stages keep FSDP2's groups gathered after each backward
    # but the last; without resharding they are kept from the first forward,
    # one set for every microbatch in flight, not one per microbatch.
    args = _debug()
    layout = Layout(gpus=4, batch=8, seq=64, pp=2, microbatches=4, engine="fsdp2")
    resharded = predict(LLAMA, args, layout, FIXED)
    kept = predict(LLAMA, args, dataclasses.replace(layout, reshard_after_forward=False), FIXED)
    stage_bf16 = resharded.memory["parameters"] * layout.fsdp / 2
    assert resharded.memory["gathered"] >= kept.memory["gathered"] >= 0.9 * stage_bf16
    assert kept.memory["activations"] == pytest.approx(resharded.memory["activations"], rel=0.1)


def test_fsdp2_under_a_pipeline_without_resharding_communicates_once_per_step() -> None:
    # torch's stages leave FSDP2's groups gathered and unsynchronised between
    # microbatches: without resharding it gathers at the first forward and
    # reduce-scatters at the last backward, whatever the microbatch count;
    # the compiled engine gathers and reduces per microbatch.
    args = _debug()
    layout = Layout(
        gpus=4, batch=8, seq=64, pp=2, microbatches=4, engine="fsdp2", reshard_after_forward=False
    )
    more = dataclasses.replace(layout, batch=16, microbatches=8)  # the same microbatch
    once, twice = (predict(LLAMA, args, lay, FIXED) for lay in (layout, more))
    assert twice.time["dp_comm_total"] == pytest.approx(once.time["dp_comm_total"])
    assert twice.time["copies"] == pytest.approx(once.time["copies"])
    for pred in (once, twice):
        parts = ("compute", "exposed_comm", "bubble", "optimizer")
        assert sum(pred.time[k] for k in parts) == pytest.approx(pred.step_s)
    compiled = [
        predict(LLAMA, args, dataclasses.replace(lay, engine="simplefsdp"), FIXED)
        for lay in (layout, more)
    ]
    assert compiled[1].time["dp_comm_total"] == pytest.approx(2 * compiled[0].time["dp_comm_total"])


@pytest.mark.slow
def test_llama3_8b_traces_at_world_size_8() -> None:
    # The real 8B shapes (two blocks), fake process group of 8 ranks, no GPU.
    pred = predict(LLAMA, get_config("8B"), Layout(gpus=8, batch=2, seq=8192), get_profile("h100"))
    n = num_params(get_config("8B"))
    assert pred.memory["parameters"] == pytest.approx(4 * n / 8, rel=1e-3)
    assert 0 < pred.peak_bytes < 200 * GiB and pred.tokens_per_s_per_gpu > 0
    assert len(pred.buckets) >= 2


# ------------------------------------------------------------ CLI


def test_cli_bad_inputs_give_one_line_errors(tmp_path, capsys) -> None:
    not_an_object = tmp_path / "list.json"
    not_an_object.write_text("[1, 2]")
    cases = [
        (["--hardware", "tpu"], "unknown hardware 'tpu'"),
        (
            ["--gpus", "8", "--tp", "3", "--model", "debug"],
            "--tp 3 does not divide --gpus 8",
        ),
        (["--model", "llama3_9b"], "unknown model 'llama3_9b'"),
        (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["--config", str(not_an_object)], "must hold a JSON object of the model config's fields"),
        (["--model", "debug", "--fsdp2-root", "whole"], "use it with --engine fsdp2"),
    ]
    for argv, message in cases:
        assert plan_cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


@pytest.mark.heavy  # half a minute on 2 CPU cores; run with -m heavy
def test_cli_batch_that_cannot_fit(tmp_path, capsys) -> None:
    # A GPU with room for the model state and half the batch's activations
    # (per-block buckets: the auto plan would shrink its buckets to fit).
    pred = predict(LLAMA, _debug(), Layout(gpus=2, batch=2, seq=64, bucketing="per_block"), FIXED)
    per_batch = pred.memory["activations"] + pred.memory["temporary"]
    small = dataclasses.replace(FIXED, memory_bytes=pred.peak_bytes - 0.4 * per_batch)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small.to_dict()))
    argv = ["--model", "debug", "--gpus", "2", "--batch", "2", "--seq", "64"]
    argv += ["--bucketing", "per_block"]
    assert plan_cli.main([*argv, "--hardware", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch 2 does not fit" in err and "largest batch that fits: about 1" in err
    assert "\n" not in err


def test_cli_layout_that_does_not_fit_names_changes_that_fit_and_not_those_given(
    tmp_path, capsys
) -> None:
    # Debug model, 2 GPUs, batch 4 x 64, full AC, per-block buckets: about
    # 37.4 MB, 34.3 MB at batch 1; one GPU per node (no TP candidates).
    small = dataclasses.replace(FIXED, memory_bytes=37.0e6, gpus_per_node=1)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small.to_dict()))
    argv = ["--model", "debug", "--gpus", "2", "--batch", "4", "--seq", "64"]
    argv += ["--bucketing", "per_block", "--ac", "full", "--hardware", str(path)]
    assert plan_cli.main(argv) == 2
    captured = capsys.readouterr()
    out, err = captured.out, captured.err.strip()
    # The breakdown, the largest batch that fits and the changes that would
    # (more GPUs shard the state), never the --ac full given.
    assert "DOES NOT FIT" in out and "activations" in out and "temporary" in out
    assert "\n" not in err and "--batch 4 does not fit" in err, err
    assert "largest batch that fits: about" in err and "changes that fit" in err, err
    assert "--gpus 4 (" in err and "--ac" not in err, err


def test_candidate_changes_leave_out_what_was_given() -> None:
    def candidates(**layout):
        base = Layout(gpus=8, batch=4, seq=64, **layout)
        memory = {"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0, "activations": 10.0}
        pred = types.SimpleNamespace(layout=base, memory=memory, peak_bytes=26.0, usable_bytes=20.0)
        return [
            text
            for ladder in plan_cli._candidate_changes(LLAMA, _debug(), pred, 8)
            for text, _ in ladder
        ]

    given_selective = candidates(ac="selective")
    assert "--ac full" in given_selective and "--tp 2" in given_selective
    assert "--gpus 16" in given_selective  # 16 / 2 + 10 <= 20: twice the GPUs first
    given_full = candidates(ac="full", tp=8)
    assert not [c for c in given_full if c.startswith(("--ac", "--tp"))], given_full
    assert "no --no-reshard" in candidates(reshard_after_forward=False)
    assert "--dtype bf16" in candidates(dtype="fp32")


def test_defaults_are_torchtitans_layouts_and_given_values_win() -> None:
    def values(*argv):
        ns = plan_cli._parser().parse_args(list(argv))
        return plan_cli.plan_defaults(ns, *plan_cli.resolve_model(ns))[0]

    assert values("--model", "8B") == {
        "gpus": 8, "tp": 1, "batch": 1, "seq": 8192, "ac": "selective"
    }  # fmt: skip
    assert values("--model", "70B") == {
        "gpus": 64, "tp": 8, "batch": 8, "seq": 8192, "ac": "full"
    }  # fmt: skip
    assert values("--model", "405B")["gpus"] == 128
    # A default TP degree that does not divide the GPUs given is lowered.
    assert values("--model", "70B", "--gpus", "4")["tp"] == 4
    assert values("--model", "70B", "--tp", "2", "--batch", "3", "--ac", "none") == {
        "gpus": 64, "tp": 2, "batch": 3, "seq": 8192, "ac": "none"
    }  # fmt: skip
    # A default batch the microbatches do not divide is raised to their next
    # multiple (405B's published batch 2 under 8 pipeline stages); a given
    # batch is left to the one-line error.
    assert values("--model", "405B", "--pp", "8")["batch"] == 8
    assert values("--model", "405B", "--pp", "4", "--microbatches", "6")["batch"] == 6
    assert values("--model", "405B", "--pp", "8", "--batch", "2")["batch"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "8B", "--gpus", "8"],
        pytest.param(["--model", "70B", "--gpus", "64", "--tp", "8"], marks=pytest.mark.heavy),
        pytest.param(["--model", "405B"], marks=pytest.mark.heavy),
    ],
)
def test_defaults_fit_for_the_shipped_models_on_their_gpu_counts(argv, capsys) -> None:
    assert plan_cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "tokens/s/GPU" in out
    assert "note: defaults (published layout)" in out


def test_cli_table_json_and_png(tmp_path, capsys) -> None:
    argv = ["--model", "debug", "--gpus", "2", "--batch", "2", "--seq", "64"]
    assert plan_cli.main([*argv, "--hardware", "h100", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peak memory / GPU" in out and "tokens/s/GPU" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    pred = data["predictions"][0]
    assert pred["peak_bytes"] == pytest.approx(sum(pred["memory_bytes"].values()))
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_sweep_ranks_by_throughput_and_says_why_losers_lose() -> None:
    base = Layout(gpus=8, batch=2, seq=64)
    layouts = plan_cli.sweep_layouts(_debug(), base)
    assert {lay.ac for lay in layouts} == {"none", "selective", "full"}
    assert {lay.bucketing for lay in layouts} == {"auto", "per_block"}
    # TP degrees up to a node are tried; 8 does not divide the debug model's
    # 4 KV heads, and none is tried beyond the node.
    assert {lay.tp for lay in layouts} == {1, 2, 4}
    assert {lay.tp for lay in plan_cli.sweep_layouts(_debug(), base, gpus_per_node=2)} == {1, 2}
    # The TP degree the user asked for is kept, even beyond a node.
    asked = plan_cli.sweep_layouts(_debug(), Layout(gpus=8, batch=2, seq=64, tp=4), gpus_per_node=2)
    assert {lay.tp for lay in asked} == {1, 2, 4}
    # A degree that does not divide the GPUs is left out (6 GPUs: 4 is not tried).
    six = plan_cli.sweep_layouts(_debug(), Layout(gpus=6, batch=2, seq=64))
    assert {lay.tp for lay in six} == {1, 2}
    # With a pipeline both 1F1B and interleaved 1F1B are tried (the debug
    # model's 4 blocks split into 2 x 2 stages), and the schedule asked for.
    piped = plan_cli.sweep_layouts(_debug(), Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2))
    assert {lay.pp_schedule for lay in piped if lay.pp == 2} == {"1f1b", "interleaved_1f1b"}
    assert {lay.pp_schedule for lay in piped if lay.pp == 1} == {"1f1b"}
    gpipe = Layout(gpus=4, batch=4, seq=64, pp=2, microbatches=2, pp_schedule="gpipe")
    assert "gpipe" in {lay.pp_schedule for lay in plan_cli.sweep_layouts(_debug(), gpipe)}
    # Three options that share one trace; one of them made not to fit.
    preds = [
        predict(LLAMA, _debug(), Layout(gpus=2, batch=2, seq=64, bucketing=b), FIXED)
        for b in ("auto", "per_block", "none")
    ]
    preds[2].usable_bytes = preds[2].peak_bytes / 2
    table = plan_cli.format_sweep(preds).splitlines()
    assert len(table) == 4 and "best" in table[1]
    assert "out of memory" in table[3]


def test_sweep_does_not_trace_options_that_need_more_than_an_oversized_leanest_one() -> None:
    """Per (TP, PP, microbatches), full AC with resharding is predicted first;
    when it does not fit, the group's other options are skipped, not predicted."""
    base = Layout(gpus=8, batch=2, seq=64)
    layouts = plan_cli.sweep_layouts(_debug(), base, gpus_per_node=2)
    called = []
    ac_bytes = {"full": 1, "selective": 2, "none": 3}

    def fake_predict(args, layout, hw):
        called.append(layout)
        # TP 1 is out of memory even with full AC; TP 2 fits with it
        peak = ac_bytes[layout.ac] * GiB * (100 if layout.tp == 1 else 1)
        return types.SimpleNamespace(
            layout=layout, peak_bytes=peak, usable_bytes=10 * GiB, fits=peak <= 10 * GiB
        )

    preds, skipped = plan_cli.sweep_predictions(_debug(), layouts, None, fake_predict)
    tp1 = [lay for lay in layouts if lay.tp == 1]
    leanest_tp1 = [lay for lay in tp1 if lay.ac == "full" and lay.reshard_after_forward]
    assert leanest_tp1 and len(skipped) == len(tp1) - len(leanest_tp1)
    assert {lay for lay in called if lay.tp == 1} == set(leanest_tp1)
    assert all(lay in called for lay in layouts if lay.tp == 2)  # its group fits: all traced
    assert len(preds) == len(called)
    assert all(
        "full AC with resharding already needs 100.0 > 10.0 GiB" in s["reason"] for s in skipped
    )
    assert "more out of memory" in plan_cli.format_skipped(skipped)


def test_why_a_loser_loses_keeps_copies_apart_from_compute() -> None:
    """Regathering in backward costs copies around the collectives, and eager
    FSDP2 its hooks, which are part of compute but are not recomputation."""
    layout = Layout(gpus=2, batch=2, seq=64, ac="none")

    def pred(compute: float, copies: float, step: float, hooks: float = 0.0):
        time = {"compute": compute, "copies": copies, "exposed_comm": 0.0, "bubble": 0.0}
        time |= {"optimizer": 0.0, "hooks": hooks}
        return types.SimpleNamespace(
            fits=True, layout=layout, time=time, step_s=step, tokens_per_s_per_gpu=1 / step
        )

    best = pred(1.0, 0.1, 1.0)
    assert plan_cli.why_loses(pred(1.2, 0.3, 1.2), best).startswith("copies around collectives")
    assert plan_cli.why_loses(pred(1.3, 0.1, 1.3), best).startswith("recomputation / compute")
    hooks = plan_cli.why_loses(pred(1.3, 0.1, 1.3, hooks=0.3), best)
    assert hooks.startswith("eager FSDP2's hooks")


def test_why_a_loser_loses_compares_layouts_at_the_same_work() -> None:
    """FSDP on 8 GPUs steps eight batches, TP 8 one: parts are compared per
    token per GPU, so TP's shorter step is not read as less of everything."""

    def pred(tokens_per_gpu: float, step: float, compute: float, comm: float):
        time = {"compute": compute, "copies": 0.0, "exposed_comm": comm, "bubble": 0.0}
        time |= {"optimizer": 0.0, "hooks": 0.0}
        return types.SimpleNamespace(
            fits=True,
            layout=Layout(gpus=8, batch=1, seq=64),
            time=time,
            step_s=step,
            tokens_per_s_per_gpu=tokens_per_gpu / step,
        )

    best = pred(tokens_per_gpu=2000, step=2.0, compute=1.9, comm=0.1)
    # an eighth of the work in 0.3 s: 2.4 s at the best's, 0.8 s of it communication
    tp = pred(tokens_per_gpu=250, step=0.3, compute=0.2, comm=0.1)
    assert plan_cli.why_loses(tp, best) == (
        "exposed communication (+0.700 s at the best's step size)"
    )
    same = pred(tokens_per_gpu=2000, step=2.2, compute=1.9, comm=0.3)
    assert plan_cli.why_loses(same, best) == "exposed communication (+0.200 s per step)"


def test_describe_names_gradient_accumulation_and_microbatches() -> None:
    assert "accum2" in Layout(gpus=2, batch=2, seq=64, microbatches=2).describe()
    assert "accum" not in Layout(gpus=2, batch=2, seq=64).describe()
    assert "pp2 m4" in Layout(gpus=2, batch=4, seq=64, pp=2, microbatches=4).describe()


def test_simplefsdp_plan_subcommand_prints_json(capsys) -> None:
    from simplefsdp.cli import main

    argv = ["plan", "--model", "debug", "--gpus", "2", "--batch", "2", "--seq", "64"]
    assert main([*argv, "--hardware", "cpu-gloo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (pred,) = data["predictions"]
    assert pred["layout"]["dp"] == 2 and pred["hardware"] == "cpu-gloo"
    assert set(pred["time_s"]) >= {"compute", "exposed_comm", "bubble", "optimizer"}


def test_cost_model_times_an_all_gather_by_its_group_size() -> None:
    # all_gather_into_tensor(input, group_size, group_name): the size, not the
    # group name, picks the fit.
    from simplefsdp.compiler.cost_model import LinearFit
    from simplefsdp.compiler.patterns import collective_kind, node_bytes

    t = traced(_key(1))
    node = next(n for n in t.forward.graph.nodes if collective_kind(n) == "all_gather")
    cm = CostModel(comm={"all_gather/2": LinearFit(1.0, 0.0)}, default_comm=LinearFit(0.0, 0.0))
    assert node_bytes(node) > 0 and cm.collective_time(node) == 1.0


def test_calibration_takes_each_quantitys_median_over_rounds() -> None:
    from simplefsdp.plan.calibrate import median_raw, profile_from

    def one(scale: float) -> dict:
        return {
            "fits": {
                "all_gather/2": [1e-3 * scale, 1.5e-9],
                "reduce_scatter/2": [2e-3, 2e-9 * scale],
            },
            "flops": 6e10 * scale,
            "overlap": 0.1 * scale,
        }

    merged = median_raw([one(1.0), one(3.0), one(1.2)])  # one round hit a burst
    assert merged["fits"]["all_gather/2"] == pytest.approx([1.2e-3, 1.5e-9])
    assert merged["fits"]["reduce_scatter/2"] == pytest.approx([2e-3, 2.4e-9])
    assert merged["flops"] == pytest.approx(7.2e10) and merged["overlap"] == pytest.approx(0.12)
    with pytest.raises(ValueError, match="at least one round"):
        median_raw([])
    raw = {**merged, "bytes_per_s": 4e9, "op_s": 1e-5}
    assert profile_from(raw, "t", "cpu").peak_fp32_flops == pytest.approx(7.2e10)


def test_cli_rejects_zero_calibration_rounds(capsys) -> None:
    from simplefsdp.plan.cli import main

    assert main(["--calibrate", "--calibrate-rounds", "0"]) == 2
    assert "--calibrate-rounds must be >= 1, got 0" in capsys.readouterr().err


def test_defaults_left_out_are_lowered_until_the_layout_fits() -> None:
    # 50 GiB fixed, per sequence of the batch 60 GiB with selective AC, 15 with full
    per_sequence = {"selective": 60, "full": 15}

    def fake_predict(args, layout, hw):
        acts = per_sequence[layout.ac] * GiB * layout.batch
        peak = 50 * GiB + acts
        return types.SimpleNamespace(
            layout=layout,
            peak_bytes=peak,
            usable_bytes=70 * GiB,
            fits=peak <= 70 * GiB,
            memory={"activations": acts, "temporary": 0},
            notes=[],
        )

    base = Layout(gpus=8, batch=2, seq=64, ac="selective")
    first = fake_predict(None, base, None)
    # neither the batch nor full AC alone fits: both lowered, both noted
    pred = plan_cli.fit_defaults(None, first, {"batch", "ac"}, None, fake_predict)
    assert (pred.layout.ac, pred.layout.batch) == ("full", 1) and pred.fits
    assert pred.notes == [
        "--ac full: the default selective is predicted to need 170.0 GiB of 70.0 GiB usable",
        "--batch 1: the default 2 is predicted to need 170.0 GiB of 70.0 GiB usable",
    ]
    # a batch given is planned as given, whether the AC mode is or not
    assert plan_cli.fit_defaults(None, first, {"ac"}, None, fake_predict) is first
    assert plan_cli.fit_defaults(None, first, {"batch"}, None, fake_predict) is first
