"""The package's layout (DESIGN.md "Layout"): no import cycles among hisparse_cli modules, kernel
modules that import nothing above them, layers that import only downward, and a packaging
declaration (pyproject.toml) that installs the top-level kernels/ and profiles/ folders as
hisparse_cli.kernels / hisparse_cli.profiles with their data files.

Imports are read from the source (ast), module-level and inside functions alike (a lazy import
is still a dependency); imports under `if TYPE_CHECKING:` are annotations only and skipped.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package it is installed as
ROOTS = {"hisparse_cli": "hisparse_cli", "kernels": "hisparse_cli.kernels",
         "profiles": "hisparse_cli.profiles"}

# Layers: a package may import only itself and the packages listed (hisparse_cli's own
# top-level modules: errors, console, scoring, the version). None: anything.
ALLOWED = {
    "kernels": {"kernels", "config.env", "errors"},
    "config": {"config", "errors", "kernels", "model"},  # execution.py asks the kernels and
    # the INT4 linear what they serve
    "documents": {"documents", "errors"},
    "model": {"model", "kernels", "errors", "hub"},
    "engine": {"engine", "model", "kernels", "config", "errors"},
    "hub": {"hub", "config", "errors", "console", "__init__"},
    "planner": {"planner", "engine", "model", "kernels", "config", "errors", "hub"},
    "quantize": {"quantize", "model", "kernels", "errors"},
    "quality": {"quality", "documents", "config", "model", "summarize", "errors", "scoring"},
    "summarize": {"summarize", "documents", "engine", "config", "planner", "quality", "hub",
                  "errors", "scoring"},
    "cli": None,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, mods: dict[str, Path]) -> set[str]:
    """The hisparse_cli modules `module` imports (a name imported from a package counts as
    the submodule when there is one, else as the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
            for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                name = f"{target}.{alias.name}"
                found.add(name if name in mods else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in mods and m != module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, mods) for m, p in mods.items()}


def _group(module: str) -> str:
    """The layer of a module: its subpackage, or the top-level module's name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "config" and len(parts) > 2 and parts[2] == "env":
        return "config.env"
    return parts[1]


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components of the import graph: each module alone."""
    index, low, stack, on, cycles = {}, {}, [], set(), []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_layers_import_only_downward(graph):
    """Kernels import only kernels, the environment and the errors; the engine never imports
    the planner, the pipeline or the CLI; nothing but the CLI imports the CLI (ALLOWED)."""
    bad = []
    for module, deps in graph.items():
        layer = _group(module)
        allowed = ALLOWED.get("config" if layer == "config.env" else layer)
        if allowed is None:
            continue
        for dep in deps:
            target = _group(dep)
            if target in allowed or (target == "config.env" and "config" in allowed):
                continue
            bad.append(f"{module} -> {dep}")
    assert bad == []


def test_the_kernels_folder_is_never_imported_as_kernels():
    """`kernels` is a PyPI distribution's import name (transformers probes for it): ours is
    only ever hisparse_cli.kernels."""
    bad = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{module}: {n}" for n in names if n == "kernels" or n.startswith("kernels.")]
    assert bad == []


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"]


def test_the_package_list_covers_every_folder():
    """pyproject lists packages by hand (package-dir mapping rules out automatic discovery):
    every folder with an __init__.py, and the data-only probes folder, is in it."""
    st = _pyproject()
    on_disk = {name.rsplit(".", 1)[0] if name.endswith(".__init__") else name
               for name in _modules()}
    on_disk = {m for m in on_disk if (_modules()[m].name == "__init__.py")}
    on_disk.add("hisparse_cli.probes")
    assert set(st["packages"]) == on_disk
    assert st["package-dir"] == {"hisparse_cli.kernels": "kernels",
                                 "hisparse_cli.profiles": "profiles"}
    data = st["package-data"]
    assert "*.toml" in data["hisparse_cli.profiles"] and list((ROOT / "profiles").glob("*.toml"))
    assert {"*.cu", "*.cuh"} <= set(data["hisparse_cli.kernels.cuda"])
    assert (ROOT / "kernels" / "cuda" / "decode_step.cu").is_file()


def test_installed_names_resolve_to_the_top_level_folders():
    """Through an editable installation of this tree, the mapped packages are the folders."""
    import hisparse_cli
    import hisparse_cli.kernels.cuda.cuda_step as cuda_step
    import hisparse_cli.profiles as profiles

    if Path(hisparse_cli.__file__).resolve().parent != ROOT / "hisparse_cli":
        pytest.skip("hisparse_cli is installed from elsewhere (a wheel)")
    assert Path(cuda_step.__file__).resolve().parent == ROOT / "kernels" / "cuda"
    assert cuda_step.SOURCE.is_file()
    assert Path(profiles.__file__).resolve().parent == ROOT / "profiles"
