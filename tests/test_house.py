"""The package's structure: no import cycle among the modules of metrale_graph (its own folder and the
folders pyproject.toml installs under it: ops, capture, tools), counting imports inside functions."""

import ast
import os

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11+")  # pyproject.toml's package folders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "metrale_graph"
# Cycles known to be there, each with why it stays for now. An entry that is no longer a cycle fails
# the test too, so the list cannot go stale.
KNOWN_CYCLES: set[tuple[str, ...]] = set()  # none: every cycle found fails the test


def package_folders() -> dict[str, str]:
    """Package name -> its folder: metrale_graph's own and those of pyproject's package-dir."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    folders = {PACKAGE: os.path.join(ROOT, PACKAGE)}
    folders.update({name: os.path.join(ROOT, path) for name, path in setuptools.get("package-dir", {}).items()})
    return folders


def package_modules() -> dict[str, str]:
    """Module name -> file, for every .py file of every package folder and its subpackages."""
    modules = {}
    folders = package_folders()
    for package, folder in folders.items():
        for here, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if os.path.isfile(os.path.join(here, d, "__init__.py"))
                       and os.path.join(here, d) not in folders.values()]
            parts = os.path.relpath(here, folder).split(os.sep)
            prefix = ".".join([package] + [p for p in parts if p != "."])
            for name in files:
                if name.endswith(".py"):
                    stem = name[:-3]
                    modules[prefix if stem == "__init__" else f"{prefix}.{stem}"] = os.path.join(here, name)
    return modules


def imports_of(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules `module` imports anywhere in its file (inside functions too). `from X import y`
    imports X.y when that is a module, else X (the names come from X's __init__)."""
    is_package = os.path.basename(path) == "__init__.py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {name for name in found if name in modules and name != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_module_walk_finds_every_package():
    modules = package_modules()
    for name in ("metrale_graph.model", "metrale_graph.onnx.export", "metrale_graph.ops.moe",
                 "metrale_graph.capture.runner", "metrale_graph.tools.flags", "metrale_graph.ops"):
        assert name in modules, name


def test_cycle_finder_names_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = {tuple(c) for c in cycles(graph)}
    new = sorted(found - KNOWN_CYCLES)
    assert not new, "import cycles among package modules: " + "; ".join(" <-> ".join(c) for c in new)
    gone = sorted(KNOWN_CYCLES - found)
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_python_files_live_in_the_package_and_tests():
    """Every tracked Python file is a module of the package (its folders) or of tests/: a script at the
    repository root is a stray probe (one imported from a folder outside the repository and could not run)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    homes = {os.path.relpath(f, ROOT) for f in package_folders().values()} | {"tests"}
    stray = [f for f in listed.stdout.split() if f.split("/")[0] not in homes]
    assert not stray, f"Python files outside the package folders and tests/: {stray}"
