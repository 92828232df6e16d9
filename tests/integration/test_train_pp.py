"""``simplefsdp train --parallel.pp 2`` end to end: pp2 x dp2 on 4 CPU processes,
its checkpoint resumed at dp4 with the same losses, and exported to one file.

The pipeline run feeds 2 rows per data-parallel rank in 2 micro-batches; the
dp4 run 1 row per rank: the same global batch, so the same data and losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

pytestmark = pytest.mark.slow


def _train(cwd: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "simplefsdp.cli", "train", *small_args(4), "--nproc", "4",
           "--metrics.val_interval", "2", "--metrics.output_dir", name,
           "--checkpoint.folder", f"{name}/ck", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_pipeline_run_resumes_at_dp4_and_exports(tmp_path):
    _train(tmp_path, "pp", ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe"])
    pp = losses(only_run(tmp_path / "pp") / "metrics.jsonl")
    pp_val = losses(only_run(tmp_path / "pp") / "metrics.jsonl", "val_loss")
    assert sorted(pp) == [1, 2, 3, 4] and pp[4] < pp[1] and sorted(pp_val) == [2, 4]
    ck = checkpoints(only_run(tmp_path / "pp"))
    state = json.loads((ck / "step-2" / "trainer_state.json").read_text())
    # both stages of a replica read the same batch: the loader advanced by dp ranks only
    assert state["data_loader"]["position"] == 2 * 2 * 2  # steps * dp ranks * batch
    manifest = json.loads((ck / "step-2" / "manifest.json").read_text())
    assert manifest["world_size"] == 4

    # resume step 2 of the pp2 x dp2 run at dp4 (1 row per rank, same global batch)
    dp_run = checkpoint_as_run(ck / "step-2", tmp_path / "dp")
    proc = _train(tmp_path, "dp", ["--data.batch_size", "1", "--resume"])
    assert "steps          2 -> 4" in proc.stdout
    dp = losses(dp_run / "metrics.jsonl")
    dp_val = losses(dp_run / "metrics.jsonl", "val_loss")
    assert sorted(dp) == [3, 4]
    for step in (3, 4):  # same math, another reduction order: fp32 tolerance
        assert dp[step] == pytest.approx(pp[step], rel=1e-5), (dp, pp)
    assert dp_val[4] == pytest.approx(pp_val[4], rel=1e-5)

    # the pipeline checkpoint exports to one file holding the whole model
    out = tmp_path / "model.safetensors"
    export = [sys.executable, "-m", "simplefsdp.cli", "export",
              "--checkpoint", str(tmp_path / "pp"), "--out", str(out)]  # fmt: skip
    subprocess.run(export, check=True, capture_output=True, env=train_env(), timeout=120)
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.llama3 import Transformer

    config = json.loads(out.with_suffix(".config.json").read_text())
    model = Transformer(model_args_from_config(config))
    model.load_state_dict(load_file(out))  # strict: every key, full shapes


def test_moe_pipeline_with_expert_parallelism_resumes_without_it(tmp_path):
    # pp2 x ep2 on 4 processes (each stage's 2 ranks one EP group, holding
    # half its experts), interleaved: 2 stages of one block per rank, the
    # first of them the dense block (no experts); resumed at pp2 1F1B alone
    # on 2 processes with the same global batch: the same losses, the
    # experts resharded by the load.
    moe = ["--model.name", "moe_debug", "--parallel.pp", "2"]
    interleaved = [
        "--parallel.pp_schedule",
        "interleaved_1f1b",
        "--parallel.pp_stages_per_rank",
        "2",
    ]
    _train(tmp_path, "ep", [*moe, "--parallel.ep", "2", *interleaved])
    ep = losses(only_run(tmp_path / "ep") / "metrics.jsonl")
    assert sorted(ep) == [1, 2, 3, 4] and ep[4] < ep[1]
    ck = checkpoints(only_run(tmp_path / "ep"))
    pp_run = checkpoint_as_run(ck / "step-2", tmp_path / "pp")
    proc = _train(tmp_path, "pp", [*moe, "--nproc", "2", "--data.batch_size", "4", "--resume"])
    assert "steps          2 -> 4" in proc.stdout
    pp = losses(pp_run / "metrics.jsonl")
    # the first resumed step runs the loaded weights: the same loss to fp32
    assert pp[3] == pytest.approx(ep[3], rel=1e-5), (pp, ep)
    # its update sums the experts' gradients in another order, which may
    # flip a near-tied routing choice on the next step: a looser bound
    assert pp[4] == pytest.approx(ep[4], rel=1e-2), (pp, ep)
