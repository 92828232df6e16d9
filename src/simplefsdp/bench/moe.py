"""The mixture-of-experts workload of ``simplefsdp bench``: both engines' recipes.

Note: [Bench MoE recipes]
    The model is a flavor of a family with expert parallelism (the
    workload's model), built with real weights under the seed on every rank. With
    ``--ep`` ranks per expert-parallel group, the ranks form the 2-D mesh
    ``(dp_shard_mod_ep, ep)`` of ``Layout(ep=...)`` and every experts module
    gets :class:`~simplefsdp.frontend.expert_parallel.ExpertParallel` over
    ``ep`` (``ep`` 1: one rank per group, tokens stay on their rank). Then the
    one recipe (:func:`simplefsdp.engines.parallelize_model`) parallelises it,
    as torchtitan parallelises its MoE models:

    - ``simplefsdp``: ``data_parallel`` with the dense parameters over all
      data-parallel ranks and the experts over ``dp_shard_mod_ep``
      (``expert_mesh``); compiled configurations run ``simplefsdp.compile``
      with ``fullgraph=False`` (the token counts are read to the host to size
      the all-to-alls: a graph break).
    - ``fsdp2``: ``fully_shard`` on each block's experts over
      ``dp_shard_mod_ep``, then on each block and the root over all
      data-parallel ranks (the root not resharded after forward); compiled
      configurations compile each block in place first, ``fullgraph=False``.

    The tokens each expert receives change from step to step; the
    expert-parallel region runs uncompiled (Note: [Expert parallelism under
    torch.compile]), so compiled configurations compile once. The workload
    warms up for 3 steps.

    After each optimizer step the family's ``after_optimizer_step`` updates
    the routing bias from the step's global expert load, so both engines
    train the same auxiliary-loss-free balancing and their losses must agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

#: The configurations the MoE workload runs (``all`` selects these).
MOE_BENCH_CONFIGS: tuple[str, ...] = (
    "fsdp2",
    "fsdp2-compile",
    "simplefsdp-uncompiled",
    "simplefsdp-none",
    "simplefsdp-manual",
    "simplefsdp-auto",
)


def parallelize_moe(
    config: Any, model: nn.Module, spec: Any, meshes: Any, device: torch.device, param_dtype
):
    """``config``'s engine applied to the MoE ``model`` by the one recipe
    (:func:`simplefsdp.engines.parallelize_model` on ``meshes``, the job's
    ``Layout(ep=...)``; Note: [Bench MoE recipes]).

    Returns:
        A :class:`simplefsdp.engines.ParallelModel` stepping with the MoE
        spec's loss, its ``notes`` naming the layout.

    Raises:
        ValueError: a configuration whose engine has no expert parallelism.
    """
    import dataclasses

    from simplefsdp.engines import get_engine, parallelize_model

    if config.name not in MOE_BENCH_CONFIGS or not get_engine(config.engine).supports("ep"):
        raise ValueError(
            f"configuration {config.name!r} does not run the MoE workload; valid: "
            f"{', '.join(MOE_BENCH_CONFIGS)}"
        )
    ep, world = meshes.layout.ep, meshes.layout.world_size
    engine = dataclasses.replace(config.engine_spec(1, param_dtype), ep=ep)
    parallel = parallelize_model(model, spec, meshes, engine, device)
    parallel.notes.append(f"experts: ep {ep} x dp_shard_mod_ep {world // ep}; dense: dp {world}")
    return parallel
