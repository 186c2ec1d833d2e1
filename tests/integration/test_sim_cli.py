"""The simulator's command line: the calibration gate, a run of the four modes with its JSON ratios and
plots, and one-line config errors."""

from __future__ import annotations

import json

from conftest import ROOT, python_m


def test_the_calibration_gate_passes_within_15_percent():
    r = python_m("reflow_hpc.sim", "--calibrate", "--json", timeout=600)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == (0 if out["passed"] else 1), r.stderr[-2000:]
    gated = [p for p in out["points"] if p["gated"]]
    assert len(gated) >= 15
    assert {p["config"] for p in gated} == {"sim_laminar_7b.toml", "sim_verl_h20_7b.toml"}
    assert out["max_abs_error"] == max(abs(p["error"]) for p in gated)
    for p in out["points"]:                      # every point is printed with its error
        assert f"{p['error']:+6.1%}" in r.stdout
    assert r.returncode == 0 and out["max_abs_error"] <= 0.15, [p for p in gated if not p["ok"]]


def test_a_run_of_the_four_modes_prints_ratios_and_plots(tmp_path):
    r = python_m("reflow_hpc.sim", str(ROOT / "configs" / "sim_laminar_7b.toml"), "--gpus", "16,32",
                 "--set", "trainer.batch_size=256", "--set", "algorithm.group_size=8", "--set", "trainer.steps=4",
                 "--json", "--plot", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {row["mode"] for row in out["rows"]} == {"sync", "one_step_off", "fully_async", "reflow"}
    assert set(out["by_gpus"]) == {"16", "32"} and "ratios" not in out
    assert {"reflow/sync", "reflow/fully_async", "reflow/one_step_off"} <= set(out["by_gpus"]["16"]["ratios"])
    for name in ("throughput.png", "idle.png", "roles_reflow_16.png", "roles_reflow_32.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    one = python_m("reflow_hpc.sim", str(ROOT / "configs" / "sim_laminar_7b.toml"), "--gpus", "16", "--modes",
                   "sync,reflow", "--set", "trainer.batch_size=128", "--set", "algorithm.group_size=8",
                   "--set", "trainer.steps=3", "--json", timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert set(json.loads(one.stdout.strip().splitlines()[-1])["ratios"]) == {"reflow/sync"}


def test_a_bad_key_is_one_line_and_exit_2():
    r = python_m("reflow_hpc.sim", str(ROOT / "configs" / "sim_laminar_7b.toml"), "--set", "sim.gpu_flop=1",
                 timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: sim.gpu_flop"), r.stderr


def test_the_cross_check_compares_bench_modes_with_the_simulated_modes(tmp_path):
    bench = {"steps": 10, "warmup_steps": 2, "rows": [
        {"system": "reflow_hpc", "mode": m, "throughput_tokens_per_s": t}
        for m, t in (("sync", 585.0), ("one_step_off", 581.0), ("fully_async", 577.0), ("reflow", 806.0))]}
    path = tmp_path / "bench.json"
    path.write_text("bench_modes: table\n" + json.dumps(bench) + "\n")
    r = python_m("reflow_hpc.sim", "--crosscheck", str(path), "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [m["mode"] for m in out["modes"]] == ["sync", "one_step_off", "fully_async", "reflow"]
    assert {x["ratio"] for x in out["ratios"]} == {"reflow/sync", "reflow/one_step_off", "reflow/fully_async"}
    assert all(m["simulated"] > 0 for m in out["modes"])
    assert out["fit"] is None and "stored cost model is used" in r.stdout    # no run directories to fit from
