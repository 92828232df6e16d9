"""docs/reference/config.md is generated from the config schema and kept current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from simplefsdp.train.config import reference
from simplefsdp.train.config.schema import SECTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"
REGENERATE = "python -m simplefsdp.train.config.reference --out docs/reference/config.md"


def test_config_reference_is_current():
    assert PAGE.read_text(encoding="utf-8") == reference.render_reference(), (
        f"docs/reference/config.md is out of date; regenerate it with: {REGENERATE}"
    )


def test_every_field_has_a_row_with_its_description():
    text = reference.render_reference()
    for section, cls in SECTIONS.items():
        docs = reference.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f"`--{section}.{f.name}`" in text
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no description under Attributes:"


def test_field_docs_reads_attributes():
    @dataclasses.dataclass
    class Section:
        """A section.

        Attributes:
            speed: How fast, in
                steps per second.
            name: Its name.

        Example:
            not: a field.
        """

        speed: float = 1.0
        name: str = "x"

    assert reference.field_docs(Section) == {
        "speed": "How fast, in steps per second.",
        "name": "Its name.",
    }
