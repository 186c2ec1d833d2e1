"""Fitting the CPU cost model to a bench_modes run (reflow_hpc/sim/fit.py): a bench whose runs were
simulated with known costs gives those costs back; control-message latency and payload fetches cost
simulated time."""

from __future__ import annotations

import json
import math

import pytest

from reflow_hpc.sim import calibrate as cal
from reflow_hpc.sim import fit
from reflow_hpc.sim.report import simulate

MODES = ("sync", "one_step_off", "fully_async", "reflow")
SETS = [*cal.BENCH_MODES_SETS, "trainer.steps=16", "sim.warmup_steps=3"]
# Costs unlike the config's own, so that a fit that returned the config's values would fail.
TRUE = {"sim.train_mfu": 0.41, "sim.train_update_overhead_s": 0.031, "sim.fetch_s_per_sample": 0.0021,
        "sim.sync_base_s": 0.017, "sim.sync_colocated_base_s": 0.0032, "sim.decode_base_s": 0.0041}


def simulated_bench(tmp_path, costs: dict) -> dict:
    """A bench_modes JSON object whose run directories hold the metrics of simulated runs."""
    rows = []
    for mode in MODES:
        res = simulate(cal.CPU_TINY, mode, [*SETS, *(f"{k}={v}" for k, v in costs.items())])
        run = tmp_path / f"bench-{mode}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res.records))
        rows.append({"system": "reflow_hpc", "mode": mode,
                     "throughput_tokens_per_s": res.summary["throughput_tokens_per_s"]})
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


def test_the_cross_check_fits_first_when_the_runs_are_there(tmp_path):
    bench = simulated_bench(tmp_path, TRUE)
    rep = cal.crosscheck(bench, seeds=1)
    assert rep["fit"] and rep["runs"] == str(tmp_path)
    # simulated against itself once fitted: every ratio within a few per cent
    assert rep["max_abs_ratio_error"] < 0.05, rep["ratios"]
    stale = cal.crosscheck(bench, seeds=1, refit=False)
    assert stale["fit"] is None and stale["max_abs_ratio_error"] > rep["max_abs_ratio_error"]


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
