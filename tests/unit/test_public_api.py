"""The public API is what docs/reference/api.md lists, and nothing else.

Only the public namespaces define ``__all__``; each name in one is an object
the API reference documents (a ``::: dotted.path`` entry), and each entry is
exported by some public namespace.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
API_MD = ROOT / "docs" / "reference" / "api.md"

PUBLIC_NAMESPACES = (
    "simplefsdp",
    "simplefsdp.checkpoint",
    "simplefsdp.data",
    "simplefsdp.engines",
    "simplefsdp.layout",
    "simplefsdp.models",
    "simplefsdp.models.llama3",
    "simplefsdp.models.moe",
)
UNDOCUMENTED = {("simplefsdp", "__version__")}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(SRC).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _defines_all(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def _documented_paths() -> list[str]:
    return re.findall(r"^::: ([\w.]+)\s*$", API_MD.read_text(), re.M)


def _resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


@pytest.fixture(scope="module")
def documented() -> dict[int, str]:
    """id of each documented object -> its path in api.md."""
    return {id(_resolve(path)): path for path in _documented_paths()}


@pytest.fixture(scope="module")
def exported() -> dict[int, str]:
    """id of each object in a public namespace's __all__ -> where it is exported."""
    out = {}
    for namespace in PUBLIC_NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            out[id(getattr(module, name))] = f"{namespace}.{name}"
    return out


def test_only_public_namespaces_define_all() -> None:
    found = set()
    for path in sorted((SRC / "simplefsdp").rglob("*.py")):
        if _defines_all(ast.parse(path.read_text(), str(path))):
            found.add(_module_name(path))
    assert found == set(PUBLIC_NAMESPACES), (
        f"__all__ outside the public namespaces: {sorted(found - set(PUBLIC_NAMESPACES))}; "
        f"public namespaces without one: {sorted(set(PUBLIC_NAMESPACES) - found)}"
    )


@pytest.mark.parametrize("namespace", PUBLIC_NAMESPACES)
def test_every_exported_name_is_documented(namespace: str, documented: dict[int, str]) -> None:
    module = importlib.import_module(namespace)
    assert len(module.__all__) == len(set(module.__all__)), module.__all__
    undocumented = [
        name
        for name in module.__all__
        if (namespace, name) not in UNDOCUMENTED and id(getattr(module, name)) not in documented
    ]
    assert not undocumented, (
        f"{namespace}.__all__ names objects docs/reference/api.md does not list: {undocumented}"
    )


def test_every_documented_object_is_exported(exported: dict[int, str]) -> None:
    paths = _documented_paths()
    assert len(paths) > 40  # the parse found the entries
    missing = [path for path in paths if id(_resolve(path)) not in exported]
    assert not missing, f"documented but in no public namespace's __all__: {missing}"
