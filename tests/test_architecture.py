"""The library's architecture, checked from its source with `ast`: layering, no import cycles, every
module placed in a layer, and no oversized class or function.

The library is fedpipe/ plus the top-level components/ and pipelines/ folders, installed as
fedpipe.components and fedpipe.pipelines (pyproject's [tool.setuptools.package-dir]). Every
intra-project import counts: absolute and relative ones, ``from fedpipe import plots`` (the module
fedpipe.plots), imports inside functions (lazy ones) and under ``if TYPE_CHECKING:``.

Each check is a function over a mapping {module name: source} (or {path: source}), so the tests
below first feed it a small synthetic tree that breaks the rule, then run it over the real one.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fedpipe"
#: where each top-level package's source lies (pyproject's package-dir)
SOURCE_DIRS = {
    PACKAGE: ROOT / "fedpipe",
    f"{PACKAGE}.components": ROOT / "components",
    f"{PACKAGE}.pipelines": ROOT / "pipelines",
}

#: The layers, lowest first. A module may import modules of its own layer or of a lower one, never of
#: a higher one. An entry names a module or a package (and then everything under it), except the root
#: package itself, which names only fedpipe/__init__.py (and its __version__).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("fedpipe.errors", "fedpipe.seeding", "fedpipe.config", "fedpipe.safe_load", "fedpipe.search_space", "fedpipe")),
    ("base", ("fedpipe.data", "fedpipe.nn", "fedpipe.store", "fedpipe.telemetry", "fedpipe.plots")),
    ("algorithms", ("fedpipe.algorithms",)),
    ("engine", ("fedpipe.engine",)),
    ("run", ("fedpipe.run",)),
    ("federation", ("fedpipe.federation",)),  # a run's rounds over Flower's deployment engine: beside run, above the engine
    ("models", ("fedpipe.models",)),
    ("serving", ("fedpipe.serving",)),
    ("study", ("fedpipe.study",)),
    ("entry", ("fedpipe.k8s", "fedpipe.components", "fedpipe.pipelines", "fedpipe.cli")),
)

MAX_CLASS_LINES = 150
MAX_FUNCTION_LINES = 60
SIZE_EXCEPTION = re.compile(r"#\s*size:\s*\S")


# --- reading the library ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def library_files() -> dict[str, Path]:
    """{module name: path} of every module of the library."""
    modules = {}
    for package, folder in SOURCE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == PACKAGE and parts and f"{PACKAGE}.{parts[0]}" in SOURCE_DIRS:
                continue  # a stray fedpipe/components/ would not be what gets installed
            modules[".".join([package, *parts])] = path
    return modules


def library_sources() -> tuple[dict[str, str], set[str]]:
    """({module name: source}, the names that are packages, i.e. __init__.py files)."""
    files = library_files()
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    return {name: path.read_text(encoding="utf-8") for name, path in files.items()}, packages


def _resolve(name: str, known: Collection[str]) -> str | None:
    """The module that importing `name` runs: `name` itself, or its longest prefix that is a module
    (``fedpipe.store.open_store`` -> fedpipe.store); None outside the project."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return name  # a project module that does not exist (Python would fail): still a dependency


def imports_of(module: str, source: str, known: Collection[str], *, is_package: bool = False) -> list[Import]:
    """Every intra-project import in `source`, anywhere in it (lazy and TYPE_CHECKING ones included)."""
    tree = ast.parse(source, filename=module)
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found = []

    def add(target: str, line: int) -> None:
        resolved = _resolve(target, known)
        if resolved is not None and resolved != module:
            found.append(Import(module, resolved, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                # `from fedpipe import plots` imports the module fedpipe.plots; `from fedpipe.store
                # import open_store` imports fedpipe.store
                sub = f"{base}.{alias.name}"
                add(sub if alias.name != "*" and sub in known else base, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value, node.lineno)
    return found


def import_graph(sources: Mapping[str, str], packages: Collection[str] = ()) -> list[Import]:
    """All intra-project imports of the modules in `sources`."""
    imports = []
    for module, source in sources.items():
        imports.extend(imports_of(module, source, sources.keys(), is_package=module in packages))
    return imports


# --- the checks --------------------------------------------------------------------------------------


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the layer `module` belongs to (its longest matching entry), or None."""
    best, best_len = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            matches = module == entry or (entry != PACKAGE and module.startswith(entry + "."))
            if matches and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def layering_violations(sources: Mapping[str, str], packages: Collection[str] = ()) -> list[str]:
    """Each import of a module of a higher layer: 'importer -> imported (layer -> higher layer)'."""
    out = []
    for imp in import_graph(sources, packages):
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is not None and high is not None and high > low:
            out.append(f"{imp.importer} -> {imp.imported} ({LAYERS[low][0]} -> {LAYERS[high][0]}) [line {imp.line}]")
    return sorted(set(out))


def unassigned_modules(modules: Collection[str]) -> list[str]:
    return sorted(m for m in modules if layer_of(m) is None)


def strongly_connected(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the strongly connected components of `graph`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph.get(root, ())))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: Mapping[str, Collection[str]]) -> list[str]:
    """A shortest import path start -> ... -> start inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]  # pragma: no cover - a component of two or more always has a cycle


def import_cycles(sources: Mapping[str, str], packages: Collection[str] = ()) -> list[str]:
    """Each import cycle, as its path 'a -> b -> c -> a'."""
    graph: dict[str, set[str]] = {module: set() for module in sources}
    for imp in import_graph(sources, packages):
        graph.setdefault(imp.importer, set()).add(imp.imported)
    cycles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            cycles.append(" -> ".join(_cycle_through(component[0], set(component), graph)))
    return sorted(cycles)


def oversized(sources: Mapping[str, str]) -> list[str]:
    """Each class over MAX_CLASS_LINES and function over MAX_FUNCTION_LINES lines, as 'path:line ...',
    unless its def/class line (or the line above it or above its decorators) says `# size: <reason>`."""
    out = []
    for path, source in sources.items():
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                limit, kind = MAX_CLASS_LINES, "class"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit, kind = MAX_FUNCTION_LINES, "function"
            else:
                continue
            length = node.end_lineno - node.lineno + 1
            if length <= limit:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            marks = {node.lineno - 1, node.lineno - 2, first - 2}  # 0-based: the def line, the lines above
            if any(0 <= i < len(lines) and SIZE_EXCEPTION.search(lines[i]) for i in marks):
                continue
            out.append(f"{path}:{node.lineno} {kind} {node.name} is {length} lines (limit {limit})")
    return sorted(out)


def _report(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)}):\n  " + "\n  ".join(problems)


# --- the checks catch what they are for (synthetic trees) ------------------------------------------


SYNTHETIC = {
    "fedpipe": "__version__ = '0'\n",
    "fedpipe.errors": "class E(Exception): pass\n",
    "fedpipe.plots": "from fedpipe.errors import E\n",
    "fedpipe.store": "from .folder import LocalStore\n",
    "fedpipe.store.folder": "from fedpipe.errors import E\nclass LocalStore: pass\n",
    "fedpipe.run.run": "from fedpipe.store import LocalStore\n",
}
SYNTHETIC_PACKAGES = {"fedpipe", "fedpipe.store"}


def test_imports_are_resolved_in_every_form():
    sources = {
        **SYNTHETIC,
        "fedpipe.run": "from . import run\n",
        "fedpipe.engine.rounds": (
            "from typing import TYPE_CHECKING\n"
            "import numpy\n"
            "from fedpipe import plots, __version__\n"
            "from ..store import folder\n"
            "if TYPE_CHECKING:\n    from fedpipe.run.run import X\n"
            "def lazy():\n    import fedpipe.errors\n    from fedpipe.store import LocalStore\n"
        ),
    }
    packages = {*SYNTHETIC_PACKAGES, "fedpipe.run"}
    found = {(i.imported, i.line) for i in imports_of("fedpipe.engine.rounds", sources["fedpipe.engine.rounds"], sources, is_package=False)}
    assert found == {
        ("fedpipe.plots", 3), ("fedpipe", 3), ("fedpipe.store.folder", 4), ("fedpipe.run.run", 6),
        ("fedpipe.errors", 8), ("fedpipe.store", 9),
    }
    assert {i.imported for i in import_graph(sources, packages) if i.importer == "fedpipe.run"} == {"fedpipe.run.run"}
    assert {i.imported for i in import_graph(sources, packages) if i.importer == "fedpipe.store"} == {"fedpipe.store.folder"}


def test_layering_check_reports_an_upward_import():
    assert layering_violations(SYNTHETIC, SYNTHETIC_PACKAGES) == []
    upward = {**SYNTHETIC, "fedpipe.store.folder": "def lazy():\n    from fedpipe.run import run\n"}
    assert layering_violations(upward, SYNTHETIC_PACKAGES) == [
        "fedpipe.store.folder -> fedpipe.run.run (base -> run) [line 2]"
    ]
    # the root package is ground: it may not import the library back
    assert layering_violations({**SYNTHETIC, "fedpipe": "from fedpipe import plots\n"}) == [
        "fedpipe -> fedpipe.plots (ground -> base) [line 1]"
    ]


def test_cycle_check_reports_the_cycle_path():
    assert import_cycles(SYNTHETIC, SYNTHETIC_PACKAGES) == []
    cyclic = {
        **SYNTHETIC,
        "fedpipe.errors": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedpipe.plots import P\n",
    }
    assert import_cycles(cyclic, SYNTHETIC_PACKAGES) == ["fedpipe.errors -> fedpipe.plots -> fedpipe.errors"]
    longer = {"fedpipe.a": "import fedpipe.b\n", "fedpipe.b": "from . import c\n", "fedpipe.c": "def f():\n    import fedpipe.a\n"}
    assert import_cycles(longer) == ["fedpipe.a -> fedpipe.b -> fedpipe.c -> fedpipe.a"]


def test_layer_check_reports_a_module_without_a_layer():
    assert unassigned_modules(SYNTHETIC) == []
    assert unassigned_modules([*SYNTHETIC, "fedpipe.newthing", "fedpipe.store.new"]) == ["fedpipe.newthing"]


def test_size_check_reports_long_functions_and_classes_unless_excused():
    def function(lines: int, mark: str = "") -> str:
        return f"def f():{mark}\n" + "    x = 1\n" * (lines - 1)

    def klass(lines: int, above: str = "") -> str:
        return above + "class C:\n" + "    x = 1\n" * (lines - 1)

    assert oversized({"a.py": function(60) + klass(150)}) == []
    assert oversized({"a.py": function(61), "b.py": "import os\n\n" + klass(151)}) == [
        "a.py:1 function f is 61 lines (limit 60)",
        "b.py:3 class C is 151 lines (limit 150)",
    ]
    assert oversized({"a.py": function(61, "  # size: one table, read top to bottom")}) == []
    assert oversized({"b.py": klass(151, "# size: mirrors the API one to one\n")}) == []
    assert oversized({"c.py": "@decorator\n" + function(61)}) == ["c.py:2 function f is 61 lines (limit 60)"]
    assert oversized({"c.py": "# size: a reason\n@decorator\n" + function(61)}) == []
    assert oversized({"a.py": function(61, "  # size:")}) != []  # a reason is required


# --- the real tree ------------------------------------------------------------------------------------


def test_the_library_is_found():
    sources, packages = library_sources()
    assert {"fedpipe", "fedpipe.store", "fedpipe.components.bodies", "fedpipe.pipelines.builder", "fedpipe.cli"} <= set(sources)
    assert "fedpipe.store" in packages and "fedpipe.store.s3" not in packages


def test_every_package_is_installed():
    """pyproject lists the packages one by one: a new subpackage left out of it is missing from the wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = set()
    for package, root in SOURCE_DIRS.items():
        for folder in [root, *(d for d in root.rglob("*") if d.is_dir())]:
            if any(folder.glob("*.py")):
                folders.add(".".join([package, *folder.relative_to(root).parts]))
    missing = sorted(folders - listed)
    assert not missing, f"packages missing from [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_module_has_a_layer():
    sources, _ = library_sources()
    problems = unassigned_modules(sources)
    assert not problems, _report("modules in no layer: add them to LAYERS in tests/test_architecture.py", problems)


def test_no_module_imports_a_higher_layer():
    problems = layering_violations(*library_sources())
    assert not problems, _report("imports of a higher layer (importer -> imported)", problems)


def test_no_import_cycles():
    problems = import_cycles(*library_sources())
    assert not problems, _report("import cycles", problems)


def test_no_oversized_classes_or_functions():
    files = library_files()
    sources = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in files.values()}
    problems = oversized(sources)
    assert not problems, _report(
        f"classes over {MAX_CLASS_LINES} lines or functions over {MAX_FUNCTION_LINES} lines: split them, or "
        "mark the def/class line with '# size: <reason>'",
        problems,
    )
