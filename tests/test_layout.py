"""The package layout holds: no import cycles, imports only down the layers, no module over 500 lines, and the
tree formatted and linted by ruff.

The layers, lowest first; a module may import its own layer and the ones below it, never one above:

    config < model < engine < runtime < server < deploy < bench < cli

- `rlserve.weight_transfer` (the weight broadcast wire) is below them all: the trainer's client, the engine
  process and the server all speak it, and it imports nothing of rlserve.
- `rlserve.client` is the trainer's side and stands apart: it imports only itself and `weight_transfer`, and no
  layer imports it (a trainer installs the client without the server's stack in its way).
- `rlserve.train` is the trainer's exact forward (true on-policy RL): it imports only itself, `config` and
  `model` (the model definition it shares with the engine), never the engine or what serves it, and no layer
  imports it.
- `bench` runs an engine or a server to measure them, so it sits above them; only the cli starts it.

Imports are read with `ast`: every `import` counts, at the top of a module or inside a function (a lazy import
still runs), except those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "rlserve"
LAYERS = ["config", "model", "engine", "runtime", "server", "deploy", "bench", "cli"]
WIRE = "rlserve.weight_transfer"
CLIENT = "rlserve.client"
TRAIN = "rlserve.train"
# the packages that stand apart from the layers: what each may import (itself included); no layer imports them
APART = {
    CLIENT: ((CLIENT,), f"itself and {WIRE}"),
    TRAIN: (("rlserve.config", "rlserve.model", TRAIN), "itself, config and model"),
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base) + (f".{node.module}" if node.module else "")
        else:
            module = node.module or ""
        # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
        names = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
    out = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name.startswith("rlserve"):
            out.append(name)
    return out


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node` except those in an `if TYPE_CHECKING:` body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _runtime_imports(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _runtime_imports(child)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the rlserve modules it imports when it runs (TYPE_CHECKING imports left out).

    Read in a fresh interpreter: CPython 3.11 keeps one AST-builder recursion counter per interpreter, so an
    `ast.parse` here can meet one on a thread an earlier test left behind (3.11 formats every traceback with
    `ast`) and fail with "AST constructor recursion depth mismatch" (python/cpython#106905)."""
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, check=True).stdout
    return {name: set(deps) for name, deps in json.loads(out).items()}


def _read_import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        deps = {dep for node in _runtime_imports(tree) for dep in _imported(node, package, modules)}
        deps.discard(name)
        # a package's __init__ runs first, but ours only hold docstrings: it is not an edge worth drawing
        graph[name] = {d for d in deps if modules[d].name != "__init__.py" or d == CLIENT}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = iter(range(len(graph) * 2 + 1))

    def connect(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def layer_of(module: str) -> str | None:
    """The layer a module belongs to; None for the package root, the wire and the client (their own rules)."""
    parts = module.split(".")
    if len(parts) < 2 or module == WIRE or module.startswith(tuple(APART)):
        return None
    return parts[1] if parts[1] in LAYERS else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if dep == WIRE:
                continue
            home = next((p for p in APART if module.startswith(p)), None)
            if home is not None:
                allowed, said = APART[home]
                if not dep.startswith(allowed):
                    bad.append(f"{module} -> {dep}: {home} imports only {said}")
                continue
            theirs_apart = next((p for p in APART if dep.startswith(p)), None)
            if theirs_apart is not None:
                bad.append(f"{module} -> {dep}: no layer imports {theirs_apart}")
                continue
            if module == WIRE:
                bad.append(f"{module} -> {dep}: {WIRE} imports nothing of rlserve")
                continue
            mine, theirs = layer_of(module), layer_of(dep)
            if mine is None or theirs is None:
                continue
            if LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{module} ({mine}) -> {dep} ({theirs}): imports go down {' < '.join(LAYERS)}")
    return bad


def test_every_module_belongs_to_a_layer():
    unplaced = [
        m
        for m in import_graph()
        if m.count(".") and layer_of(m) is None and m != WIRE and not m.startswith(tuple(APART))
    ]
    assert not unplaced, f"modules outside the layers (add them to one, or to LAYERS in this test): {unplaced}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among rlserve modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_go_down_the_layers():
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "rlserve.server.app" in graph["rlserve.cli"]  # imported inside main(), to keep --help fast
    assert "rlserve.engine.engine" not in graph["rlserve.engine.kv.transfer"]  # never imported, even for types
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_violations({"rlserve.engine.x": {"rlserve.server.y"}, "rlserve.server.y": {"rlserve.engine.x"}}) == [
        "rlserve.engine.x (engine) -> rlserve.server.y (server): imports go down " + " < ".join(LAYERS)
    ]
    assert layer_violations({"rlserve.client.c": {"rlserve.server.y"}, "rlserve.deploy.d": {"rlserve.client.c"}})
    assert layer_violations({"rlserve.train.t": {"rlserve.engine.x"}, "rlserve.engine.x": {"rlserve.train.t"}}) == [
        "rlserve.engine.x -> rlserve.train.t: no layer imports rlserve.train",
        "rlserve.train.t -> rlserve.engine.x: rlserve.train imports only itself, config and model",
    ]
    assert not layer_violations({"rlserve.train.t": {"rlserve.model.llama", "rlserve.config.schema"}})


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them into rooms of their own): {long}"


def test_every_engine_form_has_the_faces_operations():
    """The server is annotated with runtime/face.py's EngineFace; the three forms it runs provide all of it."""
    import inspect

    from rlserve.runtime.data_parallel import DataParallelClient
    from rlserve.runtime.face import EngineFace
    from rlserve.runtime.inproc import AsyncEngine
    from rlserve.runtime.proc_client import EngineClient

    operations = {
        n
        for n, v in vars(EngineFace).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }
    assert {"generate", "pause", "update_weights_from_dir", "policy_version"} <= operations
    for form in (AsyncEngine, EngineClient, DataParallelClient):
        missing = sorted(n for n in operations if not hasattr(form, n))
        assert not missing, f"{form.__name__} lacks {missing} of EngineFace"
        for name in operations:
            declared, actual = getattr(EngineFace, name), getattr(form, name)
            if inspect.isfunction(declared):
                assert list(inspect.signature(declared).parameters) == list(inspect.signature(actual).parameters), (
                    f"{form.__name__}.{name}{inspect.signature(actual)} differs from EngineFace's"
                )


# ---- ruff ------------------------------------------------------------------------------------------------------
# EXPECTED TO FAIL until the one-time `ruff format` + lint-fix commit of the whole tree (issue 31): the lead runs
# it once after merging the parallel branches, so that no branch reformats files another one edits.

RUFF_PATHS = ["src", "tests", "benchmarks", "examples"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "ruff", *args, *RUFF_PATHS], cwd=ROOT, capture_output=True, text=True)


def test_ruff_format_clean():
    result = _ruff("format", "--check")
    assert result.returncode == 0, f"run `ruff format {' '.join(RUFF_PATHS)}`:\n{result.stdout[-3000:]}"


def test_ruff_check_clean():
    result = _ruff("check", "--output-format", "concise")
    assert result.returncode == 0, f"`ruff check` finds:\n{result.stdout[-3000:]}"


if __name__ == "__main__":
    print(json.dumps({name: sorted(deps) for name, deps in _read_import_graph().items()}))
