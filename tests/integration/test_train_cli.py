"""``simplefsdp train`` / ``export`` end to end on 2 CPU processes (gloo).

Runs are tiny (seq 64, batch 2, a few steps, the first 300 kB of the stdlib
corpus) and eager or ``aot_eager``, so the whole module stays around two
minutes on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import simplefsdp
from cli_runs import checkpoint_as_run, checkpoints, only_run
from simplefsdp.testing import record_collectives, run_distributed

pytestmark = pytest.mark.slow

SMALL = [
    "--data.max_bytes", "300000", "--data.seq_len", "64", "--data.batch_size", "2",
    "--training.warmup_steps", "2", "--training.lr", "3e-3",
    "--metrics.log_interval", "1", "--metrics.val_interval", "0",
]  # fmt: skip
EAGER = ["--compile.enable", "false"]
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], cwd: Path, *, torchrun: bool = False) -> subprocess.CompletedProcess:
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "simplefsdp.train", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "simplefsdp.cli", *args]
    proc = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return proc


def _train(cwd: Path, name: str, extra: list[str], **kw) -> subprocess.CompletedProcess:
    args = ["train", *SMALL, "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck"]
    if kw.get("torchrun"):
        args = args[1:]
    proc = _run([*args, *extra], cwd, **kw)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "event" not in r}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """8 eager steps, checkpoints at 4 and 8, started by the CLI itself."""
    cwd = tmp_path_factory.mktemp("train")
    proc = _train(cwd, "A", [*EAGER, "--training.steps", "8", "--checkpoint.interval", "4"])
    return cwd, proc


def test_train_runs_loss_falls_and_checkpoints(run_a):
    cwd, proc = run_a
    assert "starting 2 processes on cpu" in proc.stdout
    assert "training finished" in proc.stdout and "tokens/s/rank" in proc.stdout
    run = only_run(cwd / "A")
    losses = _losses(run / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 9))
    assert losses[1] > 5.5
    assert max(losses[7], losses[8]) < losses[1] - 1.5, losses
    ck = checkpoints(run)
    assert ck == (cwd / "A" / "ck" / run.name).resolve()  # checkpoint.folder/<run id>
    steps = sorted(p.name for p in ck.iterdir())
    assert steps == ["step-4", "step-8"]
    manifest = json.loads((ck / "step-8" / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 2
    assert any(f["path"] == ".metadata" for f in manifest["files"])
    state = json.loads((ck / "step-8" / "trainer_state.json").read_text())
    assert state["data_loader"]["position"] == 8 * 2 * 2  # steps * world * batch windows
    assert (run / "config.toml").is_file()


def test_resume_under_torchrun_matches_uninterrupted_run(run_a):
    cwd, _ = run_a
    run = checkpoint_as_run(checkpoints(only_run(cwd / "A")) / "step-4", cwd / "B")
    # A crashed, half-written save must not be picked up.
    (run / "checkpoints" / "step-6.tmp").mkdir()
    extra = [*EAGER, "--training.steps", "8", "--checkpoint.interval", "4", "--resume"]
    proc = _train(cwd, "B", extra, torchrun=True)
    assert "steps          4 -> 8" in proc.stdout
    resumed = _losses(run / "metrics.jsonl")
    full = _losses(only_run(cwd / "A") / "metrics.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bitwise
    assert not (run / "checkpoints" / "step-6.tmp").exists()  # cleaned up by the next save
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


def _sharded_weights_and_logits(ckpt: str, tokens: torch.Tensor) -> dict:
    """Load the checkpoint into the trainer's sharded model; return full weights and logits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.llama3 import Transformer
    from simplefsdp.train.config import config_from_dict
    from simplefsdp.train.trainer import parallelize_job

    config = json.loads((Path(ckpt) / "config.json").read_text())
    job = config_from_dict(config["job"])
    with torch.device("meta"):
        model = Transformer(model_args_from_config(config))
    parallel = parallelize_job(model, job, torch.device("cpu"))
    with simplefsdp.disable_parametrization():  # read the shards, do not all-gather
        state = {"model": get_model_state_dict(parallel.module)}
    dcp.load(state, checkpoint_id=ckpt)
    with torch.no_grad():
        logits = parallel.module(tokens)
    # numpy arrays travel back by value (tensors would go through shared memory
    # that dies with the worker process).
    return {
        "weights": {k: v.full_tensor().numpy() for k, v in state["model"].items()},
        "logits": logits.numpy(),
    }


def test_export_matches_the_sharded_model(run_a):
    load_file = pytest.importorskip(
        "safetensors.torch", reason="export needs safetensors"
    ).load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.llama3 import Transformer

    cwd, _ = run_a
    proc = _run(["export", "--checkpoint", "A", "--out", "exp/model.safetensors"], cwd)
    assert proc.returncode == 0, proc.stderr
    weights = load_file(str(cwd / "exp" / "model.safetensors"))
    config = json.loads((cwd / "exp" / "model.config.json").read_text())
    assert config["step"] == 8
    model = Transformer(model_args_from_config(config))
    model.load_state_dict(weights, strict=True)  # full shapes, every key

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ranks = run_distributed(
        _sharded_weights_and_logits,
        2,
        args=(str(checkpoints(only_run(cwd / "A")) / "step-8"), tokens),
    )
    assert ranks[0]["weights"].keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, torch.from_numpy(ranks[0]["weights"][name])), name
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits, torch.from_numpy(ranks[0]["logits"]), rtol=1e-5, atol=1e-5)


def _checkpoint_state_collectives(folder: str) -> dict:
    """Collectives issued while gathering and restoring the checkpoint state dicts."""
    from simplefsdp.checkpoint import Checkpointer
    from simplefsdp.models.llama3 import Transformer, get_config
    from simplefsdp.train.config import JobConfig
    from simplefsdp.train.trainer import parallelize_job

    job = JobConfig()
    job.compile.enable = False
    with torch.device("meta"):
        model = Transformer(get_config("debug", n_layers=2))
    parallel = parallelize_job(model, job, torch.device("cpu"))
    optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-3)
    ck = Checkpointer(folder, model=parallel.module, optimizer=optimizer,
                      device=torch.device("cpu"), keep_last=1, config_hash="h",
                      config_json={})  # fmt: skip
    path = ck.save(1, {"scheduler": {}, "data_loader": {}})
    with record_collectives() as saving:
        ck._tensor_state()
    with record_collectives() as loading:
        ck.load(path)
    return {"save": saving.count("all_gather"), "load": loading.count("all_gather")}


def test_checkpoint_state_dicts_read_shards_without_all_gathers(tmp_path):
    counts = run_distributed(_checkpoint_state_collectives, 2, args=(str(tmp_path / "ck"),))
    assert counts == [{"save": 0, "load": 0}] * 2
    assert (tmp_path / "ck" / "step-1" / "manifest.json").is_file()


def test_export_bad_checkpoint_is_exit_2(tmp_path):
    proc = _run(["export", "--checkpoint", str(tmp_path), "--out", "x.safetensors"], tmp_path)
    assert proc.returncode == 2
    assert "holds no complete checkpoint" in proc.stderr
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--compile.backend", "aot_eager", "--compile.bucketing", "per_block",
                      "--activation_checkpoint.mode", "full"], id="simplefsdp-compiled-full-ac"),
        pytest.param([*EAGER, "--parallel.engine", "fsdp2", "--activation_checkpoint.mode",
                      "selective", "--training.grad_accum_steps", "2"], id="fsdp2-sac-accum"),
        pytest.param([*EAGER, "--parallel.engine", "ddp", "--parallel.mode", "replicate"],
                     id="ddp"),
        pytest.param([*EAGER, "--parallel.mode", "hybrid_shard", "--parallel.mesh_shape", "1,2",
                      "--activation_checkpoint.mode", "full"], id="simplefsdp-hsdp-ac"),
    ],
)  # fmt: skip
def test_engines_and_options_train(extra, tmp_path, run_a):
    _train(tmp_path, "run", ["--training.steps", "3", "--checkpoint.enable", "false", *extra])
    losses = _losses(only_run(tmp_path / "run") / "metrics.jsonl")
    assert sorted(losses) == [1, 2, 3]
    assert losses[3] < losses[1]
    # Every engine and layout starts from the same weights as the fully
    # sharded run (and as one process): the first loss, before any update
    # (on the same batch: accumulation reads more than one).
    if "--training.grad_accum_steps" not in extra:
        first = _losses(only_run(run_a[0] / "A") / "metrics.jsonl")[1]
        assert losses[1] == pytest.approx(first, rel=1e-5)


def test_bad_model_name_exits_2_before_starting_anything(tmp_path):
    proc = _run(["train", "--model.name", "llama9"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.name" in lines[0] and "'debug'" in lines[0]
    assert "starting" not in proc.stdout
    assert list(tmp_path.iterdir()) == []
