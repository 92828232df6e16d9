"""Options of ``simplefsdp.compile`` / ``compile_backend``, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simplefsdp.parallel_dims import COMPILE_BACKENDS

#: ``torch.compile`` backends (:data:`simplefsdp.parallel_dims.COMPILE_BACKENDS`).
BACKENDS = COMPILE_BACKENDS


@dataclass(frozen=True)
class CompileOptions:
    """Options of ``simplefsdp.compile`` / ``compile_backend`` (validated)."""

    backend: str = "inductor"
    bucketing: Any = "auto"
    reorder: bool = True
    memory_budget_bytes: int | None = None
    reshard_after_forward: bool | int = True
    prefetch_distance: int = 1
    # Buckets kept gathered for backward (Note: [Keeping gathered parameters]).
    keep_gathered: Any = None
    # Injected cost model (tests, reproducible plans); None: calibrate on first use.
    cost_model: Any = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if not isinstance(self.reorder, bool):
            raise TypeError(f"reorder must be a bool, got {self.reorder!r}")
        rf = self.reshard_after_forward
        if not isinstance(rf, int) or (not isinstance(rf, bool) and rf < 2):
            raise TypeError(
                f"reshard_after_forward must be a bool or an int >= 2 (the group size to "
                f"reshard to), got {rf!r}"
            )
        keep = self.keep_gathered
        valid_keep = (
            keep is None
            or keep == "auto"
            or (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0)
            or (isinstance(keep, (list, tuple)) and all(isinstance(k, str) and k for k in keep))
        )
        if not valid_keep:
            raise ValueError(
                f"keep_gathered must be None, 'auto', an int >= 0 or a list of module/parameter "
                f"FQNs, got {keep!r}"
            )
        budget = self.memory_budget_bytes
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
        ):
            raise ValueError(f"memory_budget_bytes must be a positive int or None, got {budget!r}")
        if (
            isinstance(self.prefetch_distance, bool)
            or not isinstance(self.prefetch_distance, int)
            or self.prefetch_distance < 0
        ):
            raise ValueError(
                f"prefetch_distance must be an int >= 0, got {self.prefetch_distance!r}"
            )

    def resolved_keep_gathered(self) -> Any:
        """``keep_gathered`` with its default applied: ``"auto"`` for
        ``bucketing="auto"`` (the planner's choice), else keep nothing."""
        if self.keep_gathered is None:
            return "auto" if isinstance(self.bucketing, str) and self.bucketing == "auto" else 0
        return self.keep_gathered

    def describe(self) -> dict:
        bucketing = self.bucketing
        if not isinstance(bucketing, (str, list, tuple)):
            bucketing = getattr(bucketing, "__name__", repr(bucketing))
        return {
            "backend": self.backend,
            "bucketing": bucketing,
            "reorder": self.reorder,
            "memory_budget_bytes": self.memory_budget_bytes,
            "reshard_after_forward": self.reshard_after_forward,
            "prefetch_distance": self.prefetch_distance,
            "keep_gathered": (
                list(keep)
                if isinstance(keep := self.resolved_keep_gathered(), (list, tuple))
                else keep
            ),
            "cost_model": "injected" if self.cost_model is not None else "calibrated",
        }
