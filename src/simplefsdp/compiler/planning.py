"""The compiler's planning face: what ``simplefsdp plan`` predicts a step with.

The cost model and its calibration, the auto-bucketing planner's units and
pipeline model, the keep search's choice, the memory estimator and the
graph patterns, under one public module: ``simplefsdp.plan`` imports the
compiler only through it (``tests/unit/test_layout.py`` checks this), so the
compiler's other modules can change without the planner reaching into them.
"""

from __future__ import annotations

from simplefsdp.compiler.auto_bucketing import (
    GatherUnit,
    bucket_comm_s,
    gather_units,
    gathers_per_step,
    greedy_buckets,
    pipeline_time_s,
    step_extra_bytes,
)
from simplefsdp.compiler.cost_model import (
    CostModel,
    LinearFit,
    calibrate_comm,
    measure_comm_overlap,
    node_flops,
)
from simplefsdp.compiler.keep_gathered import choose_kept, free_keep_count
from simplefsdp.compiler.memory_estimate import estimate_memory
from simplefsdp.compiler.passes.bucketing import find_sites
from simplefsdp.compiler.patterns import (
    collective_kind,
    is_compute,
    node_bytes,
    source_placeholder,
)

__all__ = [
    "CostModel",
    "GatherUnit",
    "LinearFit",
    "bucket_comm_s",
    "calibrate_comm",
    "choose_kept",
    "collective_kind",
    "estimate_memory",
    "find_sites",
    "free_keep_count",
    "gather_units",
    "gathers_per_step",
    "greedy_buckets",
    "is_compute",
    "measure_comm_overlap",
    "node_bytes",
    "node_flops",
    "pipeline_time_s",
    "source_placeholder",
    "step_extra_bytes",
]
