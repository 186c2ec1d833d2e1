"""Every file the package writes goes through reflow_hpc/private.py: an AST scan of reflow_hpc/ for writes
that bypass it, against an explicit allowlist.

Found as a stray write, anywhere but private.py:
- ``open(...)`` / ``<path>.open(...)`` with a write, append, exclusive or update mode (it follows a
  symlink at the path and, but for "x", truncates or appends to whatever is there);
- ``.write_text(`` and ``.write_bytes(`` (``open(path, "w")`` underneath);
- ``os.open(`` with ``O_CREAT`` in its flags;
- ``h5py.File(`` with mode "w" or "a" (the exclusive "x" / "w-" is fine);
- ``shutil.copytree`` (follows symlinks into and out of the tree), ``tempfile.mkdtemp`` / ``mkstemp``;
- ``.mkdir(...)`` / ``os.makedirs(...)`` with ``exist_ok=True``: accepts a directory planted at a
  predictable name, owner and mode unchecked (``private.private_dir`` checks both).

Not scanned: libraries writing by path (``torch.save``, ``save_pretrained``, tensorboard), which the
package points only into directories it made with ``private_dir`` or ``mkdir(mode=0o700)``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "reflow_hpc"
EXEMPT = {"private.py"}        # the module that does it right, and the only one that may
WRITE_MODE_CHARS = set("wax+")

# (file, kind) -> (how many, why it may stay). Each entry is matched exactly: a new stray write in a
# listed file fails, and so does an entry no longer found (shrink the list when its owner migrates).
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    # cgroup-v1 control files of the rank's own CPU group (resources.cpu_quota): kernel files written in
    # place (a temp-and-rename cannot work there) under a root-owned controller that holds no symlinks.
    ("runtime/cpuquota.py", "write_text"): (3, "cgroupfs control files"),
    ("runtime/cpuquota.py", "mkdir exist_ok"): (1, "the rank's cgroup under the root-owned controller"),
}


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _name(fn: ast.AST) -> str:
    """'open', 'os.open', '<expr>.open' ... as a dotted name, '?' for a part that is not a name."""
    if isinstance(fn, ast.Name):
        return fn.id
    if isinstance(fn, ast.Attribute):
        return f"{_name(fn.value)}.{fn.attr}"
    return "?"


def _arg(call: ast.Call, index: int, keyword: str) -> ast.AST | None:
    if len(call.args) > index:
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _kind(call: ast.Call) -> str | None:
    """What kind of stray write this call is, or None."""
    name = _name(call.func)
    last = name.rsplit(".", 1)[-1]
    if name == "open" or (last == "open" and name not in ("os.open",) and isinstance(call.func, ast.Attribute)):
        mode = _arg(call, 1 if name == "open" else 0, "mode")
        if mode is not None and any(WRITE_MODE_CHARS & set(s) for s in _strings(mode)):
            return "open for writing"
        return None
    if last in ("write_text", "write_bytes"):
        return last
    if name == "os.open":
        flags = _arg(call, 1, "flags")
        if flags is not None and any(isinstance(n, (ast.Name, ast.Attribute)) and _name(n).endswith("O_CREAT")
                                     for n in ast.walk(flags)):
            return "os.open O_CREAT"
        return None
    if name in ("h5py.File", "File") and any(s in ("w", "a") for s in _strings(_arg(call, 1, "mode") or ast.Tuple([]))):
        return "h5py.File w/a"
    if last == "copytree":
        return "copytree"
    if last in ("mkdtemp", "mkstemp"):
        return last
    if last in ("mkdir", "makedirs"):
        ok = next((k.value for k in call.keywords if k.arg == "exist_ok"), None)
        if isinstance(ok, ast.Constant) and ok.value is True:
            return "mkdir exist_ok"
    return None


def stray_writes() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                kind = _kind(node)
                if kind:
                    found.setdefault((rel, kind), []).append(node.lineno)
    return found


def test_no_write_bypasses_private_py():
    found = stray_writes()
    bad = [f"reflow_hpc/{rel}:{','.join(map(str, lines))}: {kind} outside reflow_hpc/private.py"
           for (rel, kind), lines in sorted(found.items()) if (rel, kind) not in ALLOWED]
    bad += [f"reflow_hpc/{rel}: {len(found[(rel, kind)])} {kind}, the allowlist says {n} ({why})"
            for (rel, kind), (n, why) in sorted(ALLOWED.items())
            if (rel, kind) in found and len(found[(rel, kind)]) != n]
    assert not bad, "\n".join(bad)


def test_the_allowlist_holds_nothing_stale():
    found = stray_writes()
    stale = [f"{rel}: {kind}" for rel, kind in ALLOWED if (rel, kind) not in found]
    assert not stale, f"no longer found, remove from ALLOWED: {stale}"


def test_the_scan_finds_each_kind():
    src = """
open(p, "w"); open(p, mode="ab"); p.open("a" if x else "w"); p.write_text("x"); p.write_bytes(b"")
os.open(p, os.O_WRONLY | os.O_CREAT); h5py.File(p, "w"); shutil.copytree(a, b); tempfile.mkdtemp()
p.mkdir(parents=True, exist_ok=True); os.makedirs(p, exist_ok=True)
open(p); open(p, "rb"); p.open(); os.open(p, os.O_RDONLY); h5py.File(p, "r"); h5py.File(p, "x"); p.mkdir()
GpuTelemetry.open(device, rank)
"""
    kinds = Counter(_kind(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call))
    kinds.pop(None, None)
    assert kinds == {"open for writing": 3, "write_text": 1, "write_bytes": 1, "os.open O_CREAT": 1,
                     "h5py.File w/a": 1, "copytree": 1, "mkdtemp": 1, "mkdir exist_ok": 2}
