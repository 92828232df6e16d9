"""Names that differ between the torch versions we support (2.11 to 2.13)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

# torch >= 2.13 renames the single-tensor collectives and the old names warn
# (FutureWarning); torch 2.11 has only the old names. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
