"""``simplefsdp bench``: simplefsdp side by side with torch DDP and FSDP2.

Run it with ``simplefsdp bench --workload compute|comm|memory``; see
``docs/benchmarks.md``. The pieces: :mod:`~simplefsdp.bench.configs` (what
is compared and on which workload), :mod:`~simplefsdp.bench.worker` (one
configuration on one rank), :mod:`~simplefsdp.bench.measure` (timing, memory,
collective counts, communication only), :mod:`~simplefsdp.bench.report`
(rows, loss check, table, JSON, PNG) and :mod:`~simplefsdp.bench.cli` (the
runner).
"""

from simplefsdp.bench.cli import main, run_bench
from simplefsdp.bench.configs import (
    CONFIGS,
    WORKLOADS,
    BenchConfig,
    BenchSpec,
    Workload,
    get_workload,
    resolve_configs,
)
