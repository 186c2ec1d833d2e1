"""The package's layers (docs/architecture.md): what each part may import, checked on every import
statement of the package, function-local ones included."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "reflow_hpc"

# The part of the package a module belongs to: its subpackage, or the module itself at the top.
# For each part, the other parts it may import (its own is always allowed).
BELOW_RUNTIME = {"core", "comm", "config", "plugins", "trajectory", "envs", "storage", "rollout", "train", "policy",
                 "metrics", "evaluation", "warmstart", "coordination"}
ALLOWED = {
    "core": set(),
    "plugins": set(),
    "trajectory": set(),
    "config": {"core", "plugins"},
    "comm": set(),
    "envs": {"config", "core", "plugins"},
    "storage": {"comm", "config", "trajectory"},
    "rollout": {"config", "envs", "trajectory"},
    "train": {"comm", "config", "trajectory", "policy"},
    "policy": {"config", "envs"},
    "metrics": {"core"},
    "evaluation": {"config", "envs", "rollout", "policy", "train", "metrics"},
    "warmstart": {"config", "envs", "evaluation", "policy", "train"},
    "coordination": {"core", "config"},
    "sim": {"core", "config", "metrics", "coordination"},
    "runtime": BELOW_RUNTIME,
    "postmortem": BELOW_RUNTIME,
    "run": BELOW_RUNTIME | {"runtime", "postmortem"},
    "submit": BELOW_RUNTIME | {"runtime", "run"},
    "analyze": {"core", "config", "trajectory", "storage", "metrics"},   # offline: no runtime, comm or torch
}
# Third-party modules that would make a pure part impure.
IMPURE = {"mpi4py", "torch", "h5py", "time", "threading", "socket"}
PURE = {"core", "sim"}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "reflow_hpc" or (node.level and not node.module):
                out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, name))
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        if part == "__init__":
            continue
        allowed = ALLOWED.get(part)
        for line, name in imports(path):
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
    return bad


def test_every_import_respects_the_layers():
    bad = violations()
    assert not bad, "imports that break the layering (docs/architecture.md):\n" + "\n".join(bad)


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
