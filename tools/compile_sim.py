"""Compile the simulator's event loop, cost models and length model to C with mypyc, in place.

    python tools/compile_sim.py            # builds reflow_hpc/sim/{engine,costs,lengths}.*.so
    python tools/compile_sim.py --clean    # removes them: the interpreted simulator again

The compiled modules simulate the same runs (the same JSON, byte for byte) with about 1.3× fewer
instructions, 1.07–1.3× less CPU time on a shared VM (the interpreted coordinator is most of what is
left); see ``tools/bench_sim.py --interpreted`` and the README's performance section. They replace only
``reflow_hpc.sim`` modules, which the MPI runtime never imports; the coordinator (``reflow_hpc.core``)
stays interpreted everywhere. Needs mypy (the ``dev`` extra) and a C compiler.

Python imports an extension module before the ``.py`` beside it, so an edit made after a build would
be silently ignored. The build therefore records each source's SHA-256 in ``reflow_hpc/sim/_compiled.json``,
and ``reflow_hpc/sim/__init__.py`` refuses to import compiled modules whose source changed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The modules that run per simulated event; the others (report, plots, workload, …) run once per run.
MODULES = ("engine", "costs", "lengths")
MANIFEST = "_compiled.json"
# mypyc's shared library of the group: reflow_hpc/sim/compiled__mypyc.<suffix>
GROUP = "reflow_hpc.sim.compiled"

SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
sources, target, temp = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
setup(name="reflow-hpc-sim-compiled", packages=[], script_args=["build_ext", "--inplace", "--build-temp", temp],
      ext_modules=mypycify(["--ignore-missing-imports", "--follow-imports=silent", *sources],
                           group_name=%r, target_dir=target, opt_level="3"))
"""


def sim_dir(root: Path) -> Path:
    return root / "reflow_hpc" / "sim"


def built(root: Path) -> list[Path]:
    """Extension modules in the simulator package (this interpreter's suffixes)."""
    d = sim_dir(root)
    return sorted({p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in d.glob(f"*{suffix}")})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clean(root: Path) -> list[Path]:
    gone = built(root)
    manifest = sim_dir(root) / MANIFEST
    if manifest.exists():
        gone.append(manifest)
    for p in gone:
        p.unlink()
    return gone


def compile_sim(root: Path) -> list[Path]:
    """Build the modules in place under ``root`` (a checkout or a copy of its ``reflow_hpc``)."""
    try:
        import mypyc  # noqa: F401
    except ImportError:
        raise SystemExit("compile_sim: mypyc is not installed: pip install mypy (the project's dev extra has it)")
    clean(root)
    sources = [f"reflow_hpc/sim/{m}.py" for m in MODULES]
    with tempfile.TemporaryDirectory(prefix="reflow-mypyc-") as tmp:
        # From the root: mypyc names modules after their paths, and build_ext --inplace writes there.
        proc = subprocess.run([sys.executable, "-c", SETUP % GROUP, ",".join(sources), f"{tmp}/c", f"{tmp}/o"],
                              cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error" in ln.lower()]
        detail = "\n".join(lines[-20:]) or (proc.stdout + proc.stderr)[-4000:]
        raise SystemExit(f"compile_sim: mypyc failed (exit {proc.returncode}):\n{detail}")
    manifest = {m: digest(sim_dir(root) / f"{m}.py") for m in MODULES}
    (sim_dir(root) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return built(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clean", action="store_true", help="remove the compiled modules")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree whose reflow_hpc/sim is built (default: this one)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.clean:
        gone = clean(root)
        print(f"compile_sim: removed {len(gone)} file(s)" + "".join(f"\n  {p.relative_to(root)}" for p in gone))
        return 0
    names = [p.name.split(".")[0] for p in compile_sim(root)]
    print(f"compile_sim: compiled {', '.join(n for n in names if not n.endswith('__mypyc'))} in "
          f"{sim_dir(root).relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
