"""Names that differ between the torch versions we support (2.11 to 2.13)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "root_mesh"]

# torch >= 2.13 renames the single-tensor collectives and the old names warn
# (FutureWarning); torch 2.11 has only the old names. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def root_mesh(mesh):
    """The mesh that ``mesh`` was sliced from (``mesh`` itself if not sliced).

    ``DeviceMesh._get_root_mesh`` where torch has it; older torch keeps the
    relation in ``_mesh_resources``.
    """
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)
