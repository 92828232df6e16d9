"""The mixture-of-experts workload of ``simplefsdp bench``: both engines' recipes.

Note: [Bench MoE recipes]
    The model is a ``simplefsdp.models.moe`` config (``moe_debug`` by
    default), built with real weights under the seed on every rank. With
    ``--ep`` ranks per expert-parallel group, the ranks form the 2-D mesh
    ``(dp_shard_mod_ep, ep)`` (:func:`~simplefsdp.frontend.expert_parallel.build_expert_parallel_mesh`)
    and every experts module gets :class:`~simplefsdp.frontend.expert_parallel.ExpertParallel`
    over ``ep`` (``ep`` 1: one rank per group, tokens stay on their rank).
    Then, as torchtitan parallelises its MoE models:

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


def parallelize_moe(config: Any, model: nn.Module, ep: int, device: torch.device, param_dtype):
    """``config``'s engine applied to the MoE ``model`` (Note: [Bench MoE recipes]).

    Returns:
        A :class:`simplefsdp.engines.ParallelModel` stepping with the Llama
        cross-entropy, its ``notes`` naming the layout.
    """
    import torch.distributed as dist

    from simplefsdp.engines import ParallelModel
    from simplefsdp.engines.parallelize import dtype_from_name
    from simplefsdp.frontend.expert_parallel import (
        apply_expert_parallel,
        build_expert_parallel_mesh,
    )
    from simplefsdp.models.llama3.parallelize import cross_entropy

    world = dist.get_world_size()
    mesh, dp_mesh = build_expert_parallel_mesh(device.type, world, ep, model.args.num_experts)
    model.to(device)
    apply_expert_parallel(model, mesh["ep"])
    dtype = dtype_from_name(param_dtype)
    reduce_dtype = torch.float32 if dtype is not None else None
    notes = [f"experts: ep {ep} x dp_shard_mod_ep {world // ep}; dense: dp {world}"]
    if config.engine == "simplefsdp":
        import simplefsdp

        simplefsdp.data_parallel(
            model,
            dp_mesh,
            expert_mesh=mesh["dp_shard_mod_ep"],
            mp_policy=simplefsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype),
        )
        forward: Any = model
        if config.compiled:
            forward = simplefsdp.compile(
                model,
                backend="inductor",
                bucketing=config.bucketing or "auto",
                reorder=config.reorder,
                keep_gathered=config.keep_gathered,
                fullgraph=False,
            )
    elif config.engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
        for block in model.layers.values():
            if config.compiled:
                block.compile(backend="inductor", fullgraph=False)
            if block.moe_enabled:
                fully_shard(block.moe.experts, mesh=mesh["dp_shard_mod_ep"], mp_policy=policy)
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
        forward = model
    else:
        raise ValueError(
            f"configuration {config.name!r} does not run the MoE workload; valid: "
            f"{', '.join(MOE_BENCH_CONFIGS)}"
        )
    parallel = ParallelModel(
        model, forward, config.engine, dp_mesh, compiled=config.compiled, notes=notes
    )
    parallel.loss_fn = cross_entropy
    return parallel


def update_routing(model: nn.Module) -> None:
    """The auxiliary-loss-free routing-bias update, once per optimizer step."""
    from simplefsdp.models.moe import update_expert_bias

    update_expert_bias(model)
