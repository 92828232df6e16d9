"""simplefsdp: fully sharded data parallel as DTensor parametrization.

Public API::

    model = simplefsdp.data_parallel(model, mesh, mode="fully_shard", mp_policy=...)
    with simplefsdp.disable_parametrization():
        model.init_weights()
    simplefsdp.compile(model, bucketing="auto")         # or:
    simplefsdp.eager(model, bucketing="per_block")      # the eager executor
    with simplefsdp.no_sync(model):                     # accumulate, reduce later
        loss_fn(model(micro_batch)).backward()
    simplefsdp.reduce_accumulated(model)                # or reduce the sum now (pipelines)

The names are loaded on first use (PEP 562), so ``import simplefsdp`` (and the
``simplefsdp`` command's ``--help``/``--version``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from simplefsdp._version import __version__

if TYPE_CHECKING:
    from simplefsdp.compiler.entry_points import (
        RecompileLimitError,
        comm_report,
        compile,
        compile_backend,
    )
    from simplefsdp.compiler.report import CommReport
    from simplefsdp.eager_executor.api import eager, get_eager_executor, remove_eager
    from simplefsdp.eager_executor.runtime import EagerExecutor
    from simplefsdp.frontend.accumulation import no_sync, reduce_accumulated
    from simplefsdp.frontend.data_parallel import (
        DataParallelState,
        data_parallel,
        get_data_parallel_state,
        parallelize_experts_and_data,
    )
    from simplefsdp.frontend.expert_parallel import (
        ExpertParallel,
        apply_expert_parallel,
        build_expert_parallel_mesh,
    )
    from simplefsdp.frontend.float8 import convert_linears_to_float8
    from simplefsdp.frontend.parametrization import disable_parametrization
    from simplefsdp.frontend.rank_check import RankDivergenceError
    from simplefsdp.policies import MixedPrecisionPolicy

# public name -> module defining it
_LAZY: dict[str, str] = {
    "CommReport": "simplefsdp.compiler.report",
    "CostModel": "simplefsdp.compiler.cost_model",
    "DataParallelState": "simplefsdp.frontend.data_parallel",
    "EagerExecutor": "simplefsdp.eager_executor.runtime",
    "ExpertParallel": "simplefsdp.frontend.expert_parallel",
    "MixedPrecisionPolicy": "simplefsdp.policies",
    "RankDivergenceError": "simplefsdp.frontend.rank_check",
    "RecompileLimitError": "simplefsdp.compiler.entry_points",
    "apply_expert_parallel": "simplefsdp.frontend.expert_parallel",
    "build_expert_parallel_mesh": "simplefsdp.frontend.expert_parallel",
    "comm_report": "simplefsdp.compiler.entry_points",
    "compile": "simplefsdp.compiler.entry_points",
    "compile_backend": "simplefsdp.compiler.entry_points",
    "convert_linears_to_float8": "simplefsdp.frontend.float8",
    "data_parallel": "simplefsdp.frontend.data_parallel",
    "disable_parametrization": "simplefsdp.frontend.parametrization",
    "eager": "simplefsdp.eager_executor.api",
    "get_data_parallel_state": "simplefsdp.frontend.data_parallel",
    "get_eager_executor": "simplefsdp.eager_executor.api",
    "no_sync": "simplefsdp.frontend.accumulation",
    "parallelize_experts_and_data": "simplefsdp.frontend.data_parallel",
    "reduce_accumulated": "simplefsdp.frontend.accumulation",
    "remove_eager": "simplefsdp.eager_executor.api",
}

# the documented names: every entry of _LAZY, and __version__
__all__ = [
    "CommReport",
    "CostModel",
    "DataParallelState",
    "EagerExecutor",
    "ExpertParallel",
    "MixedPrecisionPolicy",
    "RankDivergenceError",
    "RecompileLimitError",
    "__version__",
    "apply_expert_parallel",
    "build_expert_parallel_mesh",
    "comm_report",
    "compile",
    "compile_backend",
    "convert_linears_to_float8",
    "data_parallel",
    "disable_parametrization",
    "eager",
    "get_data_parallel_state",
    "get_eager_executor",
    "no_sync",
    "parallelize_experts_and_data",
    "reduce_accumulated",
    "remove_eager",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
