"""The compiler's planning face: what ``simplefsdp plan`` predicts a step with.

The cost model and its calibration, the auto-bucketing planner's units and
pipeline model, the keep search's choice, the memory estimator and the
graph patterns, under one public module: ``simplefsdp.plan`` imports the
compiler only through it (``tests/unit/test_layout.py`` checks this), so the
compiler's other modules can change without the planner reaching into them.
"""

from __future__ import annotations

from simplefsdp.compiler.auto_bucketing import (  # noqa: F401 (re-exported for simplefsdp.plan)
    GatherUnit,
    bucket_comm_s,
    gather_units,
    gathers_per_step,
    greedy_buckets,
    pipeline_time_s,
    step_extra_bytes,
)
from simplefsdp.compiler.cost_model import (  # noqa: F401 (re-exported for simplefsdp.plan)
    CostModel,
    LinearFit,
    calibrate_comm,
    measure_comm_overlap,
    node_flops,
)
from simplefsdp.compiler.keep_gathered import choose_kept, free_keep_count  # noqa: F401 (re-exported for simplefsdp.plan)
from simplefsdp.compiler.memory_estimate import _collective_waits as collective_waits  # noqa: F401 (re-exported: the allocator simulation frees as estimate_memory counts)
from simplefsdp.compiler.memory_estimate import (
    estimate_memory,  # noqa: F401 (re-exported for simplefsdp.plan)
    storage_root,  # noqa: F401 (re-exported: the allocator simulation allocates as estimate_memory counts)
)
from simplefsdp.compiler.passes.bucketing import find_sites  # noqa: F401 (re-exported for simplefsdp.plan)
from simplefsdp.compiler.patterns import (  # noqa: F401 (re-exported for simplefsdp.plan)
    collective_group_size,
    collective_kind,
    is_compute,
    node_bytes,
    source_placeholder,
    wait_of,
)
