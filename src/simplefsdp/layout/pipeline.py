"""The pipeline settings of a layout, checked once (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping

from simplefsdp.parallel_dims import INTERLEAVED_SCHEDULES, PIPELINE_SCHEDULES

_NAMES = {
    "pp": "pp",
    "pp_schedule": "pp_schedule",
    "microbatches": "microbatches",
    "stages_per_rank": "stages_per_rank",
    "batch": "batch",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def num_stages(pp: int, schedule: str, stages_per_rank: int | None = None) -> int:
    """Pipeline stages over all ``pp`` ranks (``stages_per_rank`` ``None``: 2 for
    the interleaved schedules, else 1)."""
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule in INTERLEAVED_SCHEDULES else 1
    return pp * stages_per_rank


def pipeline_errors(
    pp: int,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    *,
    batch: int | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Every error of a pipeline's settings, one line each.

    The rules: a known schedule; interleaved schedules hold >= 2 stages per
    rank, the others 1; 1F1B needs at least ``pp`` micro-batches; the
    per-rank ``batch`` divides into ``microbatches`` (``None``: ``pp``). With
    ``pp == 1`` only the last (``microbatches``: batches accumulated per step).

    Args:
        pp: pipeline degree.
        schedule: one of :data:`PIPELINE_SCHEDULES`.
        microbatches: micro-batches per step (``None``: ``pp``).
        stages_per_rank: stages each rank holds (``None``: the schedule's default).
        batch: the per-rank batch (``None``: not checked).
        names: how the caller's user spells each setting (its flags).
    """
    n = {**_NAMES, **(names or {})}
    errors: list[str] = []
    if pp <= 1:
        if microbatches is not None and microbatches < 1:
            errors.append(f"{n['microbatches']} must be >= 1, got {microbatches}")
        elif microbatches is not None:
            errors += _batch_errors(batch, microbatches, 1, n)
        return errors
    if schedule not in PIPELINE_SCHEDULES:
        errors.append(
            f"{n['pp_schedule']}: unknown pipeline schedule {schedule!r}; valid: "
            + ", ".join(PIPELINE_SCHEDULES)
        )
        return errors
    interleaved = schedule in INTERLEAVED_SCHEDULES
    if stages_per_rank is not None:
        if interleaved and stages_per_rank < 2:
            errors.append(
                f"schedule {schedule!r} needs {n['stages_per_rank']} >= 2, got {stages_per_rank}"
            )
        if not interleaved and stages_per_rank != 1:
            errors.append(
                f"schedule {schedule!r} runs one stage per rank, got {n['stages_per_rank']} "
                f"{stages_per_rank}; use 'interleaved_1f1b' for more"
            )
    micro = pp if microbatches is None else microbatches
    if micro < 1:
        errors.append(f"{n['microbatches']} must be >= 1, got {micro}")
        return errors
    if schedule == "1f1b" and micro < pp:
        errors.append(
            f"{n['microbatches']} {micro} is below {n['pp']} {pp} (1F1B needs at least one "
            f"micro-batch per stage); valid: >= {pp}"
        )
    return errors + _batch_errors(batch, micro, pp, n)


def _batch_errors(batch: int | None, micro: int, least: int, n: Mapping[str, str]) -> list[str]:
    if batch is None or batch <= 0 or batch % micro == 0:
        return []
    valid = [d for d in _divisors(batch) if d >= least]
    fix = (
        f"valid {n['microbatches']}: {', '.join(map(str, valid))}"
        if valid
        else f"use a {n['batch']} that is a multiple of {micro}"
    )
    return [f"{n['batch']} {batch} is not divisible by {n['microbatches']} {micro}; {fix}"]
