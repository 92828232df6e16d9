"""What a checkpoint records about its model, and reading it back.

A checkpoint's ``config.json`` (and an export's ``model.config.json``) holds
``"model": {"family", "flavor", "config"}`` (:func:`model_record`). Export and
Hugging Face conversion pick the family's spec from it
(:func:`model_from_record`). Older checkpoints hold only ``"model_args"``
(the configuration's fields); their family is inferred here, once, from the
field names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simplefsdp.models.spec import ModelSpec


def model_record(spec: ModelSpec, config: Any, flavor: str | None = None) -> dict[str, Any]:
    """The JSON-ready record of a model: family, flavor (``None`` for a model
    taken from elsewhere, e.g. a Hugging Face folder) and configuration."""
    return {"family": spec.family, "flavor": flavor, "config": dataclasses.asdict(config)}


def _infer_family(fields: Mapping[str, Any]) -> ModelSpec:
    """The family whose configuration has every field of ``fields``, the one
    with the fewest fields when several do (a record without a family)."""
    from simplefsdp.models.registry import family_names, get_spec

    matches = []
    for family in family_names():
        spec = get_spec(family)
        names = {f.name for f in dataclasses.fields(spec.config_type)}
        if set(fields) <= names:
            matches.append((len(names), family, spec))
    if not matches:
        raise ValueError(
            f"the checkpoint's model fields {sorted(fields)} match no model family "
            f"({', '.join(family_names())})"
        )
    return min(matches, key=lambda m: m[:2])[2]


def model_from_record(data: Mapping[str, Any]) -> tuple[ModelSpec, Any]:
    """``(spec, config)`` of the model a checkpoint's ``config.json`` records.

    Args:
        data: the parsed ``config.json``: with ``"model"``
            (:func:`model_record`), or an older one with ``"model_args"``.

    Raises:
        ValueError: neither entry, an unknown family or invalid fields (one line).
    """
    from simplefsdp.models.registry import get_spec

    record = data.get("model")
    if isinstance(record, Mapping) and "family" in record:
        spec = get_spec(record["family"])
        fields = dict(record["config"])
    elif "model_args" in data:
        fields = dict(data["model_args"])
        spec = _infer_family(fields)
    else:
        raise ValueError("the checkpoint's config.json records no model ('model' or 'model_args')")
    try:
        return spec, spec.config_type(**fields)
    except TypeError as exc:
        raise ValueError(f"the checkpoint's {spec.family} model config is invalid: {exc}") from None
