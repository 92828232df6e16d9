"""The data-parallel frontend: sharded DTensor parameters read through a parametrization."""

from simplefsdp.frontend.accumulation import no_sync, reduce_accumulated
from simplefsdp.frontend.data_parallel import (
    DataParallelState,
    data_parallel,
    get_data_parallel_state,
)
from simplefsdp.frontend.parametrization import (
    ParamSpec,
    disable_parametrization,
    parametrization_enabled,
)
