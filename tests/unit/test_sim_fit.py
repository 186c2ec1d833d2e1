"""Fitting the CPU cost model to a bench_modes run (reflow_hpc/sim/fit.py): a bench whose runs were
simulated with known costs gives those costs back; control-message latency and payload fetches cost
simulated time."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import ROOT

from reflow_hpc.sim import calibrate as cal
from reflow_hpc.sim import fit
from reflow_hpc.sim.report import simulate

sys.path.insert(0, str(ROOT / "tools"))
import bench_modes  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async", "reflow")
SETS = [*cal.BENCH_MODES_SETS, "trainer.steps=16", "sim.warmup_steps=3"]
# Costs unlike the config's own, so that a fit that returned the config's values would fail.
TRUE = {"sim.train_mfu": 0.41, "sim.train_update_overhead_s": 0.031, "sim.fetch_s_per_sample": 0.0021,
        "sim.sync_base_s": 0.017, "sim.sync_colocated_base_s": 0.0032, "sim.decode_base_s": 0.0041}


def simulated_bench(tmp_path, costs: dict, passes: int = 1) -> dict:
    """A bench_modes JSON object whose run directories hold the metrics of simulated runs (with
    ``passes`` > 1, as ``--repeat`` names them: one seed per pass)."""
    rows = []
    for mode in MODES:
        names = []
        for k in range(passes):
            res = simulate(cal.CPU_TINY, mode, [*SETS, *(f"{k}={v}" for k, v in costs.items()), f"run.seed={k}"])
            names.append(bench_modes.run_name(mode, k))
            run = tmp_path / names[-1]
            run.mkdir()
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res.records))
        row = {"system": "reflow_hpc", "mode": mode, "throughput_tokens_per_s": res.summary["throughput_tokens_per_s"]}
        rows.append({**row, "runs": names} if passes > 1 else row)
    return {"steps": 16, "warmup_steps": 3, "rows": rows, "out": str(tmp_path)}


def test_the_fit_gives_back_the_costs_a_simulated_bench_ran_with(tmp_path):
    bench = simulated_bench(tmp_path, TRUE)
    sets, found = fit.fit(bench, cal.CPU_TINY, SETS)
    got = dict(s.split("=", 1) for s in sets)
    assert set(got) == set(TRUE)
    for key in ("sim.train_update_overhead_s", "sim.sync_base_s", "sim.sync_colocated_base_s"):
        assert float(got[key]) == pytest.approx(TRUE[key], rel=1e-3), key
    # a step reports its slowest replica's fetch; shares split by tokens differ by a sample or so
    assert float(got["sim.fetch_s_per_sample"]) == pytest.approx(TRUE["sim.fetch_s_per_sample"], rel=0.02)
    # the trainer's attention term uses each step's mean length, not each sample's: within a percent
    assert float(got["sim.train_mfu"]) == pytest.approx(TRUE["sim.train_mfu"], rel=0.01)
    # the engine step is found by matching generation rates over the modes
    assert float(got["sim.decode_base_s"]) == pytest.approx(TRUE["sim.decode_base_s"], rel=0.05)
    assert [m.mode for m in found] == list(MODES)
    assert all(m.steps == 13 and math.isfinite(m.rate) and m.rate > 0 for m in found)


def test_the_fit_reads_every_pass_of_a_repeated_bench(tmp_path):
    bench = simulated_bench(tmp_path, TRUE, passes=2)
    assert (tmp_path / "bench-reflow-2" / "metrics.jsonl").is_file()
    sets, found = fit.fit(bench, cal.CPU_TINY, SETS)
    got = dict(s.split("=", 1) for s in sets)
    assert all(m.steps == 26 for m in found)             # 13 measured steps of each of two passes
    assert float(got["sim.sync_base_s"]) == pytest.approx(TRUE["sim.sync_base_s"], rel=1e-3)
    assert float(got["sim.decode_base_s"]) == pytest.approx(TRUE["sim.decode_base_s"], rel=0.05)
    (tmp_path / "bench-sync-2" / "metrics.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="bench-sync-2/metrics.jsonl"):
        fit.measure(bench, cal.CPU_TINY)


def test_a_repeated_bench_alternates_the_order_and_pools_the_passes():
    modes = ["sync", "one_step_off", "reflow"]
    assert bench_modes.pass_order(modes, 0) == modes
    assert bench_modes.pass_order(modes, 1) == modes[::-1]
    assert [bench_modes.run_name("sync", k) for k in range(3)] == ["bench-sync", "bench-sync-2", "bench-sync-3"]

    def steps(tokens_per_s):                 # two warm-up steps and two measured ones of 1 s each
        return [{"step": i, "tokens": tokens_per_s, "step_seconds": 1.0, "idle_ratio/trainer": 0.1,
                 "idle_ratio/rollout": 0.2, "replay_fraction": 0.0, "staleness/mean": 0.0,
                 "trainer/token_staleness_min": 0, "trainer/token_staleness_max": i % 2, "sync_seconds": 0.01}
                for i in range(1, 5)]
    summary = {"eval/task/final_reward": 0.5, "eval/curve": [[0, 0.1]], "reward_last_steps": 0.25, "steps": 4}
    runs = [("bench-sync", steps(100.0), summary, 10.0),
            ("bench-sync-2", steps(300.0), {**summary, "eval/task/final_reward": 0.7}, 20.0)]
    row = bench_modes.mode_row("sync", runs, warmup=2)
    assert row["throughput_tokens_per_s"] == pytest.approx(200.0)      # Σ tokens ÷ Σ seconds of both passes
    assert row["throughput_per_pass"] == [pytest.approx(100.0), pytest.approx(300.0)]
    assert row["runs"] == ["bench-sync", "bench-sync-2"] and row["passes"] == 2 and row["steps"] == 4
    assert row["eval/task/final_reward"] == pytest.approx(0.6) and row["eval/curve"] == [[0, 0.1]]
    assert row["wall_seconds"] == pytest.approx(15.0) and row["token_staleness"] == [0, 1]


def test_the_cross_check_fits_first_when_the_runs_are_there(tmp_path):
    bench = simulated_bench(tmp_path, TRUE)
    rep = cal.crosscheck(bench, seeds=1)
    assert rep["fit"] and rep["runs"] == str(tmp_path)
    # simulated against itself once fitted: every ratio within a few per cent
    assert rep["max_abs_ratio_error"] < 0.05, rep["ratios"]
    # and each mode on the primitives of its own runs, which here are those of every mode
    own = rep["own_primitives"]
    assert [m["mode"] for m in own["modes"]] == [m["mode"] for m in rep["modes"]]
    assert own["max_abs_ratio_error"] < 0.05, own["ratios"]
    stale = cal.crosscheck(bench, seeds=1, refit=False)
    assert stale["fit"] is None and stale["max_abs_ratio_error"] > rep["max_abs_ratio_error"]
    assert "own_primitives" not in stale


def test_a_bench_without_its_runs_is_named_in_one_line(tmp_path):
    bench = {"warmup_steps": 3, "out": str(tmp_path), "rows": [
        {"system": "reflow_hpc", "mode": "sync", "throughput_tokens_per_s": 1.0}]}
    with pytest.raises(FileNotFoundError, match="bench-sync/metrics.jsonl"):
        fit.measure(bench, cal.CPU_TINY)


def test_message_latency_and_fetches_slow_a_step():
    static = [*SETS, "scheduler.elastic=false"]       # the same split in all three runs

    def run(latency: float, fetch: float):
        return simulate(cal.CPU_TINY, "reflow", [*static, f"sim.message_latency_s={latency}",
                                                  f"sim.fetch_s_per_sample={fetch}"])
    base, slow, fetch = run(0.0, 0.0), run(0.02, 0.0), run(0.0, 0.01)
    assert slow.summary["step_s"] > base.summary["step_s"] and fetch.summary["step_s"] > base.summary["step_s"]
    # a step reports its slowest replica's fetch: 10 ms for each of its ~16 samples (the batch of 32 split
    # over 2 replicas by tokens)
    for r in fetch.records:
        assert 0.14 <= r["fetch_seconds"] <= 0.2, r["fetch_seconds"]
    assert all(r["fetch_seconds"] == 0.0 for r in base.records)
