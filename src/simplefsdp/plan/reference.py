"""Published measurements to check ``simplefsdp plan`` against.

Every published row we can reproduce the settings of, each with its source
(``REFERENCE_ROWS``):

- torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1
  8B/70B/405B on 500 W H100s: FSDP, compile, Float8, 2D, 3D 1F1B, and
  context parallelism in Tables 2 and 6);
- torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (70B
  FSDP 32 x TP 8 and 8B FSDP 8 x TP 8, vanilla and async TP, bf16 and
  float8 tensorwise; tokens/s only);
- torchtitan ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md`` (8B
  Float8 on 32 and 64 H200s);
- pytorch/torchtitan#2080 (DeepSeek-V3 16B, FSDP 4 x EP 2 on 8 H100s,
  SimpleFSDP and FSDP2);
- pytorch/torchtitan#1789 (DeepSeek-V3 16B, FSDP 8 x EP 8 on 8 H100 80GB
  HBM3 at 700 W, the 16B config of the time with local batch 4);
- pytorch/ao ``torchao/float8/README.md`` (Llama 3 8B on 8 H100s, bf16 and
  float8 tensorwise, batch 1);
- pytorch/ao ``torchao/prototype/mx_formats/README.md`` (Llama 3 8B on 8
  power-limited B200s, bf16 and float8 tensorwise; the power limit is not
  published, so their tokens/s are shown and only their memory is held).

Rows with a setting the plan does not model (rowwise float8; torchtitan's
SimpleFSDP under ``aot_eager``) are shown with ``modelled=False`` and not held to the accuracy goal; rows on a part
whose clock is not published (``tokens_held=False``) are held on memory
only. Two constants are
fitted, each on one row only (``fitted``; ``--fit`` refits them):
``CLOCK_500W`` on the 8B FSDP + torch.compile row of Table 1 and
``FP8_EFFICIENCY`` on the Float8 row of the same table. All other rows are
held out: ``python -m simplefsdp.plan.reference`` prints them apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

GiB = 2**30

_TT_2024 = "torchtitan llama3_h100_202412"
_TT_ASYNC = "torchtitan asyncTP_llama3_h100_2025-06"
_TRAINY = "torchtitan llama3-8b_h200_202506_trainy-whitefiber"
_DSV3 = "pytorch/torchtitan#2080"
_DSV3_1789 = "pytorch/torchtitan#1789"
_TORCHAO_B200 = "pytorch/ao torchao.prototype.mx_formats"
_TORCHAO_H100 = "pytorch/ao torchao.float8"


@dataclass(frozen=True)
class ReferenceRow:
    """One published measurement and the layout it ran (``memory_gib``
    ``None`` where the source gives none)."""

    table: str
    model: str
    gpus: int
    batch: int
    seq: int
    ac: str
    tp: int
    pp: int
    microbatches: int
    engine: str  # fsdp2 for every torchtitan row
    tokens_per_s_per_gpu: float
    memory_gib: float | None
    modelled: bool
    note: str = ""
    float8: bool = False
    loss_parallel: bool = False  # torchtitan's default wherever TP is on
    # The loss compiled with the model: torchtitan's build_cross_entropy_loss
    # (torchtitan/components/loss.py, 2025) compiles it when compile is on;
    # the December 2024 runs computed it eagerly in train.py.
    fused_loss: bool = False
    cp: int = 1
    ep: int = 1
    hardware: str = "h100-96gb-500w"
    source: str = _TT_2024
    fitted: str = ""  # the constant fitted on this row, if any
    # Context-parallel attention: torchtitan runs torch's context_parallel.
    cp_backend: str = "torch"
    # torchtitan's apply_fsdp keeps the blocks gathered after forward under
    # pipeline parallelism (no per-microbatch all-gathers).
    reshard_after_forward: bool = True
    # torchtitan's torch.compile: each block compiled in place under FSDP2
    compile: bool = False
    # selective AC recomputes the experts' grouped matmuls (torchtitan's op
    # list, which does not name them)
    recompute_experts: bool = False
    # False where the part's clock is not published (a power limit of its
    # own): the tokens/s are shown, the memory alone held to the goal
    tokens_held: bool = True
    # torchtitan's enable_async_tensor_parallel
    async_tp: bool = False
    # the pipeline's schedule (torchtitan's pipeline_parallel_schedule)
    pp_schedule: str = "1f1b"
    # torchtitan's grouping outside the blocks: "split" from
    # pytorch/torchtitan#1094 (2025-07) on, one root group before it
    fsdp2_root: str = "whole"
    # selective AC keeps the attention's output (False: the run's attention
    # kernel is not in its op list)
    attention_saved: bool = True
    # launched by torchtitan's run_train.sh, which has set
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True since 2024-10 (where a
    # source names no launcher: the allocator's default)
    expandable_segments: bool = False


def _table(
    table: str,
    model: str,
    gpus: int,
    batch: int,
    ac: str,
    measured: tuple[tuple[str, bool, bool, float, float | None], ...],
    *,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    modelled: bool = True,
    seq: int = 8192,
    **extra,
) -> tuple[ReferenceRow, ...]:
    """The rows of one published layout: ``measured`` holds ``(note, compile,
    float8, TPS/GPU, GiB)`` per setup measured on it (FSDP2, its blocks
    compiled with ``compile``). Loss parallelism is torchtitan's default
    wherever TP is on."""
    return tuple(
        ReferenceRow(
            table, model, gpus, batch, seq, ac, tp, pp, microbatches, "fsdp2", tps, gib,
            modelled, note, float8=float8, loss_parallel=tp > 1, compile=compile, **extra,
        )
        for note, compile, float8, tps, gib in measured
    )  # fmt: skip


_FSDP = "FSDP", False, False
_COMPILE = "FSDP + torch.compile", True, False
_FLOAT8 = "FSDP + torch.compile + Float8", True, True

# From the tables' text: local batch per data-parallel rank; Tables 1/3 use
# selective AC, 2/4/5/6 full AC; 405B's microbatch count is not given
# (torchtitan's default at the time, one per stage, is assumed). Table 2's
# and 6's sequences exceed the flavors' max_seq_len: planned with it raised.
TORCHTITAN_H100_202412 = (
    ReferenceRow(
        "1", "8B", 8, 2, 8192, "selective", 1, 1, 1, "fsdp2", 5762, 82.4, True, "FSDP"
    ),
    ReferenceRow(
        "1", "8B", 8, 2, 8192, "selective", 1, 1, 1, "fsdp2", 6667, 77.0, True,
        "FSDP + torch.compile", fitted="CLOCK_500W", compile=True,
    ),
    ReferenceRow(
        "1", "8B", 8, 2, 8192, "selective", 1, 1, 1, "fsdp2", 8532, 76.8, True,
        "FSDP + torch.compile + Float8", float8=True, fitted="FP8_EFFICIENCY", compile=True,
    ),
    *_table(
        "3", "8B", 128, 2, "selective",
        ((*_FSDP, 5605, 67.0), (*_COMPILE, 6514, 62.0), (*_FLOAT8, 8380, 61.8)),
    ),
    *_table(
        "4", "70B", 256, 16, "full", (("2D + compile + Float8", True, True, 829, 71.9),),
        tp=8,
    ),
    *_table(
        "4", "70B", 256, 16, "full",
        (("2D + compile + Float8 + AsyncTP", True, True, 876, 67.6),), tp=8, async_tp=True,
    ),
    *_table(
        "5", "405B", 512, 32, "full",
        (("3D 1F1B + compile + Float8 + AsyncTP", True, True, 100, 82.5),),
        tp=8, pp=8, microbatches=8, reshard_after_forward=False, async_tp=True,
    ),
    *_table(
        "5", "405B", 512, 32, "full",
        (("3D interleaved 1F1B + compile + Float8 + AsyncTP", True, True, 128, 72.7),),
        tp=8, pp=8, microbatches=8, reshard_after_forward=False, async_tp=True,
        pp_schedule="interleaved_1f1b",
    ),
    *(
        row
        for cp, tps, gib in ((1, 3890, 83.9), (2, 2540, 84.2), (4, 1071, 84.0), (8, 548, 84.5))
        for row in _table(
            "2", "8B", 8, 1, "full",
            ((f"FSDP {8 // cp} x CP {cp} + compile + Float8", True, True, tps, gib),),
            seq=32768 * cp, cp=cp,
        )
    ),
    *(
        row
        for cp, tps, gib in ((1, 76, 75.3), (2, 47, 75.9), (4, 31, 77.1), (8, 16, 84.9))
        for row in _table(
            "6", "405B", 512, 8, "full",
            ((f"4D CP {cp} + compile + Float8 + AsyncTP + 1F1B", True, True, tps, gib),),
            seq=32768 * cp, cp=cp, tp=8, pp=8, microbatches=8, reshard_after_forward=False,
            async_tp=True,
        )
    ),
)  # fmt: skip

# Vanilla and async TP rows; tokens/s only. Float8 tensorwise as above;
# the rowwise rows are left out (rowwise scaling is not modelled). The loss
# is compiled (torchtitan of 2025).
TORCHTITAN_ASYNCTP_202506 = tuple(
    row
    for async_tp, suffix, tps in ((False, "", (597.3, 809.8, 4378, 5078.1)),
                                  (True, " + AsyncTP", (652.4, 942.4, 4809.4, 5570.1)))
    for row in (
        *_table(
            "70B", "70B", 256, 16, "full",
            ((f"2D + compile{suffix}", True, False, tps[0], None),
             (f"2D + compile + Float8{suffix}", True, True, tps[1], None)),
            tp=8, source=_TT_ASYNC, fused_loss=True, async_tp=async_tp,
        ),
        *_table(
            "8B", "8B", 64, 12, "selective",
            ((f"2D + compile{suffix}", True, False, tps[2], None),
             (f"2D + compile + Float8{suffix}", True, True, tps[3], None)),
            tp=8, source=_TT_ASYNC, fused_loss=True, async_tp=async_tp,
        ),
    )
)  # fmt: skip

# Trainy on WhiteFiber H200s: llama3_8b.toml (seq 8192, selective AC) with
# local batch 2, compile (the loss too: torchtitan of 2025), Float8 with
# float8 all-gather.
TRAINY_H200_202506 = tuple(
    ReferenceRow(
        f"{n} nodes", "8B", 8 * n, 2, 8192, "selective", 1, 1, 1, "fsdp2", tps, gib,
        True, "FSDP + torch.compile + Float8", float8=True, hardware="h200", source=_TRAINY,
        fused_loss=True, compile=True,
    )
    for n, tps, gib in ((4, 10938, 47.96), (8, 10753, 46.97))
)  # fmt: skip

# DeepSeek-V3 16B, FSDP 4 x EP 2 on one node; batch 1; seq 4096 and
# selective AC from deepseek_v3_16b.toml of the time (assumed), whose op
# list (deepseek_v3/infra/parallelize.py) recomputes the experts' grouped
# matmuls: --recompute-experts. The
# SimpleFSDP row ran torchtitan's SimpleFSDP under aot_eager with its
# manual bucketing pass: no engine of the plan (its eager engine is FSDP2,
# whose collective buffers sit on streams of their own), so it is shown,
# planned as FSDP2, and not held to the goal.
DEEPSEEK_V3_2080 = tuple(
    ReferenceRow(
        "EP", "deepseek_v3_16b", 8, 1, 4096, "selective", 1, 1, 1, "fsdp2", tps, gib, held,
        note, ep=2, source=_DSV3, recompute_experts=True, fsdp2_root="split",
    )
    for note, tps, gib, held in (
        ("SimpleFSDP (aot_eager)", 5136, 51.1, False), ("FSDP2 eager", 5942, 59.5, True)
    )
)  # fmt: skip

# DeepSeek-V3 16B on 8 H100 80GB HBM3 (700 W), torchtitan's
# deepseek_v3_16b.toml of the time with the local batch lowered to 4 (the
# value torchtitan#1792 then made the default, citing this issue): FSDP 8 x
# EP 8, seq 4096, selective AC by the op list (the experts recomputed), the
# loss compiled. Tokens/s: the mean of the four logged windows (steps 10 to
# 40: 11,636, 11,758, 11,533, 11,254); memory: their reserved peak. Launched
# by run_train.sh (the command): expandable segments.
DEEPSEEK_V3_1789 = (
    ReferenceRow(
        "EP", "deepseek_v3_16b", 8, 4, 4096, "selective", 1, 1, 1, "fsdp2", 11545, 73.32,
        True, "FSDP2 eager, compiled loss", ep=8, hardware="h100", source=_DSV3_1789,
        recompute_experts=True, fused_loss=True, expandable_segments=True, fsdp2_root="split",
    ),
)  # fmt: skip

# Llama 3 8B on "8xH100" (pytorch/ao's float8 README: torchtitan 0.0.2, a
# torch 2.7 pre-release, torchao 0.10 pre-release): batch 1 x 8192,
# torch.compile, FSDP2, per-op SAC; bf16 and float8 tensorwise with float8
# all-gather. The parts are taken to be the PyTorch team's 500 W 96 GB
# H100s of the other rows (not stated), and the loss eager: torchtitan
# compiles it from pytorch/torchtitan#1033, after that torch pre-release.
# Memory: torchtitan's logged reserved peak (ao's parse_torchtitan_logs.py).
# ao's torchtitan_benchmark.sh launches run_train.sh: expandable segments.
TORCHAO_H100_2025 = tuple(
    ReferenceRow(
        "8 GPUs", "8B", 8, 1, 8192, "selective", 1, 1, 1, "fsdp2", tps, gib, True, note,
        float8=float8, source=_TORCHAO_H100, compile=True, expandable_segments=True,
    )
    for note, float8, tps, gib in (
        ("FSDP + torch.compile, batch 1", False, 6150.0, 47.65),
        ("FSDP + torch.compile + Float8, batch 1", True, 7689.5, 47.77),
    )
)  # fmt: skip

# Llama 3 8B on 8 "power limited" B200s (pytorch/ao's mx_formats README,
# torchtitan 6fc499f6, a torch 2.9 nightly): batch 1 x 8192,
# torch.compile (the loss too), FSDP2, per-op SAC; bf16 and float8
# tensorwise with float8 all-gather. Their limit is not published, so their
# tokens/s are not held; "Peak Memory (GB)" is torchtitan's logged reserved
# peak (GiB). At that commit torchtitan shards the embedding apart from the
# final norm and output (#1094), and on a B200 its attention runs cuDNN's
# kernel first (models/attention.py), which its op list for selective AC
# does not name: every block's attention is recomputed. Launched by ao's
# torchtitan_benchmark.sh (run_train.sh): expandable segments.
TORCHAO_B200_202508 = tuple(
    ReferenceRow(
        "8 GPUs", "8B", 8, 1, 8192, "selective", 1, 1, 1, "fsdp2", tps, gib, True, note,
        float8=float8, hardware="b200", source=_TORCHAO_B200, fused_loss=True, compile=True,
        tokens_held=False, fsdp2_root="split", attention_saved=False, expandable_segments=True,
    )
    for note, float8, tps, gib in (
        ("FSDP + torch.compile, power-limited", False, 8307.5, 33.71),
        ("FSDP + torch.compile + Float8, power-limited", True, 10417.0, 33.38),
    )
)  # fmt: skip

REFERENCE_ROWS = (
    *TORCHTITAN_H100_202412,
    *TORCHTITAN_ASYNCTP_202506,
    *TRAINY_H200_202506,
    *DEEPSEEK_V3_2080,
    *DEEPSEEK_V3_1789,
    *TORCHAO_H100_2025,
    *TORCHAO_B200_202508,
)
CALIBRATION_ROW = 1  # index of the row CLOCK_500W is fitted on
FLOAT8_CALIBRATION_ROW = 2  # the row FP8_EFFICIENCY is fitted on


def predict_row(row: ReferenceRow, hw=None):
    """The plan's prediction of ``row``'s layout on ``hw`` (default: the
    row's hardware profile)."""
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.hardware import get_profile
    from simplefsdp.plan.predict import Layout, predict

    hw = hw or get_profile(row.hardware)
    spec, config = resolve_flavor(row.model)
    if row.seq > config.max_seq_len:
        # One raised length per model (the longest of its rows), so that rows
        # whose ranks trace the same shapes share one trace (the CP rows of a
        # table: FSDP over dp x cp, seq / cp tokens per rank).
        longest = max(r.seq for r in REFERENCE_ROWS if r.model == row.model)
        spec, config = resolve_flavor(row.model, max_seq_len=max(longest, row.seq))
    if spec.plan_method == "analytic":
        from simplefsdp.plan.analytic import ExpertLayout

        layout = ExpertLayout(
            gpus=row.gpus,
            batch=row.batch,
            seq=row.seq,
            ep=row.ep,
            ac=row.ac,
            engine=row.engine,
            recompute_experts=row.recompute_experts,
            fused_loss=row.fused_loss,
            expandable_segments=row.expandable_segments,
            fsdp2_root=row.fsdp2_root,
        )
        return predict(spec, config, layout, hw)
    layout = Layout(
        gpus=row.gpus,
        batch=row.batch,
        seq=row.seq,
        tp=row.tp,
        pp=row.pp,
        cp=row.cp,
        cp_backend=row.cp_backend,
        ac=row.ac,
        microbatches=row.microbatches,
        engine=row.engine,
        float8=row.float8,
        loss_parallel=row.loss_parallel,
        fused_loss=row.fused_loss,
        compile=row.compile,
        reshard_after_forward=row.reshard_after_forward,
        async_tp=row.async_tp,
        pp_schedule=row.pp_schedule,
        fsdp2_root=row.fsdp2_root,
        attention_saved=row.attention_saved,
        expandable_segments=row.expandable_segments,
    )
    return predict(spec, config, layout, hw)


def fit_efficiency(hw, row: ReferenceRow, iterations: int = 12, field: str = "matmul_efficiency"):
    """The efficiency (``field`` of the profile: ``matmul_efficiency``, or
    ``fp8_matmul_efficiency`` for a Float8 row) at which ``row``'s predicted
    tokens/s matches the measurement (bisection; traces are cached, so each
    step is cheap)."""
    lo, hi = 0.2, 1.2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        pred = predict_row(row, dataclasses.replace(hw, **{field: mid}))
        if pred.tokens_per_s_per_gpu < row.tokens_per_s_per_gpu:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _error(predicted: float, measured: float | None) -> str:
    return "n/a" if not measured else f"{100 * (predicted / measured - 1):+.1f}%"


def _trace_shape(row: ReferenceRow) -> tuple:
    """What the traces of ``row`` depend on (rows equal here share them):
    the model, the FSDP degree (``dp x cp``), TP, the microbatch's tokens
    per rank, AC (and whether it keeps the attention) and loss
    parallelism."""
    fsdp = row.gpus // (row.tp * row.pp)
    return (
        row.model,
        fsdp,
        row.tp,
        row.pp,
        row.batch // row.microbatches,
        row.seq // row.cp,
        row.ac,
        row.loss_parallel,
        row.ep,
        row.reshard_after_forward,
        row.attention_saved,
    )


def _predict_group(rows: tuple[ReferenceRow, ...], hw) -> list[tuple[str, float, float]]:
    """``(layout, tokens/s/GPU, peak GiB)`` of each row (one process: the
    rows share their traces)."""
    out = []
    for row in rows:
        pred = predict_row(row, hw if hw is not None and hw.name == row.hardware else None)
        out.append((pred.layout.describe(), pred.tokens_per_s_per_gpu, pred.peak_bytes / GiB))
    return out


def predict_rows(rows, hw=None, jobs: int = 1) -> list[tuple[str, float, float]]:
    """``(layout, tokens/s/GPU, peak GiB)`` of each of ``rows``, ``hw``
    replacing the profile of the rows on its hardware. The rows are grouped
    by the traces they need (:func:`_trace_shape`), each group traced once;
    with ``jobs > 1`` the groups run in that many processes."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(_trace_shape(row), []).append(i)
    results: list = [None] * len(rows)
    order = list(groups.values())
    if jobs <= 1 or len(order) <= 1:
        outputs = [_predict_group(tuple(rows[i] for i in g), hw) for g in order]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(order)), mp_context=context) as pool:
            futures = [pool.submit(_predict_group, tuple(rows[i] for i in g), hw) for g in order]
            outputs = [f.result() for f in futures]
    for group, output in zip(order, outputs, strict=True):
        for i, value in zip(group, output, strict=True):
            results[i] = value
    return results


def comparison_table(hw=None, rows=REFERENCE_ROWS, jobs: int = 1, results=None) -> str:
    """The markdown table of ``rows``: measured, predicted and the errors;
    ``hw`` replaces the profile of the rows on its hardware (for fitting);
    ``jobs`` processes predict them (:func:`predict_rows`) unless
    ``results`` holds their predictions already."""
    if results is None:
        results = predict_rows(rows, hw, jobs)
    lines = [
        "| source | table | model | GPUs | hardware | layout | setup | measured TPS | "
        "predicted TPS | error | measured GiB | predicted GiB | error | held to goal |",
        "|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row, (layout, tps, mem) in zip(rows, results, strict=True):
        held = "fitted" if row.fitted else ("yes" if row.modelled else "no")
        if held == "yes" and not row.tokens_held:
            held = "memory only"
        measured_mem = "" if row.memory_gib is None else f"{row.memory_gib:.1f}"
        lines.append(
            f"| {row.source.split()[-1]} | {row.table} | {row.model} | {row.gpus} | "
            f"{row.hardware} | {layout} | {row.note} | "
            f"{row.tokens_per_s_per_gpu:,.0f} | {tps:,.0f} | "
            f"{_error(tps, row.tokens_per_s_per_gpu)} | {measured_mem} | {mem:.1f} | "
            f"{_error(mem, row.memory_gib)} | {held} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from simplefsdp.plan.hardware import get_profile

    parser = argparse.ArgumentParser(prog="python -m simplefsdp.plan.reference")
    parser.add_argument(
        "--fit",
        action="store_true",
        help="refit CLOCK_500W and FP8_EFFICIENCY on their rows first",
    )
    parser.add_argument("--rows", help="comma-separated row indices (default: all)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="processes predicting the rows, one group of rows sharing traces each (default 1)",
    )
    ns = parser.parse_args(argv)
    if ns.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {ns.jobs}")
    hw = get_profile("h100-96gb-500w")
    if ns.fit:
        clock = fit_efficiency(hw, REFERENCE_ROWS[CALIBRATION_ROW], field="clock_fraction")
        print(f"fitted CLOCK_500W (clock_fraction of h100-96gb-500w) = {clock:.4f}")
        hw = dataclasses.replace(hw, clock_fraction=clock)
        row = REFERENCE_ROWS[FLOAT8_CALIBRATION_ROW]
        efficiency = fit_efficiency(hw, row, field="fp8_matmul_efficiency")
        print(f"fitted FP8_EFFICIENCY (fp8_matmul_efficiency) = {efficiency:.4f}")
        hw = dataclasses.replace(hw, fp8_matmul_efficiency=efficiency)
    rows = REFERENCE_ROWS
    if ns.rows:
        rows = tuple(REFERENCE_ROWS[int(i)] for i in ns.rows.split(","))
    start = time.perf_counter()
    results = dict(zip(rows, predict_rows(rows, hw, ns.jobs), strict=True))
    fitted = tuple(r for r in rows if r.fitted)
    held_out = tuple(r for r in rows if not r.fitted)
    if fitted:
        print("Rows the constants are fitted on:\n")
        print(comparison_table(hw, fitted, results=[results[r] for r in fitted]))
    if held_out:
        print("\nHeld-out rows (nothing fitted on them):\n")
        print(comparison_table(hw, held_out, results=[results[r] for r in held_out]))
    print(f"\n{len(rows)} rows predicted in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
