"""Eager FSDP2's copies in the plan model: priced at the rate ``--calibrate``
measures (``fsdp2_copy_s_per_byte``), counted as the model counts copies, and
charged at world size 1 too, where FSDP2 still copies around its one-rank
collectives (docs/scale.md); and its groups, sharded, at what the
same measurement leaves per group."""

from __future__ import annotations

import dataclasses

import pytest

from simplefsdp.compiler.auto_bucketing import GatherUnit
from simplefsdp.models.llama3 import get_config, num_params
from simplefsdp.models.registry import get_spec
from simplefsdp.plan.calibrate import (
    FSDP2_BLOCKS,
    FSDP2_PARAMS,
    FSDP2_WIDE,
    FSDP2_WIDTH,
    fsdp2_copy_written_bytes,
    fsdp2_sharded_seconds,
)
from simplefsdp.plan.costs import copy_written_bytes, fsdp2_copy_seconds
from simplefsdp.plan.hardware import get_profile
from simplefsdp.plan.predict import Layout, predict
from simplefsdp.testing import run_distributed

LLAMA = get_spec("llama3")

FIXED = get_profile("cpu-gloo")  # built in: no measured FSDP2 copy rate


def _timing_model_groups(width: int, world_size: int) -> list[list[GatherUnit]]:
    matrix = width * width * 4  # fp32
    return [
        [GatherUnit(f"{b}.{p}", matrix, world_size, 0.0) for p in range(FSDP2_PARAMS)]
        for b in range(FSDP2_BLOCKS)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_calibrations_count_of_written_bytes_is_the_models(world_size) -> None:
    # The rate is measured per byte of the count the prediction multiplies it
    # by: the same count for the timing's model, resharded after forward.
    for width in (FSDP2_WIDTH, FSDP2_WIDE):
        groups = _timing_model_groups(width, world_size)
        written, _ = copy_written_bytes(groups, True)
        assert fsdp2_copy_written_bytes(width, world_size) == pytest.approx(written)
    # At world size 1 the prediction has no groups (nothing is sharded): the
    # same count from the parameters' bytes.
    hw = dataclasses.replace(FIXED, fsdp2_copy_s_per_byte=1e-9)
    total = FSDP2_BLOCKS * FSDP2_PARAMS * FSDP2_WIDE**2 * 4
    assert fsdp2_copy_seconds([], hw, True, total) == pytest.approx(
        fsdp2_copy_written_bytes(FSDP2_WIDE, 1) * 1e-9
    )
    # Kept gathered (no reshard): one all-gather per group, shards in and out.
    assert fsdp2_copy_seconds([], hw, False, total) == pytest.approx(3 * total * 1e-9)


def test_eager_fsdp2s_copies_at_their_measured_rate_at_any_world_size() -> None:
    args = get_config("debug")
    rate = 1e-9
    measured = dataclasses.replace(FIXED, fsdp2_copy_s_per_byte=rate)
    gathered = num_params(args) * 2  # bf16 parameters gathered
    for gpus in (1, 2):
        layout = Layout(gpus=gpus, batch=2, seq=64, engine="fsdp2")
        base, pred = predict(LLAMA, args, layout, FIXED), predict(LLAMA, args, layout, measured)
        # Per group two all-gathers (shards in, group out) and one
        # reduce-scatter (gradients in); at world size 1 the shards are whole.
        written = (2 * (1 + 1 / gpus) + 1) * gathered
        assert pred.time["copies"] == pytest.approx(written * rate, rel=1e-6)
        assert pred.step_s - base.step_s == pytest.approx(
            pred.time["copies"] - base.time["copies"], rel=1e-6
        )
    assert (
        predict(LLAMA, args, Layout(gpus=1, batch=2, seq=64, engine="fsdp2"), FIXED).time["copies"]
        == 0
    )  # without a measured rate, as before: no copies on one rank
    # The compiled engine's copies are not FSDP2's: the rate does not touch it.
    for gpus in (1, 2):
        compiled = Layout(gpus=gpus, batch=2, seq=64, engine="simplefsdp")
        assert (
            predict(LLAMA, args, compiled, measured).step_s
            == predict(LLAMA, args, compiled, FIXED).step_s
        )


# Each timing the measurement asks for runs once (real FSDP2 steps and real
# collectives on 2 ranks); the seconds it is given are scripted, in its order:
# the wide model's unsharded step, FSDP2 step and collectives, then the
# narrow model's.
SCRIPTED_S = (0.1, 0.5, 0.2, 0.01, 0.05, 0.01)


def _measure_scripted() -> float:
    import torch
    import torch.distributed as dist

    times = iter(SCRIPTED_S)

    def timer(run):
        run()
        return next(times)

    measured = fsdp2_sharded_seconds(dist.group.WORLD, torch.device("cpu"), lambda: None, timer)
    assert next(times, None) is None  # every timing was asked for
    return measured


def test_the_measurement_takes_the_collectives_out_and_splits_bytes_from_groups() -> None:
    results = run_distributed(_measure_scripted, 2)
    wide = SCRIPTED_S[1] - SCRIPTED_S[0] - SCRIPTED_S[2]
    narrow = SCRIPTED_S[4] - SCRIPTED_S[3] - SCRIPTED_S[5]
    narrow_bytes = fsdp2_copy_written_bytes(FSDP2_WIDTH, 2)
    grown = fsdp2_copy_written_bytes(FSDP2_WIDE, 2) - narrow_bytes
    rate = (wide - narrow) / grown
    group_s = (narrow - rate * narrow_bytes) / (FSDP2_BLOCKS + 1)
    assert results == [(pytest.approx(rate), pytest.approx(group_s))] * 2
    # The two together give back what FSDP2 added at both widths.
    for width, extra in ((FSDP2_WIDE, wide), (FSDP2_WIDTH, narrow)):
        modelled = (FSDP2_BLOCKS + 1) * group_s + rate * fsdp2_copy_written_bytes(width, 2)
        assert modelled == pytest.approx(extra)


def test_sharded_fsdp2_groups_cost_what_was_measured_sharded() -> None:
    # fsdp2_group_s is the one-rank figure; where the layout shards (data
    # parallel above 1) the measured sharded figure replaces it, if any.
    # 4 blocks: 6 groups with the embedding's and the final norm and output's
    args = get_config("debug")
    hw = dataclasses.replace(FIXED, fsdp2_group_s=1e-3, fsdp2_sharded_group_s=3e-3)
    one = Layout(gpus=1, batch=2, seq=64, engine="fsdp2")
    two = Layout(gpus=2, batch=2, seq=64, engine="fsdp2")
    assert predict(LLAMA, args, one, hw).time["hooks"] == pytest.approx(6e-3)
    assert predict(LLAMA, args, two, hw).time["hooks"] == pytest.approx(18e-3)
    unmeasured = dataclasses.replace(hw, fsdp2_sharded_group_s=0.0)  # older calibrations
    assert predict(LLAMA, args, two, unmeasured).time["hooks"] == pytest.approx(6e-3)
    compiled = Layout(gpus=2, batch=2, seq=64, engine="simplefsdp")
    assert predict(LLAMA, args, compiled, hw).time["hooks"] == 0
