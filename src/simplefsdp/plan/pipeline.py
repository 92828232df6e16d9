"""A pipeline rank's blocks and schedule for ``simplefsdp plan``: where its
memory peaks and how many microbatch slots a step takes (Note: [Pipeline
schedules in the plan] in ``simplefsdp/plan/predict.py``), for both plan
methods (traced graphs and a model's shapes)."""

from __future__ import annotations

from typing import Any

import torch

_RANK_BLOCKS: dict[tuple, list[tuple[int, int]]] = {}


def _rank_blocks(spec: Any, config: Any, pp: int, stages_per_rank: int) -> list[tuple[int, int]]:
    """Each of ``pp`` pipeline ranks' ``(blocks, blocks with routed
    experts)``, each rank holding ``stages_per_rank`` stages ("loop"
    placement: rank ``r`` the stages ``r + k * pp``), as the family's
    ``pipeline_split`` splits a model built on the meta device."""
    key = (spec.family, config, pp, stages_per_rank)
    if key not in _RANK_BLOCKS:
        with torch.device("meta"):
            model = spec.build(config)
        n = pp * stages_per_rank
        stages = [
            (
                len(stage.layers),
                sum(bool(getattr(b, "moe_enabled", False)) for b in stage.layers.values()),
            )
            for stage in spec.pipeline_split(model, list(range(n)), n)
        ]
        _RANK_BLOCKS[key] = [
            (sum(s[0] for s in stages[r::pp]), sum(s[1] for s in stages[r::pp])) for r in range(pp)
        ]
    return _RANK_BLOCKS[key]


def stage_blocks(spec: Any, config: Any, pp: int, stages_per_rank: int = 1) -> int:
    """Blocks of the most loaded of ``pp`` pipeline ranks (see
    :func:`_rank_blocks` for the placement)."""
    if pp == 1:
        return config.n_layers
    return max(blocks for blocks, _ in _rank_blocks(spec, config, pp, stages_per_rank))


def stage_compositions(
    spec: Any, config: Any, pp: int, stages_per_rank: int = 1
) -> list[tuple[int, int]]:
    """The ``(blocks, blocks with routed experts)`` of the pipeline ranks
    that may be the most loaded: those no other rank outdoes in both blocks
    with and without routed experts (a model's leading dense blocks make
    its first rank one, the ranks of only routed-expert blocks another),
    most blocks with routed experts first (see :func:`_rank_blocks` for the
    placement)."""
    if pp == 1:
        return [(config.n_layers, getattr(config, "n_moe_layers", 0))]
    ranks = set(_rank_blocks(spec, config, pp, stages_per_rank))

    def outdone(r: tuple[int, int]) -> bool:
        return any(o != r and o[1] >= r[1] and o[0] - o[1] >= r[0] - r[1] for o in ranks)

    return sorted((r for r in ranks if not outdone(r)), key=lambda r: (-r[1], -r[0]))


def first_rank_actions(schedule: str, m: int, p: int, v: int) -> list[tuple[str, int]]:
    """The first pipeline rank's forwards (``"F"``) and backwards (``"B"``)
    in the order the schedule runs them, each with its local stage (``0``
    to ``v - 1``), as torch's schedules order them (Note: [Pipeline
    schedules in the plan])."""
    if schedule == "gpipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1f1b":
        warmup = min(m, p)
        return [("F", 0)] * warmup + [("B", 0), ("F", 0)] * (m - warmup) + [("B", 0)] * warmup
    # interleaved 1F1B: rank 0's warmup, then one forward and one backward
    # per step, then the remaining backwards; stages in rounds of
    # ``per_round`` microbatches, backwards from the last local stage
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1), total)
    steady = total - warmup

    def forward(op: int) -> int:
        return (op // per_round) % v

    def backward(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    actions = [("F", forward(op)) for op in range(warmup)]
    for op in range(warmup, warmup + steady):
        actions += [("F", forward(op)), ("B", backward(op))]
    actions += [("B", backward(op)) for op in range(warmup + steady, total + warmup)]
    return actions


def pipeline_peak(layout: Any, activation_bytes: float, sum_bytes: float) -> tuple[float, float]:
    """Where the first pipeline rank's memory peaks (Note: [Pipeline
    schedules in the plan]): the microbatches whose activations it holds
    then (in microbatches over all its blocks, ``activation_bytes`` each)
    and the fraction of its gradient sums (``sum_bytes`` in all) alive,
    each local stage's from its first backward on. Without a pipeline one
    microbatch, beside the sums where there are several."""
    m, p, v = layout.microbatches, layout.pp, layout.stages_of_rank
    if p == 1:
        return 1.0, 1.0 if m > 1 else 0.0
    held, summed, best = 0, set(), (-1.0, 0.0, 0.0)
    for kind, stage in first_rank_actions(layout.pp_schedule, m, p, v):
        if kind == "F":
            held += 1
        else:
            held -= 1
            summed.add(stage)
        units, fraction = held / v, len(summed) / v
        total = units * activation_bytes + fraction * sum_bytes
        if total > best[0]:
            best = (total, units, fraction)
    return best[1], best[2]


def pipeline_slots(layout: Any) -> float:
    """A step's length in microbatch slots of the first rank's blocks (Note:
    [Pipeline schedules in the plan])."""
    if layout.pp == 1:
        return float(layout.microbatches)
    return layout.microbatches + (layout.pp - 1) / layout.stages_of_rank


_SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}


def pipeline_note(
    layout: Any, inflight: float, sums_alive: float | None, blocks: int | None = None
) -> str:
    """The plan's one line on its pipeline: the schedule, the stages (and
    ``blocks``) of a rank, what the first rank holds at its peak
    (``sums_alive``: the fraction of the gradient sums, ``None`` without
    any)."""
    name = _SCHEDULE_NAMES.get(layout.pp_schedule, layout.pp_schedule)
    where = (
        f", {blocks} block{'s' * (blocks != 1)} on the most loaded rank "
        "(with the embedding and the output)"
        if blocks is not None
        else ""
    )
    sums = f" and {sums_alive:.0%} of the gradient sums" if sums_alive is not None else ""
    return (
        f"pipeline: {name}, {layout.stages_of_rank} stage(s) per rank{where}; the first rank "
        f"peaks holding {inflight:g} microbatch(es) of activations{sums}; activation "
        "send/recv between stages not modelled"
    )
