"""The arithmetic of tools/bench_learning.py on curves whose answers are known."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_learning as bl  # noqa: E402


def ramp(start, end, t_end, horizon=200.0, every=10.0):
    """A seed's eval points: linear from start to end over t_end seconds, flat afterwards."""
    pts, t = [], 0.0
    while t <= horizon + 1e-9:
        pts.append((t, start + (end - start) * min(1.0, t / t_end)))
        t += every
    return pts


def test_interpolation_holds_the_last_value():
    pts = [(0.0, 0.2), (10.0, 0.4), (20.0, 0.6)]
    assert bl.interpolate(pts, 5.0) == pytest.approx(0.3)
    assert bl.interpolate(pts, 99.0) == 0.6 and bl.interpolate(pts, -1.0) == 0.2


def test_time_to_reach_and_the_ratios():
    curves = {"sync": [ramp(0.4, 0.8, 100.0)] * 3, "reflow": [ramp(0.4, 0.8, 50.0)] * 3,
              "fully_async": [ramp(0.4, 0.6, 100.0)] * 3}
    res = bl.summarise(curves, 200.0)
    assert res["gain_level"] == pytest.approx(0.4 + 0.9 * 0.4)
    assert res["modes"]["sync"]["time_to_90pct_of_sync_gain_s"] == pytest.approx(90.0, abs=1.0)
    assert res["modes"]["reflow"]["time_over_sync"] == pytest.approx(0.5, abs=0.02)
    assert math.isnan(res["modes"]["fully_async"]["time_to_90pct_of_sync_gain_s"])     # never gets there
    assert res["reflow_over_sync_time"] == pytest.approx(0.5, abs=0.02)
    assert res["final_gap"] == pytest.approx(0.0) and res["final_gap_se"] == pytest.approx(0.0)


def test_final_gap_is_paired_by_seed():
    curves = {"sync": [ramp(0.4, 0.70, 100), ramp(0.4, 0.80, 100)],
              "reflow": [ramp(0.4, 0.72, 50), ramp(0.4, 0.84, 50)]}
    res = bl.summarise(curves, 200.0)
    assert res["final_gap"] == pytest.approx(0.03)
    assert res["final_gap_se"] == pytest.approx(0.01)          # gaps 0.02 and 0.04


def test_a_last_evaluation_after_the_budget_still_counts():
    """Runs evaluate their final policy a little after the budget (the step in flight ends first): the
    mean curves reach the final rewards, so reflow's time to sync's final reward is defined."""
    sync = [[(0.0, 0.1), (60.0, 0.3), (120.4, 0.5)], [(0.0, 0.1), (60.0, 0.35), (120.2, 0.48)]]
    reflow = [[(0.0, 0.1), (60.0, 0.45), (120.1, 0.52)], [(0.0, 0.1), (60.0, 0.47), (120.6, 0.5)]]
    res = bl.summarise({"sync": sync, "reflow": reflow}, 120.0)
    assert res["reflow_over_sync_time"] < 1.0
    assert res["modes"]["sync"]["final_reward"] == pytest.approx(0.49)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    curves = {"sync": [ramp(0.4, 0.8, 100.0), ramp(0.4, 0.7, 100.0)], "reflow": [ramp(0.4, 0.8, 50.0)] * 2}
    out = tmp_path / "p.png"
    bl.plot(curves, 200.0, out, 0.76)
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


def test_objectives_are_summarised_per_seed_and_paired_with_grpo():
    def run(label, seed, start, final, wf_start, wf_final, is_mean):
        return {"mode": label, "seed": seed, "curve": [(0.0, start), (120.0, final)],
                "well_formed_curve": [(0.0, wf_start, 0.3), (120.0, wf_final, 0.9)],
                "rollout_is": {"rollout_is/mean": is_mean}}
    runs = [run("grpo", 0, 0.1, 0.5, 0.4, 0.5, 1.0), run("dapo", 0, 0.1, 0.6, 0.4, 0.6, 0.99),
            run("grpo", 1, 0.2, 0.4, 0.5, 0.5, 1.0), run("dapo", 1, 0.2, 0.7, 0.5, 0.8, 1.01)]
    rows = bl.summarise_algorithms(runs, ["grpo", "dapo"])
    assert rows["grpo"]["final"] == pytest.approx(0.45) and rows["grpo"]["gain"] == pytest.approx(0.3)
    assert rows["grpo"]["gain_se"] == pytest.approx(0.1)            # gains 0.4 and 0.2
    assert rows["dapo"]["gain"] == pytest.approx(0.5) and rows["dapo"]["gain_se"] == pytest.approx(0.0)
    assert rows["dapo"]["well_formed_gain"] == pytest.approx(0.25)   # 0.2 and 0.3
    assert rows["dapo"]["vs_grpo"] == pytest.approx(0.2) and rows["dapo"]["vs_grpo_se"] == pytest.approx(0.1)
    assert rows["grpo"]["vs_grpo"] == 0.0 and rows["dapo"]["rollout_is/mean"] == pytest.approx(1.0)
    assert "dapo" in bl.algorithms_table(rows)
