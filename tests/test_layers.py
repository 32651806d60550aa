"""The import graph follows the architecture: every arrow points down.

Layers, lowest first: ``errors``; the I/O-free core; the edges that do I/O; ``stream``; the
tools (``refstream.tools``). A module may import its own layer and the layers below it, never
one above: the core imports nothing from the edges, and the library never imports the tools.
Every module of the package must be placed in a layer, so a new module is a decision, not an
accident. Imports inside functions (and those for type checking only) count as much as those at
the top. No two modules import each other, directly or around a loop (the known cycles are listed
with their reason, and printed), and the pure core loads with every I/O library refused.
"""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "refstream"
TESTS = Path(__file__).resolve().parent

LAYERS = {
    "errors": 0,
    # the I/O-free core
    "rng": 1, "stats": 1, "shard": 1, "planner": 1, "resume": 1, "windows": 1, "mp4": 1,
    "synth": 1, "budget": 1,
    # the edges (meta reads its files through a source)
    "source": 2, "meta": 2, "http": 2, "hub": 2, "roots": 2, "tables": 2, "sidecar": 2,
    "decode": 2,
    # the dataset, and the package's lazy door to it
    "stream": 3, "worker": 3, "__init__": 3, "__main__": 4,
    # the tools
    "tools": 4,
}  # fmt: skip
LAYER_NAMES = ["errors", "core", "edge", "stream", "tools"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The layer of ``refstream.<name>[.…]``; None for a module outside refstream."""
    parts = module.split(".")
    if parts[0] != "refstream":
        return None
    if len(parts) == 1:
        return LAYERS["__init__"]
    return LAYERS.get(parts[1], -1)


def is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """Every refstream module ``path`` imports (``from refstream import x`` counts as
    ``refstream.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "refstream":  # a module of the package, or one of its names
                found.update(f"refstream.{alias.name}" if is_module(alias.name) else "refstream"
                             for alias in node.names)
            else:
                found.add(node.module)
    return {name for name in found if name.split(".")[0] == "refstream"}


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points to a higher layer, or from/to a module in no layer."""
    problems = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        if here == -1:
            problems.append(f"{module} is in no layer: place it in LAYERS")
            continue
        for target in sorted(targets):
            there = layer_of(target)
            if there == -1:
                problems.append(f"{module} imports {target}, which is in no layer")
            elif there > here:
                problems.append(f"{module} ({LAYER_NAMES[here]}) imports {target} "
                                f"({LAYER_NAMES[there]})")
    return problems


def package_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def test_every_import_points_down():
    assert upward_arrows(package_graph()) == []


@pytest.mark.parametrize("module, target", [
    ("refstream.mp4", "refstream.stream"),  # core -> stream
    ("refstream.planner", "refstream.sidecar"),  # core -> edge
    ("refstream.stream", "refstream.tools.demo"),  # library -> tools
    ("refstream.errors", "refstream.rng"),  # errors -> core
])
def test_an_upward_arrow_is_caught(module, target):
    graph = package_graph()
    graph[module] = graph[module] | {target}
    assert len(upward_arrows(graph)) == 1


def test_a_module_in_no_layer_is_caught():
    graph = package_graph()
    graph["refstream.newthing"] = set()
    assert upward_arrows(graph) == ["refstream.newthing is in no layer: place it in LAYERS"]


def test_the_walker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from refstream import stream\n    import refstream.tools.cli\n"
                    "from refstream import __version__\n")
    assert imports_of(path) == {"refstream.stream", "refstream.tools.cli", "refstream"}


# --- import cycles ------------------------------------------------------------------------------

# The cycles the package still has, each with why; any other cycle fails the test.
KNOWN_CYCLES = {
    frozenset({"refstream.tools.bench", "refstream.tools.droid"}):
        "droid's figures take bench's BenchConfig (an import for type checking only)",
}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The modules of each import cycle: every strongly connected part of ``graph`` with more
    than one module, or one module importing itself (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            part = {stack.pop()}
            while module not in part:
                part.add(stack.pop())
            if len(part) > 1 or module in graph.get(module, ()):
                cycles.append(frozenset(part))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycle_but_the_known_ones():
    for cycle, why in KNOWN_CYCLES.items():
        print(f"known import cycle {sorted(cycle)}: {why}")
    cycles = set(import_cycles(package_graph()))
    assert sorted(map(sorted, cycles - KNOWN_CYCLES.keys())) == [], "a new import cycle"
    assert sorted(map(sorted, KNOWN_CYCLES.keys() - cycles)) == [], \
        "a known cycle is gone: remove it from KNOWN_CYCLES"


@pytest.mark.parametrize("module, target", [
    ("refstream.stats", "refstream.meta"),  # two modules
    ("refstream.rng", "refstream.planner"),  # planner -> rng -> planner
    ("refstream.windows", "refstream.windows"),  # a module importing itself
])
def test_an_import_cycle_is_caught(module, target):
    graph = package_graph()
    graph[module] = graph[module] | {target}
    new = set(import_cycles(graph)) - KNOWN_CYCLES.keys()
    assert len(new) == 1 and {module, target} <= next(iter(new))


# --- the pure core ------------------------------------------------------------------------------

PURE_CORE = ["synth", "planner", "windows", "shard", "rng", "budget"]
IO_LIBRARIES = ["pyarrow", "av", "requests", "torch"]
# Imports the core with every I/O library refused by a meta-path finder, then prints the
# refstream modules that loaded.
BLOCKED_IMPORT = """
import importlib, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {libraries!r}:
            raise ImportError(f"{{name}} is refused: the pure core must not import it")

sys.meta_path.insert(0, Refuse())
for name in {modules!r}:
    importlib.import_module(f"refstream.{{name}}")
print(sorted(m for m in sys.modules if m.startswith("refstream")))
"""


def load_without_io(modules: list[str]) -> subprocess.CompletedProcess:
    code = BLOCKED_IMPORT.format(libraries=IO_LIBRARIES, modules=modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})


def test_the_pure_core_loads_without_io_libraries():
    done = load_without_io(PURE_CORE)
    assert done.returncode == 0, done.stderr
    print(done.stdout)


def test_a_core_module_importing_an_io_library_is_caught():
    done = load_without_io(["meta"])  # meta reads Parquet: it is no part of the pure core
    assert done.returncode != 0 and "pyarrow is refused" in done.stderr


def module_attributes(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` of every ``alias.name`` in ``path`` where ``alias`` is a
    refstream module it imports (``from refstream import x``, ``import refstream.x as y``)."""
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name.startswith("refstream.") and is_module(name.split(".", 1)[1]
                                                                .replace(".", "/")):
                    aliases[alias.asname or alias.name] = name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("refstream.") and alias.asname:
                    aliases[alias.asname] = alias.name
    return [(aliases[node.value.id], node.attr, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in aliases]


def defined_names(module: str) -> set[str]:
    """The names ``module`` defines: imported, or read from its source when it needs an optional
    dependency this environment lacks (LeRobot for the trainer command)."""
    try:
        return set(dir(importlib.import_module(module)))
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] == "refstream":
            raise
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                         and isinstance(n.ctx, ast.Store))
    return names


def test_every_name_read_from_a_module_exists():
    """A renamed name leaves no caller behind in the package or the tests (a name read in an
    ``except`` clause fails only when that exception is raised)."""
    missing = [f"{path.relative_to(PACKAGE.parent)}:{line} {module}.{name}"
               for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(TESTS.glob("*.py"))]
               for module, name, line in module_attributes(path)
               if name not in defined_names(module)]
    assert missing == []


def test_a_missing_module_name_is_caught(tmp_path):
    path = tmp_path / "caller.py"
    path.write_text("from refstream import sidecar\n\ntry:\n    pass\n"
                    "except sidecar.NO_SUCH_NAME:\n    pass\n")
    assert module_attributes(path) == [("refstream.sidecar", "NO_SUCH_NAME", 5)]
