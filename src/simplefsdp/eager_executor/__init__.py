"""The eager executor: the FSDP paper's hook-based runtime on simplefsdp's
sharded representation, for models that cannot be compiled.

Example::

    model = simplefsdp.data_parallel(model, mesh, mode="fully_shard")
    model = simplefsdp.eager(model, bucketing="per_block")
    optimizer = torch.optim.AdamW(model.parameters())

    executor = simplefsdp.get_eager_executor(model)
    with executor.no_sync():              # gradient accumulation without communication
        loss_fn(model(micro_batch_0)).backward()
    loss_fn(model(micro_batch_1)).backward()  # reduces once
    simplefsdp.remove_eager(model)        # back to data_parallel's own execution

``simplefsdp.eager``, ``simplefsdp.get_eager_executor``,
``simplefsdp.remove_eager`` and ``simplefsdp.EagerExecutor`` are exported at
the top level; the rest of this package's names are imported from
``simplefsdp.eager_executor``.
"""

from simplefsdp.eager_executor.api import eager, get_eager_executor, remove_eager
from simplefsdp.eager_executor.collectives import Collectives, Work
from simplefsdp.eager_executor.runtime import EagerExecutor, EagerStats, TraceEvent
