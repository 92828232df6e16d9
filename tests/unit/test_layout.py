"""The package layout of docs/design.md: import arrows point one way, no circles.

The table under "## Layout" in docs/design.md says, per folder or module of
``src/simplefsdp``, which of our packages it may import; this test reads that
table and checks every ``import``/``from`` statement of the source against it
(also those inside functions and under ``TYPE_CHECKING``). It also checks that
the modules' imports form a DAG: no two modules import each other, directly
or around a circle, inside a package or across packages. (The lazily loading
``simplefsdp/__init__.py``, which imports everything on first use, and a
package's ``__init__`` importing its own modules are the exceptions.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "simplefsdp"


def _documented_layout() -> dict[str, set[str]]:
    """package (first component under simplefsdp) -> the packages docs/design.md lets it import."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`") or cells[0] == "`__init__.py`":
            continue
        name = cells[0].strip("`").split("/")[0].removesuffix(".py")
        may = re.sub(r"\([^)]*\)", "", cells[2]).replace("`", "")
        names = {m.strip() for m in may.split(",") if m.strip()} - {"nothing"}
        allowed[name] = {"top" if m == "the API" else m for m in names}
    return allowed


ALLOWED = _documented_layout()


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _package_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return "top" if parts == ("__init__",) else parts[0]


def _resolve(name: str) -> str | None:
    """The simplefsdp module ``name`` is, or lies in (``None``: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """The simplefsdp modules ``path`` imports (``from pkg import mod`` names the module)."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = (
                    module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                )
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if _resolve(t) == t else base for t in targets]
        for target in targets:
            if target == "simplefsdp" or target.startswith("simplefsdp."):
                resolved = _resolve(target)
                if resolved is not None:
                    found.add(resolved)
    return found


SOURCES = sorted(p for p in SRC.rglob("*.py") if _package_of(p) != "top")


def test_the_table_names_every_package():
    packages = {_package_of(p) for p in SOURCES}
    assert packages == set(ALLOWED), "docs/design.md's layout table and src/simplefsdp differ"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_one_way(path):
    package = _package_of(path)
    assert package in ALLOWED, f"{package} is not in the documented layout (docs/design.md)"
    imported = {"top" if m == "simplefsdp" else m.split(".")[1] for m in _imports(path)}
    bad = imported - ALLOWED[package] - {package}
    assert not bad, f"{path.relative_to(SRC)} ({package}) imports {sorted(bad)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "simplefsdp":
            continue  # the lazy public API imports everything on first use
        graph[name] = {
            m
            for m in _imports(path)
            if m not in (name, "simplefsdp") and not m.startswith(name + ".")
        }
    return graph


def test_no_import_circles_between_modules():
    assert _cycles(_module_graph()) == []


def test_no_import_circles_between_packages():
    packages: dict[str, set[str]] = {}
    for name, imported in _module_graph().items():
        own = name.split(".")[1]
        packages.setdefault(own, set()).update(m.split(".")[1] for m in imported)
    for own, imported in packages.items():
        imported.discard(own)
    assert _cycles(packages) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_plan_uses_the_compilers_planning_face():
    """``simplefsdp.plan`` reaches the compiler only through ``simplefsdp.compiler.planning``."""
    for path in SOURCES:
        if _package_of(path) != "plan":
            continue
        inner = {m for m in _imports(path) if m.startswith("simplefsdp.compiler")}
        assert inner <= {"simplefsdp.compiler.planning"}, (path.relative_to(SRC), inner)


def test_only_the_recipe_of_a_model_imports_the_engines():
    """``models/llama3`` is plain modules; ``parallelize.py`` (the recipe) composes the engines."""
    for path in SOURCES:
        if _package_of(path) == "models" and path.name != "parallelize.py":
            engines = {m for m in _imports(path) if m.startswith("simplefsdp.engines")}
            assert not engines, (path.relative_to(SRC), engines)


def test_no_private_checkpoint_imports_outside_checkpoint():
    for path in SOURCES:
        if _package_of(path) == "checkpoint":
            continue
        text = path.read_text(encoding="utf-8")
        assert "simplefsdp.checkpoint._" not in text, path


def test_no_private_names_across_packages():
    """``from simplefsdp.<other package>... import _name``: a private name used outside its home."""
    for path in SOURCES:
        package = _package_of(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("simplefsdp.")
            ):
                continue
            if node.module.split(".")[1] == package:
                continue
            private = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
            ]
            assert not private, f"{path.relative_to(SRC)} imports {private} from {node.module}"


def _compares_engine(node: ast.AST) -> bool:
    """``engine == ...``, ``x.engine in (...)`` and the like."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    named = any(
        (isinstance(s, ast.Name) and s.id == "engine")
        or (isinstance(s, ast.Attribute) and s.attr == "engine")
        for s in sides
    )
    return named and any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)


def test_only_the_engines_compare_engines():
    """Apps ask an engine's declared properties (``simplefsdp.engines.kinds``)."""
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(SRC))
        if _package_of(path) == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _compares_engine(node):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"engine names compared outside simplefsdp.engines: {found}"


def test_the_engine_check_finds_a_comparison():
    assert _compares_engine(ast.parse("config.engine == 'comm'").body[0].value)
    assert _compares_engine(ast.parse("engine not in ('ddp',)").body[0].value)
    assert not _compares_engine(ast.parse("engine.name == 'x'").body[0].value)


#: Meshes built outside the layout object: a user's unnamed hybrid mesh gets a
#: named twin (``data_parallel``), and the planner's traces (pending).
_MESH_BUILDERS_ALLOWED = {"frontend/data_parallel.py", "plan/trace.py", "plan/calibrate.py"}


def _builds_mesh(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name in ("init_device_mesh", "DeviceMesh", "_flatten", "from_group")


def test_meshes_come_only_from_the_layout():
    """``DeviceMesh``/``init_device_mesh``/``_flatten`` only in ``simplefsdp.layout``."""
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(SRC))
        if _package_of(path) == "layout" or rel in _MESH_BUILDERS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _builds_mesh(node):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"meshes built outside simplefsdp.layout: {found}"


# Files outside models/ allowed to name a model flavor, and why.
_NAMES_FLAVORS = {
    # the workload presets name the model each runs: data, like train/presets/*.toml
    "bench/configs.py",
    # the published measurements name the model each ran: data, like the presets
    "plan/reference.py",
}


def _family_patterns() -> re.Pattern:
    from simplefsdp.models.registry import family_names, flavor_names

    modules = "|".join(family_names())
    flavors = "|".join(flavor_names())
    return re.compile(
        rf"models[./](?:{modules})\b|\b(?:LLAMA_MODELS|MOE_MODELS|is_moe\w*)\b|\b(?:{flavors})\b"
    )


def test_no_family_or_flavor_name_outside_models():
    """Only ``models/`` (the families and the registry) names a family or a
    flavor; apps ask the registry and the spec."""
    pattern = _family_patterns()
    # A job preset may share a flavor's name: ``--config llama3_8b`` names the preset.
    presets = {p.stem for p in (SRC / "train" / "presets").glob("*.toml")}
    found = []
    for path in SOURCES:
        relative = path.relative_to(SRC).as_posix()
        if _package_of(path) == "models" or relative in _NAMES_FLAVORS:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            names = [m.group(0) for m in pattern.finditer(line)]
            if "--config" in line:
                names = [n for n in names if n not in presets]
            if line.strip().startswith("simplefsdp "):  # a command example in a help text
                names = []
            if names:
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_family_pattern_finds_names():
    pattern = _family_patterns()
    for line in (
        "from simplefsdp.models.llama3 import get_config",
        "if name in MOE_MODELS:",
        'model = "moe_debug"',
        "see models/moe/spec.py",
    ):
        assert pattern.search(line), line
    assert not pattern.search("from simplefsdp.models.registry import spec_of")


def test_registry_names_equal_spec_flavors():
    from simplefsdp.models.registry import ALIASES, family_names, flavor_names, get_spec

    for family in family_names():
        spec = get_spec(family)
        assert spec.family == family
        assert tuple(spec.flavors) == flavor_names(family), family
    canonical = flavor_names()
    assert len(set(canonical)) == len(canonical)
    for family in family_names():  # canonical names carry a family-specific prefix
        assert all(not name[0].isdigit() for name in flavor_names(family))
    assert set(ALIASES.values()) <= set(canonical)
    assert not set(ALIASES) & set(canonical)
