"""The compiled simulator (``tools/compile_sim.py``): it builds, simulates the same runs as the
interpreted one (the same JSON, byte for byte), and a build whose source changed refuses to import.

Each test works on copies of ``reflow_hpc`` under a temporary directory, so this checkout's own build
state does not matter. Without mypyc or a C compiler the tests are skipped, unless
REFLOW_REQUIRE_MYPYC=1 (CI installs both), where that fails them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (pip install mypy)"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h)"
    return None


def copy_package(dest: Path, src: Path = ROOT) -> Path:
    shutil.copytree(src / "reflow_hpc", dest / "reflow_hpc",
                    ignore=shutil.ignore_patterns("*.so", "_compiled.json", "__pycache__"))
    return dest


def in_tree(tree: Path, *args: str, timeout: float = 300):
    """Python with ``tree``'s package imported first (the working directory leads sys.path)."""
    return run_cmd([sys.executable, *args], cwd=tree, timeout=timeout)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[Path, Path]:
    """(interpreted copy, compiled copy) of the package."""
    missing = _missing()
    if missing:
        if os.environ.get("REFLOW_REQUIRE_MYPYC") == "1":
            pytest.fail(f"REFLOW_REQUIRE_MYPYC=1 but {missing}")
        pytest.skip(missing)
    plain = copy_package(tmp_path_factory.mktemp("interpreted"))
    built = copy_package(tmp_path_factory.mktemp("compiled"))
    r = run_cmd([sys.executable, str(ROOT / "tools" / "compile_sim.py"), "--root", str(built)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled costs, engine, lengths" in r.stdout, r.stdout
    return plain, built


def simulated(tree: Path, config: str, *sets: str) -> str:
    r = in_tree(tree, "-m", "reflow_hpc.sim", str(ROOT / "configs" / config), *sets, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_the_compiled_simulator_runs_the_same_simulations(trees):
    plain, built = trees
    which = "import reflow_hpc.sim as s; print(s.compiled(), s.engine.__file__)"
    assert in_tree(plain, "-c", which).stdout.startswith("False")
    r = in_tree(built, "-c", which)
    assert r.stdout.startswith("True") and str(built) in r.stdout, r.stdout + r.stderr
    # Every mode on the CPU workload, and on Laminar's with partial rollouts, replay and the elastic pool.
    for config, sets in (("sim_cpu_tiny.toml", ()),
                         ("sim_laminar_7b.toml", ("--gpus", "32", "--set", "trainer.steps=6",
                                                  "--set", "sim.warmup_steps=1"))):
        assert simulated(built, config, *sets) == simulated(plain, config, *sets), config


def test_a_compiled_module_whose_source_changed_refuses_to_import(trees, tmp_path):
    _, built = trees
    tree = tmp_path / "edited"
    shutil.copytree(built, tree, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tree / "reflow_hpc" / "sim" / "costs.py", "a") as f:
        f.write("\n# an edit after the build\n")
    r = in_tree(tree, "-c", "import reflow_hpc.sim")
    assert r.returncode != 0
    assert "costs.py changed after tools/compile_sim.py compiled it" in r.stderr, r.stderr
    # --clean goes back to the interpreted simulator, edit included.
    r = run_cmd([sys.executable, str(ROOT / "tools" / "compile_sim.py"), "--root", str(tree), "--clean"])
    assert r.returncode == 0 and "removed 5 file(s)" in r.stdout, r.stdout + r.stderr
    r = in_tree(tree, "-c", "import reflow_hpc.sim as s; print(s.compiled())")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_bench_sim_measures_the_compiled_and_an_interpreted_copy_side_by_side(trees, tmp_path):
    _, built = trees
    tree = tmp_path / "bench"
    shutil.copytree(built, tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "bench_sim.py", tree / "tools")
    r = in_tree(tree, "tools/bench_sim.py", "--config", str(ROOT / "configs" / "sim_cpu_tiny.toml"),
                "--gpus", "4", "--steps", "2,3", "--interpreted", "--repeat", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["engine"] for row in out["rows"]] == ["compiled"] * 2
    assert [row["engine"] for row in out["interpreted_rows"]] == ["interpreted"] * 2
    # The same simulations: only the CPU time may differ.
    for a, b in zip(out["rows"], out["interpreted_rows"]):
        assert (a["samples"], a["events"], a["simulated_s"]) == (b["samples"], b["events"], b["simulated_s"])
    assert out["compiled_speedup"] > 0 and "compiled vs interpreted" in r.stdout and "(least of 2)" in r.stdout
