"""Bucket plans: which parameters share one collective. Plain data.

Both executors (``simplefsdp.compile`` and ``simplefsdp.eager``) and the
reports consume a ``BucketPlan``. A user writes a plan as a *plan spec*:

- ``"per_block"``: one bucket per repeated block (``repeated_blocks``: each
  outermost child of an ``nn.ModuleList``/``nn.ModuleDict`` that holds
  parameters, like FSDP's transformer auto-wrap policy); the remaining
  parameters are grouped by position (e.g. embeddings before the blocks,
  final norm + output after).
- a list of entries, one bucket per entry, where an entry is a list of module
  (or parameter) FQNs; a module name covers its submodules' parameters:
  ``[["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]``.
- a module class (``TransformerBlock``): one bucket per instance.
- a predicate ``(fqn, module) -> bool``: one bucket per matching module
  (outermost match wins).

Parameters no entry covers are grouped into buckets of consecutive parameters
(registration order) between the covered ones; those buckets are marked
``origin="uncovered"`` so reports can say so.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

ModulePredicate = Callable[[str, nn.Module], bool]
PlanSpec = str | Sequence[Sequence[str]] | type | ModulePredicate

BucketOrigin = Literal["manual", "uncovered", "auto", "single"]


@dataclass(frozen=True)
class Bucket:
    """One group of parameters communicated together.

    Attributes:
        name: a readable label (the entry's module names, or ``rest:<fqn>``).
        param_fqns: canonical parameter FQNs (as ``named_parameters()`` gives
            them), in registration order.
        origin: ``"manual"`` (from the user's plan), ``"uncovered"`` (parameters
            no entry covered), ``"auto"`` (from the auto planner) or
            ``"single"`` (one parameter per bucket, no bucketing).
    """

    name: str
    param_fqns: tuple[str, ...]
    origin: BucketOrigin = "manual"


@dataclass(frozen=True)
class BucketPlan:
    """An ordered tuple of disjoint buckets covering every parameter."""

    buckets: tuple[Bucket, ...]

    def bucket_index(self) -> dict[str, int]:
        """Map each parameter FQN to the index of its bucket."""
        return {fqn: i for i, b in enumerate(self.buckets) for fqn in b.param_fqns}

    def to_dict(self) -> dict:
        return {
            "buckets": [
                {"name": b.name, "origin": b.origin, "params": list(b.param_fqns)}
                for b in self.buckets
            ]
        }


def _alias_map(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Canonical FQNs in registration order, and alias FQN -> canonical FQN."""
    canonical: dict[int, str] = {}
    order: list[str] = []
    aliases: dict[str, str] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in canonical:
            canonical[id(param)] = fqn
            order.append(fqn)
        aliases[fqn] = canonical[id(param)]
    return order, aliases


def _covered_by(name: str, alias_fqns: Sequence[str]) -> list[str]:
    """Alias FQNs under module/parameter ``name`` (``""`` covers everything)."""
    if name == "":
        return list(alias_fqns)
    prefix = name + "."
    return [f for f in alias_fqns if f == name or f.startswith(prefix)]


def _outermost_modules(model: nn.Module, match: ModulePredicate) -> list[tuple[str, nn.Module]]:
    """Every outermost (non-root) module holding parameters for which ``match``
    is true, in ``named_modules()`` order."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn == t or fqn.startswith(t + ".") for t in taken):
            continue
        if fqn and match(fqn, module) and any(True for _ in module.parameters()):
            found.append((fqn, module))
            taken.append(fqn)
    return found


def _module_entries(model: nn.Module, match: ModulePredicate) -> list[list[str]]:
    """One entry per outermost module for which ``match`` is true."""
    return [[fqn] for fqn, _ in _outermost_modules(model, match)]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: ``(fqn, module)`` for each outermost child
    of an ``nn.ModuleList``/``nn.ModuleDict`` that holds parameters (and is
    not itself such a container), in ``named_modules()`` order.

    The one definition of a "block": the ``"per_block"`` bucket plan makes one
    bucket per block, and the engines use the same blocks for activation
    checkpointing and per-block FSDP2 wrapping. For a Llama-style model these
    are ``layers.0``, ``layers.1``, ...
    """
    containers = {
        fqn for fqn, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
    }

    def is_block(fqn: str, _module: nn.Module) -> bool:
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        return parent in containers and fqn not in containers

    return _outermost_modules(model, is_block)


def outer_modules(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]] | None:
    """The modules holding the parameters outside ``blocks``, split at the
    blocks: ``(before, after)``, the outermost non-root modules with such
    parameters registered before the first block (the embedding) and after
    it (the final norm, the output), in ``named_modules()`` order.

    ``None`` where the two sides share a parameter (tied input and output
    embeddings), or no block is found: the parameters outside the blocks
    then stay one group. Parameters of the root module itself belong to
    neither side.
    """
    names = [fqn for fqn, _ in blocks]
    if not names:
        return None
    in_blocks = {id(p) for _, block in blocks for p in block.parameters()}

    def inside(fqn: str, prefixes: Sequence[str]) -> bool:
        return any(fqn == t or fqn.startswith(t + ".") for t in prefixes)

    before: list[tuple[str, nn.Module]] = []
    after: list[tuple[str, nn.Module]] = []
    seen_block = False
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        if inside(fqn, names):
            seen_block = True
            continue
        if any(name.startswith(fqn + ".") for name in names):
            continue  # holds blocks (a transformers model's ``model``)
        if inside(fqn, [t for t, _ in before + after]):
            continue
        if any(id(p) not in in_blocks for p in module.parameters()):
            (after if seen_block else before).append((fqn, module))
    ids = [{id(p) for _, m in side for p in m.parameters()} for side in (before, after)]
    if ids[0] & ids[1]:
        return None
    return before, after


def _entries_from_spec(model: nn.Module, spec: PlanSpec) -> list[list[str]]:
    if isinstance(spec, str):
        if spec == "per_block":
            return [[fqn] for fqn, _ in repeated_blocks(model)]
        raise ValueError(
            f"unknown bucket plan {spec!r}; valid: 'per_block', a list of lists of module "
            "FQNs, a module class, or a predicate (fqn, module) -> bool"
        )
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise TypeError(f"a class bucket plan must be an nn.Module subclass, got {spec!r}")
        entries = _module_entries(model, lambda _f, m: isinstance(m, spec))
        if not entries:
            raise ValueError(f"bucket plan class {spec.__name__} matches no module of the model")
        return entries
    if callable(spec):
        return _module_entries(model, spec)
    if isinstance(spec, Sequence):
        entries = []
        for i, entry in enumerate(spec):
            if isinstance(entry, str) or not isinstance(entry, Sequence):
                raise TypeError(
                    f"bucket plan entry {i} must be a list of module FQNs, got {entry!r} "
                    f"(did you mean [{entry!r}]?)"
                )
            if not all(isinstance(n, str) for n in entry):
                raise TypeError(f"bucket plan entry {i} must hold strings, got {entry!r}")
            entries.append(list(entry))
        return entries
    raise TypeError(
        f"bucket plan must be 'per_block', a list of lists of FQNs, a module class or a "
        f"predicate; got {type(spec).__name__}"
    )


def resolve_plan(model: nn.Module, spec: PlanSpec) -> BucketPlan:
    """Turn a plan spec into a ``BucketPlan`` covering every parameter of ``model``.

    Args:
        model: the (wrapped or plain) module; FQNs are relative to it.
        spec: see the module docstring.

    Raises:
        ValueError: an FQN names no module or parameter (the message suggests
            close matches), a parameter is covered by two entries, or an entry
            covers no parameter.
        TypeError: the spec is not one of the accepted forms.
    """
    order, aliases = _alias_map(model)
    alias_fqns = list(aliases)
    module_names = [n for n, _ in model.named_modules() if n]
    entries = _entries_from_spec(model, spec)

    owner: dict[str, tuple[int, str]] = {}  # alias fqn -> (entry index, entry name)
    canonical_owner: dict[str, int] = {}
    buckets_fqns: list[list[str]] = [[] for _ in entries]
    for i, entry in enumerate(entries):
        for name in entry:
            covered = _covered_by(name, alias_fqns)
            if not covered:
                close = difflib.get_close_matches(name, module_names + alias_fqns, n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"bucket plan entry {i}: {name!r} names no module or parameter{hint}"
                )
            for alias in covered:
                if alias in owner and owner[alias][0] != i:
                    raise ValueError(
                        f"parameter {alias!r} is in two buckets: entry {owner[alias][0]} "
                        f"({owner[alias][1]!r}) and entry {i} ({name!r})"
                    )
                owner[alias] = (i, name)
                fqn = aliases[alias]
                # A tied parameter reached under another name joins the first bucket.
                if fqn not in canonical_owner:
                    canonical_owner[fqn] = i
                    buckets_fqns[i].append(fqn)

    position = {fqn: k for k, fqn in enumerate(order)}
    manual = [
        Bucket(name=",".join(entry) or "<root>", param_fqns=tuple(sorted(f, key=position.get)))
        for entry, f in zip(entries, buckets_fqns)
        if f
    ]
    return BucketPlan(buckets=tuple(_with_uncovered(manual, order, canonical_owner)))


def _with_uncovered(
    manual: list[Bucket], order: list[str], covered: dict[str, int]
) -> list[Bucket]:
    """Insert buckets of consecutive uncovered parameters, by registration order."""
    result: list[Bucket] = []
    emitted: set[int] = set()
    run: list[str] = []

    def flush() -> None:
        if run:
            result.append(Bucket(f"rest:{run[0]}", tuple(run), "uncovered"))
            run.clear()

    bucket_of_fqn = {fqn: i for i, b in enumerate(manual) for fqn in b.param_fqns}
    for fqn in order:
        if fqn not in covered:
            run.append(fqn)
            continue
        flush()
        i = bucket_of_fqn[fqn]
        if i not in emitted:
            emitted.add(i)
            result.append(manual[i])
    flush()
    return result
