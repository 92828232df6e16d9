"""Unit tests of the trainer's pieces: LR schedule, checkpoint selection, metrics, CLI parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn as nn

from simplefsdp.checkpoint import (
    MANIFEST_NAME,
    Checkpointer,
    DamagedCheckpointError,
    build_manifest,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resume_checkpoint,
    scan_checkpoints,
    verify_checkpoint,
    write_json_atomic,
)
from simplefsdp.engines import (
    MemoryProbe,
    apply_activation_checkpointing,
    clip_grad_norm_,
    lower_mmap_threshold,
    mesh_shape_for,
)
from simplefsdp.train import cli
from simplefsdp.train.config import JobConfig, load_config
from simplefsdp.train.metrics import (
    MMAP_THRESHOLD_BYTES,
    MetricsWriter,
    format_bytes,
    format_step_line,
    mfu,
    peak_flops_for,
)
from simplefsdp.train.schedule import build_lr_scheduler, json_ready, lr_factor

# --------------------------------------------------------------------------- LR schedule


def _factors(total: int, warmup: int, min_ratio: float = 0.1) -> list[float]:
    return [
        lr_factor(s, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio)
        for s in range(total)
    ]


def test_lr_warmup_is_linear_then_cosine_reaches_min_at_last_step():
    f = _factors(total=20, warmup=5)
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f[5] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1)
    decay = f[5:]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    # 14 decay intervals from step 5 to step 19: step 12 is the cosine's midpoint.
    assert f[12] == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize(("total", "warmup"), [(1, 0), (3, 0), (4, 4), (5, 10)])
def test_lr_edge_cases_stay_in_range(total, warmup):
    f = _factors(total=total, warmup=warmup, min_ratio=0.25)
    assert all(0.0 < x <= 1.0 for x in f)
    if warmup == 0:
        assert f[0] == pytest.approx(1.0)


def test_scheduler_state_is_json_and_resumes_the_same_lrs():
    job = JobConfig()
    job.training.steps, job.training.warmup_steps, job.training.lr = 12, 3, 0.5

    def make():
        opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=job.training.lr)
        return opt, build_lr_scheduler(opt, job)

    opt, sched = make()
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.5 * f for f in _factors(12, 3)]
    assert lrs == pytest.approx(expected)

    opt_a, sched_a = make()
    for _ in range(5):
        opt_a.step()
        sched_a.step()
    state = json.loads(json.dumps(json_ready(sched_a.state_dict())))
    opt_b, sched_b = make()
    sched_b.load_state_dict(state)
    for group, lr in zip(opt_b.param_groups, sched_b.get_last_lr()):
        group["lr"] = lr
    assert opt_b.param_groups[0]["lr"] == pytest.approx(lrs[5])
    opt_b.step()
    sched_b.step()
    assert opt_b.param_groups[0]["lr"] == pytest.approx(lrs[6])


def test_first_resumed_step_follows_the_new_schedule():
    """12 steps with warm-up 2, then resumed with training.steps 24: step 13 (index 12)
    gets the 24-step schedule's rate, not the 12-step run's last one."""
    job = JobConfig()
    job.training.steps, job.training.warmup_steps, job.training.lr = 12, 2, 1e-3
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=job.training.lr)
    sched = build_lr_scheduler(opt, job)
    for _ in range(12):
        opt.step()
        sched.step()
    job.training.steps, job.training.lr = 24, 2e-3  # the resumed run's config
    opt_b = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=job.training.lr)
    opt_b.load_state_dict(opt.state_dict())  # the optimizer state as a checkpoint restores it
    sched_b = build_lr_scheduler(opt_b, job, start_step=12)
    new = [2e-3 * f for f in _factors(24, 2)]
    assert opt_b.param_groups[0]["lr"] == pytest.approx(new[12])  # about 1.17e-3
    opt_b.step()
    sched_b.step()
    assert opt_b.param_groups[0]["lr"] == pytest.approx(new[13])


# --------------------------------------------------------------------------- checkpoints


def _fake_checkpoint(root: Path, step: int, *, manifest: bool = True, tmp: bool = False) -> Path:
    folder = root / (f"step-{step}" + (".tmp" if tmp else ""))
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(64))
    (folder / ".metadata").write_bytes(b"meta")
    if manifest:
        data = build_manifest(folder, step=step, world_size=2, config_hash="abc")
        write_json_atomic(folder / MANIFEST_NAME, data)
    return folder


def test_manifest_lists_files_with_sizes_and_hashes(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert {f["path"] for f in manifest["files"]} == {"__0_0.distcp", ".metadata"}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"])
    assert verify_checkpoint(folder, check_hashes=True) is None
    assert not list(folder.glob("*.tmp"))  # the atomic JSON write left nothing behind


def test_latest_ignores_tmp_and_incomplete_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 8)
    _fake_checkpoint(tmp_path, 12, tmp=True)  # crashed mid-save
    _fake_checkpoint(tmp_path, 16, manifest=False)  # no manifest
    damaged = _fake_checkpoint(tmp_path, 20)
    (damaged / "__0_0.distcp").write_bytes(b"short")  # size no longer matches
    wrong = _fake_checkpoint(tmp_path, 24)
    wrong.rename(tmp_path / "step-28")  # manifest step != folder name
    (tmp_path / "notes").mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [4, 8]
    assert latest_checkpoint(tmp_path).step == 8
    assert latest_checkpoint(tmp_path / "missing") is None


def test_verify_detects_same_size_corruption_only_with_hashes(tmp_path):
    folder = _fake_checkpoint(tmp_path, 1)
    (folder / "__0_0.distcp").write_bytes(os.urandom(64))
    assert verify_checkpoint(folder) is None
    assert "sha256" in verify_checkpoint(folder, check_hashes=True)


def test_unparsable_manifest_is_ignored(tmp_path):
    folder = _fake_checkpoint(tmp_path, 2)
    (folder / MANIFEST_NAME).write_text("{not json")
    assert latest_checkpoint(tmp_path) is None


def test_prune_keeps_last_k_and_removes_stale_tmp(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 5, tmp=True)
    in_progress = _fake_checkpoint(tmp_path, 6, tmp=True)
    removed = prune_checkpoints(tmp_path, 2, keep=[in_progress])
    assert sorted(p.name for p in removed) == ["step-1", "step-2", "step-5.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4", "step-6.tmp"]
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, 0)


# --------------------------------------------------------------------------- damaged checkpoints


def _real_checkpoints(folder: Path, steps: tuple[int, ...]) -> Checkpointer:
    """A single-process Checkpointer of a tiny model that saved ``steps``."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    ck = Checkpointer(folder, model=model, optimizer=optimizer, device=torch.device("cpu"),
                      keep_last=5, config_hash="h", config_json={})  # fmt: skip
    # CPU tensors only: DCP's writer would open a CUDA stream where CUDA merely
    # looks visible (the pretend-CUDA run of the unit tests)
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        for step in steps:
            ck.save(step, {"step": step})
    return ck


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:-10])
    elif how == "changed":  # same size, other bytes: only the sha256 tells
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        path.unlink()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["truncated", "changed", "missing"])
def test_damaged_latest_checkpoint_is_one_error_naming_file_previous_step_and_flag(tmp_path, how):
    ck = _real_checkpoints(tmp_path, (4, 8))
    shard = _shard(tmp_path / "step-8")
    _damage(shard, how)
    with pytest.raises(DamagedCheckpointError) as err:
        info = resume_checkpoint(tmp_path)  # sizes only: catches truncated and missing
        ck.load(info.path)  # every sha256: catches the same-size change
    message = str(err.value)
    assert "\n" not in message and str(shard) in message
    assert "previous good checkpoint is step 4" in message
    assert "--checkpoint.load_step 4" in message
    assert err.value.previous == 4 and err.value.step == 8
    # falling back, as the message says, resumes from step 4
    info = resume_checkpoint(tmp_path, 4)
    assert info.step == 4 and ck.load(info.path)["step"] == 4


@pytest.mark.parametrize("given", ["folder", "step"])
def test_export_refuses_a_damaged_checkpoint_naming_the_previous_good_one(tmp_path, given):
    from simplefsdp.checkpoint.export import resolve_checkpoint

    _fake_checkpoint(tmp_path, 4)
    damaged = _fake_checkpoint(tmp_path, 8)
    data = (damaged / "__0_0.distcp").read_bytes()
    (damaged / "__0_0.distcp").write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size
    with pytest.raises(ValueError) as err:
        resolve_checkpoint(tmp_path if given == "folder" else damaged)
    message = str(err.value)
    assert f"checkpoint {damaged} is damaged: {damaged / '__0_0.distcp'} does not match" in message
    assert message.endswith(
        f"previous good checkpoint is step 4: export it with --checkpoint {tmp_path / 'step-4'}"
    )


def test_damaged_checkpoint_without_earlier_one_says_so(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / "step-4" / "__0_0.distcp").write_bytes(b"short")
    with pytest.raises(DamagedCheckpointError, match="no earlier complete checkpoint"):
        resume_checkpoint(tmp_path)


def test_load_step_must_name_a_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 8)
    assert resume_checkpoint(tmp_path, 4).step == 4
    with pytest.raises(ValueError, match=r"load_step 6: .* no checkpoint step-6; .*steps 4, 8"):
        resume_checkpoint(tmp_path, 6)


def test_uncommitted_save_is_skipped_with_one_line(tmp_path, caplog):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 8)
    _fake_checkpoint(tmp_path, 12, tmp=True)  # the run died while saving step 12
    with caplog.at_level("WARNING", logger="simplefsdp.checkpoint.steps"):
        assert resume_checkpoint(tmp_path, report=True).step == 8
        assert resume_checkpoint(tmp_path).step == 8  # preflight: quiet
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "step-12.tmp" in line and "never committed" in line and "step 8" in line


def test_scan_sorts_complete_damaged_and_uncommitted(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 8, manifest=False)
    _fake_checkpoint(tmp_path, 12, tmp=True)
    scan = scan_checkpoints(tmp_path)
    assert [i.step for i in scan.complete] == [4]
    assert list(scan.damaged) == [8] and "manifest.json is missing" in scan.damaged[8]
    assert scan.uncommitted == [12] and scan.previous_good(8) == 4


# --------------------------------------------------------------------------- metrics


def test_metrics_writer_appends_json_lines(tmp_path):
    writer = MetricsWriter(tmp_path / "out", tensorboard=False)
    writer.write({"loss": 2.5, "lr": 1e-3, "grad_norm": float("nan")}, step=1)
    writer.write({"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0}, step=2)
    writer.close()
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[0]["grad_norm"] == "nan" and lines[1]["loss"] == 2.0
    assert all("time" in r for r in lines)


def test_metrics_writer_tensorboard_optional(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write({"loss": 1.0}, step=1)
    try:
        import torch.utils.tensorboard  # noqa: F401

        assert writer.tensorboard_dir == tmp_path / "tensorboard"
    except ImportError:
        assert writer.tensorboard_dir is None
    writer.close()


def test_step_line_and_helpers():
    record = {
        "loss": 3.14159,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s_per_rank": 1234.5,
        "mfu_pct": None,
        "peak_memory_bytes": 3 * 1024**2,
    }
    line = format_step_line(7, 100, record)
    assert line.startswith("step   7/100 | loss 3.1416")
    assert "mem 3.0 MiB" in line and "mfu" not in line
    assert "mfu 12.5%" in format_step_line(7, 100, {**record, "mfu_pct": 12.5})
    assert format_bytes(None) == "n/a" and format_bytes(512) == "512 B"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(10.0)
    assert peak_flops_for(torch.device("cpu")) is None


def test_cpu_memory_probe_sees_a_large_allocation():
    lower_mmap_threshold(MMAP_THRESHOLD_BYTES)
    probe = MemoryProbe(torch.device("cpu"))
    probe.reset()
    block = torch.ones(64 * 1024**2 // 4)  # 64 MiB, touched
    assert probe.peak_bytes() >= 48 * 1024**2
    del block
    with MemoryProbe("cpu") as region:
        block = torch.ones(32 * 1024**2 // 4)  # 32 MiB above the level at entry
        del block
    assert region.peak is not None and region.peak >= 24 * 1024**2


# --------------------------------------------------------------------------- parallelism helpers


@pytest.mark.parametrize(
    ("engine", "mode", "shape", "world", "expected"),
    [
        ("simplefsdp", "fully_shard", None, 4, (4,)),
        ("simplefsdp", "replicate", None, 2, (2,)),
        ("fsdp2", "replicate", None, 2, (2, 1)),
        ("simplefsdp", "hybrid_shard", [2, 2], 4, (2, 2)),
        ("fsdp2", "hybrid_shard", None, 8, (2, 4)),
    ],
)
def test_mesh_shape_for(engine, mode, shape, world, expected):
    local = 4 if world == 8 else world
    got = mesh_shape_for(engine, mode, world, mesh_shape=shape, local_world_size=local)
    assert got == expected


def test_mesh_shape_error_names_valid_shapes():
    with pytest.raises(ValueError, match=r"needs 4 ranks.*world size is 2.*\[1, 2\], \[2, 1\]"):
        mesh_shape_for("simplefsdp", "hybrid_shard", 2, mesh_shape=[2, 2])


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn_like(p) * 3
        r.grad = p.grad.clone()
    norm = clip_grad_norm_(params, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert torch.equal(norm, ref_norm)
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r.grad)
    unclipped = [nn.Parameter(torch.ones(4))]
    unclipped[0].grad = torch.full((4,), 10.0)
    assert clip_grad_norm_(unclipped, 0.0).item() == pytest.approx(20.0)
    assert torch.equal(unclipped[0].grad, torch.full((4,), 10.0))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_keys_and_gradients(mode):
    from simplefsdp.models.llama3 import Transformer, get_config

    args = get_config("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    ref = Transformer(args)
    model = Transformer(args)
    model.load_state_dict(ref.state_dict())
    assert apply_activation_checkpointing(model, mode) == 2
    assert model.state_dict().keys() == ref.state_dict().keys()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    ref(tokens).square().mean().backward()
    model(tokens).square().mean().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        clean = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(p.grad, ref_grads[clean], rtol=0, atol=0)


@pytest.mark.parametrize(("mode", "recomputed"), [("none", 0), ("selective", 3), ("full", 6)])
def test_selective_ac_recomputes_every_other_matmul_of_a_block(mode, recomputed):
    """torchtitan's op policy: of a Llama block's seven matmuls wk, wo and w3
    (the 2nd, 4th and 6th) are recomputed in backward, the others saved. Full
    AC recomputes all but w2, whose output no gradient needs (the
    recomputation stops early)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from simplefsdp.models.llama3 import Transformer, get_config

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.count += 1
            return func(*args, **(kwargs or {}))

    args = get_config("debug", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = Transformer(args)
    apply_activation_checkpointing(model, mode)
    for p in (*model.tok_embeddings.parameters(), *model.output.parameters()):
        p.requires_grad_(False)  # the block's matmuls only
    loss = model(torch.randint(0, args.vocab_size, (1, 8))).sum()
    with CountMatmuls() as counter:
        loss.backward()
    # each of the block's 7 linears: input and weight gradients; the output
    # layer: its input gradient
    assert counter.count == 2 * 7 + 1 + recomputed


@pytest.mark.parametrize(("recompute_experts", "recomputed"), [(False, 0), (True, 3)])
def test_selective_ac_saves_the_experts_grouped_matmuls_unless_told(recompute_experts, recomputed):
    """The experts' three grouped matmuls (w1, w3, w2) are saved by selective
    AC; ``recompute_experts`` recomputes them in backward, as torchtitan's op
    list does."""
    import dataclasses

    from torch.utils._python_dispatch import TorchDispatchMode

    from simplefsdp.models.registry import resolve_flavor

    class CountGroupedMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "grouped_mm" in str(func)
            return func(*args, **(kwargs or {}))

    spec, config = resolve_flavor("deepseek_v3_debug")
    config = dataclasses.replace(config, n_layers=config.n_dense_layers + 1)  # one MoE block
    torch.manual_seed(0)
    model = spec.build(config)
    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = True
    apply_activation_checkpointing(model, "selective", recompute_experts)
    loss = model(torch.randint(0, config.vocab_size, (1, 16))).float().square().mean()
    with CountGroupedMatmuls() as counter:
        loss.backward()
    # input and weight gradients of the three, and what was recomputed
    assert counter.count == 2 * 3 + recomputed
    # the same gradients as without AC, bit for bit
    torch.manual_seed(0)
    plain = spec.build(config)
    for module in plain.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = True
    torch.manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    plain(tokens).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None
    model(tokens).float().square().mean().backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in model.named_parameters():
        clean = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(p.grad, expected[clean], rtol=0, atol=0, msg=clean)
    with pytest.raises(ValueError, match="recompute_experts applies to selective"):
        apply_activation_checkpointing(spec.build(config), "full", True)


# --------------------------------------------------------------------------- CLI


def test_worker_argv_strips_launcher_flags():
    argv = ["--nproc", "3", "--training.steps", "5", "--max-restarts=1", "--resume"]
    assert cli._worker_argv(argv) == ["--training.steps", "5", "--resume"]


def test_print_config_shows_overrides(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no run to resume: the configuration as given
    assert cli.main(["--print-config", "--training.steps", "7", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "steps = 7" in out and "resume = true" in out and 'name = "debug"' in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model.name", "tiny"], "model.name: invalid value 'tiny'; valid choices"),
        (["--trainig.steps", "5"], "Did you mean 'training'"),
        (["--training.steps", "0", "--data.seq_len", "-1"], "training.steps"),
        (["--config", "missing.toml"], "built-in configs"),
        (["--data.path", "/does/not/exist"], "data.path '/does/not/exist' does not exist"),
        (
            ["--nproc", "2", "--parallel.mode", "hybrid_shard", "--parallel.mesh_shape", "2,2"],
            "valid shapes for 2 ranks",
        ),
        (["--data.seq_len", "1024"], "exceeds max_seq_len 512 of model 'debug'"),
        (["--nprocs", "4"], "unknown option --nprocs. Did you mean --nproc?"),
        (["--nproc-per-node=4"], "unknown option --nproc-per-node. Did you mean --nproc?"),
        (["--steps", "4"], "unknown option --steps. Did you mean --training.steps?"),
        (["--learning-rate", "1"], "Did you mean --training.lr?"),
        (["--reume"], "unknown option --reume. Did you mean --resume?"),
        (["--training.learning_rate", "1"], "'learning_rate' in section [training]. Did you mean 'lr'?"),
        (["--resume", "--checkpoint.load_step", "4"], "no run in outputs/debug has a complete"),
        (["--nproc", "3", "--parallel.tp", "3", "--parallel.sequence_parallel", "false"],
         "parallel.tp 3 does not divide the n_heads 8, n_kv_heads 4 of model 'debug'; valid"),
        (["--activation_checkpoint.mode", "full", "--activation_checkpoint.recompute_experts",
          "true"], "activation_checkpoint.recompute_experts: invalid value True; must be false "
         "with activation_checkpoint.mode 'full'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    argv, needle, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("simplefsdp train: error: ")
    assert needle in err
    assert list(tmp_path.iterdir()) == []


def test_a_binary_data_path_is_refused_before_anything_starts(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 16)
    assert cli.main(["--data.path", "model.bin"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data file 'model.bin' is mostly not text" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


def test_config_notes_and_warnings_are_printed_once_each(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.toml").write_text('[model]\nname = "debug"\n[training]\nsteps = 12\n')
    assert cli.main(["--config", "my.toml", "--print-config"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(x.startswith("simplefsdp train: warning: ") for x in lines)
    assert "no 'extends'" in lines[0] and "--training.warmup_steps 1" in lines[1]


@pytest.mark.parametrize(("launcher", "printed"), [(True, 0), (False, 1)])
def test_config_warnings_are_printed_by_the_launcher_not_again_by_its_workers(
    capsys, monkeypatch, tmp_path, launcher, printed
):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    if launcher:  # a worker of `simplefsdp train`, which printed them already
        monkeypatch.setenv("SIMPLEFSDP_ERROR_DIR", str(tmp_path))
    else:  # under a plain torchrun, rank 0 prints them
        monkeypatch.delenv("SIMPLEFSDP_ERROR_DIR", raising=False)
    assert cli.main(["--print-config", "--training.steps", "5"]) == 0
    assert capsys.readouterr().err.count("warmup_steps 10 is not below") == printed


def test_load_config_debug_default_is_debug_model():
    job = load_config(cli.DEFAULT_CONFIG)
    assert job.model.name == "debug" and job.compile.enable


def test_one_engine_vocabulary():
    """The config (no torch), the engine layer and the bench spell the engines alike."""
    from simplefsdp.bench.configs import CONFIGS
    from simplefsdp.bench.configs import ENGINES as BENCH_ENGINES
    from simplefsdp.engines import ENGINES
    from simplefsdp.train.config import ENGINES as CONFIG_ENGINES

    assert set(CONFIG_ENGINES) == set(ENGINES)
    assert set(BENCH_ENGINES) == {*ENGINES, "comm"}
    assert {c.engine for c in CONFIGS.values()} <= set(ENGINES)


def test_one_pipeline_vocabulary():
    """The config (no torch) and the engine layer name the same schedules and engines."""
    from simplefsdp.engines import PIPELINE_SCHEDULES, engines_with
    from simplefsdp.train import config as C

    assert set(C.PP_SCHEDULES) == set(PIPELINE_SCHEDULES)
    assert set(engines_with("pp")) == set(engines_with("tp")) == {"simplefsdp", "fsdp2"}


def test_worker_errors_under_torchrun_name_their_rank(monkeypatch, capsys):
    from simplefsdp.train import cli
    from simplefsdp.train.launch import ERROR_DIR_ENV

    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    assert cli._report_worker_error("checkpoint step-2 is damaged", 2) == 2
    assert capsys.readouterr().err == (
        "simplefsdp train: error on rank 3: checkpoint step-2 is damaged\n"
    )
    monkeypatch.setenv("RANK", "0")
    cli._report_worker_error("bad", 2)
    assert capsys.readouterr().err == "simplefsdp train: error: bad\n"


def test_keep_gathered_setting_reaches_the_engine_spec():
    from simplefsdp.train.config import load_config
    from simplefsdp.train.parallelism import engine_spec, keep_gathered_option

    assert keep_gathered_option(None) is None
    assert keep_gathered_option("auto") == "auto"
    assert keep_gathered_option("2") == 2
    assert keep_gathered_option("layers.3, norm,output") == ["layers.3", "norm", "output"]
    job = load_config(None, ["--compile.keep_gathered", "auto"])
    assert engine_spec(job).keep_gathered == "auto"
    assert engine_spec(load_config(None, [])).keep_gathered is None


def test_fullgraph_setting_reaches_the_engine_spec_and_refuses_tensor_parallelism():
    from simplefsdp.train.parallelism import engine_spec
    from simplefsdp.train.resolve import job_errors

    assert engine_spec(load_config(None, [])).fullgraph is True
    job = load_config(None, ["--compile.fullgraph", "false"])
    assert engine_spec(job).fullgraph is False
    assert job_errors(job, 2)[0] == []
    tp = load_config(None, ["--compile.fullgraph", "false", "--parallel.tp", "2"])
    assert job_errors(tp, 4)[0] == [
        "parallel.tp 2 with compile.fullgraph false: tensor parallelism compiles whole "
        "graphs; use compile.fullgraph true, compile.enable false or parallel.tp 1"
    ]


def test_check_ranks_setting_reaches_the_engine_spec():
    from simplefsdp.train.config import load_config
    from simplefsdp.train.parallelism import engine_spec

    assert engine_spec(load_config(None, [])).check_ranks is True
    job = load_config(None, ["--parallel.check_ranks", "false"])
    assert engine_spec(job).check_ranks is False


class _Failures:
    """What ``_report_failure`` reads of torchelastic's ``ChildFailedError``."""

    def __init__(self, codes: dict[int, int]) -> None:
        self.failures = {rank: SimpleNamespace(exitcode=c) for rank, c in codes.items()}

    def format_msg(self) -> str:
        return "details"


@pytest.mark.parametrize("codes", [{0: -15, 1: 143}, {0: -9, 1: 0}, {0: 1, 1: 1}])
def test_a_failed_worker_group_is_one_line_with_its_exit_codes(tmp_path, capsys, codes):
    # Note: [Clean stop]: a clean stop ends with exit 0 in every worker, so
    # whatever reaches the failure report (a stop mark or not) is a failure.
    from simplefsdp.train.launch import STOPPED_MARK, _report_failure

    (tmp_path / STOPPED_MARK).write_text("15")
    assert _report_failure(_Failures(codes), tmp_path) == 1
    err = capsys.readouterr().err
    assert f"exit codes {sorted(set(codes.values()))}" in err and "training failed" in err


def test_launcher_gone_only_when_the_watched_launcher_is_no_longer_the_parent(monkeypatch):
    from simplefsdp.train import interrupts

    monkeypatch.setattr(interrupts, "_watched_launcher", None)
    monkeypatch.setenv(interrupts.LAUNCHER_PID_ENV, str(os.getppid() + 1))
    assert interrupts.watch_launcher() is None  # its parent is not that launcher
    assert not interrupts.launcher_gone()  # nothing watched: another launcher's worker
    monkeypatch.setattr(interrupts, "_watched_launcher", os.getppid())
    assert not interrupts.launcher_gone()
    monkeypatch.setattr(interrupts, "_watched_launcher", os.getppid() + 1)
    assert interrupts.launcher_gone()
