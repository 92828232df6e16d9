"""``simplefsdp plan``'s predictions against ``simplefsdp bench`` on this machine, drift bracketed.

Run (2 CPU processes, gloo; about 10 minutes per workload with 3 rounds, on a
machine running nothing else)::

    python benchmarks/plan_validation.py --out /tmp/pv [--workloads compute,comm,memory]
        [--configs fsdp2,simplefsdp-auto] [--rounds 3] [--calibrate-rounds 3]
    python benchmarks/plan_validation.py --out /tmp/pv --workloads long --cp 2
    python benchmarks/plan_validation.py --out /tmp/pv --workloads moe --ep 2

Why bracketed: on a small shared machine the speed drifts by more than the
model's error (on a 2-core CPU machine the same configuration took
0.56 s in one launch and 0.90 s in another minutes later; docs/scale.md). A
profile calibrated once and a bench run minutes later measure two different
machines. So this script alternates them: a calibration (``simplefsdp plan
--calibrate``), one configuration's bench run (``simplefsdp bench --configs
C``, in fresh processes), the next calibration, and so on, in alternating
order over rounds (A B, B A, ...). Each run is predicted with a profile made
from the rounds of the two calibrations around it (``median_raw`` over both,
then ``profile_from``, as ``--calibrate`` makes one), and also with the one
before it alone, to show what the bracketing changes.

Every workload of ``simplefsdp bench`` is predicted by its model's plan
method: the traced plan for dense models (``long`` with ``--cp``, forwarded
to the bench), the analytic plan for models with routed experts (``moe``
with ``--ep``), with the workload's model overrides.

Measured: the run's median step time and its peak without warm-up residency
(``peak_mem_bytes_beyond_warmup_resident``: the number comparable with a
prediction, which does not model Dynamo's and Inductor's host-side residency;
Note: [Warm-up residency] in ``simplefsdp/bench/measure.py``). Predicted: the
plan's ``step_s`` and ``peak_bytes`` for the bench's model, batch and
sequence, ``--dtype fp32 --ac none``, ``--engine fsdp2`` or ``simplefsdp``.

Writes ``validation.json`` (every run, both predictions, the load average)
and prints a markdown table per configuration: medians over rounds, and each
round's error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = {"fsdp2": "fsdp2", "simplefsdp-auto": "simplefsdp"}
MIB = 2**20


def _run(cmd: list[str], log: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def calibrate(out: Path, rounds: int) -> dict:
    """One ``simplefsdp plan --calibrate``; the profile file's contents."""
    rc = _run(
        ["simplefsdp", "plan", "--calibrate", "--calibrate-rounds", str(rounds), "--out", str(out)],
        out.with_suffix(".log"),
    )
    if rc != 0:
        raise RuntimeError(f"calibration failed (exit {rc}); see {out.with_suffix('.log')}")
    data = json.loads((out / "calibrated-cpu-gloo.json").read_text())
    data["load_avg_1m"] = os.getloadavg()[0]
    return data


def bench(workload: str, config: str, out: Path, extra: list[str]) -> dict:
    """One ``simplefsdp bench`` of one configuration; its row and environment."""
    cmd = ["simplefsdp", "bench", "--workload", workload, "--configs", config]
    rc = _run([*cmd, "--out", str(out), "--no-png", *extra], out.with_suffix(".log"))
    path = out / "bench.json"
    if not path.exists():
        raise RuntimeError(f"bench failed (exit {rc}); see {out.with_suffix('.log')}")
    data = json.loads(path.read_text())
    (row,) = [r for r in data["configs"] if r["name"] == config]
    return {"env": data["env"], "row": row}


def profile(calibrations: list[dict]):
    """A profile from every round of ``calibrations`` (their medians)."""
    from simplefsdp.plan.calibrate import median_raw, profile_from

    rounds = [r for cal in calibrations for r in cal["raw"]["rounds"]]
    return profile_from(median_raw(rounds), "calibrated-cpu-gloo", "cpu")


def predict_run(env: dict, config: str, hw, cp: int = 1) -> tuple[float, int]:
    """The plan's step time and peak bytes for the bench's job under ``hw``
    (``cp``: the bench's context-parallel degree, which its record lacks)."""
    from simplefsdp.models.registry import resolve_flavor
    from simplefsdp.plan.predict import Layout, predict

    spec, model = resolve_flavor(env["model"], **(env.get("model_overrides") or {}))
    if env["seq_len"] > model.max_seq_len:  # as the bench's workers build it
        spec, model = resolve_flavor(
            env["model"], **(env.get("model_overrides") or {}), max_seq_len=env["seq_len"]
        )
    if spec.plan_method == "analytic":
        from simplefsdp.plan.analytic import ExpertLayout

        layout = ExpertLayout(
            gpus=env["world_size"],
            batch=env["batch_size"],
            seq=env["seq_len"],
            ep=env.get("ep") or 1,
            cp=cp,
            ac="none",
            engine=ENGINES[config],
        )
    else:
        layout = Layout(
            gpus=env["world_size"],
            batch=env["batch_size"],
            seq=env["seq_len"],
            cp=cp,
            ac="none",
            bucketing="auto",
            engine=ENGINES[config],
            dtype="fp32",
        )
    pred = predict(spec, model, layout, hw)
    return pred.step_s, pred.peak_bytes


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def measure_workload(workload: str, ns, out: Path) -> list[dict]:
    """Calibration, run, calibration, run, ... over ``ns.rounds`` rounds."""
    extra = ["--steps", str(ns.steps)] if ns.steps else []
    extra += ["--cp", str(ns.cp), "--ep", str(ns.ep)]
    cals = [calibrate(out / "cal0", ns.calibrate_rounds)]
    runs = []
    for r in range(ns.rounds):
        order = ns.configs if r % 2 == 0 else ns.configs[::-1]
        for config in order:
            load = os.getloadavg()[0]
            result = bench(workload, config, out / f"r{r}_{config}", extra)
            cals.append(calibrate(out / f"cal{len(cals)}", ns.calibrate_rounds))
            runs.append(
                {"workload": workload, "config": config, "round": r, "cal": len(cals) - 2}
                | {"load_avg_1m_before": load, **result}
            )
    for run in runs:
        before, after = cals[run["cal"]], cals[run["cal"] + 1]
        row = run["row"]
        step, peak = predict_run(run["env"], run["config"], profile([before, after]), ns.cp)
        step_before, _ = predict_run(run["env"], run["config"], profile([before]), ns.cp)
        run.update(
            measured_step_s=row["step_time_s_median"],
            measured_peak_bytes=row["peak_mem_bytes_beyond_warmup_resident"],
            predicted_step_s=step,
            predicted_step_s_before_only=step_before,
            predicted_peak_bytes=peak,
            cal_load_avg_1m=[before["load_avg_1m"], after["load_avg_1m"]],
        )
        run.pop("row")
        run["ok"] = bool(row["ok"])
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """Per (workload, config): medians over rounds and each round's errors."""
    keys = list(dict.fromkeys((r["workload"], r["config"]) for r in runs))
    rows = []
    for workload, config in keys:
        mine = [r for r in runs if (r["workload"], r["config"]) == (workload, config) and r["ok"]]
        if not mine:
            rows.append({"workload": workload, "config": config, "ok": False})
            continue

        def med(key: str, mine=mine):
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.median(values) if values else None

        step, pred = med("measured_step_s"), med("predicted_step_s")
        peak, pred_peak = med("measured_peak_bytes"), med("predicted_peak_bytes")
        rows.append(
            {
                "workload": workload,
                "config": config,
                "ok": True,
                "measured_step_s": step,
                "predicted_step_s": pred,
                "step_error": _error(pred, step),
                "step_error_per_round": [
                    _error(r["predicted_step_s"], r["measured_step_s"]) for r in mine
                ],
                "step_error_per_round_before_only": [
                    _error(r["predicted_step_s_before_only"], r["measured_step_s"]) for r in mine
                ],
                "measured_peak_bytes": peak,
                "predicted_peak_bytes": pred_peak,
                "peak_error": _error(pred_peak, peak),
            }
        )
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def format_table(rows: list[dict]) -> str:
    lines = [
        "| workload | config | measured s | predicted s | error | per round (bracketed) "
        "| per round (before only) | measured MiB | predicted MiB | error |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for row in rows:
        if not row["ok"]:
            lines.append(f"| {row['workload']} | {row['config']} | failed |" + " |" * 7)
            continue
        peak, pred_peak = row["measured_peak_bytes"], row["predicted_peak_bytes"]
        lines.append(
            f"| {row['workload']} | {row['config']} | {row['measured_step_s']:.3f} "
            f"| {row['predicted_step_s']:.3f} | {_pct(row['step_error'])} "
            f"| {' '.join(_pct(e) for e in row['step_error_per_round'])} "
            f"| {' '.join(_pct(e) for e in row['step_error_per_round_before_only'])} "
            f"| {'-' if peak is None else f'{peak / MIB:.1f}'} | {pred_peak / MIB:.1f} "
            f"| {_pct(row['peak_error'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workloads", default="compute,comm,memory")
    p.add_argument("--configs", default="fsdp2,simplefsdp-auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calibrate-rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="measured steps per bench run")
    p.add_argument("--cp", type=int, default=1, help="context parallel degree (workload long)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel degree (workload moe)")
    ns = p.parse_args(argv)
    ns.configs = ns.configs.split(",")
    unknown = [c for c in ns.configs if c not in ENGINES]
    if unknown:
        p.error(f"unknown --configs {unknown}; valid: {sorted(ENGINES)}")
    if ns.cp < 1 or ns.ep < 1:
        p.error(f"--cp and --ep must be >= 1, got {ns.cp}, {ns.ep}")
    if ns.rounds < 1 or ns.calibrate_rounds < 1:
        p.error(
            f"--rounds and --calibrate-rounds must be >= 1, got {ns.rounds}, {ns.calibrate_rounds}"
        )
    start = time.perf_counter()
    runs = []
    for workload in ns.workloads.split(","):
        out = ns.out / workload
        out.mkdir(parents=True, exist_ok=True)
        runs += measure_workload(workload, ns, out)
    rows = summarize(runs)
    result = {"runs": runs, "rows": rows, "wall_s": time.perf_counter() - start}
    (ns.out / "validation.json").write_text(json.dumps(result, indent=2, default=str))
    print(format_table(rows))
    print(f"wrote {ns.out / 'validation.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
