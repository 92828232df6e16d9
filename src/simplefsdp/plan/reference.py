"""Published measurements to check ``simplefsdp plan`` against.

``TORCHTITAN_H100_202412``: torchtitan's 2024-12 Llama 3.1 benchmark on H100
(pytorch/torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md``, commit
31a17bf as stored): TPS/GPU and peak memory (GiB, the maximum across GPUs) per
row, with the row's layout. Float8 rows are predicted with ``--float8``
(Note: [Float8 in the plan]); rows with AsyncTP are kept with
``modelled=False``: we predict TP's collectives exposed, so their errors are
shown but not held to the accuracy goal. Context parallelism (Tables 2 and
6) and the interleaved 1F1B schedule are left out.

``python -m simplefsdp.plan.reference`` prints the comparison table of
``docs/scale.md``; ``--fit`` fits the ``h100-96gb-500w`` profile's matmul
efficiency on the bf16 calibration row only, ``--fit-float8`` its float8
matmul efficiency on the Float8 calibration row only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class ReferenceRow:
    table: str
    model: str
    gpus: int
    batch: int
    seq: int
    ac: str
    tp: int
    pp: int
    microbatches: int
    engine: str  # simplefsdp = compiled, fsdp2 = eager FSDP2
    tokens_per_s_per_gpu: float
    memory_gib: float
    modelled: bool
    note: str = ""
    float8: bool = False
    loss_parallel: bool = False  # torchtitan's default wherever TP is on


def _table(
    table: str,
    model: str,
    gpus: int,
    batch: int,
    ac: str,
    measured: tuple[tuple[str, str, bool, float, float], ...],
    *,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    modelled: bool = True,
) -> tuple[ReferenceRow, ...]:
    """The rows of one published layout: ``measured`` holds ``(note, engine,
    float8, TPS/GPU, GiB)`` per setup measured on it. Loss parallelism is
    torchtitan's default wherever TP is on."""
    return tuple(
        ReferenceRow(
            table, model, gpus, batch, 8192, ac, tp, pp, microbatches, engine, tps, gib,
            modelled, note, float8=float8, loss_parallel=tp > 1,
        )
        for note, engine, float8, tps, gib in measured
    )  # fmt: skip


_FSDP = "FSDP", "fsdp2", False
_COMPILE = "FSDP + torch.compile", "simplefsdp", False
_FLOAT8 = "FSDP + torch.compile + Float8", "simplefsdp", True

# From the table's text: local batch per data-parallel rank; Tables 1/3 use
# selective AC, 4/5 full AC; 405B's microbatch count is not given (torchtitan's
# default at the time, one per stage, is assumed).
TORCHTITAN_H100_202412 = (
    *_table(
        "1", "8B", 8, 2, "selective",
        ((*_FSDP, 5762, 82.4), (*_COMPILE, 6667, 77.0), (*_FLOAT8, 8532, 76.8)),
    ),
    *_table(
        "3", "8B", 128, 2, "selective",
        ((*_FSDP, 5605, 67.0), (*_COMPILE, 6514, 62.0), (*_FLOAT8, 8380, 61.8)),
    ),
    *_table(
        "4", "70B", 256, 16, "full", (("2D + compile + Float8", "simplefsdp", True, 829, 71.9),),
        tp=8,
    ),
    *_table(
        "5", "405B", 512, 32, "full",
        (("3D 1F1B + compile + Float8 + AsyncTP", "simplefsdp", True, 100, 82.5),),
        tp=8, pp=8, microbatches=8, modelled=False,
    ),
)  # fmt: skip
CALIBRATION_ROW = 1  # index of the row the matmul efficiency is fitted on
FLOAT8_CALIBRATION_ROW = 2  # the row the float8 matmul efficiency is fitted on


def predict_row(row: ReferenceRow, hw):
    """The plan's prediction of ``row``'s layout on ``hw``."""
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.predict import Layout, predict

    layout = Layout(
        gpus=row.gpus,
        batch=row.batch,
        seq=row.seq,
        tp=row.tp,
        pp=row.pp,
        ac=row.ac,
        microbatches=row.microbatches,
        engine=row.engine,
        float8=row.float8,
        loss_parallel=row.loss_parallel,
    )
    return predict(*resolve_flavor(row.model), layout, hw)


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


def comparison_table(hw, rows=TORCHTITAN_H100_202412) -> str:
    lines = [
        "| table | model | GPUs | layout | engine | measured TPS | predicted TPS | error | "
        "measured GiB | predicted GiB | error | modelled |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        pred = predict_row(row, hw)
        tps, mem = pred.tokens_per_s_per_gpu, pred.peak_bytes / GiB
        lines.append(
            f"| {row.table} | {row.model} | {row.gpus} | {pred.layout.describe()} | "
            f"{row.note} | {row.tokens_per_s_per_gpu:,.0f} | {tps:,.0f} | "
            f"{100 * (tps / row.tokens_per_s_per_gpu - 1):+.1f}% | {row.memory_gib:.1f} | "
            f"{mem:.1f} | {100 * (mem / row.memory_gib - 1):+.1f}% | "
            f"{'yes' if row.modelled else 'no (AsyncTP)'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from simplefsdp.plan.hardware import get_profile

    parser = argparse.ArgumentParser(prog="python -m simplefsdp.plan.reference")
    parser.add_argument("--hardware", default="h100-96gb-500w")
    parser.add_argument("--fit", action="store_true", help="fit the matmul efficiency first")
    parser.add_argument(
        "--fit-float8",
        action="store_true",
        help="fit the float8 matmul efficiency on the Float8 calibration row (after --fit)",
    )
    parser.add_argument("--rows", help="comma-separated row indices (default: all)")
    ns = parser.parse_args(argv)
    hw = get_profile(ns.hardware)
    if ns.fit:
        field = "clock_fraction" if hw.sm_count else "matmul_efficiency"
        efficiency = fit_efficiency(hw, TORCHTITAN_H100_202412[CALIBRATION_ROW], field=field)
        print(f"fitted {field} = {efficiency:.4f}")
        hw = dataclasses.replace(hw, **{field: efficiency})
    if ns.fit_float8:
        row = TORCHTITAN_H100_202412[FLOAT8_CALIBRATION_ROW]
        efficiency = fit_efficiency(hw, row, field="fp8_matmul_efficiency")
        print(f"fitted fp8_matmul_efficiency = {efficiency:.4f}")
        hw = dataclasses.replace(hw, fp8_matmul_efficiency=efficiency)
    if ns.rows:
        rows = tuple(TORCHTITAN_H100_202412[int(i)] for i in ns.rows.split(","))
        print(comparison_table(hw, rows))
        return 0
    print(comparison_table(hw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
