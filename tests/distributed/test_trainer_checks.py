"""Checks the trainer makes across ranks before training (2 CPU processes)."""

from __future__ import annotations

import torch.distributed as dist

from simplefsdp.testing import run_distributed


def _check(fingerprints):
    from types import SimpleNamespace

    from simplefsdp.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.world_size = dist.get_world_size()
    trainer.job = SimpleNamespace(data=SimpleNamespace(path="corpus/"))
    try:
        trainer._check_same_data(fingerprints[dist.get_rank()])
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_read_other_data_are_named():
    same = {"num_tokens": 10, "data_hash": 7}
    assert run_distributed(_check, world_size=2, args=([same, dict(same)],)) == [None, None]
    other = {"num_tokens": 10, "data_hash": 8}
    errors = run_distributed(_check, world_size=2, args=([same, other],))
    assert errors[0] == errors[1] and errors[0].startswith("ranks [1] read other data than rank 0")
    assert "same data.path 'corpus/'" in errors[0]
