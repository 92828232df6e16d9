"""Clean stop: every rank learns of any rank's signal after the same step, one step late."""

from __future__ import annotations

import signal

import pytest
import torch

from simplefsdp.testing import run_distributed


def _agree(signalled_at: dict[int, tuple[int, int]]) -> list[int]:
    import torch.distributed as dist

    from simplefsdp.train.interrupts import StopAgreement

    agreement = StopAgreement(torch.device("cpu"), dist.get_world_size())
    rank, signum = dist.get_rank(), None
    results = []
    for step in range(1, 7):
        at, sig = signalled_at.get(rank, (0, 0))
        signum = signum or (sig if at == step else None)
        results.append(agreement.after_step(signum))
    return results


def test_all_ranks_stop_after_the_same_step_and_learn_the_signal():
    # rank 1 gets SIGTERM during step 3; rank 0 SIGINT during step 5 (too late
    # to matter): both learn after step 4 that SIGTERM stopped the run
    term, intr = int(signal.SIGTERM), int(signal.SIGINT)
    results = run_distributed(_agree, world_size=2, args=({1: (3, term), 0: (5, intr)},))
    assert results[0] == results[1] == [0, 0, 0, term, term, term]


def test_one_process_answers_at_once():
    from simplefsdp.train.interrupts import StopAgreement

    agreement = StopAgreement(torch.device("cpu"), 1)
    assert agreement.after_step(None) == 0
    assert agreement.after_step(int(signal.SIGINT)) == int(signal.SIGINT)
    assert agreement.after_step(signal.SIGTERM) == int(signal.SIGTERM)  # the enum, too
    with pytest.raises(
        ValueError, match="signum must be a positive signal number or None, got True"
    ):
        agreement.after_step(True)


def test_a_rank_without_a_signal_reports_the_agreed_one():
    from simplefsdp.train.interrupts import StopRequest

    quiet, signalled = StopRequest(), StopRequest()
    signalled._handle(int(signal.SIGINT), None)
    assert quiet.settle(int(signal.SIGTERM)) == "SIGTERM (received by another rank)"
    assert quiet.exit_code == 128 + signal.SIGTERM
    assert signalled.settle(int(signal.SIGTERM)) == "SIGINT"  # its own signal first
    assert signalled.exit_code == 128 + signal.SIGINT
