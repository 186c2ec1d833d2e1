"""The what-if replay on synthesised runs (tools/bench_analyze.py drives the real coordinator, no MPI):
it reproduces every recorded batch in each mode, and its predictions obey the rules of the index
they come from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, python_m

sys.path.insert(0, str(ROOT / "tools"))
from bench_analyze import synthesise  # noqa: E402

from reflow_hpc.analyze import analyze_run  # noqa: E402

SMALL = ["trainer.batch_size=32", "checkpoint.every_steps=10"]   # ~90 steps of 3,000 samples, checkpoint blocks


@pytest.fixture(scope="module")
def reflow_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("synth") / "run"
    synthesise(run_dir, 3000, 0, SMALL)
    return run_dir


@pytest.mark.parametrize("mode", ["fully_async", "one_step_off", "sync"])
def test_the_replay_reproduces_every_mode(tmp_path, mode):
    run_dir = tmp_path / "run"
    synthesise(run_dir, 1000, 1, [f"reflow.mode={mode}", "reflow.sigma=0", *SMALL])
    res, _ = analyze_run(run_dir, tmp_path / "a", what_if_overrides=[], plots=False)
    base = res["what_if"]["outcomes"][1]
    assert res["reproduces_run"], base
    assert base["matched_steps"] == res["steps"] > 20


def test_what_if_under_other_settings(reflow_run, tmp_path):
    res, text = analyze_run(reflow_run, tmp_path, plots=False,
                            what_if_overrides=["reflow.sigma=0.25", "reflow.delta=1", "reflow.b_max=16"])
    run, base, wi = res["what_if"]["outcomes"]
    assert res["reproduces_run"] and base["matched_steps"] == run["steps"]
    # The run's own column is the recorded one, and the replay under its settings agrees with it.
    for key in ("steps", "trained", "replayed", "evicted_unused", "staleness_max"):
        assert base[key] == run[key], key
    assert run["trainer_waits"] == base["trainer_waits"] is not None
    # The what-if obeys the rules of the index it ran: σ caps the replay fraction, δ = 1 trains
    # nothing older than one step, and b_max = 16 < the run's window defers dispatches.
    assert wi["settings"] == {"sigma": 0.25, "tau": 1.0, "delta": 1, "b_max": 16, "batch_fill": "unused_first",
                              "sampler": "random", "replay_filter": "accept_all"}
    assert wi["replay_fraction"] <= 0.25 and wi["staleness_max"] <= 1
    assert wi["deferred_groups"] > 0 and wi["created"] <= run["created"]
    assert 0 < wi["steps"] <= run["steps"]
    assert "what-if (overrides reflow.sigma=0.25 reflow.delta=1 reflow.b_max=16" in text
    assert "reproduces its" in text and ": yes" in text


def test_the_same_settings_spelled_out_are_no_change(reflow_run, tmp_path):
    res, _ = analyze_run(reflow_run, tmp_path, plots=False, what_if_overrides=["reflow.sigma=0.5", "reflow.tau=1.0"])
    assert res["what_if"]["changed"] is False and len(res["what_if"]["outcomes"]) == 2 and res["reproduces_run"]


def test_what_if_refuses_what_it_cannot_replay(reflow_run):
    r = python_m("reflow_hpc.analyze", str(reflow_run), "--no-plots", "--what-if", "trainer.lr=1e-3")
    assert r.returncode == 2 and "trainer.lr" in r.stderr and "reflow.sigma" in r.stderr
    r = python_m("reflow_hpc.analyze", str(reflow_run), "--no-plots", "--what-if", "reflow.sigma=1.5")
    assert r.returncode == 2 and "reflow.sigma" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_broken_arrival_stream_is_reported_not_raised(reflow_run, tmp_path):
    """A finish line that cannot be read: the analysis names it, the replay no longer reproduces."""
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(reflow_run, run_dir)
    lines = (run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    k = next(i for i, ln in enumerate(lines) if b'"e":"finish"' in ln and i > len(lines) // 3)
    lines[k] = lines[k][:20] + b"\x00\xff garbage\n"
    (run_dir / "events.jsonl").write_bytes(b"".join(lines))
    res, _ = analyze_run(run_dir, tmp_path / "a", plots=False, what_if_overrides=[])
    assert {"file": "events.jsonl", "reason": "not a JSON object", "lines": [k + 1, k + 1]} in res["unreadable"]
    assert res["reproduces_run"] is False


def test_the_package_imports_no_torch_or_mpi():
    code = ("import sys, reflow_hpc.analyze, reflow_hpc.analyze.plots; "
            "bad = [m for m in ('torch', 'mpi4py', 'reflow_hpc.runtime', 'reflow_hpc.comm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
