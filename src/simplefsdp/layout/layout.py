"""The degrees of a job's parallel layout (torch-free)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DIM_ORDER", "Layout"]

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
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

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
        composes with ``dp_shard`` and ``cp`` only (``dp_replicate``, ``tp``
        and ``pp`` 1). Model and engine rules belong to the model's spec
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
        others = [k for k in ("dp_replicate", "tp", "pp") if getattr(self, k) > 1]
        if others:
            have = ", ".join(f"{n[k]} {getattr(self, k)}" for k in others)
            use = " and ".join(f"{n[k]} 1" for k in others)
            errors.append(
                f"{n['ep']} {ep} with {have}: expert parallelism composes with data "
                f"parallelism (dp_shard, cp) only; use {use}, or {n['ep']} 1"
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
        return cls(dp_replicate=shape[0], dp_shard=shape[1], **degrees)

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
        if self.dp_replicate > 1:
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

    def build(self, device_type: str, world_size: int | None = None):
        """The job's one ``DeviceMesh`` over the default process group, by role.

        Args:
            device_type: ``"cuda"`` or ``"cpu"``.
            world_size: the world (default: the default process group's size).

        Returns:
            :class:`~simplefsdp.layout.Meshes`.

        Raises:
            ValueError: the layout does not fit the world (every error).
        """
        from simplefsdp.layout.meshes import build_meshes

        return build_meshes(self, device_type, world_size)

    def describe(self) -> str:
        """One line: the degrees above 1 (``dp_shard`` always)."""
        parts = [f"{k} {v}" for k, v in self.degrees().items() if v != 1 or k == "dp_shard"]
        return ", ".join(parts)
