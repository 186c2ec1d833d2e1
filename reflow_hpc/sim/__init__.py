"""The discrete-event simulator: the second driver of :class:`reflow_hpc.core.coordinator.Coordinator`
(DESIGN §4), in simulated time, with cost models of a GPU cluster.

- ``engine.py``: the event loop; simulated workers carry out the coordinator's commands.
- ``costs.py``: decode, prefill, training, weight sync, role switches, tool calls (``[sim]`` keys).
- ``lengths.py``: prompt and response lengths, groups, the cap mass, drift.
- ``workload.py``: a mode's config, the placement of GPUs into workers, the coordinator.
- ``report.py``: one run end to end and its summary; ``plots.py``: figures.
- ``calibrate.py``: the calibration gate and the cross-check against real CPU runs; ``fit.py``: the CPU
  cost model fitted to the machine of a ``tools/bench_modes.py`` run.

``python -m reflow_hpc.sim --help`` for the command line. ``tools/compile_sim.py`` compiles ``engine.py``,
``costs.py`` and ``lengths.py`` with mypyc (the same runs, ≈ 1.3× fewer instructions); the check below
keeps a stale build from shadowing its sources.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
from pathlib import Path


def _check_compiled() -> None:
    """Modules compiled by ``tools/compile_sim.py`` must match their sources: Python imports an
    extension before the ``.py`` beside it, so an edit made after the build would be silently ignored."""
    here = Path(__file__).parent
    built = {p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in here.glob(f"*{suffix}")}
    if not built:
        return
    try:
        manifest = json.loads((here / "_compiled.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    for ext in sorted(built):
        name = ext.name.split(".")[0]
        if name.endswith("__mypyc"):              # the group's shared library, not a module of its own
            continue
        src = here / f"{name}.py"
        if not src.exists() or manifest.get(name) != hashlib.sha256(src.read_bytes()).hexdigest():
            raise ImportError(f"{src} changed after tools/compile_sim.py compiled it into {ext.name}: run "
                              f"`python tools/compile_sim.py` again, or with --clean for the interpreted simulator")


def compiled() -> bool:
    """Whether the event loop runs compiled (``tools/compile_sim.py``)."""
    from . import engine
    return not str(engine.__file__).endswith(".py")


_check_compiled()
