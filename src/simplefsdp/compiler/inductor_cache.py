"""Inductor's FX graph cache for graphs our passes have processed.

Note: [Inductor's cache for processed graphs]
    Inductor's FX graph cache is off while AOTAutograd traces and partitions
    (our joint pass and partitioner are plain callables, not hashable graph
    passes), and on again, as the user has it, around ``compile_fx_inner``,
    which receives each graph after our passes ran: the cache key is then the
    final graph with its inputs and Inductor's config, so a hit returns code
    compiled from exactly this graph. Our passes and the report still run on
    every compile (they take seconds; Inductor's code generation and C++/Triton
    compilation are what the cache saves). The key would still change from
    process to process through the DeviceMesh inputs' hash cache, so pickling
    is made stable for the call (Note: [Stable DeviceMesh pickles for
    Inductor's cache] in ``simplefsdp._compat``). AOTAutograd's own cache stays
    off: a hit there would skip our joint pass. ``inductor_cache_counts()``
    tells how many graphs were served from the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from simplefsdp._compat import stable_mesh_pickling


@contextlib.contextmanager
def cache_processed_graph(use_cache: bool) -> Iterator[None]:
    """Around ``compile_fx_inner`` of a graph our passes have processed: the
    FX graph cache as the user has it (``use_cache``), without our joint pass
    and partitioner in Inductor's config (they already ran, and they are not
    hashable graph passes), with DeviceMesh inputs pickled stably."""
    config = torch._inductor.config
    patches = {"fx_graph_cache": use_cache, "joint_custom_post_pass": None}
    if hasattr(config, "custom_partitioner_fn"):  # not in every torch we support
        patches["custom_partitioner_fn"] = None
    with config.patch(patches), stable_mesh_pickling():
        yield


def inductor_cache_counts() -> dict[str, int]:
    """Graphs compiled by Inductor in this process so far, by how its FX graph
    cache served them: ``{"hit": ..., "miss": ..., "bypass": ...}``."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {k: int(inductor[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")}
