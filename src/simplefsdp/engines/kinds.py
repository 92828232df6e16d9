"""The engines as classes: what each composes with, and the one function that says why not.

One class per engine with its declared capabilities (:class:`Engine`);
:func:`get_engine` finds one by name and :func:`composition_errors` is the
only place that decides which features an engine composes with and writes
the "does not compose" lines: the train config, ``EngineSpec``, the bench
configurations and the planner all ask it. Apps read an engine's
properties (``shards``, ``fsdp2_runtime``, ``fused_buckets``, ...) instead of
comparing its name.

Pure data: this module imports neither torch nor the rest of simplefsdp, so a
command line can check a job before it imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

#: The features an engine may compose with, and how messages name them.
FEATURES: dict[str, str] = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "ep": "expert parallelism",
    "cp": "context parallelism",
    "float8": "float8",
    "compile": "compilation",
    "torch_passes": "torch's own Inductor passes",
    "group_reshard": "a reshard group size",
    "mixed_precision": "mixed precision",
}

_ALL_MODES = ("replicate", "fully_shard", "hybrid_shard")


class Engine:
    """An engine: how a model becomes data parallel, and what it composes with.

    Class attributes (declared by each engine):

    Attributes:
        name: the name on command lines (``--parallel.engine``, bench configs).
        description: one line for listings.
        modes: the data-parallel modes it runs.
        features: what it composes with (keys of :data:`FEATURES`).
        why_not: per missing feature, the reason (one clause).
        ep_modes: the modes it runs expert parallelism with.
        shards: parameters are sharded DTensors (``data_parallel`` or FSDP2).
        simplefsdp: parameters are ``data_parallel``'s (our parametrization).
        fused_buckets: compiled by ``simplefsdp.compile``, whose passes fuse
            each bucket's collectives (the planner's view; keep_gathered and
            reshard groups apply); FSDP2 and the eager executor copy into
            flat buffers per block.
        fsdp2_runtime: torch FSDP2's hooks and copy-in/copy-out buffers.
        needs_same_reads: every rank must read, and give gradients to, the
            same parameters in each step (``simplefsdp`` gathers each
            parameter where it is read; FSDP2 reduce-scatters the gradients
            that exist; DDP expects every gradient), so a model whose reads
            depend on its data (``ModelSpec.data_dependent_reads``) is
            refused. The eager executor gathers and reduces whole blocks
            (zeros for parameters not read).
        replicate_on_2d: ``replicate`` runs as HSDP on a ``(dp, 1)`` mesh.
        trains: it runs a model (``False``: the bench's collectives-only baseline).
        bench_only: a baseline of ``simplefsdp bench``, not a training engine.
        plannable: ``simplefsdp plan`` predicts it.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    modes: ClassVar[tuple[str, ...]] = _ALL_MODES
    features: ClassVar[frozenset[str]] = frozenset()
    why_not: ClassVar[Mapping[str, str]] = {}
    ep_modes: ClassVar[tuple[str, ...]] = ()
    shards: ClassVar[bool] = False
    simplefsdp: ClassVar[bool] = False
    fused_buckets: ClassVar[bool] = False
    fsdp2_runtime: ClassVar[bool] = False
    needs_same_reads: ClassVar[bool] = False
    replicate_on_2d: ClassVar[bool] = False
    trains: ClassVar[bool] = True
    bench_only: ClassVar[bool] = False
    plannable: ClassVar[bool] = False

    def supports(self, feature: str) -> bool:
        """Whether this engine composes with ``feature`` (a key of :data:`FEATURES`)."""
        if feature not in FEATURES:
            raise ValueError(f"unknown feature {feature!r}; valid: {', '.join(FEATURES)}")
        return feature in self.features

    def __repr__(self) -> str:
        return f"<engine {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Engine) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class SimpleFSDP(Engine):
    """``data_parallel``, then ``simplefsdp.compile`` (our passes) when compiled."""

    name = "simplefsdp"
    description = "simplefsdp: data_parallel, compiled with our passes or run eagerly"
    features = frozenset(
        {
            "tp",
            "pp",
            "ep",
            "cp",
            "float8",
            "compile",
            "torch_passes",
            "group_reshard",
            "mixed_precision",
        }
    )
    ep_modes = ("fully_shard", "replicate")
    shards = True
    simplefsdp = True
    fused_buckets = True
    needs_same_reads = True
    plannable = True


class SimpleFSDPEager(Engine):
    """``data_parallel`` run by the eager executor (hooks, flat all-gathers), never compiled."""

    name = "simplefsdp_eager"
    description = "simplefsdp with the eager executor (hook-based, never compiled)"
    features = frozenset({"mixed_precision"})
    why_not = {
        "tp": "the eager executor gathers flat buffers of plain shards",
        "pp": "the eager executor gathers flat buffers of plain shards",
        "ep": "the eager executor gathers flat buffers of data-parallel shards only",
        "cp": "the eager executor gathers flat buffers of plain shards",
        "float8": "the eager executor gathers in the parameter dtype",
        "compile": "the eager executor is never compiled",
        "torch_passes": "the eager executor is never compiled",
        "group_reshard": "the eager executor reshards fully",
    }
    shards = True
    simplefsdp = True


class FSDP2(Engine):
    """torch's ``fully_shard`` per block and on the root; blocks compiled in place."""

    name = "fsdp2"
    description = "torch FSDP2 (fully_shard per block)"
    features = frozenset(
        {"tp", "pp", "ep", "cp", "float8", "compile", "group_reshard", "mixed_precision"}
    )
    why_not = {
        "torch_passes": "torch's passes are compared on simplefsdp's graphs",
    }
    ep_modes = ("fully_shard",)
    shards = True
    needs_same_reads = True
    fsdp2_runtime = True
    replicate_on_2d = True
    plannable = True


class DDP(Engine):
    """``DistributedDataParallel``: every rank holds the full model."""

    name = "ddp"
    description = "torch DDP (replicated parameters, all-reduced gradients)"
    modes = ("replicate",)
    needs_same_reads = True
    features = frozenset({"compile"})
    why_not = {
        "tp": "use engine 'simplefsdp' with mode 'replicate' for DDP semantics",
        "pp": "use engine 'simplefsdp' with mode 'replicate' for DDP semantics",
        "ep": "DDP replicates every parameter",
        "cp": "DDP replicates every parameter",
        "float8": "DDP does not gather weights",
        "torch_passes": "torch's passes are compared on simplefsdp's graphs",
        "group_reshard": "DDP does not reshard",
        "mixed_precision": "DDP trains in the parameters' dtype",
    }


class Replica(Engine):
    """No data parallelism: each rank trains its own copy (the single-device limit)."""

    name = "replica"
    description = "the replica limit (each rank trains its own copy, no communication)"
    modes = ("replicate",)
    features = frozenset({"compile"})
    why_not = {
        "tp": "the replica limit trains one full copy per rank",
        "pp": "the replica limit trains one full copy per rank",
        "ep": "each rank trains a full copy",
        "cp": "each rank trains a full copy",
        "float8": "the replica limit does not gather weights",
        "torch_passes": "torch's passes are compared on simplefsdp's graphs",
        "group_reshard": "the replica limit does not reshard",
        "mixed_precision": "the replica limit trains in the parameters' dtype",
    }


class CommOnly(Engine):
    """The bench's baseline: the collectives of a step, without compute."""

    name = "comm"
    description = "collectives only (no compute): the communication floor"
    modes = ("fully_shard",)
    features = frozenset({"mixed_precision"})  # its collectives move param_dtype
    trains = False
    bench_only = True
    why_not = {f: "it runs collectives only" for f in FEATURES if f != "mixed_precision"}


#: Every engine class, in the order command lines list them.
ENGINE_CLASSES: tuple[type[Engine], ...] = (
    SimpleFSDP,
    SimpleFSDPEager,
    FSDP2,
    DDP,
    Replica,
    CommOnly,
)


def engine_names(*, bench: bool = False) -> tuple[str, ...]:
    """The engines' names: the training engines, plus the bench-only ones with ``bench``."""
    return tuple(c.name for c in ENGINE_CLASSES if bench or not c.bench_only)


def get_engine(name: str | Engine, *, bench: bool = False) -> Engine:
    """The engine named ``name`` (an :class:`Engine` is returned as is).

    Args:
        name: an engine's name.
        bench: also accept the bench-only baselines.

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    if isinstance(name, Engine):
        return name
    for cls in ENGINE_CLASSES:
        if cls.name == name and (bench or not cls.bench_only):
            return cls()
    raise ValueError(f"unknown engine {name!r}; valid: {', '.join(engine_names(bench=bench))}")


def engines_with(*features: str, bench: bool = False) -> tuple[str, ...]:
    """The names of the engines that compose with every one of ``features``."""
    return tuple(
        c.name
        for c in ENGINE_CLASSES
        if (bench or not c.bench_only) and all(c().supports(f) for f in features)
    )


def composition_errors(
    engine: str | Engine,
    *,
    mode: str | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    float8: bool = False,
    compile: bool = False,
    torch_passes: bool = False,
    group_reshard: bool | int = False,
    mixed_precision: bool = False,
    names: Mapping[str, str] | None = None,
    bench: bool = False,
) -> list[str]:
    """Every way ``engine`` does not compose with the requested features, one line each.

    The one statement of which engine composes with what. ``compile`` and
    ``mixed_precision`` are not errors for engines that ignore them (the
    eager executor never compiles; ddp and replica train in the parameters'
    dtype): the caller notes those.

    Args:
        engine: the engine or its name.
        mode: the data-parallel mode (``None``: not checked).
        tp, pp, ep, cp: the degrees (``> 1`` asks for that parallelism).
        float8, torch_passes: the features asked for.
        group_reshard: a reshard group size (an int >= 2, or ``True``).
        compile, mixed_precision: accepted by every engine (see above).
        names: how the caller spells each setting (e.g. ``{"engine":
            "parallel.engine", "tp": "parallel.tp"}``); default: the plain names.
        bench: accept the bench-only engines.
    """
    n = {"engine": "engine", "mode": "mode", **{f: f for f in FEATURES}, **(names or {})}
    try:
        e = get_engine(engine, bench=bench)
    except ValueError as err:
        return [f"{n['engine']}: {err}"]
    errors = []
    if mode is not None and mode not in e.modes:
        errors.append(
            f"{n['mode']}: invalid value {mode!r} for engine {e.name!r}; valid choices: "
            f"{list(e.modes)}"
        )
    asked = {
        "tp": tp > 1,
        "pp": pp > 1,
        "ep": ep > 1,
        "cp": cp > 1,
        "float8": float8,
        "torch_passes": torch_passes,
        "group_reshard": bool(group_reshard),
    }
    values: dict[str, Any] = {"tp": tp, "pp": pp, "ep": ep, "cp": cp}
    if not isinstance(group_reshard, bool):
        values["group_reshard"] = group_reshard
    for feature, wanted in asked.items():
        if not wanted or e.supports(feature):
            continue
        value = values.get(feature, True)
        flag = n[feature]
        setting = f"{flag}={str(value).lower() if isinstance(value, bool) else value}"
        why = e.why_not.get(feature, "")
        valid = list(engines_with(feature, bench=bench))
        errors.append(
            f"{n['engine']}: invalid value {e.name!r} with {setting}"
            + (f" ({why})" if why else "")
            + f"; valid choices with {FEATURES[feature]}: {valid}"
        )
    if ep > 1 and e.supports("ep") and mode is not None and mode not in e.ep_modes:
        errors.append(
            f"{n['mode']}: invalid value {mode!r} with {n['ep']}={ep} and engine {e.name!r}; "
            f"valid choices with expert parallelism: {list(e.ep_modes)}"
        )
    return errors
