"""The mixture-of-experts workload of ``simplefsdp bench``: both engines' recipes.

Note: [Bench MoE recipes]
    The model is a ``simplefsdp.models.moe`` config (``moe_debug`` by
    default), built with real weights under the seed on every rank. With
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

    The tokens each expert receives change from step to step: a compiled
    configuration compiles in its first step and recompiles in its second,
    when Dynamo marks the token counts dynamic (measured: about as long as
    the first compile, then steady). The workload therefore warms up for 3
    steps; with ``--warmup`` below 3 compiled rows time a recompile.

    After each optimizer step the routing bias is updated from the step's
    global expert load (``update_expert_bias``), so both engines train the
    same auxiliary-loss-free balancing and their losses must agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["MOE_BENCH_CONFIGS", "build_moe_model", "is_moe_model", "parallelize_moe"]

#: The configurations the MoE workload runs (``all`` selects these).
MOE_BENCH_CONFIGS: tuple[str, ...] = (
    "fsdp2",
    "fsdp2-compile",
    "simplefsdp-uncompiled",
    "simplefsdp-none",
    "simplefsdp-manual",
    "simplefsdp-auto",
)


def is_moe_model(name: str) -> bool:
    """Whether ``name`` is a ``simplefsdp.models.moe`` config."""
    from simplefsdp.models import MOE_MODELS

    return name in MOE_MODELS


def moe_args(model: str, overrides: dict[str, Any], seq_len: int) -> Any:
    """The ``MoEArgs`` of config ``model`` with ``overrides``, ``max_seq_len``
    raised to ``seq_len`` where shorter.

    Raises:
        ValueError: an unknown field or value (the model's own errors).
    """
    from simplefsdp.models.moe import get_config

    args = get_config(model, **overrides)
    if seq_len > args.max_seq_len:
        args = args.replace(max_seq_len=seq_len)
    return args


def build_moe_model(model: str, overrides: dict[str, Any], seq_len: int, seed: int) -> nn.Module:
    """The MoE model on the CPU, initialised under ``seed``."""
    from simplefsdp.models.moe import Transformer

    args = moe_args(model, overrides, seq_len)
    torch.manual_seed(seed)
    return Transformer(args)


def parallelize_moe(config: Any, model: nn.Module, meshes: Any, device: torch.device, param_dtype):
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
    from simplefsdp.models.moe.spec import SPEC

    if config.name not in MOE_BENCH_CONFIGS or not get_engine(config.engine).supports("ep"):
        raise ValueError(
            f"configuration {config.name!r} does not run the MoE workload; valid: "
            f"{', '.join(MOE_BENCH_CONFIGS)}"
        )
    ep, world = meshes.layout.ep, meshes.layout.world_size
    engine = dataclasses.replace(config.engine_spec(1, param_dtype), ep=ep)
    parallel = parallelize_model(model, SPEC, meshes, engine, device)
    parallel.notes.append(f"experts: ep {ep} x dp_shard_mod_ep {world // ep}; dense: dp {world}")
    return parallel


def update_routing(model: nn.Module) -> None:
    """The auxiliary-loss-free routing-bias update, once per optimizer step."""
    from simplefsdp.models.moe import update_expert_bias

    update_expert_bias(model)
