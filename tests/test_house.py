"""The house rules the code can check: no import cycle among the modules of metrale_graph (its own folder and
the folders pyproject.toml installs under it: ops, capture, tools), counting imports inside functions; Python
files only in the package, benchmarks/ and tests/, and nothing stray at the root; tools/ holding the commands
users run; METRALE_* variables read by metrale_graph/envs.py alone, its table in docs/DESIGN.md, and no removed
setting or backend named; no source file outside tests/ past 400 lines but those listed."""

import ast
import os
import re

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


def test_python_files_live_in_the_package_benchmarks_and_tests():
    """Every tracked Python file is a module of the package (its folders), a script of benchmarks/ or a module of
    tests/: a script at the repository root is a stray probe (one imported from a folder outside the repository
    and could not run)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    homes = {os.path.relpath(f, ROOT) for f in package_folders().values()} | {"benchmarks", "tests"}
    stray = [f for f in listed.stdout.split() if f.split("/")[0] not in homes]
    assert not stray, f"Python files outside the package folders, benchmarks/ and tests/: {stray}"


# The installed tools are the commands a user runs (issue 41, item 5): kernel checks, sweeps and op-level
# benchmarks are scripts under benchmarks/, not installed
USER_TOOLS = {"prefill", "generate", "serve", "warmup", "quantize", "export_onnx", "bench", "bench_serve", "bench_prefix"}


def test_the_installed_tools_are_the_commands_users_run():
    """A module of tools/ with a main() is a command; each is one a user runs, with a console script; the rest
    of tools/ are their shared modules."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    commands = set()
    for name, path in package_modules().items():
        if name.startswith(f"{PACKAGE}.tools."):
            with open(path) as f:
                if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(f.read()).body):
                    commands.add(name.rsplit(".", 1)[1])
    assert commands == USER_TOOLS, f"commands in tools/ that are not a user's: {sorted(commands - USER_TOOLS)}"
    installed = {target.split(":")[0].rsplit(".", 1)[1] for target in scripts.values()}
    assert installed == USER_TOOLS, f"console scripts: {sorted(installed ^ USER_TOOLS)}"


# Settings: metrale_graph/envs.py is the one reader of METRALE_* variables ----------------------------------
SETTINGS_MODULE = os.path.join(ROOT, PACKAGE, "envs.py")


def environ_reads(source: str, path: str = "<source>") -> list[str]:
    """Where `source` reads an environment variable that may be a METRALE_* one: os.environ[KEY],
    os.environ.get / pop / setdefault (KEY), os.getenv(KEY), KEY in os.environ, with KEY a "METRALE_..." literal
    or not a literal at all (a name could hold one). Each as "line N: KEY". Copies of the whole environment
    (a subprocess's env) are not reads."""
    tree = ast.parse(source, path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value))
                or node.func.attr == "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name) and node.func.id == "getenv":
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                is_environ(c) for c in node.comparators):
            key = node.left
        if key is None or isinstance(parents.get(node), ast.Delete):
            continue
        if not isinstance(key, ast.Constant):
            found.append(f"line {node.lineno}: {ast.unparse(key)} (not a literal)")
        elif isinstance(key.value, str) and key.value.startswith("METRALE_"):
            found.append(f"line {node.lineno}: {key.value}")
    return found


def test_environ_reads_finds_every_form():
    source = ('import os\nfrom os import environ, getenv\n'
              'a = os.environ["METRALE_A"]\nb = os.environ.get("METRALE_B", "x")\nc = os.getenv("METRALE_C")\n'
              'd = "METRALE_D" in os.environ\ne = environ.pop("METRALE_E")\nf = getenv("METRALE_F")\n'
              'NAME = "METRALE_G"\ng = os.environ.get(NAME)\n'
              'ok = os.environ.get("RANK"), os.environ["LOCAL_RANK"], {**os.environ, "METRALE_COMMIT": "x"}\n'
              'os.environ["TRITON_CACHE_DIR"] = "/tmp"\n')
    assert environ_reads(source) == ["line 3: METRALE_A", "line 4: METRALE_B", "line 5: METRALE_C",
                                     "line 6: METRALE_D", "line 7: METRALE_E", "line 8: METRALE_F",
                                     "line 10: NAME (not a literal)"]


def python_files_to_check() -> dict[str, str]:
    """Every Python file of the package, benchmarks/ and tests/, by its path in the repository."""
    files = {os.path.relpath(path, ROOT): path for path in package_modules().values()}
    for folder in ("benchmarks", "tests"):
        for here, _, names in os.walk(os.path.join(ROOT, folder)):
            files.update({os.path.relpath(os.path.join(here, n), ROOT): os.path.join(here, n)
                          for n in names if n.endswith(".py")})
    return files


def test_the_settings_module_is_the_only_reader_of_metrale_variables():
    """METRALE_* variables are read by metrale_graph/envs.py alone (docs/DESIGN.md "Settings"): a module that
    reads one itself escapes the declared type, default, check and docs table."""
    readers = {}
    for name, path in sorted(python_files_to_check().items()):
        if path != SETTINGS_MODULE:
            with open(path) as f:
                reads = environ_reads(f.read(), path)
            if reads:
                readers[name] = reads
    assert not readers, f"METRALE_* variables read outside metrale_graph/envs.py: {readers}"


def test_design_shows_the_settings_table():
    from metrale_graph import envs

    with open(os.path.join(ROOT, "docs", "DESIGN.md")) as f:
        design = f.read()
    assert envs.markdown_table() in design, "docs/DESIGN.md's settings table is not envs.markdown_table()"


# Habits (issue 41, item 7) ---------------------------------------------------------------------------------
MAX_LINES = 400
# Source files outside tests/ over MAX_LINES lines, each with what will split it. A file that reaches MAX_LINES
# without an entry fails the test, and so does an entry whose file is back under it (or gone): the list only shrinks.
OVER_MAX_LINES = {
}
SOURCE_SUFFIXES = (".py", ".sh")
# what the repository's root holds: anything else there is a stray file
ROOT_ENTRIES = {".ci", ".gitignore", "BENCHMARKS.md", "LICENSE", "Makefile", "README.md", "benchmarks", "capture",
                "constraints.txt", "docs", "metrale_graph", "ops", "pyproject.toml", "tests", "tools"}


def tracked_files() -> list[str]:
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in listed.stdout.splitlines() if os.path.exists(os.path.join(ROOT, f))]


def test_no_source_file_outside_tests_grows_past_400_lines():
    long = {}
    for name in tracked_files():
        if name.endswith(SOURCE_SUFFIXES) and not name.startswith("tests/"):
            with open(os.path.join(ROOT, name)) as f:
                lines = sum(1 for _ in f)
            if lines > MAX_LINES:
                long[name] = lines
    new = {name: n for name, n in long.items() if name not in OVER_MAX_LINES}
    assert not new, f"over {MAX_LINES} lines: {new}; split them (a file of one concern)"
    back = sorted(set(OVER_MAX_LINES) - set(long))
    assert not back, f"no longer over {MAX_LINES} lines (or gone): remove them from OVER_MAX_LINES: {back}"


def test_no_stray_file_at_the_root():
    stray = sorted({name.split("/")[0] for name in tracked_files()} - ROOT_ENTRIES)
    assert not stray, f"files at the repository's root that belong in a folder: {stray}"


SETTING_MENTION = re.compile(r"\b(METRALE_[A-Z0-9_]*[A-Z0-9])(?:=([A-Za-z0-9_.]+))?")


def stale_settings(text: str) -> list[str]:
    """The METRALE_* names `text` mentions that are not settings, and the NAME=value mentions whose value the
    setting does not take (a backend or setting removed, the docs and scripts left behind)."""
    from metrale_graph import envs

    found = []
    for match in SETTING_MENTION.finditer(text):
        name, value = match.groups()
        if name not in envs.SETTINGS:
            found.append(name)
        elif value is not None and envs.SETTINGS[name].kind != "text":
            try:
                envs.SETTINGS[name].parse(value)
            except ValueError:
                found.append(f"{name}={value}")
    return found


def test_stale_settings_finds_removed_names_and_values():
    text = ("METRALE_GDN_CHUNKED=fla METRALE_GDN_CHUNKED=gemv METRALE_MOE_EXPERTS=grouped_mm `METRALE_MOE_BACKEND` "
            "METRALE_* METRALE_COMMIT=abc METRALE_FP8_DECODE=$form METRALE_FP8_ACTIVATIONS=off METRALE_ONNX_UNVERIFIED=2 "
            "METRALE_MOE_SORT=count METRALE_MOE_DECODE=$decode")
    assert stale_settings(text) == ["METRALE_GDN_CHUNKED=gemv", "METRALE_MOE_EXPERTS", "METRALE_MOE_BACKEND",
                                    "METRALE_ONNX_UNVERIFIED=2", "METRALE_MOE_SORT", "METRALE_MOE_DECODE"]


def test_no_removed_setting_or_backend_is_named():
    """Every METRALE_* name the code, scripts and docs mention is a setting, and every NAME=value a value it
    takes: a backend deleted from envs.SETTINGS leaves no switch to it behind; the docs are every page under
    docs/. BENCHMARKS.md, benchmarks/HISTORY.md and the JSON records are history (what ran then) and stay as they
    are; test_envs.py and this file name bad ones on purpose."""
    files = [name for name in python_files_to_check() if name not in ("tests/test_envs.py", "tests/test_house.py")]
    files += ["README.md", "benchmarks/gpu_session.sh", "benchmarks/gpu_pending.sh", "Makefile", "pyproject.toml"]
    files += sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    stale = {}
    for name in files:
        with open(os.path.join(ROOT, name)) as f:
            found = stale_settings(f.read())
        if found:
            stale[name] = found
    assert not stale, f"settings or values that are no longer there: {stale}"


# the names of backends removed after they lost (issue 41, item 1): the code that ran them, not the words that say
# they are gone (docs and docstrings may name torch._grouped_mm or "cudnn_varlen" to say why)
REMOVED_BACKEND_NAMES = ("EXPERTS_BACKEND", "experts_backend", "routed_experts_grouped_mm", "torch._grouped_mm(",
                         "SWAP_MAX_ROWS", "SMALL_BLOCKS", "small_block_swap", "_load_rows_of",
                         "SWAP=", "PREFILL_BACKEND", "_cudnn_varlen", "_fa2_paged", "fa2_paged_supported")


def test_no_removed_backend_is_called():
    """No source file outside tests/ uses a removed backend's function, switch or constexpr."""
    found = {}
    for name, path in sorted(python_files_to_check().items()):
        if name.startswith("tests/"):
            continue
        with open(path) as f:
            text = f.read()
        hits = [n for n in REMOVED_BACKEND_NAMES if n in text
                and not (n == "SWAP=" and name == "ops/fp8/w8a16.py")]  # the W8A16 kernel's own swapped form
        if hits:
            found[name] = hits
    assert not found, f"removed backends still called: {found}"
