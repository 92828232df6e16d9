"""Asynchronous checkpoints (``checkpoint.async_mode``) on 2 CPU processes: a
process killed while its save is written in the background leaves the previous
checkpoint the latest, and resuming from it trains exactly as an uninterrupted run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._faults import FAIL_SAVE_ENV
from simplefsdp.checkpoint import Checkpointer, latest_checkpoint
from simplefsdp.testing import run_distributed
from toy_models import TiedEmbeddingModel, loss_fn, make_batch

GLOBAL_BATCH = 8
STEPS = 4


def _train(folder: str, mode: str, *, resume_from: int = 0, die_saving: int = 0) -> dict:
    """Train ``STEPS`` steps with a save after each (``mode``); each step's global loss.

    ``resume_from``: load that step's checkpoint first. ``die_saving``: rank 0
    is killed (SIGKILL) in the background thread of that step's save, once its
    files are written and before it commits.
    """
    torch.manual_seed(0)
    model = TiedEmbeddingModel(vocab=19)
    model.temperature = torch.nn.Parameter(model.temperature.detach().reshape(1))
    model = simplefsdp.data_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    checkpointer = Checkpointer(
        folder, model=model, optimizer=optimizer, device=torch.device("cpu"), keep_last=2,
        config_hash="h", config_json={}, async_mode=mode,
    )  # fmt: skip
    if resume_from:
        checkpointer.load(Path(folder) / f"step-{resume_from}")
    rows = GLOBAL_BATCH // dist.get_world_size()
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    losses = {}
    for step in range(resume_from + 1, STEPS + 1):
        inputs, targets = make_batch("tied", step, GLOBAL_BATCH)
        loss = loss_fn("tied", model(inputs[mine]), targets[mine])
        loss.backward()
        checkpointer.wait_staged()  # the copy of the previous save, before the update
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses[step] = reduced.item()
        if step == die_saving:
            checkpointer.finish()  # the previous save commits
            os.environ[FAIL_SAVE_ENV] = "after_write"
        checkpointer.save(step, {"step": step})
    checkpointer.close()
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The losses of an uninterrupted run with synchronous saves."""
    folder = tmp_path_factory.mktemp("reference")
    return run_distributed(_train, 2, args=(str(folder), "none"))[0]


@pytest.mark.parametrize(
    "mode", [pytest.param("async", marks=pytest.mark.heavy), "staged"]
)  # the same commit path: one in the default run
def test_killed_during_a_background_save_resumes_from_the_previous_one(tmp_path, mode, reference):
    folder = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="rank 0 died"):
        run_distributed(_train, 2, args=(str(folder), mode), kwargs={"die_saving": 3})
    assert (folder / "step-3.tmp").is_dir()  # written, never committed
    assert latest_checkpoint(folder).step == 2
    (resumed,) = run_distributed(_train, 2, args=(str(folder), mode), kwargs={"resume_from": 2})[:1]
    assert resumed == {3: reference[3], 4: reference[4]}
    assert latest_checkpoint(folder).step == 4
    from simplefsdp.checkpoint.export import load_full_model_state

    assert "embed.weight" in load_full_model_state(folder / "step-4")  # exports like any other
