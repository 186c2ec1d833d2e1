"""The coordinator's drivers read nothing of it but what ``handle`` returns and ``summary()``.

Two checks: every attribute the runtime, the simulator, the analyzer and the tools read of a
coordinator object (found in their source: ``….coordinator.X``, and ``X`` of every name bound to a
coordinator), and a simulated run with a coordinator that records every attribute read of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

from reflow_hpc.sim.engine import Simulation
from reflow_hpc.sim.workload import build_coordinator, load_mode, placement

DRIVERS = [*sorted((ROOT / "reflow_hpc" / "runtime").glob("*.py")), *sorted((ROOT / "reflow_hpc" / "sim").glob("*.py")),
           *sorted((ROOT / "reflow_hpc" / "analyze").glob("*.py")), *sorted((ROOT / "tools").glob("*.py")),
           ROOT / "reflow_hpc" / "run.py", ROOT / "reflow_hpc" / "submit.py"]
# What a driver may use: the one entrance, the one query, and restoring a checkpoint before the run starts.
ALLOWED = {"handle", "summary", "load_state_dict"}


def _is_coordinator(node: ast.AST, names: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "coordinator") or \
        (isinstance(node, ast.Name) and node.id in names)


def _makes_coordinator(node: ast.AST, names: set[str]) -> bool:
    if _is_coordinator(node, names):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return "coordinator" in name.lower() and name != "coordinator_settings"
    return False


def coordinator_reads(path: Path) -> set[str]:
    """Attributes read of a coordinator object in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):                          # names bound to a coordinator
        if isinstance(node, ast.Assign) and _makes_coordinator(node.value, names):
            for target in node.targets:
                elts = target.elts[:1] if isinstance(target, ast.Tuple) else [target]   # (coordinator, settings)
                names |= {e.id for e in elts if isinstance(e, ast.Name)}
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _is_coordinator(node.value, names)}


def test_drivers_read_nothing_of_the_coordinator_but_its_outputs_and_summary():
    bad = {f"{p.relative_to(ROOT)}: {sorted(coordinator_reads(p) - ALLOWED)}" for p in DRIVERS
           if coordinator_reads(p) - ALLOWED}
    assert not bad, "drivers read coordinator internals:\n" + "\n".join(sorted(bad))


def test_the_check_sees_an_alias(tmp_path):
    p = tmp_path / "driver.py"
    p.write_text("def f(side):\n    c = side.coordinator\n    return c.index.version, side.coordinator.phase\n")
    assert coordinator_reads(p) == {"index", "phase"}


class Recorder:
    """A coordinator that notes every attribute read of it."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._inner, name)


def test_a_simulated_run_reads_only_handle_and_summary():
    cfg = load_mode(str(ROOT / "configs" / "sim_cpu_tiny.toml"), "reflow", ["trainer.steps=3"], None)
    place = placement(cfg)
    coordinator, settings = build_coordinator(cfg, place)
    spy = Recorder(coordinator)
    sim = Simulation(cfg, spy, settings, place).run()
    assert sim.phase.value == "finished" and spy.read <= {"handle", "summary"} and "handle" in spy.read
