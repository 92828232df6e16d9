"""simplefsdp: fully sharded data parallel as DTensor parametrization.

Public API::

    model = simplefsdp.data_parallel(model, mesh, mode="fully_shard", mp_policy=...)
    with simplefsdp.disable_parametrization():
        model.init_weights()
"""

from simplefsdp.api import MixedPrecisionPolicy
from simplefsdp.compiler import comm_report, compile, compile_backend
from simplefsdp.eager import eager
from simplefsdp.frontend import (
    data_parallel,
    disable_parametrization,
    get_data_parallel_state,
)

__version__ = "0.1.0"

__all__ = [
    "MixedPrecisionPolicy",
    "__version__",
    "comm_report",
    "compile",
    "compile_backend",
    "data_parallel",
    "disable_parametrization",
    "eager",
    "get_data_parallel_state",
]
