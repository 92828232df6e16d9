"""The parallel layout of a job: its degrees, checked once, and the meshes built from them.

:class:`Layout` holds the degrees (``dp_replicate``, ``dp_shard``, ``cp``,
``tp``, ``pp``, ``ep``) and is plain data: :meth:`Layout.resolve` fills in
``dp_shard = -1`` (the ranks left) and :meth:`Layout.validate` returns every
degree error at once, both without torch, so a command line checks a layout
before any process starts. :meth:`Layout.build` makes the job's one
``DeviceMesh`` and hands out its views by role (:class:`Meshes`): the FSDP
mesh, the ranks that read different batches, the loss mesh, and the TP, PP,
EP and expert data-parallel meshes. Nothing else in simplefsdp constructs a
device mesh. ``import simplefsdp.layout`` does not import torch.
"""

from simplefsdp.layout.layout import DIM_ORDER, Layout, Meshes, build_meshes, meshes_of
from simplefsdp.layout.pipeline import pipeline_errors

__all__ = [
    "Layout",
    "Meshes",
    "pipeline_errors",
]
