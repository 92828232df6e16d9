"""The ordered graph passes run on each partitioned graph."""

from __future__ import annotations

import logging
import time

import torch.fx as fx
from torch._guards import detect_fake_mode

from simplefsdp.bucket_plan import BucketPlan
from simplefsdp.compiler.passes.bucketing import (
    CollectiveSite,
    apply_buckets,
    find_sites,
    plan_buckets,
)
from simplefsdp.compiler.passes.float8 import AMAX_BUCKET, fold_double_waits, merge_amax_all_reduces
from simplefsdp.compiler.passes.reordering import reorder
from simplefsdp.compiler.patterns import ALL_DATA_PARALLEL, CollectiveGroups, placeholders
from simplefsdp.compiler.report import BucketInfo

logger = logging.getLogger(__name__)


def _fake_mode(gm: fx.GraphModule):
    vals = [n.meta.get("val") for n in placeholders(gm.graph)]
    return detect_fake_mode([v for v in vals if v is not None])


def run_graph_passes(
    gm: fx.GraphModule,
    graph_name: str,
    options,
    plan: BucketPlan | None,
    primal_names: dict[str, str],
    output_fqns: dict[int, str | None],
    sites: list[CollectiveSite] | None = None,
    groups: CollectiveGroups = ALL_DATA_PARALLEL,
) -> dict:
    """Bucket (when a plan is given) and reorder (when enabled) ``gm`` in place.

    With a plan, the float8 amax all-reduces are merged first (Note: [One
    amax all-reduce per graph]).

    ``sites``: the graph's FSDP collectives when the caller already found
    them (the auto planner does, on the same unchanged forward graph);
    ``None`` finds them here. ``groups``: which collectives are data
    parallel; only those are bucketed and reordered (Note: [Data-parallel
    collectives only]).

    Returns report data: the buckets formed and pass statistics.
    """
    start = time.perf_counter()
    result: dict = {"buckets": [], "notes": []}
    if fold_double_waits(gm.graph):
        gm.recompile()
    if plan is not None:
        for merged in merge_amax_all_reduces(gm, _fake_mode(gm), groups, primal_names):
            result["buckets"].append(
                BucketInfo(
                    "all_reduce", AMAX_BUCKET, merged["params"], merged["bytes"], merged["dtype"]
                )
            )
            result["notes"].append(
                f"float8: {merged['merged']} amax all-reduces -> 1 ({merged['dtype']}, "
                f"{merged['bytes']} B)"
            )
        if sites is None:
            sites = find_sites(gm.graph, primal_names, output_fqns, groups)
        names = [b.name for b in plan.buckets]
        buckets = plan_buckets(sites, plan.bucket_index(), names)
        # Describe the buckets before the rewrite erases their original nodes.
        result["buckets"] += [
            BucketInfo(kind=b.kind, name=b.name, params=b.fqns, bytes=b.bytes, dtype=b.dtype)
            for b in buckets
        ]
        removed = apply_buckets(gm, buckets, _fake_mode(gm))
        result["notes"].append(
            f"bucketing: {len(sites)} collectives -> {len(sites) - removed} ({len(buckets)} buckets)"
        )
    if options.reorder:
        stats = reorder(gm, options.prefetch_distance, groups)
        result["notes"].append(
            "reordering: "
            + ", ".join(f"{k}={v}" for k, v in stats.items())
            + f", prefetch_distance={options.prefetch_distance}"
        )
    result["notes"].append(f"passes took {1000 * (time.perf_counter() - start):.1f} ms")
    logger.debug("%s graph passes: %s", graph_name, result["notes"])
    return result
