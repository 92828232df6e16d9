"""The learning-rate schedule of ``simplefsdp train``: linear warm-up, then cosine decay."""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Any

import torch

from simplefsdp.train.config import JobConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` steps (``(step + 1) / warmup_steps``,
    so the first step already moves), then cosine decay from 1 to
    ``min_lr_ratio``, reaching it at the last step ``total_steps - 1``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, job: JobConfig, *, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine ``LambdaLR`` for ``job.training``, positioned at ``start_step``.

    The learning rate is a function of the step and the configuration only:
    every param group gets ``training.lr * lr_factor(step)``. A resumed run
    builds its scheduler with ``start_step`` = the checkpoint's step (no
    scheduler state is restored), so the first resumed step already follows
    the current ``training.steps``, ``warmup_steps``, ``lr`` and ``min_lr_ratio``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set.
        job: the job config (its ``training`` section).
        start_step: optimizer steps already taken (0-based index of the next step).
    """
    t = job.training
    fn = partial(
        lr_factor,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps,
        min_lr_ratio=t.min_lr_ratio,
    )
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = t.lr
    with warnings.catch_warnings():
        # Positioning a new scheduler on a resumed step is not a skipped optimizer.step().
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=fn, last_epoch=start_step - 1)


def json_ready(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with tuples as lists and only JSON-representable values kept."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out
