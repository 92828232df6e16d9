"""``simplefsdp bench`` end to end on a tiny model, and its report logic.

The end-to-end run uses a 1-layer, dim-64 Llama on 2 CPU processes (gloo),
sequence 32, 1 warm-up + 2 measured steps and only eager configurations, so
it takes well under 90 s. Nothing here asserts a timing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runs import descendants
from simplefsdp.bench import cli
from simplefsdp.bench.configs import (
    CONFIGS,
    FLOAT8_CONFIGS,
    TEST_CONFIGS,
    get_workload,
    resolve_configs,
)
from simplefsdp.bench.measure import phase_peaks
from simplefsdp.bench.report import (
    add_ratios,
    check_losses,
    failed_row,
    format_table,
    merge_ranks,
    write_png,
)

TINY_MODEL = {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
TINY = [
    "--workload", "comm", "--steps", "2", "--warmup", "1", "--seq-len", "32",
    *(arg for k, v in TINY_MODEL.items() for arg in ("--model-override", f"{k}={v}")),
    "--lr", "3e-3", "--timeout", "240",
]  # fmt: skip
E2E_CONFIGS = "fsdp2,simplefsdp-uncompiled,simplefsdp-eager,test-wrong-lr"
ROW_TYPES = {
    "name": str,
    "step_time_s_median": float,
    "step_time_s_min": float,
    "step_time_s_max": float,
    "tokens_per_s_per_rank": float,
    "peak_mem_bytes": int,
    "num_all_gathers": int,
    "num_reduce_scatters": int,
    "num_all_reduces": int,
    "compile_s": float,
    "final_loss": float,
    "ok": bool,
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main([*TINY, "--configs", E2E_CONFIGS, "--out", str(out)])
    return rc, out, stdout.getvalue()


@pytest.mark.slow
def test_bench_json_shape(bench_run):
    rc, out, _ = bench_run
    result = json.loads((out / "bench.json").read_text())
    assert {"env", "configs", "comm_only_s"} <= set(result)
    env = result["env"]
    for key in ("torch_version", "device", "world_size", "model", "batch_size", "seq_len"):
        assert key in env, key
    assert env["world_size"] == 2 and env["seq_len"] == 32 and env["batch_size"] == 1
    assert [r["name"] for r in result["configs"]] == E2E_CONFIGS.split(",")
    for row in result["configs"]:
        assert row["error"] is None, row["error"]
        for key, typ in ROW_TYPES.items():
            assert isinstance(row[key], typ), (row["name"], key, row[key])
        assert row["step_time_s_min"] <= row["step_time_s_median"] <= row["step_time_s_max"]
        phases = row["phase_peak_mem_bytes"]
        assert list(phases) == ["forward_backward", "optimizer"], phases
        assert all(isinstance(v, int) for v in phases.values()), phases
        resident = row["warmup_resident_mem_bytes"]
        assert isinstance(resident, int), (row["name"], resident)
        assert isinstance(row["peak_mem_bytes_beyond_warmup_resident"], int), row["name"]
    assert isinstance(result["comm_only_s"], float) and result["comm_only_s"] > 0
    assert result["comm_only_error"] is None
    # The wrong configuration makes the run fail as a whole.
    assert rc == 1


@pytest.mark.slow
def test_bench_collective_counts(bench_run):
    _, out, _ = bench_run
    result = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    # FSDP2 with the embedding, 1 block and the norm + output as groups: all
    # three gathered in forward, the embedding and the block again in
    # backward (resharded after forward); one reduce-scatter each.
    # comm-only issues the same.
    fsdp2 = rows["fsdp2"]
    assert (fsdp2["num_all_gathers"], fsdp2["num_reduce_scatters"]) == (5, 3)
    assert fsdp2["num_all_reduces"] == 0
    comm = result["comm_only"]["collectives"]
    assert (comm["all_gather"], comm["reduce_scatter"]) == (5, 3)
    # simplefsdp uncompiled: one collective per parameter (9 in the block, 3 in the root).
    uncompiled = rows["simplefsdp-uncompiled"]
    assert (uncompiled["num_all_gathers"], uncompiled["num_reduce_scatters"]) == (12, 12)
    assert uncompiled["collectives_source"] == "profiler"
    # The eager executor, one bucket per block: the embedding, the block and
    # the norm + output are gathered in forward, the first two again in
    # backward (the root bucket, last to finish forward, is kept); one
    # reduction each.
    eager = rows["simplefsdp-eager"]
    assert (eager["num_all_gathers"], eager["num_reduce_scatters"]) == (5, 3)


@pytest.mark.slow
def test_bench_loss_check_flags_wrong_config(bench_run):
    _, out, stdout = bench_run
    result = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert result["loss_check"]["reference"] == "fsdp2"
    for name in ("fsdp2", "simplefsdp-uncompiled", "simplefsdp-eager"):
        assert rows[name]["ok"], name
        assert rows[name]["final_loss"] == pytest.approx(rows["fsdp2"]["final_loss"], rel=1e-4)
    assert rows["fsdp2"]["first_loss"] == pytest.approx(rows["test-wrong-lr"]["first_loss"])
    wrong = rows["test-wrong-lr"]
    assert wrong["ok"] is False
    assert any("final loss" in note and "disagrees" in note for note in wrong["notes"])
    assert "test-wrong-lr" in stdout and "NO" in stdout


@pytest.mark.slow
def test_bench_writes_table_and_png(bench_run):
    _, out, stdout = bench_run
    for name in E2E_CONFIGS.split(","):
        assert name in stdout
    assert "comm-only:" in stdout
    assert "peak MiB by phase above the step's start" in stdout
    assert "peak MiB without what warm-up left resident" in stdout
    assert (out / "bench.txt").read_text().strip() in stdout
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- no processes


def test_bad_names_raise_value_error_listing_choices(capsys):
    with pytest.raises(ValueError, match="valid configurations: limit, ddp, fsdp2"):
        resolve_configs("fsdp2,fsdp3")
    with pytest.raises(ValueError, match="valid workloads: compute, comm, memory"):
        get_workload("network")
    assert cli.main(["--configs", "nope", "--out", "unused"]) == 2
    assert "unknown configuration 'nope'" in capsys.readouterr().err
    assert cli.main(["--workload", "nope", "--out", "unused"]) == 2
    assert "valid workloads" in capsys.readouterr().err


def test_default_configs_are_public_and_ordered():
    assert [c.name for c in resolve_configs(None)] == list(CONFIGS)
    assert not set(TEST_CONFIGS) & set(CONFIGS)
    assert [c.name for c in resolve_configs("fsdp2, limit,fsdp2")] == ["fsdp2", "limit"]


def _row(name: str, first: float, final: float, time_s: float, mem: int) -> dict:
    config = {**CONFIGS, **FLOAT8_CONFIGS, **TEST_CONFIGS}[name]
    row = failed_row(config, "")
    row.update(
        ok=True, error=None, first_loss=first, final_loss=final, step_time_s_median=time_s,
        step_time_s_min=time_s, step_time_s_max=time_s, peak_mem_bytes=mem,
        tokens_per_s_per_rank=100 / time_s, num_all_gathers=1, num_reduce_scatters=1,
        num_all_reduces=0, compile_s=1.0,
    )  # fmt: skip
    return row


def test_injected_loss_perturbation_is_flagged():
    rows = [
        _row("fsdp2", 6.0, 5.0, 2.0, 400),
        _row("limit", 6.0, 4.9, 1.0, 800),  # replicas diverge: only the first loss counts
        _row("simplefsdp-manual", 6.0, 5.0 * (1 + 5e-4), 1.5, 300),
        _row("simplefsdp-auto", 6.0, 5.0 * 1.01, 1.2, 300),  # perturbed final loss
    ]
    check = check_losses(rows, rtol=2e-3)
    assert check["reference"] == "fsdp2"
    assert [r["ok"] for r in rows] == [True, True, True, False]
    rows[1]["first_loss"] = 6.5
    rows[1]["ok"] = True
    check_losses(rows, rtol=2e-3)
    assert rows[1]["ok"] is False


def test_ratios_table_and_png_fallback(tmp_path, monkeypatch):
    rows = [_row("fsdp2", 6.0, 5.0, 2.0, 400), _row("limit", 6.0, 4.9, 1.0, 800)]
    rows.append(failed_row(CONFIGS["ddp"], "exit code 1: boom"))
    add_ratios(rows)
    assert rows[0]["step_time_vs_limit"] == pytest.approx(2.0)
    assert rows[1]["speedup_vs_fsdp2"] == pytest.approx(2.0)
    assert rows[1]["peak_mem_vs_fsdp2"] == pytest.approx(2.0)
    assert rows[2]["step_time_vs_limit"] is None
    env = {
        "workload": "compute", "model": "debug", "num_params": 1, "world_size": 2,
        "device": "cpu", "batch_size": 4, "seq_len": 256, "warmup": 1, "steps": 2,
        "memory_method": "peak RSS",
    }  # fmt: skip
    result = {"env": env, "configs": rows, "comm_only_s": 0.5, "bound_s": 1.0}
    table = format_table(result)
    assert "ddp: exit code 1: boom" in table and "max(limit, comm-only) = 1.000" in table
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_png(result, tmp_path / "bench.png") is False
    assert not (tmp_path / "bench.png").exists()


def test_failed_comm_only_run_is_reported_and_fails_the_run(tmp_path, monkeypatch, capsys):
    def fake_run_one(config, spec, spec_path, raw_dir, on_phase=None):
        if config.engine == "comm":
            return None, "exit code 1: boom"
        return _row(config.name, 6.0, 5.0, 1.0, 400), None

    monkeypatch.setattr(cli, "_run_one", fake_run_one)
    rc = cli.main([*TINY, "--configs", "fsdp2", "--out", str(tmp_path), "--no-png"])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 1
    assert result["comm_only_error"] == "exit code 1: boom" and result["comm_only_s"] is None
    assert "comm-only: FAILED: exit code 1: boom" in capsys.readouterr().out


class _FakeProbe:
    """A probe over a scripted memory level: ``level`` above the baseline."""

    def __init__(self) -> None:
        self.level = self.peak = 100
        self.start_bytes = None
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        self.peak, self.start_bytes = self.level, self.level

    def alloc(self, n: int) -> None:
        self.level += n
        self.peak = max(self.peak, self.level)

    def peak_bytes(self) -> int:
        return self.peak


def test_phase_peaks_are_above_the_step_start():
    probe = _FakeProbe()

    def forward_backward():  # 50 of activations, freed; 30 of gradients kept
        probe.alloc(80)
        probe.alloc(-50)

    def optimizer():  # a 30 temporary while the gradients live, then both freed
        probe.alloc(30)
        probe.alloc(-60)

    peaks = phase_peaks(probe, {"forward_backward": forward_backward, "optimizer": optimizer})
    assert peaks == {"forward_backward": 80, "optimizer": 60}
    assert probe.resets == 2


def test_phase_peaks_unknown_stays_unknown():
    probe = _FakeProbe()
    probe.peak_bytes = lambda: None  # type: ignore[method-assign]
    assert phase_peaks(probe, {"a": lambda: None}) == {"a": None}


def test_phase_peaks_with_the_cpu_probe():
    """The real probe on this process: a 64 MiB phase and an 8 MiB one."""
    import torch

    from simplefsdp.engines import MemoryProbe
    from simplefsdp.engines.memory import lower_mmap_threshold

    if not lower_mmap_threshold():
        pytest.skip("no glibc mallopt: RSS does not follow freed tensors")
    probe = MemoryProbe("cpu")
    mib = 1024 * 1024

    def touch(n_mib: int) -> None:
        t = torch.ones(n_mib * mib // 4)
        del t

    peaks = phase_peaks(probe, {"big": lambda: touch(64), "small": lambda: touch(8)})
    assert peaks["big"] is not None and peaks["small"] is not None
    assert peaks["big"] >= 60 * mib
    assert peaks["small"] < 32 * mib


def _raw_rank(rank: int, before: int, start: int, state_before: int, state: int, peak: int) -> dict:
    """A worker's raw result with the memory readings given, everything else fixed."""
    return {
        "rank": rank, "warmup_times_s": [3.0], "step_times_s": [1.0, 1.0], "losses": [5.0, 4.0],
        "peak_mem_bytes": peak, "mem_at_measure_start_bytes": start,
        "mem_before_warmup_bytes": before, "state_mem_before_warmup_bytes": state_before,
        "state_mem_bytes": state, "phase_peak_mem_bytes": None, "mem_method": "rss",
        "collectives": {}, "collectives_source": "profiler", "collectives_profiled": {},
        "predicted": None, "predicted_step_time_s": None, "predicted_peak_mem_bytes": None,
        "num_params": 10, "notes": [],
    }  # fmt: skip


def test_warmup_residency_is_the_growth_beyond_the_optimizer_state():
    """Note: [Warm-up residency]: level growth over warm-up minus state growth."""
    workload = get_workload("comm")
    m = 1024 * 1024  # in MiB, as the table prints them
    # rank 0: +100 of level, +40 of state (the moments) -> 60 resident; peak 500
    # rank 1: +90 of level, +40 of state -> 50 resident; peak 520
    ranks = [
        _raw_rank(0, 200 * m, 300 * m, 20 * m, 60 * m, 500 * m),
        _raw_rank(1, 210 * m, 300 * m, 20 * m, 60 * m, 520 * m),
    ]
    row = merge_ranks(CONFIGS["simplefsdp-auto"], ranks, workload)
    assert row["warmup_resident_mem_bytes"] == 60 * m
    assert row["peak_mem_bytes_beyond_warmup_resident"] == 470 * m  # max(500 - 60, 520 - 50)
    fsdp2 = merge_ranks(
        CONFIGS["fsdp2"], [_raw_rank(0, 200 * m, 240 * m, 20 * m, 60 * m, 400 * m)], workload
    )
    assert fsdp2["warmup_resident_mem_bytes"] == 0
    rows = [fsdp2, row]
    add_ratios(rows)
    assert row["peak_beyond_resident_vs_fsdp2"] == pytest.approx(470 / 400)
    env = {
        "workload": "comm", "model": "debug", "num_params": 10, "world_size": 2,
        "device": "cpu", "batch_size": 1, "seq_len": 128, "warmup": 1, "steps": 2,
        "memory_method": "peak RSS",
    }  # fmt: skip
    table = format_table({"env": env, "configs": rows, "comm_only_s": None})
    assert "fsdp2 400.0 (1.00x fsdp2) [0.0], simplefsdp-auto 470.0 (1.18x fsdp2) [60.0]" in table
    assert "Note: [" not in table  # words, not references to the source
    # An older worker's result (no readings before warm-up) stays unknown.
    old = _raw_rank(0, 200, 300, 20, 60, 500)
    del old["mem_before_warmup_bytes"]
    assert merge_ranks(CONFIGS["fsdp2"], [old], workload)["warmup_resident_mem_bytes"] is None


_IMPORTS_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from simplefsdp.bench import worker
from simplefsdp.bench.configs import CONFIGS, BenchSpec, get_workload
if sys.argv[1] == "import":
    worker._import_engine_code()
overrides = json.loads(sys.argv[2])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = worker.Layout().build("cpu", 1)
spec = BenchSpec(get_workload("comm", model_overrides=overrides), nproc=1)
before = set(sys.modules)
for config in CONFIGS.values():
    if worker.get_engine(config.engine, bench=True).trains:
        model = worker.build_model(spec.workload, 0)
        worker._parallelize(config, spec, model, mesh, torch.device("cpu"))
new = sorted(m for m in set(sys.modules) - before
             if m.startswith("simplefsdp.") and not m.startswith("simplefsdp.models"))
dist.destroy_process_group()
print(json.dumps(new))
"""


@pytest.mark.parametrize("imported", [True, False])
def test_engine_code_is_imported_before_the_memory_baseline(imported):
    # Code is resident once per process: no configuration may be charged for
    # the library modules it imports first (Note: [Warm-up residency]).
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _IMPORTS_SCRIPT,
            "import" if imported else "skip",
            json.dumps(TINY_MODEL),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    new = json.loads(run.stdout.strip().splitlines()[-1])
    if imported:
        assert new == []
    else:  # without it the compiled configurations would load these after the baseline
        assert "simplefsdp.compiler.backend" in new


class _CountingProbe:
    """A memory probe whose level is 1000 x the number of resets so far."""

    kind, reset_ok, baseline_bytes = "fake", True, 0

    def __init__(self, device):
        self.resets, self.start_bytes = 0, None

    def reset(self):
        self.resets += 1
        self.start_bytes = 1000 * self.resets

    def level_bytes(self):
        return 1000 * self.resets

    def peak_bytes(self):
        return 1000 * self.resets + 1


def _measure_start_rank():
    import torch

    from simplefsdp.bench import worker
    from simplefsdp.bench.configs import BenchSpec, get_workload

    worker.MemoryProbe = _CountingProbe
    mesh = worker.Layout().build("cpu", 1)
    workload = get_workload("comm", model_overrides=TINY_MODEL, steps=2, warmup=1, seq_len=32)
    spec = BenchSpec(workload, nproc=1)
    flat = worker.build_batches(spec, 0, 1, 4)
    config = worker.lookup_config("fsdp2")
    return worker._run_training(config, spec, mesh, torch.device("cpu"), [[b] for b in flat])


def test_measure_start_is_read_when_the_measured_steps_start():
    # The phase peaks after the measured steps reset the probe twice more;
    # the level the measured steps started at must be the first reset's.
    from simplefsdp.testing import run_distributed

    (result,) = run_distributed(_measure_start_rank, 1)
    assert result["mem_at_measure_start_bytes"] == 1000
    assert result["peak_mem_bytes"] == 1001
    assert result["mem_before_warmup_bytes"] == 0


def test_rounds_alternate_the_order_and_pool_the_steps(tmp_path, monkeypatch, capsys):
    launched = []
    times = {"fsdp2": [[5.0, 6.0, 7.0], [1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]}
    times["simplefsdp-auto"] = [[2.0, 2.0, 2.0], [3.0, 3.0, 3.0], [1.0, 1.0, 1.0]]

    def fake_run_one(config, spec, spec_path, raw_dir, on_phase=None):
        if config.engine == "comm":
            return None, "skipped"
        launched.append((raw_dir.name, config.name))
        steps = times[config.name][int(raw_dir.name.removeprefix("round")) - 1]
        row = _row(config.name, 6.0, 5.0, statistics.median(steps), 100 * len(launched))
        row.update(step_times_s=steps, step_time_s_min=min(steps), step_time_s_max=max(steps))
        row["tokens_per_s_per_rank"] = 100 / row["step_time_s_median"]
        return row, None

    monkeypatch.setattr(cli, "_run_one", fake_run_one)
    argv = [*TINY, "--configs", "fsdp2,simplefsdp-auto", "--rounds", "3", "--out", str(tmp_path)]
    cli.main([*argv, "--no-png"])
    assert launched == [
        ("round1", "fsdp2"), ("round1", "simplefsdp-auto"),
        ("round2", "simplefsdp-auto"), ("round2", "fsdp2"),
        ("round3", "fsdp2"), ("round3", "simplefsdp-auto"),
    ]  # fmt: skip
    result = json.loads((tmp_path / "bench.json").read_text())
    fsdp2, auto = result["configs"]
    # the median of all nine steps, not of the three round medians (6, 2, 4)
    assert fsdp2["step_time_s_median"] == 4.0
    assert (fsdp2["step_time_s_min"], fsdp2["step_time_s_max"]) == (1.0, 7.0)
    assert fsdp2["tokens_per_s_per_rank"] == pytest.approx(100 / 4.0)
    assert [r["step_time_s_median"] for r in fsdp2["rounds"]] == [6.0, 2.0, 4.0]
    # memory and the rest from the median round: fsdp2's third, auto's first
    assert (fsdp2["peak_mem_bytes"], auto["peak_mem_bytes"]) == (500, 200)
    assert auto["step_time_s_median"] == 2.0 and auto["speedup_vs_fsdp2"] == pytest.approx(2.0)
    assert result["env"]["rounds"] == 3
    assert "3 rounds in alternating order" in capsys.readouterr().out


def test_a_failed_round_is_the_row_and_is_not_run_again(tmp_path, monkeypatch):
    launched = []

    def fake_run_one(config, spec, spec_path, raw_dir, on_phase=None):
        if config.engine == "comm":
            return None, "skipped"
        launched.append(config.name)
        if config.name == "simplefsdp-auto":
            return failed_row(config, "exit code 1: boom"), "exit code 1: boom"
        return _row(config.name, 6.0, 5.0, 1.0, 100) | {"step_times_s": [1.0]}, None

    monkeypatch.setattr(cli, "_run_one", fake_run_one)
    argv = [*TINY, "--configs", "fsdp2,simplefsdp-auto", "--rounds", "2", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-png"]) == 1
    assert launched == ["fsdp2", "simplefsdp-auto", "fsdp2"]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["configs"][1]["error"] == "exit code 1: boom"
    assert not result["configs"][1]["ok"]


def test_bad_rounds_are_a_usage_error(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["--rounds", "0", "--out", str(out)]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()  # refused before anything is written


@pytest.mark.slow
@pytest.mark.heavy  # half a minute on 2 CPU cores; run with -m heavy
def test_rounds_end_to_end(tmp_path):
    """Two real rounds of one eager configuration: each round's raw results in
    its own folder, the row pooling both rounds' measured steps."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main([*TINY, "--configs", "fsdp2", "--rounds", "2", "--out", str(tmp_path)])
    assert rc == 0, stdout.getvalue()
    (row,) = json.loads((tmp_path / "bench.json").read_text())["configs"]
    rounds = [tmp_path / "raw" / f"round{r}" for r in (1, 2)]
    assert [len(list(d.glob("fsdp2.rank*.json"))) for d in rounds] == [2, 2]
    assert len(row["rounds"]) == 2 and len(row["step_times_s"]) == 2 * 2  # 2 measured steps each
    assert row["step_time_s_median"] == statistics.median(row["step_times_s"])
    assert "(round 2/2)" in stdout.getvalue()


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_command_stops_its_workers(tmp_path, sig):
    """Note: [Stopping a bench]: a signal sent to the command alone (not its
    process group) stops torchrun's agent and the workers too, with one line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "simplefsdp.cli", "bench", *TINY, "--steps", "100000",
         "--configs", "fsdp2", "--out", str(tmp_path), "--no-png"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(below := descendants(proc.pid)) < 3:  # the agent and 2 workers
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}; its workers were stopped" in err
    assert "Traceback" not in out + err
    assert not any(_alive(pid) for pid in below), [p for p in below if _alive(p)]
    assert not (tmp_path / "bench.json").exists()


# --- float8 configurations, loss groups, all-gather bytes, the MoE workload ----------


def test_float8_configs_are_named_not_default(monkeypatch):
    from simplefsdp.bench import configs

    names = [c.name for c in resolve_configs("fsdp2-float8,simplefsdp-float8")]
    assert names == ["fsdp2-float8", "simplefsdp-float8"]
    assert all(c.float8 for c in resolve_configs(names))
    assert not any(c.float8 for c in resolve_configs(None))  # "all" needs no torchao
    with pytest.raises(
        ValueError, match="'simplefsdp-float8' \\(float8\\) does not run with --tp 2"
    ):
        resolve_configs("simplefsdp-float8", tp=2)
    monkeypatch.setattr(configs, "_torchao_missing", lambda: True)
    with pytest.raises(ValueError, match=r"'fsdp2-float8' needs torchao: pip install -e"):
        resolve_configs("fsdp2-float8")
    with pytest.raises(ValueError, match="float8 runs with engines simplefsdp, fsdp2, not 'ddp'"):
        configs.BenchConfig("x", "ddp", True, "", float8=True)


def test_numerics_and_mixed_precision_of_the_engine_spec():
    f8 = resolve_configs("simplefsdp-float8")[0]
    assert f8.numerics() == "float32+float8"
    assert f8.numerics("bfloat16") == "bfloat16+float8"
    assert CONFIGS["ddp"].numerics("bfloat16") == "float32"  # ddp has no mixed precision
    spec = CONFIGS["fsdp2"].engine_spec(1, "bfloat16")
    assert (spec.param_dtype, spec.reduce_dtype) == ("bfloat16", "float32")
    assert CONFIGS["ddp"].engine_spec(1, "bfloat16").param_dtype is None


def test_float8_losses_are_checked_against_float8():
    rows = [
        _row("fsdp2", 6.0, 5.0, 2.0, 400),
        _row("fsdp2-float8", 6.02, 5.05, 1.5, 300),  # 1% off float32: not a failure
        _row("simplefsdp-float8", 6.02, 5.05 * (1 + 5e-4), 1.2, 300),
        _row("simplefsdp-auto", 6.0, 5.0, 1.2, 300),
    ]
    check = check_losses(rows, rtol=2e-3)
    assert check["references"] == {"float32": "fsdp2", "float32+float8": "fsdp2-float8"}
    assert [r["ok"] for r in rows] == [True, True, True, True]
    rows[2]["final_loss"] = 5.0  # agrees with float32, not with the float8 reference
    check_losses(rows, rtol=2e-3)
    assert rows[2]["ok"] is False
    assert "disagrees with fsdp2-float8" in rows[2]["notes"][-1]
    env = {
        "workload": "comm", "model": "debug", "num_params": 1, "world_size": 2,
        "device": "cpu", "batch_size": 1, "seq_len": 32, "warmup": 1, "steps": 2,
        "memory_method": "peak RSS", "param_dtype": "bfloat16",
    }  # fmt: skip
    rows[0]["all_gather_bytes"], rows[1]["all_gather_bytes"] = 2 * 1024 * 1024, 1024 * 1024
    table = format_table({"env": env, "configs": rows, "comm_only_s": None, "loss_check": check})
    assert "AG MiB" in table and "bfloat16 mixed precision" in table
    assert "float32 against fsdp2, float32+float8 against fsdp2-float8" in table
    assert "Note: [" not in table
    fsdp2_line = next(line for line in table.splitlines() if line.startswith("fsdp2 "))
    f8_line = next(line for line in table.splitlines() if line.startswith("fsdp2-float8 "))
    assert " 2.00 " in fsdp2_line and " 1.00 " in f8_line


def test_collective_bytes_from_the_profiler_events():
    from types import SimpleNamespace

    from simplefsdp.bench.measure import _event_bytes

    def event(shapes, dtypes):
        return SimpleNamespace(input_shapes=shapes, input_dtypes=dtypes)

    # all-gather (output, input): the gathered size counts
    assert _event_bytes(event([[10], [5], [], []], ["c10::BFloat16"] * 2 + ["", ""])) == 20
    assert _event_bytes(event([[8], [4]], ["unsigned char", "unsigned char"])) == 8
    # reduce-scatter (output, input): the unsharded input counts
    assert _event_bytes(event([[4], [8]], ["float", "float"])) == 32
    assert _event_bytes(event([[], []], ["TensorList", ""])) is None  # all-reduce lists
    assert _event_bytes(SimpleNamespace()) is None  # an older profiler without dtypes


def test_state_bytes_reads_through_wrapper_subclasses():
    import torch

    from simplefsdp.bench.measure import state_bytes

    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False)),
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
    )
    assert type(model[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert state_bytes(model, opt) == 16 * 32 * 4


def test_moe_workload_configs_and_layout_errors(capsys):
    from simplefsdp.bench.moe import MOE_BENCH_CONFIGS

    assert [c.name for c in resolve_configs(None, moe=True)] == list(MOE_BENCH_CONFIGS)
    assert [c.name for c in resolve_configs("fsdp2,simplefsdp-auto", moe=True)] == [
        "fsdp2",
        "simplefsdp-auto",
    ]
    cases = [
        (["--configs", "simplefsdp-eager"], "'simplefsdp-eager' does not run a mixture-of-experts"),
        (["--ep", "3"], "--ep 3 does not divide the 2 ranks of dp_shard 2"),
        (["--ep", "4", "--nproc", "2"], "--ep 4 does not divide the 2 ranks of dp_shard 2"),
        (["--tp", "2", "--nproc", "4"], "does not compose with tensor parallelism; use --tp 1"),
    ]
    for extra, message in cases:
        assert cli.main(["--workload", "moe", *extra, "--out", "unused"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert cli.main(["--workload", "comm", "--ep", "2", "--out", "unused"]) == 2
    assert "--ep 2 applies to mixture-of-experts models" in capsys.readouterr().err


TINY_MOE = [
    "--workload", "moe", "--steps", "2", "--warmup", "1", "--seq-len", "32",
    *(arg for k, v in {**TINY_MODEL, "n_layers": 2, "moe_hidden_dim": 32}.items()
      for arg in ("--model-override", f"{k}={v}")),
    "--timeout", "400", "--no-png",
]  # fmt: skip


@pytest.mark.heavy
def test_moe_workload_end_to_end(tmp_path, capsys):
    # Two eager configurations with experts over ep 2: about 2 minutes of process start-up.
    rc = cli.main([*TINY_MOE, "--ep", "2", "--configs", "fsdp2,simplefsdp-uncompiled",
                   "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0, capsys.readouterr().out
    fsdp2, ours = result["configs"]
    assert fsdp2["ok"] and ours["ok"] and result["loss_check"]["reference"] == "fsdp2"
    assert ours["final_loss"] == pytest.approx(fsdp2["final_loss"], rel=1e-4)
    # Dispatch and combine per MoE layer in forward, both again in backward.
    assert fsdp2["collectives_profiled"]["all_to_all"] > 0
    assert ours["collectives_profiled"]["all_to_all"] > 0
    assert result["env"]["ep"] == 2 and result["comm_only"] is None
    assert "experts ep 2 x dp_shard_mod_ep 1" in capsys.readouterr().out


@pytest.mark.heavy
def test_float8_configs_end_to_end(tmp_path, capsys):
    # Two compiled float8 configurations and eager bf16 FSDP2: several minutes.
    pytest.importorskip("torchao")
    rc = cli.main([*TINY, "--param-dtype", "bfloat16", "--no-png", "--out", str(tmp_path),
                   "--configs", "fsdp2,fsdp2-float8,simplefsdp-float8"])  # fmt: skip
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0, capsys.readouterr().out
    bf16, fsdp2_f8, ours_f8 = result["configs"]
    assert result["loss_check"]["references"] == {
        "bfloat16": "fsdp2",
        "bfloat16+float8": "fsdp2-float8",
    }
    # The block's linear weights travel as one byte per element instead of two.
    assert fsdp2_f8["all_gather_bytes"] < bf16["all_gather_bytes"]
    assert ours_f8["all_gather_bytes"] < bf16["all_gather_bytes"]
    assert ours_f8["collectives_source"] == "comm_report"
