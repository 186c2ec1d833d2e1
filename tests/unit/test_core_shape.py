"""The shape of reflow_hpc/core/: small classes and short functions, so that the coordinator, its
sub-machines and the replay index's parts each read in one sitting. An AST scan of every module:

- no class longer than MAX_CLASS_LINES lines;
- no class with more than MAX_ATTRIBUTES distinct attributes assigned through ``self`` (``self.x = …``,
  ``self.x += …``, ``self.x: T = …``, tuple targets included);
- no function or method longer than MAX_FUNCTION_LINES lines (from its ``def`` to its last line,
  nested functions counted in the one that holds them and on their own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "reflow_hpc" / "core"
MAX_CLASS_LINES = 300
MAX_ATTRIBUTES = 25
MAX_FUNCTION_LINES = 40


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """Names ``x`` of every ``self.x`` assigned anywhere in the class body."""
    found = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found


def shape_violations(source: str, name: str) -> list[str]:
    """What in ``source`` (the module ``name``) breaks the limits of the module docstring."""
    bad = []
    for node in ast.walk(ast.parse(source, name)):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.ClassDef):
            attrs = self_attributes(node)
            if lines > MAX_CLASS_LINES:
                bad.append(f"{name}:{node.lineno}: class {node.name} has {lines} lines (at most {MAX_CLASS_LINES})")
            if len(attrs) > MAX_ATTRIBUTES:
                bad.append(f"{name}:{node.lineno}: class {node.name} has {len(attrs)} attributes "
                           f"(at most {MAX_ATTRIBUTES}): {sorted(attrs)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
            bad.append(f"{name}:{node.lineno}: {node.name} has {lines} lines (at most {MAX_FUNCTION_LINES})")
    return bad


@pytest.mark.parametrize("module", sorted(p.name for p in CORE.glob("*.py")))
def test_core_classes_and_functions_stay_small(module):
    bad = shape_violations((CORE / module).read_text(), f"reflow_hpc/core/{module}")
    assert not bad, "split these (tests/unit/test_core_shape.py):\n" + "\n".join(bad)


def test_the_scan_catches_each_limit():
    long_body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    many = "".join(f"        self.a{i} = 0\n" for i in range(MAX_ATTRIBUTES + 1))
    source = ("class Big:\n    def __init__(self):\n" + many + "        self.a0 += 1\n"
              "    def long(self):\n" + long_body +
              "".join(f"    def f{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 2)))
    bad = shape_violations(source, "big.py")
    assert any(f"class Big has {MAX_ATTRIBUTES + 1} attributes" in b for b in bad), bad
    assert any("class Big has" in b and "lines" in b for b in bad), bad
    assert any(f"big.py:{MAX_ATTRIBUTES + 5}: long has {MAX_FUNCTION_LINES + 1} lines" in b for b in bad), bad
    assert not shape_violations("class Small:\n    def __init__(self):\n        self.a, self.b = 1, 2\n", "s.py")
