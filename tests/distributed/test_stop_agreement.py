"""Clean stop: every rank learns of any rank's signal after the same step, one step late."""

from __future__ import annotations

import torch

from simplefsdp.testing import run_distributed


def _agree(asked_at: dict[int, int]) -> list[bool]:
    import torch.distributed as dist

    from simplefsdp.train.interrupts import StopAgreement

    agreement = StopAgreement(torch.device("cpu"), dist.get_world_size())
    rank, asked = dist.get_rank(), False
    results = []
    for step in range(1, 7):
        asked = asked or asked_at.get(rank) == step
        results.append(agreement.after_step(asked))
    return results


def test_all_ranks_stop_after_the_same_step():
    # rank 1 is signalled during step 3; rank 0 during step 5 (too late to matter)
    results = run_distributed(_agree, world_size=2, args=({1: 3, 0: 5},))
    expected = [False, False, False, True, True, True]  # known after step 4
    assert results == [expected, expected]


def test_one_process_answers_at_once():
    from simplefsdp.train.interrupts import StopAgreement

    agreement = StopAgreement(torch.device("cpu"), 1)
    assert agreement.after_step(False) is False
    assert agreement.after_step(True) is True
