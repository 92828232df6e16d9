"""The model families and their flavors, by name.

The one place besides ``simplefsdp/models/<family>/`` that names a family.
Flavor names are listed here without importing torch, so command lines can
check ``--model`` before any process starts; :func:`get_spec` imports the
family's ``spec`` module (and torch) only when asked. A unit test keeps the
names here equal to each spec's ``flavors``.

Adding a family: write ``simplefsdp/models/<family>/spec.py`` with a
``SPEC: ModelSpec`` and add one line to :data:`_FAMILIES`.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simplefsdp.models.spec import ModelSpec

__all__ = ["family_names", "family_of", "flavor_names", "get_spec", "resolve_flavor"]

# family -> (module holding SPEC, flavor names)
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama3": ("simplefsdp.models.llama3.spec", ("debug", "small", "8B", "70B", "405B")),
    "moe": (
        "simplefsdp.models.moe.spec",
        ("moe_debug", "moe_small", "deepseek_v3_16b", "deepseek_v3_671b", "llama4_scout"),
    ),
}


def family_names() -> tuple[str, ...]:
    """Every registered family."""
    return tuple(_FAMILIES)


def flavor_names(family: str | None = None) -> tuple[str, ...]:
    """Every flavor name (of ``family``, or of all families)."""
    if family is not None:
        _check_family(family)
        return _FAMILIES[family][1]
    return tuple(name for _, names in _FAMILIES.values() for name in names)


def _check_family(family: str) -> None:
    if family not in _FAMILIES:
        close = difflib.get_close_matches(family, list(_FAMILIES), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(_FAMILIES)}.{hint}")


def family_of(flavor: str) -> str:
    """The family of flavor ``flavor``.

    Raises:
        ValueError: an unknown flavor (one line with the valid names and the
            closest one).
    """
    for family, (_, names) in _FAMILIES.items():
        if flavor in names:
            return family
    valid = flavor_names()
    close = difflib.get_close_matches(flavor, list(valid), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown model {flavor!r}; valid: {', '.join(valid)}.{hint}")


def get_spec(family: str) -> ModelSpec:
    """The :class:`~simplefsdp.models.spec.ModelSpec` of ``family`` (imports it)."""
    _check_family(family)
    return importlib.import_module(_FAMILIES[family][0]).SPEC


def resolve_flavor(flavor: str, **overrides: Any) -> tuple[ModelSpec, Any]:
    """``(spec, config)`` of flavor ``flavor``, with config fields overridden.

    Raises:
        ValueError: an unknown flavor, an unknown field or an invalid config.
    """
    import dataclasses

    spec = get_spec(family_of(flavor))
    base = spec.flavors[flavor]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown {spec.config_type.__name__} field(s) {unknown}; "
            f"valid fields: {', '.join(sorted(fields))}"
        )
    return spec, dataclasses.replace(base, **overrides)
