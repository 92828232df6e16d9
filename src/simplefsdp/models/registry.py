"""The model families and their flavors, by name.

The one place besides ``simplefsdp/models/<family>/`` that names a family or a
flavor. Flavor names are listed here without importing torch, so command
lines can check ``--model`` before any process starts; :func:`get_spec`
imports the family's ``spec`` module (and torch) only when asked. A unit test
keeps the names here equal to each spec's ``flavors``.

Every flavor has one canonical, family-prefixed name (``llama3_debug``,
``moe_debug``, ``deepseek_v3_16b``); the short Llama 3 names ``debug``,
``small``, ``8B``, ``70B`` and ``405B`` are accepted aliases
(:data:`ALIASES`) that resolve to the canonical ones.

Adding a family: write ``simplefsdp/models/<family>/spec.py`` with a
``SPEC: ModelSpec`` and add one line to :data:`_FAMILIES`.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simplefsdp.models.spec import ModelSpec


# family -> (module holding SPEC, canonical flavor names)
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama3": (
        "simplefsdp.models.llama3.spec",
        ("llama3_debug", "llama3_small", "llama3_8b", "llama3_70b", "llama3_405b"),
    ),
    "moe": (
        "simplefsdp.models.moe.spec",
        ("moe_debug", "moe_small", "llama4_scout"),
    ),
    "deepseek_v3": (
        "simplefsdp.models.deepseek_v3.spec",
        ("deepseek_v3_debug", "deepseek_v3_16b", "deepseek_v3_671b"),
    ),
    "gpt_oss": ("simplefsdp.models.gpt_oss.spec", ("gpt_oss_debug", "gpt_oss_20b", "gpt_oss_120b")),
    "qwen3": (
        "simplefsdp.models.qwen3.spec",
        (
            "qwen3_debug",
            "qwen3_0_6b",
            "qwen3_1_7b",
            "qwen3_4b",
            "qwen3_8b",
            "qwen3_14b",
            "qwen3_32b",
        ),
    ),
    "qwen3_moe": (
        "simplefsdp.models.qwen3.moe_spec",
        ("qwen3_moe_debug", "qwen3_30b_a3b", "qwen3_235b_a22b"),
    ),
    # any other causal LM, from a Hugging Face folder (no flavors)
    "transformers": ("simplefsdp.models.hf_transformers.spec", ()),
}

#: Accepted older names -> canonical flavor names.
#: The flavor ``simplefsdp plan`` plans when ``--model`` is not given (its
#: family publishes a reference layout for it).
PLAN_DEFAULT_FLAVOR = "llama3_8b"

ALIASES: dict[str, str] = {
    "debug": "llama3_debug",
    "small": "llama3_small",
    "8B": "llama3_8b",
    "70B": "llama3_70b",
    "405B": "llama3_405b",
}


def family_names() -> tuple[str, ...]:
    """Every registered family."""
    return tuple(_FAMILIES)


def flavor_names(family: str | None = None, *, aliases: bool = False) -> tuple[str, ...]:
    """Every canonical flavor name (of ``family``, or of all families).

    Args:
        family: one family, or ``None`` for all.
        aliases: also list the accepted aliases (after the canonical names).
    """
    if family is not None:
        _check_family(family)
        names = _FAMILIES[family][1]
    else:
        names = tuple(name for _, flavors in _FAMILIES.values() for name in flavors)
    if aliases:
        names = names + tuple(a for a, c in ALIASES.items() if c in names)
    return names


def _check_family(family: str) -> None:
    if family not in _FAMILIES:
        close = difflib.get_close_matches(family, list(_FAMILIES), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(_FAMILIES)}.{hint}")


def canonical_flavor(flavor: str) -> str:
    """The canonical name of flavor ``flavor`` (itself, or what its alias names).

    Raises:
        ValueError: an unknown flavor (one line with the valid names and the
            closest one).
    """
    name = ALIASES.get(flavor, flavor)
    if any(name in names for _, names in _FAMILIES.values()):
        return name
    valid = flavor_names()
    candidates = [*valid, *ALIASES]
    close = difflib.get_close_matches(flavor, candidates, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        close = difflib.get_close_matches(flavor.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    hint = f" Did you mean {ALIASES.get(close[0], close[0])!r}?" if close else ""
    raise ValueError(f"unknown model {flavor!r}; valid: {', '.join(valid)}.{hint}")


def family_of(flavor: str) -> str:
    """The family of flavor ``flavor`` (a canonical name or an alias).

    Raises:
        ValueError: an unknown flavor (see :func:`canonical_flavor`).
    """
    name = canonical_flavor(flavor)
    return next(family for family, (_, names) in _FAMILIES.items() if name in names)


def get_spec(family: str) -> ModelSpec:
    """The :class:`~simplefsdp.models.spec.ModelSpec` of ``family`` (imports it)."""
    _check_family(family)
    return importlib.import_module(_FAMILIES[family][0]).SPEC


def spec_of(flavor: str) -> ModelSpec:
    """The :class:`~simplefsdp.models.spec.ModelSpec` of flavor ``flavor``'s family."""
    return get_spec(family_of(flavor))


def spec_for_config(config: Any) -> ModelSpec:
    """The :class:`~simplefsdp.models.spec.ModelSpec` whose ``config_type`` is
    the type of ``config`` (imports every family).

    Raises:
        ValueError: no family has that configuration type.
    """
    for family in _FAMILIES:
        spec = get_spec(family)
        if type(config) is spec.config_type:
            return spec
    raise ValueError(
        f"no model family has configuration type {type(config).__name__}; "
        f"families: {', '.join(_FAMILIES)}"
    )


def resolve_flavor(flavor: str, **overrides: Any) -> tuple[ModelSpec, Any]:
    """``(spec, config)`` of flavor ``flavor``, with config fields overridden.

    Raises:
        ValueError: an unknown flavor, an unknown field or an invalid config.
    """
    import dataclasses

    name = canonical_flavor(flavor)
    spec = get_spec(family_of(name))
    base = spec.flavors[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown {spec.config_type.__name__} field(s) {unknown}; "
            f"valid fields: {', '.join(sorted(fields))}"
        )
    return spec, dataclasses.replace(base, **overrides)
