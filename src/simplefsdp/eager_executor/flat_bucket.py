"""Flat buckets: one bucket's parameters as one padded flat buffer.

Note: [Flat bucket layout]
    A bucket's parameters are stored sharded (DTensor ``Shard(d)`` on the shard
    mesh dim, uneven in ``torch.chunk`` style) or replicated (``replicate``
    mode, 0-d parameters). The executor gathers and reduces a whole bucket with
    one collective each, so every rank contributes a segment of equal size:

    - *per-rank segment* (``shard_numel`` elements): for each sharded slot, this
      rank's shard padded along ``d`` to ``ceil(size_d / shard_size)`` (the
      chunk size, so rank r's rows start at ``r * chunk``); padding is zero.
    - *all-gather output*: rank-major, ``shard_size`` segments back to back.
    - *unsharded flat buffer* (``flat``, the autograd leaf): param-major, so
      each parameter is a view of it: slot i's region holds the ``shard_size``
      padded shards of parameter i one after the other, i.e. the padded full
      parameter (for ``d == 0``), followed by the replicated slots in full.
      Copy-out (gather output -> flat) is one ``split_with_sizes_copy``, as in
      FSDP2. Views of padded parameters strip the padding with ``narrow``; for ``d > 0`` the view
      needs a ``movedim`` + ``reshape`` (a copy held by autograd, so such
      parameters are not freed by resharding until their backward).
    - *gradient*: autograd accumulates the views' gradients into ``flat.grad``
      (param-major; zeros in padding). Before the reduce-scatter it is cast to
      ``reduce_dtype`` and rearranged rank-major with one ``cat``; each rank
      receives its reduced segment and strips its padding per parameter.

    ``flat`` keeps one storage for its whole life: freeing ("resharding")
    resizes the storage to 0 bytes and regathering resizes it back and writes
    into it through ``_flat_data`` (a ``.data`` alias with its own version
    counter), so tensors autograd saved in forward (views of ``flat``) see the
    regathered values in backward without tripping the in-place check. This is
    the FSDP paper's storage-resize technique.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class MeshGroups:
    """The process groups and sizes a bucket communicates over.

    Attributes:
        shard_group: group of the mesh dim parameters are sharded on (the
            only dim for ``replicate``/``fully_shard``, dim 1 for hybrid).
        shard_size: size of ``shard_group``.
        shard_rank: this rank's index in ``shard_group``.
        replicate_group: group of hybrid's replicate dim (mesh dim 0), else None.
        dp_size: number of data-parallel ranks (the ``avg`` divisor).
    """

    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    dp_size: int


@dataclass(frozen=True)
class FlatSlot:
    """Where one parameter lives in its bucket's buffers (see Note: [Flat bucket layout]).

    Attributes:
        fqn: canonical parameter FQN.
        param: the stored parameter (an ``nn.Parameter`` wrapping a DTensor).
        shard_dim: the tensor dim sharded on the shard mesh dim; None if replicated.
        padded_shape: one rank's padded shard (the full shape if replicated).
        local_shape: this rank's actual shard shape.
        offset: start in its section (per-rank segment, or replicated section).
    """

    fqn: str
    param: nn.Parameter
    shard_dim: int | None
    padded_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.padded_shape)

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad


def _shard_dim_of(param: DTensor, shard_mesh_dim: int) -> int | None:
    placement = param.placements[shard_mesh_dim]
    return placement.dim if placement.is_shard() else None


def make_slots(
    named_params: list[tuple[str, nn.Parameter]], shard_mesh_dim: int, groups: MeshGroups
) -> tuple[list[FlatSlot], list[FlatSlot]]:
    """Lay out a bucket's parameters: (sharded slots, replicated slots)."""
    sharded: list[FlatSlot] = []
    replicated: list[FlatSlot] = []
    shard_offset = replicated_offset = 0
    for fqn, param in named_params:
        local_shape = tuple(param.to_local().shape)
        dim = _shard_dim_of(param, shard_mesh_dim)
        if dim is None:
            slot = FlatSlot(fqn, param, None, tuple(param.shape), local_shape, replicated_offset)
            replicated.append(slot)
            replicated_offset += slot.numel
            continue
        chunk = -(-param.shape[dim] // groups.shard_size)  # ceil: torch.chunk's chunk size
        padded = tuple(chunk if i == dim else s for i, s in enumerate(param.shape))
        expected_rows = max(0, min(chunk, param.shape[dim] - groups.shard_rank * chunk))
        assert local_shape[dim] == expected_rows, (fqn, local_shape, padded)
        slot = FlatSlot(fqn, param, dim, padded, local_shape, shard_offset)
        sharded.append(slot)
        shard_offset += slot.numel
    return sharded, replicated


class FlatBucket:
    """One bucket's flat buffers and the copies in and out of them.

    See Note: [Flat bucket layout]. Holds data, not scheduling: the runtime
    decides when to gather, free and reduce.

    Args:
        index: position in the plan.
        name: the plan bucket's name (for logs and profiler labels).
        sharded: sharded slots (``make_slots``).
        replicated: replicated slots.
        groups: process groups and sizes.
        compute_dtype: dtype of the gathered parameters (``param_dtype``).
        reduce_dtype: dtype of the gradient reduction.
        device: compute device (the mesh's device).
    """

    def __init__(
        self,
        index: int,
        name: str,
        sharded: list[FlatSlot],
        replicated: list[FlatSlot],
        groups: MeshGroups,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.index = index
        self.name = name
        self.sharded = sharded
        self.replicated = replicated
        self.groups = groups
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.device = device
        self.shard_numel = sum(s.numel for s in sharded)  # per-rank segment
        self.sharded_region_numel = groups.shard_size * self.shard_numel
        self.unsharded_numel = self.sharded_region_numel + sum(s.numel for s in replicated)
        self.region_sizes = [groups.shard_size * s.numel for s in sharded] + [
            s.numel for s in replicated
        ]
        self.requires_grad = any(s.requires_grad for s in self.slots)
        self.flat = torch.empty(self.unsharded_numel, dtype=compute_dtype, device=device)
        self._flat_data = self.flat.data  # own version counter, same storage
        self._free_storage()
        self.flat.requires_grad_(self.requires_grad)

    @property
    def slots(self) -> list[FlatSlot]:
        return self.sharded + self.replicated

    @property
    def is_allocated(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def _free_storage(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def free(self) -> None:
        """Release the unsharded flat buffer (views keep their metadata only)."""
        if self.is_allocated:
            self._free_storage()

    def copy_in(self) -> torch.Tensor:
        """This rank's padded shards of the sharded slots, concatenated.

        Returns:
            ``(shard_numel,)`` in ``compute_dtype`` on the compute device (the
            cast and, with CPU offload, the host-to-device copy happen here).
        """
        segment = torch.empty(self.shard_numel, dtype=self.compute_dtype, device=self.device)
        with torch.no_grad():
            for slot in self.sharded:
                dst = segment[slot.offset : slot.offset + slot.numel].view(slot.padded_shape)
                dim = slot.shard_dim
                rows, padded_rows = slot.local_shape[dim], slot.padded_shape[dim]
                if rows:
                    dst.narrow(dim, 0, rows).copy_(slot.param.to_local(), non_blocking=True)
                if rows < padded_rows:
                    dst.narrow(dim, rows, padded_rows - rows).zero_()
        return segment

    def copy_out(self, gathered: torch.Tensor | None) -> None:
        """Fill ``flat`` from the all-gather output and the replicated slots.

        Args:
            gathered: the rank-major all-gather output ``(shard_size *
                shard_numel,)``, or None when the bucket has no sharded slot.
        """
        self.flat.untyped_storage().resize_(self.unsharded_numel * self.flat.element_size())
        data = self._flat_data
        world = self.groups.shard_size
        with torch.no_grad():
            if self.sharded:
                assert gathered is not None
                regions = data[: self.sharded_region_numel].split(
                    self.region_sizes[: len(self.sharded)]
                )
                torch.split_with_sizes_copy(
                    gathered.view(world, self.shard_numel),
                    [s.numel for s in self.sharded],
                    dim=1,
                    out=[r.view(world, s.numel) for r, s in zip(regions, self.sharded)],
                )
            base = self.sharded_region_numel
            for slot in self.replicated:
                start = base + slot.offset
                dst = data[start : start + slot.numel].view(slot.padded_shape)
                dst.copy_(slot.param.to_local(), non_blocking=True)

    def views(self) -> dict[str, torch.Tensor]:
        """Each parameter as a view of ``flat`` (padding stripped), by FQN.

        Built under the caller's grad mode: with grad enabled the views carry
        autograd history to ``flat``; frozen parameters' views are detached.
        """
        regions = torch.split(self.flat, self.region_sizes)
        world = self.groups.shard_size
        result: dict[str, torch.Tensor] = {}
        for slot, region in zip(self.slots, regions):
            shape = tuple(slot.param.shape)
            dim = slot.shard_dim
            if dim is None:
                view = region.view(shape)
            elif dim == 0:
                view = region.view(world * slot.padded_shape[0], *shape[1:])
            else:
                stacked = region.view(world, *slot.padded_shape).movedim(0, dim)
                merged = list(slot.padded_shape)
                merged[dim] *= world
                view = stacked.reshape(merged)
            if dim is not None and view.shape[dim] != shape[dim]:
                # Strip the padding. Only padded parameters pay for this: the
                # narrow's backward writes a zero-filled copy of the region.
                view = view.narrow(dim, 0, shape[dim])
                if dim != 0:
                    # Hand module code the contiguous tensor DTensor's gather
                    # gives: on some CPUs a strided weight takes another GEMM
                    # kernel, one ulp off the uncompiled data_parallel model.
                    view = view.contiguous()
            result[slot.fqn] = view if slot.requires_grad else view.detach()
        return result

    def reduce_inputs(
        self, flat_grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Turn the param-major flat gradient into the reductions' inputs.

        Returns:
            ``(rank-major reduce-scatter input (shard_size * shard_numel,) or
            None, replicated slots' gradient (own buffer) or None)``, both in
            ``reduce_dtype``.
        """
        grad = flat_grad.to(self.reduce_dtype)
        regions = torch.split(grad, self.region_sizes)
        world = self.groups.shard_size
        scatter_input = None
        if self.sharded:
            scatter_input = torch.empty(
                self.sharded_region_numel, dtype=self.reduce_dtype, device=self.device
            )
            pieces = [r.view(world, s.numel) for r, s in zip(regions, self.sharded)]
            torch.cat(pieces, dim=1, out=scatter_input.view(world, self.shard_numel))
        replicated_grad = None
        if self.replicated:
            replicated_grad = grad[self.sharded_region_numel :].clone()
        return scatter_input, replicated_grad

    def write_grads(
        self,
        sharded_grad: torch.Tensor | None,
        replicated_grad: torch.Tensor | None,
        divide_by: int,
    ) -> None:
        """Set (or accumulate into) each trainable parameter's ``.grad``.

        Args:
            sharded_grad: this rank's reduced segment ``(shard_numel,)``.
            replicated_grad: the reduced replicated section.
            divide_by: 1 for ``reduce_op="sum"``, the data-parallel size for ``"avg"``.
        """
        with torch.no_grad():
            for tensor in (sharded_grad, replicated_grad):
                if tensor is not None and divide_by != 1:
                    tensor.div_(divide_by)
            for slot in self.sharded:
                if not slot.requires_grad:
                    continue
                padded = sharded_grad[slot.offset : slot.offset + slot.numel]
                rows = slot.local_shape[slot.shard_dim]
                local = padded.view(slot.padded_shape).narrow(slot.shard_dim, 0, rows)
                _set_or_accumulate_grad(slot.param, local)
            for slot in self.replicated:
                if slot.requires_grad:
                    local = replicated_grad[slot.offset : slot.offset + slot.numel]
                    _set_or_accumulate_grad(slot.param, local.view(slot.padded_shape))


def dtensor_like(param: nn.Parameter, local: torch.Tensor) -> DTensor:
    """A DTensor with ``param``'s mesh, placements and global shape around ``local``.

    Uses the DTensor constructor (as FSDP2 does) rather than ``from_local``,
    which would move a CPU-offloaded local tensor to the mesh's device.
    """
    return DTensor(local, param._spec, requires_grad=False)


def _set_or_accumulate_grad(param: nn.Parameter, local: torch.Tensor) -> None:
    """``param.grad += local`` as a DTensor with ``param``'s placements."""
    stored = param.to_local()
    local = local.to(dtype=stored.dtype)
    if param.grad is not None:
        # Offloaded gradients: a blocking copy to the host, then add there.
        param.grad.to_local().add_(local.to(stored.device))
        return
    if stored.device != local.device:
        # CPU offload: gradients live with the shards; the runtime synchronizes
        # the stream at the end of backward, before the optimizer reads them.
        host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
        local = host.copy_(local, non_blocking=True)
    elif not local.is_contiguous():
        local = local.contiguous()
    param.grad = dtensor_like(param, local)
