"""The package layout of docs/design.md: import arrows point one way, files stay small.

cli -> train / bench / plan -> engines -> compiler / eager_executor -> frontend ->
policies, bucket_plan. checkpoint sits beside the engines (it reads the
frontend); data and models import nothing of ours. Checked on the source text
(every ``import``/``from`` statement, also those inside functions).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "simplefsdp"

_CORE = {"parallel_dims", "policies", "bucket_plan", "frontend", "_version", "_compat"}
_EXECUTORS = _CORE | {"compiler", "eager_executor", "top"}
# package (first component under simplefsdp) -> the packages it may import.
ALLOWED: dict[str, set[str]] = {
    "_version": set(),
    "_compat": set(),
    "parallel_dims": set(),
    "policies": {"parallel_dims"},
    "bucket_plan": set(),
    "models": {"parallel_dims"},
    "data": {"_version"},
    "testing": {"_compat"},
    "frontend": {"parallel_dims", "policies", "bucket_plan", "_compat"},
    "compiler": _CORE,
    "eager_executor": _CORE,
    "checkpoint": {"frontend", "testing", "models", "_version"},
    "engines": _EXECUTORS,
    "train": _EXECUTORS | {"engines", "data", "checkpoint", "models", "testing"},
    "bench": _EXECUTORS | {"engines", "data", "models"},
    "plan": _EXECUTORS | {"engines", "models"},
    "cli": {"_version"},
}


def _package_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return "top" if parts == ("__init__",) else parts[0]


def _imported_packages(path: Path) -> set[str]:
    """First components of the simplefsdp modules ``path`` imports (``top``: ``simplefsdp``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name == "simplefsdp":
                found.add("top")
            elif name.startswith("simplefsdp."):
                found.add(name.split(".")[1])
    return found


SOURCES = sorted(p for p in SRC.rglob("*.py") if _package_of(p) != "top")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_one_way(path):
    package = _package_of(path)
    assert package in ALLOWED, f"{package} is not in the documented layout (docs/design.md)"
    bad = _imported_packages(path) - ALLOWED[package] - {package}
    assert not bad, f"{path.relative_to(SRC)} ({package}) imports {sorted(bad)}"


def test_no_private_checkpoint_imports_outside_checkpoint():
    for path in SOURCES:
        if _package_of(path) == "checkpoint":
            continue
        text = path.read_text(encoding="utf-8")
        assert "simplefsdp.checkpoint._" not in text, path


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_files_stay_small(path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 600
