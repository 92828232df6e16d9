"""Turn the workers' raw measurements into rows, a table, bench.json and bench.png."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from simplefsdp.bench.configs import BenchConfig, Workload

# The loss reference is the first of these that ran: torch's own eager
# implementations first, since they are the ones a wrong pass cannot touch.
REFERENCE_ORDER = (
    "fsdp2",
    "ddp",
    "simplefsdp-uncompiled",
    "simplefsdp-eager",
    "fsdp2-compile",
    "simplefsdp-none",
    "simplefsdp-manual",
    "simplefsdp-auto",
    "simplefsdp-torch-passes",
    "fsdp2-float8",
    "simplefsdp-float8",
)
_COUNT_FIELDS = {
    "all_gather": "num_all_gathers",
    "reduce_scatter": "num_reduce_scatters",
    "all_reduce": "num_all_reduces",
}
_MIB = 1024 * 1024


def _empty_row(config: BenchConfig) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": config.name,
        "description": config.description,
        "syncs_grads": config.syncs_grads,
        "numerics": config.numerics(),
        "ok": False,
        "error": None,
        "notes": [],
    }
    for key in (
        "step_time_s_median", "step_time_s_min", "step_time_s_max", "tokens_per_s_per_rank",
        "peak_mem_bytes", "num_all_gathers", "num_reduce_scatters", "num_all_reduces",
        "all_gather_bytes", "reduce_scatter_bytes",
        "compile_s", "first_loss", "final_loss", "predicted_step_time_s",
        "predicted_peak_mem_bytes", "warmup_resident_mem_bytes",
        "peak_mem_bytes_beyond_warmup_resident",
    ):  # fmt: skip
        row[key] = None
    return row


def failed_row(config: BenchConfig, error: str) -> dict[str, Any]:
    """The row of a configuration that did not produce results."""
    row = _empty_row(config)
    row["error"] = error
    return row


def _step_stats(ranks: list[dict]) -> tuple[list[float], float]:
    """Per measured step the slowest rank's time, and the slowest first step."""
    per_step = [max(times) for times in zip(*(r["step_times_s"] for r in ranks))]
    first = max(r["warmup_times_s"][0] for r in ranks)
    return per_step, first


def _max_or_none(values: list[Any]) -> int | None:
    known = [v for v in values if v is not None]
    return int(max(known)) if known else None


def _transient(rank: dict) -> int | None:
    """Peak during the measured steps above the level they started at."""
    peak, start = rank["peak_mem_bytes"], rank["mem_at_measure_start_bytes"]
    return None if peak is None or start is None else peak - start


def _warmup_resident(rank: dict) -> int | None:
    """What warm-up left resident besides the state it created (Note: [Warm-up residency])."""
    before, start = rank.get("mem_before_warmup_bytes"), rank["mem_at_measure_start_bytes"]
    state_before, state = rank.get("state_mem_before_warmup_bytes"), rank["state_mem_bytes"]
    if None in (before, start, state_before, state):
        return None
    return (start - before) - (state - state_before)


def _peak_beyond(resident: int | None, peak: int | None) -> int | None:
    return None if resident is None or peak is None else peak - resident


def _phase_peaks(ranks: list[dict]) -> dict[str, int | None] | None:
    """Per phase the largest rank's peak (Note: [Peak by phase])."""
    per_rank = [r.get("phase_peak_mem_bytes") for r in ranks]
    if not all(per_rank):
        return None
    return {name: _max_or_none([p.get(name) for p in per_rank]) for name in per_rank[0]}


def merge_ranks(config: BenchConfig, ranks: list[dict], workload: Workload) -> dict[str, Any]:
    """One result row from every rank's raw result of a training configuration.

    Step time is, per step, the slowest rank's; memory is the largest rank's;
    losses are averaged over ranks (the global-batch loss for data-parallel
    configurations); counts and notes come from rank 0.
    """
    ranks = sorted(ranks, key=lambda r: r["rank"])
    resident = [_warmup_resident(r) for r in ranks]
    per_step, first = _step_stats(ranks)
    median = statistics.median(per_step)
    # A pipeline's loss exists on its last stage's ranks only (None elsewhere).
    losses = [
        statistics.fmean(v for v in step if v is not None)
        for step in zip(*(r["losses"] for r in ranks))
    ]
    row = _empty_row(config)
    row.update(
        ok=True,
        step_time_s_median=median,
        step_time_s_min=min(per_step),
        step_time_s_max=max(per_step),
        step_times_s=per_step,
        # a tensor-parallel group's and a pipeline's ranks share their batch
        tokens_per_s_per_rank=workload.batch_size
        * workload.seq_len
        * ranks[0].get("grad_accum", 1)
        / (ranks[0].get("tp", 1) * ranks[0].get("pp", 1))
        / median,
        peak_mem_bytes=_max_or_none([r["peak_mem_bytes"] for r in ranks]),
        mem_at_measure_start_bytes=_max_or_none([r["mem_at_measure_start_bytes"] for r in ranks]),
        state_mem_bytes=_max_or_none([r["state_mem_bytes"] for r in ranks]),
        step_transient_mem_bytes=_max_or_none([_transient(r) for r in ranks]),
        warmup_resident_mem_bytes=_max_or_none(resident),
        peak_mem_bytes_beyond_warmup_resident=_max_or_none(
            [_peak_beyond(res, r["peak_mem_bytes"]) for res, r in zip(resident, ranks)]
        ),
        phase_peak_mem_bytes=_phase_peaks(ranks),
        mem_method=ranks[0]["mem_method"],
        # Noise can make the first step of an eager run faster than the median.
        compile_s=max(0.0, first - median),
        first_step_s=first,
        first_loss=losses[0],
        final_loss=losses[-1],
        losses=losses,
        collectives_source=ranks[0]["collectives_source"],
        collectives_profiled=ranks[0]["collectives_profiled"],
        num_broadcasts=ranks[0]["collectives_profiled"].get("broadcast", 0),
        predicted=ranks[0]["predicted"],
        predicted_step_time_s=ranks[0]["predicted_step_time_s"],
        predicted_peak_mem_bytes=ranks[0]["predicted_peak_mem_bytes"],
        num_params=ranks[0]["num_params"],
        notes=list(ranks[0]["notes"]),
    )
    for kind, key in _COUNT_FIELDS.items():
        row[key] = int(ranks[0]["collectives"].get(kind, 0))
    if ranks[0].get("numerics"):
        row["numerics"] = ranks[0]["numerics"]
    nbytes = ranks[0].get("collective_bytes") or {}
    for kind in ("all_gather", "reduce_scatter"):
        row[f"{kind}_bytes"] = int(nbytes[kind]) if kind in nbytes else None
    row["collective_bytes_profiled"] = ranks[0].get("collective_bytes_profiled")
    if all(r.get("bubble_fractions") for r in ranks):
        per_rank = [statistics.median(r["bubble_fractions"]) for r in ranks]
        row["bubble_fraction_per_rank"] = per_rank
        row["bubble_fraction"] = statistics.fmean(per_rank)
        row["peak_mem_bytes_per_rank"] = [r["peak_mem_bytes"] for r in ranks]
    return row


def merge_rounds(rows: list[dict]) -> dict[str, Any]:
    """One configuration's rows from several rounds (``--rounds``) as one row.

    Note: [Bench rounds]
        On a shared machine the speed drifts between one configuration's
        processes and the next's by more than the differences the bench is
        run to show (docs/benchmarks.md). Rounds run every configuration again, in alternating order
        (A B C, C B A, A B C, ...), so that drift falls on all of them alike.
        The row pools the rounds' measured steps: its median, min and max
        step time (and the tokens/s from that median) are over all of them.
        Everything else (memory, collective counts, losses, compile time) is
        the median round's: the one whose own median step time is the
        median (the lower middle of an even count). ``rounds`` lists each
        round's median step time, peak memory and final loss. A round that
        failed is the row: nothing is averaged over a failure.
    """
    if not rows:
        raise ValueError("merge_rounds needs at least one round")
    failed = next((r for r in rows if r["step_time_s_median"] is None), None)
    if failed is not None:
        return failed
    if len(rows) == 1:
        return rows[0]
    by_time = sorted(rows, key=lambda r: r["step_time_s_median"])
    row = dict(by_time[(len(rows) - 1) // 2])
    tokens_per_step = row["tokens_per_s_per_rank"] * row["step_time_s_median"]
    steps = [t for r in rows for t in r["step_times_s"]]
    median = statistics.median(steps)
    row.update(
        step_times_s=steps,
        step_time_s_median=median,
        step_time_s_min=min(steps),
        step_time_s_max=max(steps),
        tokens_per_s_per_rank=tokens_per_step / median,
        rounds=[
            {
                "step_time_s_median": r["step_time_s_median"],
                "peak_mem_bytes": r["peak_mem_bytes"],
                "final_loss": r["final_loss"],
                "load_avg_1m_before": r.get("load_avg_1m_before"),
            }
            for r in rows
        ],
    )
    return row


def merge_comm_only(ranks: list[dict]) -> dict[str, Any]:
    """The communication-only measurement merged over ranks (slowest rank per step)."""
    per_step = [max(times) for times in zip(*(r["step_times_s"] for r in ranks))]
    return {
        "step_time_s_median": statistics.median(per_step),
        "step_time_s_min": min(per_step),
        "step_time_s_max": max(per_step),
        "collectives": ranks[0]["collectives"],
        "bytes_per_step": ranks[0]["bytes_per_step"],
    }


def _reference(rows: list[dict]) -> dict | None:
    by_name = {r["name"]: r for r in rows if r["ok"] and r["syncs_grads"]}
    for name in REFERENCE_ORDER:
        if name in by_name:
            return by_name[name]
    return next(iter(by_name.values()), None)


def _numerics(row: dict) -> str:
    return row.get("numerics") or "float32"


def _rel_diff(value: float, reference: float) -> float:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def check_losses(rows: list[dict], rtol: float) -> dict[str, Any]:
    """Flag rows whose losses disagree with the reference configuration (in place).

    Every configuration starts from the same weights and data, so the first
    step's loss must agree for all of them (``limit`` included). The final
    loss must agree for the configurations that average gradients; ``limit``
    trains an independent replica per rank and is only held to the first
    step. A disagreeing row gets ``ok=false`` and an explanatory note.

    Note: [Loss groups]
        Rows are compared within their numerics (``numerics``: the dtype the
        matmuls run in, ``+float8`` for torchao float8 linears), each group
        against its own reference: float8 rounding moves the loss by far
        more than any tolerance that would catch a wrong pass, so a float8
        row is held to the other float8 rows (``fsdp2-float8`` first), not
        to the float32 ones.

    Returns:
        ``{"reference": name | None, "rtol": rtol, "references": {numerics:
        name}}``; ``reference`` is the first group's.
    """
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(_numerics(row), []).append(row)
    references: dict[str, str] = {}
    for numerics, group in groups.items():
        reference = _check_group(group, rtol)
        if reference is not None:
            references[numerics] = reference
    first = next(iter(references.values()), None)
    return {"reference": first, "rtol": rtol, "references": references}


def _check_group(rows: list[dict], rtol: float) -> str | None:
    """:func:`check_losses` for rows of one numerics; the reference's name."""
    reference = _reference(rows)
    if reference is None:
        return None
    for row in rows:
        if row["final_loss"] is None:
            continue
        row["first_loss_rel_diff"] = _rel_diff(row["first_loss"], reference["first_loss"])
        checks = [("first", row["first_loss_rel_diff"])]
        if row["syncs_grads"]:
            row["final_loss_rel_diff"] = _rel_diff(row["final_loss"], reference["final_loss"])
            checks.append(("final", row["final_loss_rel_diff"]))
        for which, diff in checks:
            if diff > rtol:
                row["ok"] = False
                row["notes"].append(
                    f"{which} loss {row[f'{which}_loss']:.6f} disagrees with "
                    f"{reference['name']} ({reference[f'{which}_loss']:.6f}): relative "
                    f"difference {diff:.2e} > {rtol:.0e}"
                )
    return reference["name"]


def _by_name(rows: list[dict], name: str) -> dict | None:
    return next((r for r in rows if r["name"] == name and r["step_time_s_median"]), None)


def add_ratios(rows: list[dict]) -> None:
    """Add ``step_time_vs_limit``, ``speedup_vs_fsdp2`` and ``peak_mem_vs_fsdp2`` (in place).

    ``step_time_vs_limit`` is time / limit's time (1.0 = the compute-only
    bound); ``speedup_vs_fsdp2`` is fsdp2's time / time (above 1 = faster
    than eager FSDP2); ``peak_mem_vs_fsdp2`` is peak memory / fsdp2's, and
    ``peak_beyond_resident_vs_fsdp2`` the same without what warm-up left
    resident (Note: [Warm-up residency]).
    """
    limit, fsdp2 = _by_name(rows, "limit"), _by_name(rows, "fsdp2")
    for row in rows:
        time_s, mem = row["step_time_s_median"], row["peak_mem_bytes"]
        row["step_time_vs_limit"] = (
            time_s / limit["step_time_s_median"] if time_s and limit else None
        )
        row["speedup_vs_fsdp2"] = fsdp2["step_time_s_median"] / time_s if time_s and fsdp2 else None
        row["peak_mem_vs_fsdp2"] = (
            mem / fsdp2["peak_mem_bytes"] if mem and fsdp2 and fsdp2["peak_mem_bytes"] else None
        )
        key = "peak_mem_bytes_beyond_warmup_resident"
        own, ref = row.get(key), fsdp2.get(key) if fsdp2 else None
        row["peak_beyond_resident_vs_fsdp2"] = own / ref if own and ref else None


def _fmt(value: Any, spec: str, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:{spec}}".rjust(width)


def _mib(value: int | None) -> float | None:
    return None if value is None else value / _MIB


def _fmt_mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:.1f}"


def _table_line(row: dict) -> str:
    counts = "-"
    if row["num_all_gathers"] is not None:
        counts = f"{row['num_all_gathers']}/{row['num_reduce_scatters']}/{row['num_all_reduces']}"
    mem = row["peak_mem_bytes"] / _MIB if row["peak_mem_bytes"] is not None else None
    spread = "-"
    if row["step_time_s_min"] is not None:
        spread = f"{row['step_time_s_min']:.3f}-{row['step_time_s_max']:.3f}"
    return (
        f"{row['name']:<24} {'yes' if row['ok'] else 'NO':>3} "
        f"{_fmt(row['step_time_s_median'], '.3f', 8)} {spread:>13} "
        f"{_fmt(row.get('step_time_vs_limit'), '.2f', 6)} "
        f"{_fmt(row.get('speedup_vs_fsdp2'), '.2f', 6)} "
        f"{_fmt(row['tokens_per_s_per_rank'], '.0f', 8)} {_fmt(mem, '.1f', 8)} "
        f"{_fmt(row.get('peak_mem_vs_fsdp2'), '.2f', 6)} {counts:>10} "
        f"{_fmt(_mib(row.get('all_gather_bytes')), '.2f', 7)} "
        f"{_fmt(row['compile_s'], '.1f', 7)} {_fmt(row['final_loss'], '.5f', 9)} "
        f"{_fmt(row['predicted_step_time_s'], '.3f', 7)}"
    )


def format_table(result: dict) -> str:
    """The terminal table of a benchmark ``result`` (the bench.json content)."""
    env = result["env"]
    tp = env.get("tp", 1)
    ranks = f"{env['world_size']} ranks" + (
        f" (dp {env['world_size'] // tp} x tp {tp})" if tp > 1 else ""
    )
    if env.get("ep", 1) > 1:
        ranks += f", experts ep {env['ep']} x dp_shard_mod_ep {env['world_size'] // env['ep']}"
    accum = env.get("grad_accum", 1)
    if accum > 1:
        ranks += f", {accum} accumulation batches per step"
    pp = env.get("pp", 1)
    if pp > 1:
        ranks += f", pp {pp} ({env.get('pp_schedule')}, {env.get('microbatches')} micro-batches)"
    per = "per data-parallel rank" if tp > 1 or pp > 1 else "per rank"
    if env.get("param_dtype") not in (None, "float32"):
        ranks += f", {env['param_dtype']} mixed precision (fsdp2 and simplefsdp configurations)"
    lines = [
        f"simplefsdp bench: workload {env['workload']} ({env['model']}, {env['num_params']:,} "
        f"params), {ranks} on {env['device']}, batch {env['batch_size']} x "
        f"{env['seq_len']} {per}, {env['warmup']} warm-up + {env['steps']} measured steps",
        f"{'config':<24} {'ok':>3} {'step s':>8} {'min-max s':>13} {'/limit':>6} "
        f"{'fsdp2/':>6} {'tok/s/rk':>8} {'peak MiB':>8} {'/fsdp2':>6} {'AG/RS/AR':>10} "
        f"{'AG MiB':>7} "
        f"{'compile':>7} {'final loss':>9} {'pred s':>7}",
    ]
    lines.append("-" * len(lines[-1]))
    lines.extend(_table_line(row) for row in result["configs"])
    comm = result.get("comm_only")
    if comm:
        c = comm["collectives"]
        lines.append(
            f"comm-only: {comm['step_time_s_median']:.3f} s/step ({c['all_gather']} all-gathers, "
            f"{c['reduce_scatter']} reduce-scatters, {comm['bytes_per_step'] / _MIB:.1f} MiB "
            "per step, no compute)"
        )
    elif result.get("comm_only_error"):
        lines.append(f"comm-only: FAILED: {result['comm_only_error']}")
    elif tp > 1 or pp > 1:
        lines.append("comm-only: not measured with tensor or pipeline parallelism")
    elif env.get("moe"):
        lines.append("comm-only: not measured for a mixture of experts (experts on their own mesh)")
    a2a = [
        (row["name"], (row.get("collectives_profiled") or {}).get("all_to_all", 0))
        for row in result["configs"]
        if (row.get("collectives_profiled") or {}).get("all_to_all")
    ]
    if a2a:
        lines.append(
            "all-to-alls per step (expert parallelism, profiled): "
            + ", ".join(f"{name} {n}" for name, n in a2a)
        )
    for row in result["configs"]:
        if row.get("bubble_fraction") is not None:
            per_rank = ", ".join(f"{b:.2f}" for b in row["bubble_fraction_per_rank"])
            mems = ", ".join(
                "-" if m is None else f"{m / _MIB:.1f}" for m in row["peak_mem_bytes_per_rank"]
            )
            lines.append(
                f"pipeline bubble {row['name']}: {row['bubble_fraction']:.2f} (ranks: {per_rank}; "
                f"share of the pipeline step outside this rank's stage compute); "
                f"peak MiB per rank: {mems}"
            )
    phased = [
        (row["name"], row["phase_peak_mem_bytes"], row.get("predicted_peak_mem_bytes"))
        for row in result["configs"]
        if row.get("phase_peak_mem_bytes")
    ]
    if phased:
        lines.append(
            "peak MiB by phase above the step's start, forward+backward / optimizer"
            " (predicted forward+backward): "
            + ", ".join(
                f"{name} "
                + "/".join("-" if v is None else f"{v / _MIB:.1f}" for v in p.values())
                + ("" if pred is None else f" ({pred / _MIB:.1f})")
                for name, p, pred in phased
            )
        )
    resident = [
        row for row in result["configs"] if row.get("warmup_resident_mem_bytes") is not None
    ]
    if resident:
        lines.append(
            "peak MiB without what warm-up left resident beyond the optimizer state "
            "(compiled code, graphs, guards; see Method in docs/benchmarks.md) [that residency]: "
            + ", ".join(
                f"{row['name']} {_fmt_mib(row.get('peak_mem_bytes_beyond_warmup_resident'))}"
                + (
                    ""
                    if row.get("peak_beyond_resident_vs_fsdp2") is None
                    else f" ({row['peak_beyond_resident_vs_fsdp2']:.2f}x fsdp2)"
                )
                + f" [{_fmt_mib(row['warmup_resident_mem_bytes'])}]"
                for row in resident
            )
        )
    rounds = [row for row in result["configs"] if row.get("rounds")]
    if rounds:
        lines.append(
            f"{len(rounds[0]['rounds'])} rounds in alternating order (A B C, C B A, ...: "
            "slow drift of the machine hits every config alike); "
            "step s per round: "
            + ", ".join(
                f"{row['name']} "
                + "/".join(f"{r['step_time_s_median']:.3f}" for r in row["rounds"])
                for row in rounds
            )
        )
    if result.get("bound_s") is not None:
        lines.append(
            f"best any overlap could reach: max(limit, comm-only) = {result['bound_s']:.3f} s"
        )
    lines.append(
        "step s: median over measured steps (of every round) of the slowest rank; "
        "/limit: time / limit's time; "
        "fsdp2/: fsdp2's time / time (>1 = faster than fsdp2); AG MiB: bytes all-gathered per "
        "step (gathered size; comm_report for simplefsdp.compile, else the profiler); peak: "
        + env["memory_method"]
    )
    loads = env.get("load_avg_1m_before_each")
    if loads:
        lines.append(
            f"machine load (1-min load average before each config): {min(loads):.1f}-"
            f"{max(loads):.1f} on {env['device']}; other processes slow every measurement"
        )
    check = result.get("loss_check", {})
    references = check.get("references") or {}
    if len(references) > 1:
        lines.append(
            "losses checked within each numerics (matmul dtype, float8 or not: their "
            "rounding differs by more than the tolerance): "
            + ", ".join(f"{n} against {ref}" for n, ref in references.items())
            + f" (relative tolerance {check.get('rtol')})"
        )
    else:
        lines.append(
            f"losses checked against {check.get('reference')} "
            f"(relative tolerance {check.get('rtol')})"
        )
    for row in result["configs"]:
        for note in ([row["error"]] if row["error"] else []) + [
            n for n in row["notes"] if not row["ok"]
        ]:
            lines.append(f"  {row['name']}: {note}")
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    """Write ``result`` as indented JSON (infinities as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(result), indent=2) + "\n")


def _bar_colors(rows: list[dict]) -> list[str]:
    """Ours blue, peers grey, the bound green, wrong or failed rows red."""
    colors = []
    for row in rows:
        if not row["ok"]:
            colors.append("tab:red")
        elif row["name"] == "limit":
            colors.append("tab:green")
        elif row["name"].startswith("simplefsdp") and row["name"] != "simplefsdp-torch-passes":
            colors.append("tab:blue")
        else:
            colors.append("tab:gray")
    return colors


def write_png(result: dict, path: Path) -> bool:
    """Step time and peak memory per configuration as bars, with the limit drawn.

    Returns False when matplotlib is not installed (an optional dependency,
    ``pip install simplefsdp[bench]``); the caller tells the user.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["configs"] if r["step_time_s_median"] is not None]
    names = [r["name"] for r in rows]
    colors = _bar_colors(rows)
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows) + 4), 5))
    medians = [r["step_time_s_median"] for r in rows]
    errors = [
        [m - r["step_time_s_min"] for m, r in zip(medians, rows)],
        [r["step_time_s_max"] - m for m, r in zip(medians, rows)],
    ]
    ax_time.bar(names, medians, color=colors, yerr=errors, capsize=3)
    limit = _by_name(rows, "limit")
    if limit:
        ax_time.axhline(limit["step_time_s_median"], color="tab:green", ls="--", label="limit")
    if result.get("comm_only_s") is not None:
        ax_time.axhline(result["comm_only_s"], color="tab:orange", ls=":", label="comm-only")
    ax_time.set_ylabel("step time (s)")
    mems = [(r["peak_mem_bytes"] or 0) / _MIB for r in rows]
    ax_mem.bar(names, mems, color=colors)
    if limit and limit["peak_mem_bytes"]:
        ax_mem.axhline(limit["peak_mem_bytes"] / _MIB, color="tab:green", ls="--", label="limit")
    ax_mem.set_ylabel("peak memory per rank (MiB)")
    ax_mem.set_title(result["env"]["memory_method"], fontsize=8)
    ax_time.set_title("median step time, slowest rank; bars: min-max", fontsize=8)
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", labelrotation=60)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    env = result["env"]
    fig.suptitle(
        f"simplefsdp bench: {env['workload']} workload, {env['model']}, {env['world_size']} ranks "
        f"on {env['device']}, batch {env['batch_size']} x {env['seq_len']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
