"""The degrees of a job's parallel layout and the meshes built from them.

:class:`Layout` is torch-free; :class:`Meshes`, :func:`build_meshes` and
:func:`meshes_of` import torch when called.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


#: The order of the mesh dims, outermost first (torchtitan's): ranks that
#: differ only in ``tp`` are neighbours, ranks that differ in ``pp`` are far apart.
DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

_WHAT = {
    "dp_replicate": "data-parallel replicas",
    "dp_shard": "data-parallel shards",
    "cp": "context-parallel",
    "tp": "tensor-parallel",
    "pp": "pipeline-parallel",
    "ep": "expert-parallel",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join(values: Sequence[int]) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class Layout:
    """The degrees of a job: how its ranks split into parallel groups.

    The world is ``pp x dp_replicate x dp_shard x cp x tp`` ranks, in that
    order (:data:`DIM_ORDER`). Expert parallelism borrows its ranks from
    ``dp_shard x cp`` (torchtitan's ``dp_shard_in_ep x cp``), never from
    ``tp``: an expert-parallel group is ``ep`` consecutive ranks of the FSDP
    mesh, and the experts are sharded over the rest (``dp_shard x cp / ep``,
    torchtitan's ``dp_shard_mod_ep``).

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's outer dim).
        dp_shard: data-parallel shards per replica; ``-1``: the ranks left
            (:meth:`resolve`).
        cp: context-parallel degree: ranks that split one sequence (they read
            the same batch and shard the parameters with ``dp_shard``).
        tp: tensor-parallel degree (innermost).
        pp: pipeline-parallel degree (outermost).
        ep: expert-parallel degree, borrowed from ``dp_shard x cp``.
        hybrid: hybrid sharding was asked for: the world mesh keeps its
            ``dp_replicate`` dim (and the FSDP mesh is 2-D) even at one replica.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    hybrid: bool = False

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``dp_replicate * dp_shard`` (resolved layouts only)."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_degree(self) -> int:
        """Ranks that read different batches: ``dp_replicate * dp_shard`` (not cp, tp, pp)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_degree(self) -> int:
        """Ranks a parameter is sharded over per replica: ``dp_shard * cp``."""
        return self.dp_shard * self.cp

    @property
    def loss_degree(self) -> int:
        """Ranks whose losses average into the global loss: ``batch_degree * cp``."""
        return self.batch_degree * self.cp

    @property
    def expert_dp_degree(self) -> int:
        """Ranks an expert's parameters are sharded over: ``dp_shard * cp / ep``."""
        return self.fsdp_degree // self.ep

    @property
    def world_size(self) -> int:
        """The product of the degrees (resolved layouts only)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def degrees(self) -> dict[str, int]:
        """The six degrees by name."""
        return {k: getattr(self, k) for k in _DEGREES}

    # ------------------------------------------------------------------ checks

    def resolve(self, world_size: int) -> Layout:
        """This layout with ``dp_shard = -1`` replaced by the ranks left.

        Raises:
            ValueError: the layout does not fit ``world_size`` ranks; every
                error of :meth:`validate`, one per line.
        """
        errors = self.validate(world_size)
        if errors:
            raise ValueError("\n".join(errors))
        if self.dp_shard != -1:
            return self
        rest = world_size // (self.dp_replicate * self.cp * self.tp * self.pp)
        return dataclasses.replace(self, dp_shard=rest)

    def validate(self, world_size: int, names: Mapping[str, str] | None = None) -> list[str]:
        """Every degree error of this layout on ``world_size`` ranks, one line each.

        The rules: each degree is an int >= 1 (``dp_shard`` may be -1: the
        rest); the degrees multiply to the world size; ``ep`` divides
        ``dp_shard x cp`` and is a multiple of ``cp`` (an expert-parallel
        group takes whole context-parallel groups); expert parallelism
        composes with ``dp_shard``, ``cp`` and ``pp`` only (``dp_replicate``
        and ``tp`` 1: each pipeline stage's ranks form its own EP groups). Model and engine rules belong to the model's spec
        and the engine.

        Args:
            world_size: ranks in the job.
            names: how the caller's user spells each degree (e.g.
                ``{"tp": "--parallel.tp"}``); default: the field names.
        """
        n = {k: k for k in (*_DEGREES, "world_size")}
        n["world_size"] = "world size"
        n.update(names or {})
        errors: list[str] = []
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            return [f"{n['world_size']} must be >= 1, got {world_size!r}"]
        bad = False
        for key in _DEGREES:
            value = getattr(self, key)
            if key == "dp_shard" and value == -1:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                rest = " or -1 (the rest)" if key == "dp_shard" else ""
                errors.append(f"{n[key]} must be >= 1{rest}, got {value!r}")
                bad = True
        if bad:
            return errors
        ws = world_size
        for key in ("tp", "pp", "cp", "dp_replicate"):
            value = getattr(self, key)
            if ws % value:
                errors.append(
                    f"{n[key]} {value} does not divide {n['world_size']} {ws}; "
                    f"valid {_WHAT[key]} sizes for {ws} ranks: {_join(_divisors(ws))}"
                )
        if errors:
            return errors
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        named = [k for k in ("pp", "dp_replicate", "cp", "tp") if getattr(self, k) > 1]
        product = " x ".join(f"{n[k]} {getattr(self, k)}" for k in named) or "1"
        if self.dp_shard == -1 and ws % fixed:
            last, others = named[-1], named[:-1]
            rest = 1
            for k in others:
                rest *= getattr(self, k)
            with_others = " x ".join(f"{n[k]} {getattr(self, k)}" for k in others)
            errors.append(
                f"{product} does not divide {n['world_size']} {ws}; valid {_WHAT[last]} "
                f"sizes with {with_others}: {_join(_divisors(ws // rest))}"
            )
            return errors
        if self.dp_shard != -1 and fixed * self.dp_shard != ws:
            valid = ws // fixed if ws % fixed == 0 else None
            fix = f"valid {n['dp_shard']}: {valid} or -1" if valid else "use -1 (the rest)"
            errors.append(
                f"{product} x {n['dp_shard']} {self.dp_shard} = {fixed * self.dp_shard} ranks "
                f"but {n['world_size']} is {ws}; {fix}"
            )
            return errors
        errors += self._validate_experts(ws // fixed, n)
        return errors

    def _validate_experts(self, dp_shard: int, n: Mapping[str, str]) -> list[str]:
        ep = self.ep
        if ep == 1:
            return []
        errors = []
        others = [k for k in ("dp_replicate", "tp") if getattr(self, k) > 1]
        if others:
            have = ", ".join(f"{n[k]} {getattr(self, k)}" for k in others)
            use = " and ".join(f"{n[k]} 1" for k in others)
            errors.append(
                f"{n['ep']} {ep} with {have}: expert parallelism composes with data "
                f"parallelism (dp_shard, cp) and pipeline stages only; use {use}, or "
                f"{n['ep']} 1"
            )
        span = dp_shard * self.cp
        if span % ep or ep % self.cp:
            valid = [d for d in _divisors(span) if d % self.cp == 0]
            cp = f" x {n['cp']} {self.cp}" if self.cp > 1 else ""
            errors.append(
                f"{n['ep']} {ep} does not divide the {span} ranks of dp_shard {dp_shard}{cp} "
                f"(expert parallelism splits them into groups of {n['ep']}); valid: "
                f"{_join(valid)}"
            )
        return errors

    # ------------------------------------------------------------------ building

    @classmethod
    def for_data_parallel(
        cls,
        mode: str,
        world_size: int,
        *,
        mesh_shape: Sequence[int] | None = None,
        local_world_size: int | None = None,
        replicate_on_2d: bool = False,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
    ) -> Layout:
        """The layout of a data-parallel ``mode`` on ``world_size`` ranks.

        ``replicate`` and ``fully_shard`` shard over all data-parallel ranks
        (``dp_shard = -1``; ``replicate_on_2d``: ``replicate`` as HSDP on
        ``(dp, 1)``, as FSDP2 runs it). ``hybrid_shard`` takes ``mesh_shape``
        ``[replicate, shard]`` or, when unset, ``[dp // local, local]``
        (replicate across hosts, shard within one; ``local`` is the
        data-parallel ranks per host).

        Raises:
            ValueError: a ``mesh_shape`` that is not 2-D or does not cover the
                data-parallel ranks (one line listing the valid shapes).
        """
        fixed = max(cp * tp * pp, 1)
        dp = world_size // fixed if world_size % fixed == 0 else 0
        degrees = {"cp": cp, "tp": tp, "pp": pp, "ep": ep}
        if mode != "hybrid_shard":
            if replicate_on_2d and mode == "replicate" and dp:
                return cls(dp_replicate=dp, dp_shard=1, **degrees)
            return cls(**degrees)
        if not dp:
            return cls(**degrees)  # validate() names the bad degrees
        if mesh_shape is not None:
            shape = tuple(int(x) for x in mesh_shape)
        else:
            local = max((local_world_size or world_size) // (tp * cp), 1)
            if dp % local:
                local = dp
            shape = (dp // local, local)
        if len(shape) != 2 or shape[0] * shape[1] != dp:
            valid = ", ".join(f"[{d}, {dp // d}]" for d in _divisors(dp))
            needs = f"needs {shape[0] * shape[1]} ranks" if len(shape) == 2 else "is not 2-D"
            if fixed > 1:
                have = (
                    f"there are {dp} data-parallel ranks "
                    f"(world size {world_size} / (pp {pp} x tp {tp}"
                    + (f" x cp {cp}" if cp > 1 else "")
                    + "))"
                )
            else:
                have = f"the world size is {world_size}"
            raise ValueError(
                f"parallel.mesh_shape {list(shape)} {needs} but {have}; "
                f"valid shapes for {dp} ranks: {valid}"
            )
        return cls(dp_replicate=shape[0], dp_shard=shape[1], hybrid=True, **degrees)

    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The names and sizes of the world mesh's dims (resolved layouts only).

        :data:`DIM_ORDER` with the degrees of 1 left out, except ``dp_shard``
        (always present, so the FSDP mesh exists). With ``ep > 1``
        ``dp_shard`` is two dims, ``dp_shard_mod_ep`` and ``ep`` (or
        ``dp_shard_in_ep`` when ``cp > 1``: ``ep`` is then it and ``cp``).
        """
        names: list[str] = []
        sizes: list[int] = []

        def add(name: str, size: int) -> None:
            names.append(name)
            sizes.append(size)

        if self.pp > 1:
            add("pp", self.pp)
        if self.dp_replicate > 1 or self.hybrid:
            add("dp_replicate", self.dp_replicate)
        if self.ep > 1:
            inner = self.ep // self.cp
            add("dp_shard_mod_ep", self.dp_shard // inner)
            add("ep" if self.cp == 1 else "dp_shard_in_ep", inner)
        else:
            add("dp_shard", self.dp_shard)
        if self.cp > 1:
            add("cp", self.cp)
        if self.tp > 1:
            add("tp", self.tp)
        return tuple(names), tuple(sizes)

    def build(self, device_type: str, world_size: int | None = None) -> Meshes:
        """The job's one ``DeviceMesh`` over the default process group, by role.

        Args:
            device_type: ``"cuda"`` or ``"cpu"``.
            world_size: the world (default: the default process group's size).

        Returns:
            :class:`Meshes`.

        Raises:
            ValueError: the layout does not fit the world (every error).
        """
        return build_meshes(self, device_type, world_size)

    def describe(self) -> str:
        """One line: the degrees above 1 (``dp_shard`` always)."""
        parts = [f"{k} {v}" for k, v in self.degrees().items() if v != 1 or k == "dp_shard"]
        return ", ".join(parts)


#: Dims of a mesh that shard parameters with data parallelism (and cp).
_SHARD_DIMS = ("dp_shard", "dp_shard_mod_ep", "ep", "dp_shard_in_ep", "dp")
#: Older names of a mesh's data-parallel dims, read by :func:`meshes_of`.
_REPLICATE_DIMS = ("dp_replicate", "replicate", "rep")


@dataclass(frozen=True)
class Meshes:
    """The views of a job's mesh by role; a role of degree 1 without a dim is ``None``.

    Attributes:
        layout: the resolved degrees.
        world: the one mesh over all ranks (dims in :data:`~simplefsdp.layout.DIM_ORDER`).
        fsdp: what dense parameters are sharded over: ``dp_shard x cp``
            (flattened), or 2-D ``(dp_replicate, dp_shard x cp)`` with
            replicas (HSDP).
        batch: ranks that read different batches: ``dp_replicate x
            dp_shard`` (excludes cp, tp and pp).
        loss: ranks whose losses average into the global loss: ``batch x cp``.
        tp / pp / cp / ep: the tensor-, pipeline-, context- and
            expert-parallel meshes (``None`` at degree 1).
        expert_dp: what the experts' parameters are sharded over
            (``dp_shard x cp / ep``, torchtitan's ``dp_shard_mod_ep``;
            ``None`` without ``ep``).
    """

    layout: Layout
    world: DeviceMesh
    fsdp: DeviceMesh
    batch: DeviceMesh
    loss: DeviceMesh
    tp: DeviceMesh | None = None
    pp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_dp: DeviceMesh | None = None

    @property
    def batch_rank(self) -> int:
        """This rank's index among the ranks that read different batches."""
        return _flat_rank(self.batch)

    @property
    def batch_size(self) -> int:
        """How many different batches a step reads (``dp_replicate * dp_shard``)."""
        return self.batch.size()

    @property
    def stage_mesh(self) -> DeviceMesh:
        """The world without its pipeline dim: what one pipeline stage runs on."""
        names = self.world.mesh_dim_names or ()
        if "pp" not in names:
            return self.world
        return self.world[tuple(n for n in names if n != "pp")]


def _flat_rank(mesh: DeviceMesh) -> int:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this process is not part of the mesh")
    rank = 0
    for dim, index in enumerate(coordinate):
        rank = rank * mesh.size(dim) + index
    return rank


def _view(
    world: DeviceMesh,
    dims: tuple[str, ...],
    name: str,
    cache: dict[tuple[str, ...], DeviceMesh],
) -> DeviceMesh:
    """``world`` restricted to ``dims`` (flattened to one dim ``name`` when several;
    ``cache`` keeps one flattening per set of dims: each makes process groups)."""
    if dims in cache:
        return cache[dims]
    names = world.mesh_dim_names or ()
    if len(dims) == 1:
        view = world if names == dims else world[dims[0]]
    else:
        view = (world if names == dims else world[dims])._flatten(name)
    cache[dims] = view
    return view


def build_meshes(layout: Layout, device_type: str, world_size: int | None = None) -> Meshes:
    """Build ``layout``'s world mesh over the default process group; see :meth:`Layout.build`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if world_size is None:
        world_size = dist.get_world_size()
    layout = layout.resolve(world_size)
    names, sizes = layout.mesh_dims()
    logger.info("mesh %s %s on %s", names, sizes, device_type)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return meshes_of(world, layout)


def meshes_of(world: DeviceMesh, layout: Layout | None = None) -> Meshes:
    """The role views of ``world``, a mesh :meth:`Layout.build` made (or one named alike).

    Dims are read by name: ``pp``, ``tp``, ``cp``; ``dp_replicate``
    (or ``replicate``/``rep``); the sharded dims ``dp_shard`` (or ``dp``,
    ``shard``, or ``dp_shard_mod_ep`` with ``ep``/``dp_shard_in_ep``). A
    mesh whose dims have other names is data parallel on all of them (1-D:
    sharded; 2-D: replicated on the first dim, sharded on the second).

    Args:
        world: the job's mesh.
        layout: its degrees (default: read from ``world``).
    """
    names = tuple(world.mesh_dim_names or ())
    size = dict(zip(names, world.shape, strict=True)) if names else {}
    special = {"pp", "tp", "cp"}
    data = tuple(n for n in names if n not in special)
    if not data:
        raise ValueError(f"mesh {names} has no data-parallel dim besides pp/tp/cp")
    replicate = tuple(n for n in data if n in _REPLICATE_DIMS)
    shard = tuple(n for n in data if n not in _REPLICATE_DIMS)
    if not names or (not replicate and len(shard) == 2 and "dp_shard_mod_ep" not in shard):
        # an unnamed or (replicate, shard)-style 2-D data-parallel mesh
        replicate, shard = data[:1], data[1:]
    if not shard:
        raise ValueError(f"mesh {names} has no sharded data-parallel dim")
    cp = ("cp",) if "cp" in names else ()
    if layout is None:
        shard_size = 1
        for n in shard:
            shard_size *= size[n]
        ep = 1
        if "ep" in size:
            ep = size["ep"]
        elif "dp_shard_in_ep" in size:
            ep = size["dp_shard_in_ep"] * size.get("cp", 1)
        layout = Layout(
            dp_replicate=size[replicate[0]] if replicate else 1,
            dp_shard=shard_size,
            cp=size.get("cp", 1),
            tp=size.get("tp", 1),
            pp=size.get("pp", 1),
            ep=ep,
        )
    fsdp_dims = (*shard, *cp)
    fsdp_name = "dp_shard_cp" if cp else "dp_shard"
    cache: dict[tuple[str, ...], DeviceMesh] = {}
    fsdp = _view(world, fsdp_dims, fsdp_name, cache)
    if replicate:
        if len(fsdp_dims) == 1:
            dims = (*replicate, *fsdp_dims)
            fsdp = world if names == dims else world[dims]
        else:
            # HSDP over a flattened shard dim: (dp_replicate, dp_shard_cp)
            fsdp = world[(replicate[0], fsdp.mesh_dim_names[0])]
    batch_dims = (*replicate, *shard)
    batch = _view(world, batch_dims, "batch", cache)
    loss = _view(world, (*batch_dims, *cp), "loss", cache)
    ep_mesh = expert_dp = None
    if "ep" in size and "dp_shard_mod_ep" in size:
        ep_mesh = world["ep"]
        expert_dp = world["dp_shard_mod_ep"]
    elif "dp_shard_in_ep" in size:
        ep_mesh = _view(world, ("dp_shard_in_ep", "cp"), "ep", cache)
        expert_dp = world["dp_shard_mod_ep"]
    return Meshes(
        layout=layout,
        world=world,
        fsdp=fsdp,
        batch=batch,
        loss=loss,
        tp=world["tp"] if "tp" in size else None,
        pp=world["pp"] if "pp" in size else None,
        cp=world["cp"] if cp else None,
        ep=ep_mesh,
        expert_dp=expert_dp,
    )
