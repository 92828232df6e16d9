"""simplefsdp.checkpoint on 1-4 CPU processes: resharding across world sizes and
modes, torch FSDP2 interchange, crashes while saving, damaged checkpoints.

The model is the toy ``tied`` model (uneven dims 19 x 10, a tied embedding, a
buffer) with its 0-d ``temperature`` made a 1-element vector, which torch FSDP2
requires (and which leaves most ranks an empty shard); every optimizer is
AdamW, so the compared state is ``exp_avg``, ``exp_avg_sq`` and ``step``.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
import simplefsdp.checkpoint as ckpt
from simplefsdp._faults import FAIL_SAVE_ENV
from simplefsdp.checkpoint import (
    Checkpointer,
    CheckpointError,
    build_manifest,
    latest_checkpoint,
    write_json_atomic,
)
from simplefsdp.testing import run_distributed
from toy_models import TiedEmbeddingModel, loss_fn, make_batch

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks
SAVED_STEPS = 3
LR = 1e-2

# --------------------------------------------------------------------------- helpers (run in workers)


def _mesh(mode: str):
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _build(vocab: int = 19) -> TiedEmbeddingModel:
    torch.manual_seed(0)
    model = TiedEmbeddingModel(vocab=vocab)
    model.temperature = torch.nn.Parameter(model.temperature.detach().reshape(1))
    return model


def _model(engine: str, mode: str = "fully_shard") -> torch.nn.Module:
    model = _build()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model, mesh=_mesh("fully_shard"))
    return simplefsdp.data_parallel(model, _mesh(mode), mode=mode)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's rows of the fixed global batch of ``step``."""
    inputs, targets = make_batch("tied", step, GLOBAL_BATCH)
    rows = GLOBAL_BATCH // dist.get_world_size()
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    loss_fn("tied", model(inputs[mine]), targets[mine]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(tensor: torch.Tensor) -> np.ndarray:
    # A copy (full_tensor() of a replicated DTensor may alias the parameter), as
    # numpy, which travels back from the worker by value (tensors would use
    # shared memory that dies with the worker).
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().clone().numpy()


def _gathered_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full (gathered) parameters and AdamW state by parameter name."""
    out = {}
    with simplefsdp.disable_parametrization():
        for name, param in model.named_parameters():
            out[name] = _full(param)
            for key, value in optimizer.state[param].items():
                out[f"{name}.{key}"] = _full(value)
    return out


def _train_save_continue(folder: str) -> dict:
    """Reference on 2 ranks (fully_shard): train, save, then one more step."""
    model = _model("simplefsdp")
    optimizer = _optimizer(model)
    for step in range(SAVED_STEPS):
        _train_step(model, optimizer, step)
    ckpt.save(model, optimizer, folder, extra_state={"step": SAVED_STEPS}, step=SAVED_STEPS)
    saved = _gathered_state(model, optimizer)
    _train_step(model, optimizer, SAVED_STEPS)
    return {"saved": saved, "after": _gathered_state(model, optimizer)}


def _load_and_continue(folder: str, engine: str, modes: list[str]) -> dict:
    """Load into fresh models of each mode; their state, then one more step."""
    out = {}
    for mode in modes:
        model = _model(engine, mode)
        optimizer = _optimizer(model)
        extra = ckpt.load(model, optimizer, folder)
        loaded = _gathered_state(model, optimizer)
        _train_step(model, optimizer, SAVED_STEPS)
        out[mode] = {"extra": extra, "loaded": loaded, "after": _gathered_state(model, optimizer)}
    return out


# --------------------------------------------------------------------------- resharding


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reshard") / "step-3"
    ranks = run_distributed(_train_save_continue, 2, args=(str(folder),))
    return folder, ranks[0]


def _assert_same_state(got: dict, want: dict, *, exact: bool) -> None:
    assert got.keys() == want.keys()
    assert any(k.endswith(".exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)
    for key, value in want.items():
        if exact:
            assert np.array_equal(got[key], value), key
        else:
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize(
    ("world", "modes"),
    [
        (1, ["fully_shard"]),
        (3, ["fully_shard"]),
        (4, ["fully_shard", "replicate", "hybrid_shard"]),
    ],
)
def test_reshard_from_2_ranks_to_other_world_sizes_and_modes(reference, world, modes):
    folder, ref = reference
    results = run_distributed(_load_and_continue, world, args=(str(folder), "simplefsdp", modes))
    for mode in modes:
        for rank_result in results:
            assert rank_result[mode]["extra"] == {"step": SAVED_STEPS}
            _assert_same_state(rank_result[mode]["loaded"], ref["saved"], exact=True)
            # Training continues: same step as the 2-rank run (reduction order differs).
            _assert_same_state(rank_result[mode]["after"], ref["after"], exact=False)


# --------------------------------------------------------------------------- FSDP2 interchange


def _fsdp2_interchange(ours: str, theirs: str) -> dict:
    """simplefsdp checkpoint -> FSDP2 (our loader and plain DCP); FSDP2 checkpoint -> simplefsdp."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fsdp2 = _model("fsdp2")
    plain_dcp = {"model": get_model_state_dict(fsdp2)}
    dcp.load(plain_dcp, checkpoint_id=ours)  # a torch user needs no simplefsdp code
    plain = {k: _full(v) for k, v in plain_dcp["model"].items()}
    optimizer = _optimizer(fsdp2)
    ckpt.load(fsdp2, optimizer, ours)
    loaded = _gathered_state(fsdp2, optimizer)
    _train_step(fsdp2, optimizer, SAVED_STEPS)
    ckpt.save(fsdp2, optimizer, theirs)
    fsdp2_after = _gathered_state(fsdp2, optimizer)
    model = _model("simplefsdp")
    optimizer = _optimizer(model)
    ckpt.load(model, optimizer, theirs)
    return {
        "plain": plain,
        "loaded": loaded,
        "fsdp2_after": fsdp2_after,
        "back": _gathered_state(model, optimizer),
    }


def test_fsdp2_interchange(reference, tmp_path):
    folder, ref = reference
    result = run_distributed(_fsdp2_interchange, 2, args=(str(folder), str(tmp_path / "fsdp2")))[0]
    assert set(result["plain"]) == set(_build().state_dict())  # plain names
    for name, value in result["plain"].items():
        key = name.replace("head.weight", "embed.weight")  # tied
        if key != "offset":  # the buffer
            assert np.array_equal(value, ref["saved"][key]), name
    _assert_same_state(result["loaded"], ref["saved"], exact=True)
    _assert_same_state(result["fsdp2_after"], ref["after"], exact=False)
    _assert_same_state(result["back"], result["fsdp2_after"], exact=True)


def test_export_and_plain_single_process_load(reference):
    from simplefsdp.checkpoint.export import load_full_model_state

    folder, ref = reference
    model = _build()
    model.load_state_dict(load_full_model_state(folder), strict=True)
    for name, param in model.named_parameters():
        assert np.array_equal(param.detach().numpy(), ref["saved"][name]), name
    # Model and optimizer through our loader, in this process (no process group).
    plain = _build()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    assert ckpt.load(plain, optimizer, folder) == {"step": SAVED_STEPS}
    _assert_same_state(_gathered_state(plain, optimizer), ref["saved"], exact=True)


# --------------------------------------------------------------------------- crash while saving


def _save_then_die_saving(folder: str, stage: str) -> None:
    """Save step 1, then die (rank 0, SIGKILL) at ``stage`` of the save of step 2."""
    model = _model("simplefsdp")
    optimizer = _optimizer(model)
    checkpointer = Checkpointer(
        folder, model=model, optimizer=optimizer, device=torch.device("cpu"), keep_last=1,
        config_hash="h", config_json={"model": "tied"},
    )  # fmt: skip
    _train_step(model, optimizer, 0)
    checkpointer.save(1, {"step": 1})
    expected = _gathered_state(model, optimizer)  # collective
    if dist.get_rank() == 0:
        np.savez(Path(folder).parent / "expected-step-1.npz", **expected)
    _train_step(model, optimizer, 1)
    os.environ[FAIL_SAVE_ENV] = stage
    checkpointer.save(2, {"step": 2})


@pytest.mark.parametrize(
    "stage", ["before_write", "after_write", "before_publish", "after_publish"]
)
def test_killed_while_saving_keeps_the_previous_checkpoint(tmp_path, stage):
    folder = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="rank 0 died with exit code -9"):
        run_distributed(_save_then_die_saving, 2, args=(str(folder), stage), timeout_s=60)
    published = stage == "after_publish"
    assert latest_checkpoint(folder).step == (2 if published else 1)
    assert (folder / "step-1").is_dir()  # old ones are pruned only after publishing
    assert (folder / "step-2.tmp").is_dir() != published  # the partial save, never picked
    ckpt.verify(folder / "step-1")  # intact: every sha256 matches
    plain = _build()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    assert Checkpointer(
        folder, model=plain, optimizer=optimizer, device=torch.device("cpu"), keep_last=1,
        config_hash="h", config_json={},
    ).load(folder / "step-1")["step"] == 1  # fmt: skip
    expected = dict(np.load(tmp_path / "expected-step-1.npz"))
    _assert_same_state(_gathered_state(plain, optimizer), expected, exact=True)


def test_next_save_cleans_up_a_crashed_one(tmp_path):
    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    checkpointer = Checkpointer(
        tmp_path, model=model, optimizer=optimizer, device=torch.device("cpu"), keep_last=1,
        config_hash="h", config_json={},
    )  # fmt: skip
    checkpointer.save(1, {"step": 1})
    (tmp_path / "step-2.tmp").mkdir()  # a crashed save
    (tmp_path / "step-2.tmp" / "__0_0.distcp").write_bytes(b"partial")
    checkpointer.save(3, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


# --------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture
def plain_checkpoint(tmp_path) -> Path:
    """A single-process checkpoint of the model after one step (no process group)."""
    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs, targets = make_batch("tied", 0, 4)
    loss_fn("tied", model(inputs), targets).backward()
    optimizer.step()
    return ckpt.save(model, optimizer, tmp_path / "step-1", step=1)


def _shard(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(folder: Path) -> None:
    path = _shard(folder)
    path.write_bytes(path.read_bytes()[:-100])


def _flip_bytes(folder: Path) -> None:
    data = bytearray(_shard(folder).read_bytes())
    data[-40:-30] = bytes(b ^ 0xFF for b in data[-40:-30])
    _shard(folder).write_bytes(bytes(data))


def _unlisted_missing_shard(folder: Path) -> None:
    name = _shard(folder).name
    _shard(folder).unlink()
    manifest = json.loads((folder / ckpt.MANIFEST_NAME).read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != name]
    write_json_atomic(folder / ckpt.MANIFEST_NAME, manifest)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, r"__0_0\.distcp has \d+ bytes but manifest\.json lists \d+ \(truncated"),
        (_flip_bytes, r"__0_0\.distcp does not match its sha256 in manifest\.json"),
        (lambda f: _shard(f).unlink(), r"__0_0\.distcp is missing \(listed in manifest\.json"),
        (_unlisted_missing_shard, r"__0_0\.distcp is missing \(a shard referenced by \.metadata"),
        (lambda f: (f / "manifest.json").unlink(), r"step-1/manifest\.json is missing"),
        (lambda f: (f / "manifest.json").write_text("{"), r"manifest\.json is not a valid"),
    ],
    ids=["truncated", "corrupted", "missing-shard", "unlisted-missing-shard", "no-manifest",
         "bad-manifest"],
)  # fmt: skip
def test_damaged_checkpoint_is_refused_in_one_line(plain_checkpoint, damage, message):
    damage(plain_checkpoint)
    model = _build()
    before = model.embed.weight.detach().clone()
    with pytest.raises(CheckpointError, match=message) as error:
        ckpt.load(model, torch.optim.AdamW(model.parameters()), plain_checkpoint)
    assert "\n" not in str(error.value) and str(plain_checkpoint) in str(error.value)
    assert torch.equal(model.embed.weight, before)  # nothing was loaded


def test_wrong_model_config_is_refused_in_one_line(plain_checkpoint):
    model = _build(vocab=23)
    with pytest.raises(CheckpointError) as error:
        ckpt.load(model, torch.optim.AdamW(model.parameters()), plain_checkpoint)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{plain_checkpoint}/.metadata: ")
    assert (
        "model tensor 'embed.weight' has shape [19, 10] in the checkpoint but [23, 10]" in message
    )
    assert "more" in message and "another model config" in message


def test_model_only_checkpoint_has_no_optimizer_state(tmp_path):
    model = _build()
    path = ckpt.save(model, None, tmp_path / "model-only", rng=False)
    assert ckpt.load(_build(), None, path) == {}
    with pytest.raises(CheckpointError, match="the checkpoint holds no optimizer state at all"):
        ckpt.load(model, torch.optim.AdamW(model.parameters()), path)


def _remanifest(folder: Path) -> None:
    manifest = build_manifest(folder, step=1, world_size=1, config_hash="")
    write_json_atomic(folder / ckpt.MANIFEST_NAME, manifest)


class _Exploit:
    def __reduce__(self):
        return (exec, ("open('pwned', 'w').close()",))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loading_never_unpickles_code(plain_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 1. DCP's .metadata index replaced by a pickle that runs code.
    (plain_checkpoint / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    _remanifest(plain_checkpoint)  # checksums fine: the file is what the manifest says
    model = _build()
    with pytest.raises(CheckpointError, match=r"\.metadata is not valid DCP metadata .*exec"):
        ckpt.load(model, None, plain_checkpoint)
    # 2. A pickled object where a tensor belongs (DCP would torch.load it unsafely).
    state = {"model": {**_build().state_dict(), "temperature": _Exploit()}}
    evil = tmp_path / "evil"
    dcp.save(state, checkpoint_id=str(evil), no_dist=True)
    _remanifest(evil)
    with pytest.raises(CheckpointError, match="model tensor 'temperature' is a pickled object"):
        ckpt.load(model, None, evil)
    assert not (tmp_path / "pwned").exists()


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace .*data: it is not a checkpoint"):
        ckpt.save(_build(), None, tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "data.tmp").exists()  # refused before writing anything
