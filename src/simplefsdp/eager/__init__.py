"""The eager executor: the FSDP paper's hook-based runtime on simplefsdp's
sharded representation, for models that cannot be compiled.

Example::

    model = simplefsdp.data_parallel(model, mesh, mode="fully_shard")
    model = simplefsdp.eager(model, buckets="per_block")
    optimizer = torch.optim.AdamW(model.parameters())

    executor = get_eager_executor(model)  # from simplefsdp.eager import get_eager_executor
    with executor.no_sync():              # gradient accumulation without communication
        loss_fn(model(micro_batch_0)).backward()
    loss_fn(model(micro_batch_1)).backward()  # reduces once

``simplefsdp.eager`` (the attribute of the top-level package) is the function;
import the rest of this package's names from ``simplefsdp.eager`` directly.
"""

from simplefsdp.eager.api import eager, get_eager_executor, remove_eager
from simplefsdp.eager.collectives import Collectives, Work
from simplefsdp.eager.runtime import EagerExecutor, EagerStats, TraceEvent

__all__ = [
    "Collectives",
    "EagerExecutor",
    "EagerStats",
    "TraceEvent",
    "Work",
    "eager",
    "get_eager_executor",
    "remove_eager",
]
