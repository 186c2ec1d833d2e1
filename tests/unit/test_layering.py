"""The package's layers (docs/architecture.md): what each part may import, checked on every import of
the package, function-local ones included, and on every import by name (``importlib.import_module``,
``__import__``, ``importlib.util.find_spec``); and no import cycle among the package's modules."""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "reflow_hpc"

# The part of the package a module belongs to: its subpackage, or the module itself at the top.
# For each part, the other parts it may import (its own is always allowed).
BELOW_RUNTIME = {"core", "comm", "config", "plugins", "trajectory", "envs", "storage", "rollout", "train", "policy",
                 "metrics", "evaluation", "warmstart", "assembly", "sandbox"}
ALLOWED = {
    "core": set(),
    "private": set(),                   # stdlib only: the safe writes every writer below uses
    "plugins": set(),
    "trajectory": set(),
    "config": {"core", "plugins"},
    "comm": set(),
    "envs": {"config", "core", "plugins", "sandbox"},   # the code tool and the math scorer's helper process
    "sandbox": {"config"},              # fork servers for model-written code; stdlib inside the sandbox
    "storage": {"comm", "config", "trajectory"},
    "rollout": {"config", "envs", "trajectory"},
    "train": {"comm", "config", "plugins", "trajectory", "policy"},
    "policy": {"config", "envs"},
    "metrics": {"core"},
    "evaluation": {"config", "envs", "rollout", "policy", "train", "metrics"},
    "warmstart": {"config", "envs", "evaluation", "policy", "train"},
    "assembly": {"core", "config"},
    "sim": {"core", "config", "metrics", "assembly"},
    "runtime": BELOW_RUNTIME,
    "postmortem": BELOW_RUNTIME,
    "run": BELOW_RUNTIME | {"runtime", "postmortem"},
    "submit": BELOW_RUNTIME | {"runtime", "run"},
    "analyze": {"core", "config", "trajectory", "storage", "metrics"},   # offline: no runtime, comm or torch
}
# Every part that writes files may import reflow_hpc/private.py; the pure parts write nothing.
for _part, _below in ALLOWED.items():
    if _part not in ("core", "private"):
        _below.add("private")
# Third-party modules that would make a pure part impure.
IMPURE = {"mpi4py", "torch", "h5py", "time", "threading", "socket"}
PURE = {"core", "sim"}
# The one function that may import a module by a name computed at run time: the modules of
# run.plugins (reflow_hpc/plugins.py). Anywhere else an import by name must spell the name.
PLUGIN_SITE = ("plugins.py", "import_plugin")
# Calls that import (or look up) the module their first argument names.
IMPORT_CALLS = {"import_module", "__import__", "find_spec"}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


class _Imports(ast.NodeVisitor):
    """Every import of one file: statements anywhere, and calls of IMPORT_CALLS."""

    def __init__(self, package: list[str]):
        self.package = package
        self.found: list[tuple[int, str]] = []          # (line, absolute module name)
        self.computed: list[tuple[int, str]] = []       # (line, enclosing function): name not a literal
        self.scope: list[str] = []

    def _function(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _absolute(self, level: int, module: str | None) -> str:
        base = self.package[: len(self.package) - level + 1] if level else []
        return ".".join(base + ([module] if module else []))

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, a.name) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.level, node.module)
        # `from a.b import c` imports a.b, and a.b.c too when c is a module: name each, the graph keeps
        # the longest one that is a module of the package.
        self.found += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
        if name in IMPORT_CALLS and arg is not None:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                target = arg.value
                if target.startswith("."):
                    level = len(target) - len(target.lstrip("."))
                    target = self._absolute(level, target.lstrip(".") or None)
                self.found.append((node.lineno, target))
            else:
                self.computed.append((node.lineno, ".".join(self.scope) or "<module>"))
        self.generic_visit(node)


def scan(path: Path) -> _Imports:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    v = _Imports(list(rel.parts[:-1]))
    v.visit(ast.parse(path.read_text(), str(path)))
    return v


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, by statement or by a literal name."""
    return scan(path).found


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        if part == "__init__":
            continue
        allowed = ALLOWED.get(part)
        found = scan(path)
        for line, name in found.found:
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            top = name.split(".")[0]
            if top == "reflow_hpc":
                target = name.split(".")[1] if "." in name else ""
                if allowed is None:
                    bad.append(f"{where}: {part} is not in the layer table of tests/unit/test_layering.py")
                elif target and target != part and target not in allowed:
                    bad.append(f"{where}: {part} imports {name} ({target} is not below it)")
            elif part in PURE and top in IMPURE:
                bad.append(f"{where}: {part} must stay pure (no I/O libraries, no clock) but imports {name}")
        rel = path.relative_to(PACKAGE).as_posix()
        for line, function in found.computed:
            if (rel, function) != PLUGIN_SITE:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports a module by a computed name in "
                           f"{function}; only {PLUGIN_SITE[0]} {PLUGIN_SITE[1]} may (the modules of run.plugins)")
    return bad


def module_graph() -> dict[str, dict[str, str]]:
    """module → {module it imports: "file:line" of the first such import}, over the package's modules.

    A package's ``__init__`` that imports its own submodules is not a cycle with them: importing a
    submodule runs its package first, but that is Python's order, not an import the submodule makes."""
    files = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, str]] = {m: {} for m in files}
    for mod, path in files.items():
        for line, name in imports(path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].setdefault(name, f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def cycles() -> dict[tuple[str, ...], str]:
    """Each import cycle as a path, ``a → b → a``, with the line of every import in it: for every
    import inside a cycle, the shortest cycle through it (so each import that closes one is shown).
    Keyed by its modules, starting at the first by name. Imports under ``TYPE_CHECKING`` count: a
    type-only back-reference is the same coupling, hidden."""
    graph = module_graph()
    found: dict[tuple[str, ...], str] = {}
    for comp in _components(graph):
        members = set(comp)
        for u in comp:
            for v in sorted(graph[u]):
                if v not in members:
                    continue
                prev = {v: v}
                queue = deque([v])
                while queue and u not in prev:
                    x = queue.popleft()
                    for y in sorted(graph[x]):
                        if y in members and y not in prev:
                            prev[y] = x
                            queue.append(y)
                path = [u]
                while path[-1] != v:
                    path.append(prev[path[-1]])
                ring = [u] + path[::-1][:-1]             # u → v → … → (back to u)
                start = ring.index(min(ring))
                ring = ring[start:] + ring[:start]
                key = tuple(ring)
                if key not in found:
                    hops = list(zip(ring, ring[1:] + ring[:1]))
                    found[key] = (" → ".join(ring + ring[:1]) + "  (" +
                                  "; ".join(f"{graph[a][b]} imports {b}" for a, b in hops) + ")")
    return dict(sorted(found.items()))


def test_every_import_respects_the_layers():
    bad = violations()
    assert not bad, "imports that break the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_no_module_imports_one_that_imports_it_back():
    found = cycles()
    assert not found, ("import cycles among the package's modules (move the shared piece down instead of "
                       "hiding the import in a function):\n" + "\n".join(found.values()))


def test_every_part_of_the_package_is_in_the_table():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert parts <= set(ALLOWED), sorted(parts - set(ALLOWED))


def test_the_check_catches_a_break(tmp_path, monkeypatch):
    """A core module that imports the runtime (or torch) is reported."""
    fake = tmp_path / "reflow_hpc"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("import torch\n\ndef f():\n    from ..runtime import worker\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    bad = violations()
    assert any("core imports reflow_hpc.runtime" in b for b in bad) and any("imports torch" in b for b in bad)


def test_the_check_catches_an_import_by_name_and_a_cycle(tmp_path, monkeypatch):
    """Imports by name count as imports; a computed name is allowed only at the plugin site; a cycle
    through a function-local import or an import by name is reported as a path."""
    fake = tmp_path / "reflow_hpc"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "named.py").write_text(
        "import importlib\nimport importlib.util\n\n"
        "def f(name):\n"
        "    importlib.import_module('reflow_hpc.runtime.worker')\n"
        "    __import__('torch')\n"
        "    importlib.util.find_spec('reflow_hpc.sim')\n"
        "    return importlib.import_module(name)\n")
    # a → b at the top, b → a inside a function: a two-module cycle.
    (fake / "core" / "a.py").write_text("from . import b\n")
    (fake / "core" / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    # p → q by a literal name, q → r, r → p: a three-module cycle.
    (fake / "core" / "p.py").write_text("import importlib\nq = importlib.import_module('reflow_hpc.core.q')\n")
    (fake / "core" / "q.py").write_text("import reflow_hpc.core.r\n")
    (fake / "core" / "r.py").write_text("from reflow_hpc.core import p\n")
    (fake / "plugins.py").write_text(
        "import importlib\n\n"
        "def import_plugin(module):\n    importlib.import_module(module)\n\n"
        "def elsewhere(module):\n    importlib.import_module(module)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    bad = violations()
    assert any("named.py:5: core imports reflow_hpc.runtime.worker" in b for b in bad), bad
    assert any("named.py:6: core must stay pure" in b and "torch" in b for b in bad), bad
    assert any("named.py:7: core imports reflow_hpc.sim" in b for b in bad), bad
    assert any("named.py:8: imports a module by a computed name in f" in b for b in bad), bad
    assert any("plugins.py:7: imports a module by a computed name in elsewhere" in b for b in bad), bad
    assert not any("plugins.py:4" in b for b in bad), bad
    found = cycles()
    assert set(found) == {("reflow_hpc.core.a", "reflow_hpc.core.b"),
                          ("reflow_hpc.core.p", "reflow_hpc.core.q", "reflow_hpc.core.r")}, found
    assert found["reflow_hpc.core.a", "reflow_hpc.core.b"] == (
        "reflow_hpc.core.a → reflow_hpc.core.b → reflow_hpc.core.a  (reflow_hpc/core/a.py:1 imports "
        "reflow_hpc.core.b; reflow_hpc/core/b.py:2 imports reflow_hpc.core.a)")
    assert "reflow_hpc/core/p.py:2 imports reflow_hpc.core.q" in found["reflow_hpc.core.p", "reflow_hpc.core.q",
                                                                       "reflow_hpc.core.r"]
