"""The ordered graph passes run on each partitioned graph."""

from __future__ import annotations

import torch.fx as fx


def run_graph_passes(
    gm: fx.GraphModule,
    graph_name: str,
    options,
    primal_fqns: list[str | None],
    notes: list[str],
) -> dict | None:
    """Bucketing and reordering arrive with their passes; for now, nothing runs."""
    return None
