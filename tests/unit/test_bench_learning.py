"""The arithmetic of tools/bench_learning.py (and the per-rank helpers of tools/bench_common.py) on curves
and records whose answers are known; no runs."""

from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_common as bc  # noqa: E402
import bench_learning as bl  # noqa: E402


def ramp(start, end, t_end, horizon=200.0, every=10.0):
    """A seed's eval points: linear from start to end over t_end seconds, flat afterwards."""
    pts, t = [], 0.0
    while t <= horizon + 1e-9:
        pts.append((t, start + (end - start) * min(1.0, t / t_end)))
        t += every
    return pts


# ------------------------------------------------------------------------------------------------
# Curves, per-seed times, censoring
# ------------------------------------------------------------------------------------------------

def test_interpolation_holds_the_last_value():
    pts = [(0.0, 0.2), (10.0, 0.4), (20.0, 0.6)]
    assert bl.interpolate(pts, 5.0) == pytest.approx(0.3)
    assert bl.interpolate(pts, 99.0) == 0.6 and bl.interpolate(pts, -1.0) == 0.2


def test_reach_interpolates_between_snapshots_and_censors_at_the_budget():
    pts = [(0.0, 0.2), (10.0, 0.4), (20.0, 0.6), (30.0, 0.5)]
    assert bl.reach(pts, 0.5) == (pytest.approx(15.0), False)
    assert bl.reach(pts, 0.1) == (0.0, False)                      # there from the start
    assert bl.reach(pts, 0.6) == (pytest.approx(20.0), False)      # the first time, not the last
    assert bl.reach(pts, 0.7, censor_at=120.0) == (120.0, True)    # never: counted at the budget
    # a last snapshot after the budget (the step in flight ends first): censored at that snapshot
    assert bl.reach([(0.0, 0.1), (121.0, 0.2)], 0.5, censor_at=120.0) == (121.0, True)
    assert bl.reach([(0, 0.1), (40, 0.3)], 0.5) == (40, True)      # steps: at the last step


def test_seed_times_are_per_seed_then_averaged():
    runs = {0: [(0.0, 0.0), (100.0, 1.0)], 1: [(0.0, 0.0), (50.0, 1.0)], 2: [(0.0, 0.0), (100.0, 0.2)]}
    b = bl.seed_times(runs, 0.5, censor_at=100.0)
    assert b["per_seed"] == {0: pytest.approx(50.0), 1: pytest.approx(25.0), 2: 100.0}
    assert b["censored"] == 1 and b["censored_seeds"] == [2] and b["seeds"] == 3
    assert b["mean"] == pytest.approx(175 / 3) and b["median"] == pytest.approx(50.0)
    sd = math.sqrt(((50 - 175 / 3) ** 2 + (25 - 175 / 3) ** 2 + (100 - 175 / 3) ** 2) / 2)
    assert b["se"] == pytest.approx(sd / math.sqrt(3))


def test_paired_differences_and_ratios_are_by_seed():
    p = bl.paired({0: 30.0, 1: 60.0, 2: 45.0, 7: 1.0}, {0: 60.0, 1: 80.0, 2: 0.0})
    assert p["pairs"] == 3                                          # seed 7 has no partner
    assert p["diff"] == pytest.approx((-30 - 20 + 45) / 3)
    assert p["ratio_pairs"] == 2                                   # a reference time of 0 has no ratio
    assert p["ratio"] == pytest.approx((0.5 + 0.75) / 2) and p["ratio_se"] == pytest.approx(0.125)
    assert p["ratio_median"] == pytest.approx(0.625)


def test_time_to_reach_and_the_ratios():
    curves = {"sync": [ramp(0.4, 0.8, 100.0)] * 3, "reflow": [ramp(0.4, 0.8, 50.0)] * 3,
              "fully_async": [ramp(0.4, 0.6, 100.0)] * 3}
    res = bl.summarise(curves, 200.0)
    assert res["reference"] == "sync"
    assert res["gain_level"] == pytest.approx(0.4 + 0.9 * 0.4) and res["sync_final_level"] == pytest.approx(0.8)
    assert res["modes"]["sync"]["time_to_90pct_of_sync_gain_s"] == pytest.approx(90.0)
    assert res["modes"]["reflow"]["time_over_sync"] == pytest.approx(0.5)
    fa = res["modes"]["fully_async"]["targets"]["sync_gain_90"]["time"]
    assert fa["censored"] == 3 and fa["mean"] == 200.0             # never gets there: at the budget
    assert res["reflow_over_sync_time"] == pytest.approx(0.5) and res["reflow_over_sync_time_se"] == pytest.approx(0.0)
    assert res["reflow_minus_sync_time_s"] == pytest.approx(-50.0)
    assert res["final_gap"] == pytest.approx(0.0) and res["final_gap_se"] == pytest.approx(0.0)


def test_per_seed_times_differ_from_the_time_read_off_the_mean_curve():
    """Two sync seeds reach 0.8 at 20 s and 100 s: the per-seed mean is 60 s; the mean curve reaches
    the mean level later than the average seed does, which is what the old reading measured."""
    sync = {0: [(0.0, 0.0), (20.0, 0.8), (120.0, 0.8)], 1: [(0.0, 0.0), (100.0, 0.8), (120.0, 0.8)]}
    reflow = {0: [(0.0, 0.0), (10.0, 0.8), (120.0, 0.8)], 1: [(0.0, 0.0), (80.0, 0.8), (120.0, 0.8)]}
    res = bl.summarise({"sync": sync, "reflow": reflow}, 120.0)
    t = res["modes"]["sync"]["targets"]["sync_final"]["time"]
    assert t["per_seed"] == {0: pytest.approx(20.0), 1: pytest.approx(100.0)} and t["mean"] == pytest.approx(60.0)
    v = res["modes"]["reflow"]["targets"]["sync_final"]["time"]["vs_ref"]
    assert v["diff"] == pytest.approx(-15.0) and v["diff_se"] == pytest.approx(5.0)
    assert res["reflow_over_sync_time"] == pytest.approx((0.5 + 0.8) / 2)
    assert res["reflow_over_sync_time_se"] == pytest.approx(0.15)


def test_censored_seeds_are_counted_at_the_budget_and_named():
    sync = {0: ramp(0.2, 0.6, 60.0, 120.0), 1: ramp(0.2, 0.4, 60.0, 120.0)}    # sync's final mean: 0.5
    reflow = {0: ramp(0.2, 0.6, 30.0, 120.0), 1: ramp(0.2, 0.45, 30.0, 120.0)}
    res = bl.summarise({"sync": sync, "reflow": reflow}, 120.0)
    s = res["modes"]["sync"]["targets"]["sync_final"]["time"]
    assert s["censored_seeds"] == [1] and s["per_seed"][1] == 120.0 and s["per_seed"][0] == pytest.approx(45.0)
    r = res["modes"]["reflow"]["targets"]["sync_final"]["time"]
    assert r["censored_seeds"] == [1] and r["per_seed"][0] == pytest.approx(22.5)
    lines = bl.censored_lines(res)
    assert any(line.startswith("censored: sync, sync's final reward (time): 1 of 2 seeds") and "seed(s) 1" in line
               and "120 s" in line for line in lines)
    # seed 1 never reaches 0.5 in either arm: its ratio is 1 by construction and is named
    assert r["vs_ref"]["both_censored"] == [1] and r["vs_ref"]["ratio"] == pytest.approx((0.5 + 1.0) / 2)
    assert r["vs_ref"]["ratio_without_both_censored"] == pytest.approx(0.5)
    assert any(line.startswith("censored on both sides: reflow and sync, sync's final reward: seed(s) 1")
               and line.endswith("without them 0.50") for line in lines)


def test_the_step_axis_separates_algorithm_from_system():
    """Reflow makes its steps twice as fast and learns the same per step: half sync's time, sync's steps."""
    sync_t = {s: [(0.0, 0.2), (50.0, 0.4), (100.0, 0.6)] for s in (0, 1)}
    sync_k = {s: [(0, 0.2), (50, 0.4), (100, 0.6)] for s in (0, 1)}
    reflow_t = {s: [(0.0, 0.2), (25.0, 0.4), (50.0, 0.6), (100.0, 0.7)] for s in (0, 1)}
    reflow_k = {s: [(0, 0.2), (50, 0.4), (100, 0.6), (200, 0.7)] for s in (0, 1)}
    res = bl.summarise({"sync": sync_t, "reflow": reflow_t}, 100.0, {"sync": sync_k, "reflow": reflow_k})
    tgt = res["modes"]["reflow"]["targets"]["sync_final"]
    assert tgt["time"]["vs_ref"]["ratio"] == pytest.approx(0.5)
    assert tgt["steps"]["vs_ref"]["ratio"] == pytest.approx(1.0) and tgt["steps"]["mean"] == pytest.approx(100.0)
    assert res["reflow_over_sync_steps"] == pytest.approx(1.0)
    # a run that never reaches the level on the step axis is censored at its last step
    slow = {0: [(0, 0.2), (80, 0.5)], 1: [(0, 0.2), (90, 0.55)]}
    res = bl.summarise({"sync": sync_t, "slow": {0: [(0.0, 0.2), (99.0, 0.5)], 1: [(0.0, 0.2), (99.0, 0.55)]}},
                       100.0, {"sync": sync_k, "slow": slow})
    steps = res["modes"]["slow"]["targets"]["sync_final"]["steps"]
    assert steps["per_seed"] == {0: 80, 1: 90} and steps["censored"] == 2


def test_final_gap_is_paired_by_seed():
    curves = {"sync": [ramp(0.4, 0.70, 100), ramp(0.4, 0.80, 100)],
              "reflow": [ramp(0.4, 0.72, 50), ramp(0.4, 0.84, 50)]}
    res = bl.summarise(curves, 200.0)
    assert res["final_gap"] == pytest.approx(0.03)
    assert res["final_gap_se"] == pytest.approx(0.01)          # gaps 0.02 and 0.04
    assert res["final_gap_resolution"] == pytest.approx(0.02)
    # seeds pair by id, not by position
    res = bl.summarise({"sync": {3: ramp(0.4, 0.7, 100), 5: ramp(0.4, 0.8, 100)},
                        "reflow": {5: ramp(0.4, 0.84, 50), 3: ramp(0.4, 0.72, 50)}}, 200.0)
    assert res["final_gap_se"] == pytest.approx(0.01)


def test_a_last_evaluation_after_the_budget_still_counts():
    """Runs evaluate their final policy a little after the budget (the step in flight ends first)."""
    sync = [[(0.0, 0.1), (60.0, 0.3), (120.4, 0.5)], [(0.0, 0.1), (60.0, 0.35), (120.2, 0.48)]]
    reflow = [[(0.0, 0.1), (60.0, 0.45), (120.1, 0.52)], [(0.0, 0.1), (60.0, 0.47), (120.6, 0.5)]]
    res = bl.summarise({"sync": sync, "reflow": reflow}, 120.0)
    assert res["reflow_over_sync_time"] < 1.0
    assert res["modes"]["sync"]["final_reward"] == pytest.approx(0.49)
    assert res["modes"]["sync"]["targets"]["sync_final"]["time"]["per_seed"][0] <= 120.4


def test_the_reference_is_sync_else_grpo():
    assert bl.reference_label(["reflow", "sync"]) == "sync"
    assert bl.reference_label(["reflow:grpo", "sync:grpo", "sync:dapo"]) == "sync:grpo"
    assert bl.reference_label(["dapo", "grpo"]) == "grpo"
    assert bl.reference_label(["dapo", "cispo"]) is None
    res = bl.summarise({"dapo": [ramp(0.1, 0.5, 50)] * 2, "grpo": [ramp(0.1, 0.5, 100)] * 2}, 200.0)
    assert res["reference"] == "grpo" and res["modes"]["dapo"]["time_over_sync"] == pytest.approx(0.5)
    assert "reflow_over_sync_time" not in res
    assert "targets" not in bl.summarise({"dapo": [ramp(0.1, 0.5, 50)]}, 200.0)["modes"]["dapo"]


# ------------------------------------------------------------------------------------------------
# Resolution
# ------------------------------------------------------------------------------------------------

def test_resolution_of_the_eval_set_and_the_seeds():
    curves = {"sync": {0: [(0.0, 0.1), (50.0, 0.3), (100.0, 0.5)], 1: [(0.0, 0.1), (50.0, 0.3), (100.0, 0.5)]},
              "reflow": {0: [(0.0, 0.1), (25.0, 0.3), (50.0, 0.5)], 1: [(0.0, 0.1), (40.0, 0.3), (80.0, 0.5)]}}
    res = bl.summarise(curves, 100.0)
    r = bl.resolution(res, curves, 256, 4)
    assert r["eval_samples"] == 1024
    assert r["point_se"]["sync"] == pytest.approx(math.sqrt(0.25 / 1024))
    assert r["final_diff_resolution"] == {"reflow": pytest.approx(0.0)}
    t = r["time_ratio_resolution"]["sync_final"]["reflow"]          # per-seed ratios 0.5 and 0.8: s.e. 0.15
    assert res["reflow_over_sync_time"] == pytest.approx(0.65)
    assert t["two_se"] == pytest.approx(0.30) and t["pairs"] == 2
    assert t["seeds_for_10pct"] == 18                               # 2 seeds × (0.30 / 0.10)²
    # the 90 % level 0.46 is crossed on sync's segment of slope 0.004 / s: jitter = s.e. at 0.46 / slope
    assert r["eval_time_jitter_s"]["sync_gain_90"] == pytest.approx(math.sqrt(0.46 * 0.54 / 1024) / 0.004)
    assert r["eval_time_jitter_s"]["sync_final"] == pytest.approx(math.sqrt(0.25 / 1024) / 0.004)
    lines = bl.resolution_lines(r, res)
    assert lines[0].startswith("eval set: 256 prompts x 4 samples = 1024")
    assert any(line.startswith("eval noise alone moves sync's crossing of 90% of sync's gain by about ±3.9 s (4.3%")
               for line in lines)
    assert any(line.startswith("reflow ÷ sync, time to sync's final reward: 2 s.e. of the paired ratio 0.300 over 2 "
                               "seeds: does not resolve a 10% difference; about 18 seeds would") for line in lines)
    # seeds that agree closely resolve it
    tight = {"sync": curves["sync"], "reflow": {0: [(0.0, 0.1), (50.0, 0.5)], 1: [(0.0, 0.1), (51.0, 0.5)]}}
    res = bl.summarise(tight, 100.0)
    r = bl.resolution(res, tight, 256, 4)["time_ratio_resolution"]["sync_final"]["reflow"]
    assert r["two_se"] == pytest.approx(0.01) and r["seeds_for_10pct"] == 2
    assert any("resolves a 10% difference" in line for line in bl.resolution_lines(bl.resolution(res, tight, 256, 4), res))


# ------------------------------------------------------------------------------------------------
# Per run diagnostics and flags
# ------------------------------------------------------------------------------------------------

def steps_of(n, replay=lambda i: 0.0, gen_rate=1000.0, tokens=500.0, step_s=1.0, trainer_s=0.5):
    return [{"step": i + 1, "step_seconds": step_s, "tokens": tokens, "trainer/seconds": trainer_s,
             "rollout/generated_tokens_per_s": gen_rate, "replay_fraction": replay(i), "idle_ratio/trainer": 0.1,
             "idle_ratio/rollout": 0.2, "buffer/created": 100 * (i + 1), "buffer/pending": 20,
             "buffer/trained_samples": 40 * (i + 1), "buffer/replayed_uses": 10 * (i + 1),
             "buffer/evicted_unused": 5 * (i + 1)} for i in range(n)]


def test_run_diagnostics():
    d = bl.run_diagnostics(steps_of(8, replay=lambda i: i // 2 / 10))
    assert d["steps"] == 8
    assert d["generated_per_trained"] == pytest.approx((800 - 20) / 320)
    assert d["uses_per_trained"] == pytest.approx((320 + 80) / 320)
    assert d["evicted_unused_fraction"] == pytest.approx(40 / 800)
    assert d["replay_quarters"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert d["gen_tokens_per_s"] == pytest.approx(1000.0) and d["train_tokens_per_s"] == pytest.approx(500.0)
    assert d["busy_train_tokens_per_s"] == pytest.approx(1000.0)
    assert bl.quarters([1.0, 2.0])[1] == 1.0 and math.isnan(bl.quarters([1.0, 2.0])[0])


def test_a_run_far_from_its_arms_median_is_flagged():
    runs = [{"mode": "reflow", "seed": s, "diagnostics": bl.run_diagnostics(steps_of(4, gen_rate=g))}
            for s, g in enumerate((1000.0, 1050.0, 600.0))]
    runs.append({"mode": "sync", "seed": 0, "diagnostics": bl.run_diagnostics(steps_of(4, gen_rate=100.0))})
    flags = bl.run_flags(runs)
    assert len(flags) == 1 and flags[0].startswith("FLAG: reflow seed 2: generation rate 600 tok/s differs by -40%")


def rank(r, busy=500.0, threads=20, torch_threads=1, cpu=40.0, wall=100.0, group="/sys/fs/cgroup/cpu/x", tokens=1000):
    return {"rank": r, "busy_generation_tokens_per_s": busy, "generated_tokens": tokens, "threads": threads,
            "torch_threads": torch_threads, "cpu_s": cpu, "cgroup_cpu_s": None, "wall_s": wall, "cpu_group": group,
            "throttled_s": 10.0}


def test_rank_profiles_and_flags_between_modes():
    runs = [{"mode": "sync", "seed": 0, "ranks": [rank(0), rank(1, busy=520.0)]},
            {"mode": "reflow", "seed": 0, "ranks": [rank(0, tokens=0, busy=None), rank(1, busy=700.0)]},
            {"mode": "fully_async", "seed": 0, "ranks": [rank(0, busy=540.0, threads=30), rank(1, busy=560.0, threads=30)]}]
    prof = bl.rank_profiles(runs)
    assert prof["sync"]["busy_gen_tokens_per_s"] == pytest.approx(510.0)
    assert prof["reflow"]["busy_gen_tokens_per_s"] == pytest.approx(700.0)     # a rank that generated nothing: out
    assert prof["sync"]["cpu_share"] == pytest.approx(0.4) and prof["sync"]["throttled_share"] == pytest.approx(0.1)
    flags = bc.mode_flags(prof, "sync")
    assert any(f.startswith("FLAG: reflow: per-rank busy generation rate 700 tok/s differs by +37% from sync's")
               for f in flags)
    assert any(f.startswith("FLAG: fully_async: threads per rank 30 differs by +50%") for f in flags)
    assert not any("fully_async: per-rank busy" in f for f in flags)           # +8%: within 25 %
    assert len(flags) == 2
    text = bl.profiles_table(prof)
    assert "reflow" in text and "510" in text


def test_the_pools_busy_share_counts_generating_and_training_seconds():
    ranks = [{**rank(0), "generate_s": 0.0, "train_s": 30.0}, {**rank(1), "generate_s": 35.0, "train_s": 0.0},
             {**rank(2), "generate_s": 10.0, "train_s": 5.0}]
    assert bl.pool_busy_share(ranks, 40.0) == pytest.approx(80.0 / 120.0)
    assert math.isnan(bl.pool_busy_share([], 40.0)) and math.isnan(bl.pool_busy_share(ranks, None))
    runs = [{"mode": "sync", "seed": s, "diagnostics": {**bl.run_diagnostics(steps_of(4)), "pool_busy": b}}
            for s, b in enumerate((0.6, 0.7))]
    assert "pool busy 65% ± 5%" in bl.idle_lines(runs)[0]


def test_ranks_not_held_to_their_cap_are_flagged():
    assert bc.cap_flags("x", [rank(0), rank(1)], 0.45) == []
    flags = bc.cap_flags("reflow seed 1", [rank(0, group=None), rank(1, cpu=70.0)], 0.45)
    assert flags[0].startswith("FLAG: reflow seed 1: rank(s) 0 ran in no CPU cgroup")
    assert flags[1].startswith("FLAG: reflow seed 1: rank(s) 1 (0.70) used more than their cap")
    assert bc.cap_flags("x", [rank(0, group=None)], 0.0) == []                  # no cap asked for
    assert bc.rank_cpu_s({"cgroup_cpu_s": 3.0, "cpu_s": 2.0}) == 3.0
    assert bc.per_rank([rank(1, busy=2.0), rank(0, busy=1.0)], bc.busy_rate, ".0f") == "1/2"


# ------------------------------------------------------------------------------------------------
# Reading a run, arms, tables, plot
# ------------------------------------------------------------------------------------------------

def test_a_run_directory_is_read_into_curves_diagnostics_and_ranks(tmp_path):
    run = tmp_path / "learn-reflow-s1"
    run.mkdir()
    evals = [{"kind": "eval", "step": k, "eval/elapsed_s": 2.0 * k, "eval/task/reward": 0.1 + k / 100,
              "eval/task/greedy": 0.0, "eval/task/prompts": 256} for k in (0, 10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps_of(20) + evals))
    (run / "summary.json").write_text(json.dumps({"steps": 20, "train_seconds": 40.0, "eval/samples_per_prompt": 4,
                                                  "ranks": [rank(0), rank(1)]}))
    r = bl.read_run(run, "reflow", 1)
    assert [x for pt in r["curve"] for x in pt] == pytest.approx([0.0, 0.1, 20.0, 0.2, 40.0, 0.3])
    assert r["step_curve"][1] == (10, pytest.approx(0.2))
    assert r["eval_prompts"] == 256 and r["samples_per_prompt"] == 4 and len(r["ranks"]) == 2
    assert r["diagnostics"]["steps"] == 20
    assert math.isnan(r["diagnostics"]["pool_busy"])                           # records without busy seconds: -
    (run / "summary.json").write_text(json.dumps({"steps": 20}))
    (run / "ranks").mkdir()
    (run / "ranks" / "rank00001.json").write_text(json.dumps(rank(1)))
    assert [x["rank"] for x in bl.read_run(run, "reflow", 1)["ranks"]] == [1]      # summary without ranks: the files
    assert "reflow" in bl.runs_table([r])


def test_a_run_scored_on_the_held_out_texts_is_read_from_that_set(tmp_path):
    run = tmp_path / "learn-sync-s0"
    run.mkdir()
    evals = [{"kind": "eval", "step": k, "eval/elapsed_s": 2.0 * k, "eval/held_out/reward": 0.5 + k / 100,
              "eval/held_out/greedy": 0.0, "eval/held_out/prompts": 128} for k in (0, 10)]
    evals[0].update({"eval/task/reward": 0.9, "eval/task/greedy": 1.0})      # the start: both sets
    evals.append({"kind": "eval", "step": 20, "eval/elapsed_s": 40.0, "eval/task/reward": 0.95,
                  "eval/task/greedy": 1.0, "eval/held_out/reward": 0.7, "eval/held_out/greedy": 0.0,
                  "eval/held_out/prompts": 128})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps_of(20) + evals))
    (run / "summary.json").write_text(json.dumps({"steps": 20, "eval/curve_set": "held_out"}))
    r = bl.read_run(run, "sync", 0)
    assert r["step_curve"] == [(0, 0.5), (10, pytest.approx(0.6)), (20, 0.7)] and r["eval_prompts"] == 128
    assert r["curve_set"] == "held_out"
    (run / "summary.json").write_text(json.dumps({"steps": 20}))                 # before run.eval_curve: task
    assert bl.read_run(run, "sync", 0)["step_curve"] == [(0, 0.9), (20, 0.95)]


def test_arms_keep_their_settings():
    arms = bl.parse_algorithms("grpo,cispo[cispo_clip_low=1;cispo_clip_high=2],dapo")
    assert arms == ["grpo", "cispo[cispo_clip_low=1;cispo_clip_high=2]", "dapo"]
    assert bl.arm_sets(arms[1]) == ["algorithm.name=cispo", "algorithm.cispo_clip_low=1", "algorithm.cispo_clip_high=2"]
    assert bl.arm_sets("ppo[trainer.lr=1e-5]") == ["algorithm.name=ppo", "trainer.lr=1e-5"]
    assert bl.run_name("reflow:cispo[cispo_clip_low=1]", 2) == "learn-reflow-cispo-cispo_clip_low-1-s2"
    assert bl.parse_algorithms(None) == [None]


def test_mode_arms_keep_their_settings_after_the_modes_own():
    arms = bl.parse_algorithms("sync,reflow[batch_fill=fixed_share;trainer.lr=1e-5]")
    assert arms == ["sync", "reflow[batch_fill=fixed_share;trainer.lr=1e-5]"]
    assert bl.mode_arm_sets(arms[1]) == [*bl.mode_sets("reflow"), "reflow.batch_fill=fixed_share", "trainer.lr=1e-5"]
    assert bl.mode_arm_sets("sync") == bl.mode_sets("sync")
    with pytest.raises(SystemExit, match="'turbo' is not a mode"):
        bl.mode_arm_sets("turbo[sigma=0.5]")


def test_the_tables_show_every_arm_and_level():
    curves = {"sync": [ramp(0.4, 0.8, 100.0), ramp(0.4, 0.7, 100.0)], "reflow": [ramp(0.4, 0.8, 50.0)] * 2}
    res = bl.summarise(curves, 200.0, {m: [[(t / 2, y) for t, y in c] for c in cs] for m, cs in curves.items()})
    text = bl.targets_table(res)
    assert text.count("reflow") == 4 and "sync's final reward" in text and "90% of sync's gain" in text
    assert "reflow" in bl.table(res)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    curves = {"sync": [ramp(0.4, 0.8, 100.0), ramp(0.4, 0.7, 100.0)], "reflow": [ramp(0.4, 0.8, 50.0)] * 2}
    steps = {m: [[(t / 2, y) for t, y in c] for c in cs] for m, cs in curves.items()}
    out = tmp_path / "p.png"
    bl.plot(curves, steps, 200.0, out, {"sync_gain_90": 0.76, "sync_final": 0.75})
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


def test_reward_is_read_at_the_fewest_uses_and_generated_samples_any_run_reached():
    # replay (sigma) trains each generated sample twice: at equal uses it learned less, at equal
    # generated samples more.
    def run(label, seed, uses, generated, final):
        return {"mode": label, "seed": seed, "curve": [(0.0, 0.1), (60.0, final)],
                "uses_curve": [(0, 0.1), (uses, final)], "generated_curve": [(0, 0.1), (generated, final)]}
    runs = [run("fresh", 0, 1000, 1000, 0.5), run("fresh", 1, 1200, 1200, 0.7),
            run("replay", 0, 2000, 1000, 0.5), run("replay", 1, 2000, 1000, 0.5)]
    rows = bl.summarise_algorithms(runs, ["fresh", "replay"])
    assert rows["fresh"]["common_uses"] == 1000 and rows["fresh"]["common_generated"] == 1000
    assert rows["fresh"]["at_uses"] == pytest.approx((0.5 + (0.1 + 0.6 * 1000 / 1200)) / 2)
    assert rows["replay"]["at_uses"] == pytest.approx(0.3)                 # halfway along 0.1 -> 0.5
    assert rows["replay"]["at_generated"] == pytest.approx(0.5) and rows["replay"]["at_generated_se"] == 0.0
    assert "at 1000 uses" in bl.algorithms_table(rows)


def test_summarising_reads_the_budget_the_runs_trained_for(tmp_path):
    """--summarise-only censors at the runs' own budget; a --budget-s that disagrees, or runs of two
    budgets, is an error naming the directory."""
    runs = [{"mode": "sync", "seed": 0, "budget_s": 240.0}, {"mode": "reflow", "seed": 0, "budget_s": 240.0},
            {"mode": "trl", "seed": 0}]
    assert bl.runs_budget(runs, None, tmp_path) == 240.0
    assert bl.runs_budget(runs, 240.0, tmp_path) == 240.0
    with pytest.raises(SystemExit, match=f"--budget-s 120, but the runs in {tmp_path} trained for 240 s"):
        bl.runs_budget(runs, 120.0, tmp_path)
    with pytest.raises(SystemExit, match="different budgets .60 s, 240 s."):
        bl.runs_budget(runs + [{"mode": "reflow", "seed": 1, "budget_s": 60.0}], None, tmp_path)
    assert bl.runs_budget([{"mode": "sync", "seed": 0, "budget_s": None}], None, tmp_path) == bl.DEFAULT_BUDGET_S


def test_a_run_whose_answers_lose_their_form_is_flagged():
    def run(seed, shares):
        return {"mode": "reflow", "seed": seed,
                "well_formed_curve": [(10.0 * i, 0.5, wf) for i, wf in enumerate(shares)]}
    runs = [run(0, (0.94, 0.92, 0.93)), run(1, (0.93, 0.78, 0.86)), {"mode": "sync", "seed": 0},
            run(2, (math.nan, math.nan))]
    assert bl.format_share(runs[1]) == (0.93, 0.78, 0.86)
    assert all(math.isnan(x) for x in bl.format_share(runs[2]) + bl.format_share(runs[3]))
    flags = bl.format_flags(runs)
    assert flags == ["FLAG: reflow seed 1: the share of well-formed eval answers fell 0.930 -> 0.860 (lowest 0.780): "
                     "training is breaking the answers' form"]
