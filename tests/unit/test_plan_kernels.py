"""``simplefsdp plan``'s per-kernel GPU model, profiles as data, context
parallelism, the published reference rows, and ``--measure`` on CPU."""

from __future__ import annotations

import dataclasses

import pytest

import plan_profiles
from simplefsdp.models.llama3 import get_config
from simplefsdp.models.registry import get_spec
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.kernels import MEMORY_EFFICIENT_FRACTION, KernelModel, kernel_model
from simplefsdp.plan.predict import Layout, predict, validate
from simplefsdp.plan.reference import REFERENCE_ROWS

LLAMA = get_spec("llama3")
H100 = PROFILES["h100"]


def _kernels(**overrides) -> KernelModel:
    base = kernel_model(H100, H100.memory_bandwidth * H100.memory_efficiency)
    assert base is not None
    return dataclasses.replace(base, **overrides)


# ------------------------------------------------------------ GEMMs


def test_a_large_gemm_runs_at_the_published_maximum_rate() -> None:
    k = _kernels(kernel_overhead_s=0.0)
    m, n, kk = 132 * 128 * 4, 256 * 8, 8192  # whole waves, long K
    seconds = k.gemm_seconds(m, n, kk, "bfloat16")
    rate = 2 * m * n * kk / seconds
    assert rate == pytest.approx(989e12 * 792.1 / 989, rel=1e-9)  # mamf-finder's H100


def test_one_tile_more_than_a_wave_costs_a_second_wave() -> None:
    k = _kernels(kernel_overhead_s=0.0)
    full = k.shape_efficiency(128 * 132, 256, 8192)
    one_more = k.shape_efficiency(128 * 133, 256, 8192)
    assert full == pytest.approx(1.0)
    assert one_more == pytest.approx(133 / 264)


def test_small_expert_gemms_lose_to_tile_padding_and_waves() -> None:
    # DeepSeek-V3 16B on EP 2: 768 tokens per expert, hidden 1408, dim 2048.
    # One expert: 6 x 6 large tiles on 132 SMs, or 6 x 11 smaller tiles with
    # K split in two (one wave) at the smaller tile's lower operand reuse.
    k = _kernels()
    eff = k.shape_efficiency(768, 1408, 2048)
    ramp = (1024 / (1024 + 128)) / (2048 / (2048 + 128))
    assert eff == pytest.approx((128 * 128 / 256) / (128 * 256 / 384) * ramp, rel=1e-9)
    grouped = k.shape_efficiency(768, 1408, 2048, batch=32)  # one grouped kernel
    assert eff < grouped < 1.0


def test_a_skinny_gemm_is_bound_by_its_bytes() -> None:
    k = _kernels(kernel_overhead_s=0.0)
    n = kk = 8192
    seconds = k.gemm_seconds(1, n, kk, "bfloat16")
    assert seconds == pytest.approx((kk + kk * n + n) * 2 / k.bytes_per_s)


def test_causal_attention_is_half_its_unmasked_flops_at_flash_rates() -> None:
    k = _kernels(kernel_overhead_s=0.0)
    flops = 4.0 * 2 * 32 * 8192 * 8192 * 128
    fwd = k.attention_seconds(flops, 0.0, backward=False)
    bwd = k.attention_seconds(2.5 * flops, 0.0, backward=True)
    assert fwd == pytest.approx(flops / 2 / (989e12 * H100.flash_fwd_efficiency))
    assert bwd / fwd == pytest.approx(2.5 * H100.flash_fwd_efficiency / H100.flash_bwd_efficiency)
    # a value head dim other than the query's: SDPA's memory-efficient kernel
    slower = k.attention_seconds(flops, 0.0, backward=False, flash=False)
    assert slower == pytest.approx(fwd / MEMORY_EFFICIENT_FRACTION)


def test_latent_attention_with_its_own_value_dim_runs_the_memory_efficient_kernel() -> None:
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.analytic import ExpertLayout, predict_analytic

    spec, config = resolve_flavor("deepseek_v3_16b")
    layout = ExpertLayout(gpus=8, batch=1, seq=4096, engine="simplefsdp")
    pred = predict_analytic(spec, config, layout, H100)
    # value head dim equal to the query's: the flash kernel, faster
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    flash = predict_analytic(spec, dataclasses.replace(config, v_head_dim=qk), layout, H100)
    assert flash.time["compute"] < pred.time["compute"]


def test_profiles_are_data_with_sources_and_gpu_generations() -> None:
    for name in ("a100", "a100-40gb", "h100", "h100-96gb-500w", "h200", "b200"):
        hw = PROFILES[name]
        assert hw.sm_count and hw.gemm_efficiency and hw.flash_fwd_efficiency, name
        assert hw.source, name
    # the memory CUDA reports (what a job's percentages are of), below the
    # marketed capacity in GB
    GiB = 2**30
    for name, reported in (("a100-40gb", 39.39), ("h100", 79.18), ("h200", 139.81)):
        assert PROFILES[name].memory_bytes == reported * GiB, name
    assert PROFILES["h100-96gb-500w"].clock_fraction < 1.0 == PROFILES["h100"].clock_fraction
    assert PROFILES["b200"].peak_bf16_flops > PROFILES["h200"].peak_bf16_flops
    assert kernel_model(PROFILES["cpu-gloo"], 1.0) is None  # CPU: one measured rate


def test_the_same_job_runs_faster_on_faster_parts() -> None:
    args = get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=64)  # the trace test_plan.py takes too
    steps = {n: predict(LLAMA, args, layout, PROFILES[n]).step_s for n in ("a100", "h100", "b200")}
    assert steps["a100"] > steps["h100"] > steps["b200"]


# ------------------------------------------------------------ context parallelism


def test_context_parallel_gathers_keys_and_scales_attention() -> None:
    # The same tokens per rank: FSDP 2 at 64 tokens, or CP 2 of 128 tokens
    # (one trace: each CP rank holds 64); CP's queries meet twice the keys.
    args = get_config("debug")
    hw = plan_profiles.FIXED
    one = predict(LLAMA, args, Layout(gpus=2, batch=2, seq=64), hw)
    two = predict(LLAMA, args, Layout(gpus=2, batch=2, seq=128, cp=2), hw)
    assert two.layout.describe().startswith("dp1 cp2")
    assert two.time["cp_comm_total"] > 0 == one.time["cp_comm_total"]
    assert two.time["flops"] > one.time["flops"]
    assert two.step_s > one.step_s
    # FSDP shards over dp x cp: the same parameter shards
    assert two.memory["parameters"] == one.memory["parameters"]
    # the gathered keys and values are saved for backward (selective AC)
    assert two.memory["activations"] > one.memory["activations"]
    assert two.tokens_per_s_per_gpu * two.step_s == pytest.approx(
        one.tokens_per_s_per_gpu * one.step_s
    )


@pytest.mark.parametrize("profile", ["fixed", "h100"])
def test_allgather_attention_pays_its_mask_and_the_masked_kernel(profile, monkeypatch) -> None:
    # simplefsdp's allgather backend runs SDPA with a (T/cp x T) boolean mask:
    # the mask and its bf16 bias while an attention runs, and the masked
    # kernel skips no block; torch's flash ring (--cp-backend torch) does
    # neither. The same traces, the same communication.
    import importlib

    seq = 2048
    args = get_config("debug", max_seq_len=seq)
    hw = plan_profiles.FIXED if profile == "fixed" else PROFILES[profile]
    layout = Layout(gpus=2, batch=2, seq=seq, cp=2)
    ours = predict(LLAMA, args, layout, hw)
    # the kernels alone: without the ring's merges and copies beside them
    predict_module = importlib.import_module("simplefsdp.plan.predict")
    monkeypatch.setattr(predict_module, "ring_attention_bytes", lambda *a, **k: (0.0, 0.0))
    torch_cp = predict(LLAMA, args, dataclasses.replace(layout, cp_backend="torch"), hw)
    assert torch_cp.layout.describe().startswith("dp1 cp2 torch")
    mask = (seq // 2) * seq
    assert ours.memory["temporary"] - torch_cp.memory["temporary"] == pytest.approx(3 * mask)
    # (the bucket plans may differ with the memory: compare without the copies)
    kernels = [p.time["compute"] - p.time["copies"] for p in (ours, torch_cp)]
    assert kernels[0] > 1.2 * kernels[1]
    assert ours.time["cp_comm_total"] == torch_cp.time["cp_comm_total"]
    assert any("boolean mask" in n for n in ours.notes)
    assert not any("boolean mask" in n for n in torch_cp.notes)
    with pytest.raises(
        ValueError, match=r"--cp-backend 'ring' is not planned; valid: allgather, ulysses, torch"
    ):
        validate(args, dataclasses.replace(layout, cp_backend="ring"))


def _bytes_moved(fn) -> float:
    """Bytes that ``fn``'s ATen ops read and write (inputs and outputs), views
    (an output sharing an input's storage) moving none."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        moved = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            storages = {t.untyped_storage().data_ptr() for t in ins}
            if any(t.untyped_storage().data_ptr() not in storages for t in outs):
                Count.moved += sum(t.numel() * t.element_size() for t in (*ins, *outs))
            return out

    with Count():
        fn()
    return Count.moved


@pytest.mark.parametrize("cp", [2, 4])
def test_torch_rings_merges_move_what_the_plan_counts(cp) -> None:
    # torch's own merger of a ring's partial outputs (the last rank's: every
    # step whole), run eagerly and its bytes counted, against the plan's
    # forward bytes without the key/value copies the merger does not make.
    import torch

    attention = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._attention"
    )
    from simplefsdp.plan.costs import ring_attention_bytes

    b, h, t, d = 1, 4, 256, 64
    outs = [torch.randn(b, h, t, d, dtype=torch.bfloat16) for _ in range(cp)]
    lses = [torch.randn(b, h, t) for _ in range(cp)]

    def merge() -> None:
        merger = attention._SDPAMerger(True, seq_dim=2)
        for out, lse in zip(outs, lses):
            merger.step(out, lse, False)
        merger.results()

    e = b * h * t * d
    forward, _ = ring_attention_bytes(e, 0, 2, cp, fused=False)
    assert _bytes_moved(merge) == pytest.approx(forward, rel=0.05)  # the lse's traffic
    fused, _ = ring_attention_bytes(e, 0, 2, cp, fused=True)
    assert fused < forward


@pytest.mark.parametrize("engine", ["simplefsdp", "fsdp2"])
def test_torch_ring_adds_its_merges_and_copies_to_the_step(engine) -> None:
    # The torch backend's step: its attention kernels as the traced ones
    # scaled, plus per attention node what the ring moves outside them.
    import importlib

    from simplefsdp.plan.costs import ring_attention_bytes

    predict_module = importlib.import_module("simplefsdp.plan.predict")

    seq = 512
    args = get_config("debug", max_seq_len=seq)
    hw = plan_profiles.FIXED
    layout = Layout(gpus=2, batch=2, seq=seq, cp=2, cp_backend="torch", engine=engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(predict_module, "ring_attention_bytes", lambda *a, **k: (0.0, 0.0))
        bare = predict(LLAMA, args, layout, hw)
    ring = predict(LLAMA, args, layout, hw)
    # per block: a forward and a backward attention (selective AC saves it)
    heads, d = args.n_heads, args.dim // args.n_heads
    out = 2 * (seq // 2) * heads * d  # this rank's queries, bf16
    fused = engine == "simplefsdp"  # compiled: the merges fused
    forward, backward = ring_attention_bytes(out, 2 * out, 2, 2, fused, False)
    expected = args.n_layers * (forward + backward) / (hw.memory_bandwidth * hw.memory_efficiency)
    added = ring.time["compute"] - bare.time["compute"]
    assert added == pytest.approx(expected, rel=0.02)
    assert ring.step_s > bare.step_s


def test_ulysses_all_to_alls_and_masks_the_whole_sequence() -> None:
    # Ulysses: the queries, keys, values and output all-to-all'd per attention
    # (no gathered keys and values kept), SDPA over the whole sequence on
    # H/cp heads with a (T x T) mask.
    seq = 2048
    args = get_config("debug", max_seq_len=seq)
    layout = Layout(gpus=2, batch=2, seq=seq, cp=2)
    gathered = predict(LLAMA, args, layout, plan_profiles.FIXED)
    ulysses = predict(
        LLAMA, args, dataclasses.replace(layout, cp_backend="ulysses"), plan_profiles.FIXED
    )
    assert ulysses.layout.describe().startswith("dp1 cp2 ulysses")
    masks = 3 * (seq * seq - (seq // 2) * seq)
    assert ulysses.memory["temporary"] - gathered.memory["temporary"] == pytest.approx(masks)
    assert ulysses.memory["activations"] < gathered.memory["activations"]
    assert ulysses.time["cp_comm_total"] != gathered.time["cp_comm_total"] > 0
    assert any("all-to-all'd" in n for n in ulysses.notes)
    # 8 heads do not split over 16 ranks
    with pytest.raises(ValueError, match=r"ulysses needs the 8 attention heads .* --cp 16"):
        predict(
            LLAMA,
            args,
            Layout(gpus=16, batch=1, seq=seq, cp=16, cp_backend="ulysses"),
            plan_profiles.FIXED,
        )


def test_context_parallel_needs_a_sequence_and_gpus_it_splits() -> None:
    with pytest.raises(ValueError, match=r"--seq 250 does not split over --cp 2 .* 4"):
        validate(get_config("debug"), Layout(gpus=4, batch=1, seq=250, cp=2))
    with pytest.raises(
        ValueError, match=r"--cp 3 does not divide the 4 GPUs .*valid --cp: 1, 2, 4$"
    ):
        validate(get_config("debug"), Layout(gpus=4, batch=1, seq=240, cp=3))


# ------------------------------------------------------------ reference rows


def test_reference_rows_name_their_source_and_two_fitted_constants() -> None:
    fitted = [r for r in REFERENCE_ROWS if r.fitted]
    assert sorted(r.fitted for r in fitted) == ["CLOCK_500W", "FP8_EFFICIENCY"]
    assert all(r.source and r.hardware in PROFILES for r in REFERENCE_ROWS)
    held_out = [r for r in REFERENCE_ROWS if not r.fitted]
    assert {r.hardware for r in held_out} >= {"h200", "h100-96gb-500w"}
    assert any(r.cp > 1 for r in held_out) and any(r.ep > 1 for r in held_out)
    # a part whose clock is not published: its tokens/s shown, its memory held
    unclocked = [r for r in REFERENCE_ROWS if not r.tokens_held]
    assert unclocked and {r.hardware for r in unclocked} == {"b200"}
    from simplefsdp.plan.reference import comparison_table

    table = comparison_table(rows=tuple(unclocked), results=[("x", 1.0, 1.0)] * len(unclocked))
    assert table.count("| memory only |") == len(unclocked)


# ------------------------------------------------------------ --measure


def test_measure_refuses_a_pipeline_in_one_line(capsys) -> None:
    argv = ["--model", "debug", "--gpus", "4", "--pp", "2", "--batch", "2", "--seq", "64"]
    argv += ["--measure", "--hardware", "cpu-gloo"]
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "simplefsdp plan: error: --measure runs one rank without a pipeline or CP; got --pp 2"
    )


def test_measure_runs_one_rank_on_cpu_with_a_fake_group() -> None:
    import torch

    from simplefsdp.plan.measure import measure_step

    args = get_config("debug", n_layers=1)
    layout = Layout(gpus=4, batch=1, seq=32, ac="none", dtype="fp32", engine="fsdp2")
    measured = measure_step(LLAMA, args, layout, torch.device("cpu"), warmup=1)
    assert measured.device == "cpu" and measured.step_s > 0
    assert measured.memory_kind == "cpu_peak_rss_over_baseline"
    assert not torch.distributed.is_initialized()  # the fake group is gone


def test_measure_runs_tensor_parallel_after_the_plans_own_trace() -> None:
    # The plan traces over a fake group with meshes of its own first; the
    # measured rank's meshes (the same ranks, other dim names) must still
    # compose TP with FSDP: torch's cached slices of the traced mesh do not
    # count as another mesh.
    import torch

    from simplefsdp.plan.measure import measure_step
    from simplefsdp.plan.trace import TraceKey, layer_variant, trace_step

    args = get_config("debug", n_layers=1)
    trace_step(TraceKey("llama3", layer_variant(LLAMA, args, 1), 2, 2, 1, 32, "none"))
    layout = Layout(gpus=4, tp=2, batch=1, seq=32, ac="none", dtype="fp32")
    measured = measure_step(LLAMA, args, layout, torch.device("cpu"), warmup=1)
    assert measured.step_s > 0


def test_measured_reserved_peak_is_set_beside_the_plans() -> None:
    # On a GPU the plan's peak (reserved) is compared with the allocator's
    # reserved peak, the tensors' with its allocated peak.
    from simplefsdp.plan.measure import Measured, format_measured

    GiB = 2**30
    pred = predict(LLAMA, get_config("debug"), Layout(gpus=2, batch=2, seq=64), PROFILES["h100"])
    reserved = int(pred.peak_bytes / 1.25)
    text = format_measured(Measured("cuda", int(pred.peak_bytes), 1.0, "cuda", reserved), pred)
    assert "reserved peak" in text and "(+25.0%; the caching allocator's)" in text
    assert "reserved peak" not in format_measured(Measured("cpu", GiB, 1.0, "rss"), pred)


def test_measure_runs_float8_as_the_trainer_converts_it(monkeypatch) -> None:
    # --float8 --measure: the linears converted as simplefsdp train
    # --float8.enable converts them (the output left bf16), then one step.
    import torch

    import simplefsdp
    from simplefsdp.plan.measure import measure_step

    converted = []
    real = simplefsdp.convert_linears_to_float8

    def spy(model, recipe, filter_fqns):
        out = real(model, recipe, filter_fqns)
        converted.extend(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
        return out

    monkeypatch.setattr(simplefsdp, "convert_linears_to_float8", spy)
    args = get_config("debug", n_layers=1)
    layout = Layout(gpus=2, batch=1, seq=32, ac="none", engine="fsdp2", float8=True)
    measured = measure_step(LLAMA, args, layout, torch.device("cpu"), warmup=1)
    assert measured.step_s > 0
    assert converted and "output" not in converted and any("attention" in n for n in converted)
