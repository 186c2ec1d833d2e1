"""tools/bench_modes.py's rows on synthetic runs: the per-rank figures and the flags between modes."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_common as bc  # noqa: E402
import bench_modes  # noqa: E402


def metrics(n=6):
    return [{"step": i + 1, "step_seconds": 1.0, "tokens": 1000.0, "idle_ratio/trainer": 0.1, "idle_ratio/rollout": 0.0,
             "replay_fraction": 0.2, "staleness/mean": 1.0, "trainer/token_staleness_min": 0,
             "trainer/token_staleness_max": 1, "sync_seconds": 0.05, "trainer/seconds": 0.8, "fetch_seconds": 0.01}
            for i in range(n)]


def ranks(busy, threads=20):
    return [{"rank": r, "role": "rollout" if r else "trainer", "busy_generation_tokens_per_s": busy if r else None,
             "generated_tokens": 5000 if r else 0, "generate_s": 10.0, "cpu_s": 40.0, "cgroup_cpu_s": None,
             "wall_s": 100.0, "cpu_group": f"/sys/fs/cgroup/cpu/g-rank{r}", "throttled_s": 5.0, "threads": threads,
             "torch_threads": 1} for r in range(2)]


def test_rows_carry_the_per_rank_medians_and_the_records_of_every_pass():
    row = bench_modes.mode_row("reflow", [("bench-reflow", metrics(), {"ranks": ranks(600.0)}, 10.0),
                                          ("bench-reflow-2", metrics(), {"ranks": ranks(400.0)}, 10.0)], warmup=2)
    assert row["rank_busy_gen_tokens_per_s"] == pytest.approx(500.0)
    assert row["rank_cpu_share"] == pytest.approx(0.4) and row["rank_threads"] == 20
    assert [len(r) for r in row["ranks"]] == [2, 2]
    assert "gen/rank" in bench_modes.table([row])
    old = bench_modes.mode_row("sync", [("bench-sync", metrics(), {}, 10.0)], warmup=2)   # a run without records
    assert old["rank_profile"]["ranks"] == 0 and "-" in bench_modes.table([old])


def test_a_mode_whose_ranks_generate_slower_at_equal_caps_is_flagged():
    rows = {m: bench_modes.mode_row(m, [(f"bench-{m}", metrics(), {"ranks": ranks(busy)}, 1.0)], warmup=2)
            for m, busy in (("sync", 500.0), ("fully_async", 560.0), ("reflow", 300.0))}
    flags = bc.mode_flags({m: r["rank_profile"] for m, r in rows.items()}, "sync")
    assert flags == ["FLAG: reflow: per-rank busy generation rate 300 tok/s differs by -40% from sync's 500 tok/s "
                     "(more than 25% at equal caps)"]
    text = bc.ranks_table([("bench-sync", rows["sync"]["ranks"][0])])
    assert "bench-sync" in text and "busy gen tok/s" in text and "500" in text


def test_a_ranks_tokens_per_cpu_second_is_read_against_the_machine_probe_around_its_run():
    """The machine's own speed drifts between runs; a rank is flagged for its speed relative to the probe."""
    def recs(per_cpu, probe):
        return [{**r, "generation_tokens_per_cpu_s": per_cpu if r["rank"] else None, "generate_cpu_s": 5.0,
                 "machine_tokens_per_cpu_s": probe} for r in ranks(500.0)]
    # sync's machine ran 40 % faster: its ranks' tokens per CPU second are higher, their speed vs the probe not
    rows = {"sync": bc.rank_profile(recs(1400.0, 1400.0)), "reflow": bc.rank_profile(recs(1000.0, 1000.0))}
    assert rows["reflow"]["gen_speed_vs_machine"] == pytest.approx(1.0)
    assert bc.mode_flags(rows, "sync") == []
    rows["reflow"] = bc.rank_profile(recs(700.0, 1000.0))
    assert bc.mode_flags(rows, "sync") == ["FLAG: reflow: generation tokens per CPU second ÷ the machine probe's 0.70 "
                                           "differs by -30% from sync's 1.00 (more than 25% at equal caps)"]
    assert "÷ probe" in bc.ranks_table([("bench-reflow", recs(700.0, 1000.0))])
    # ...and so is the drift itself: sync's runs met a machine 40 % faster, which leans every time ratio its way.
    rows["reflow"] = bc.rank_profile(recs(1000.0, 1000.0))
    assert rows["sync"]["machine_probe"] == pytest.approx(1400.0)
    assert bc.drift_flags(rows, "sync") == ["FLAG: reflow: the machine probe read 1000 tokens per CPU second around "
                                            "its runs, -29% against sync's 1400 (more than 10%): its time ratios "
                                            "lean against it"]
    rows["reflow"] = bc.rank_profile(recs(1300.0, 1300.0))
    assert bc.drift_flags(rows, "sync") == []                                  # -7 %: within 10 %
    assert bc.drift_flags(rows, None) == [] and bc.drift_flags({}, "sync") == []


def test_the_machine_probe_generates_with_the_runs_policy(tmp_path):
    from reflow_hpc.config import Config
    from reflow_hpc.policy import build_tiny_policy, save_policy
    model, tokenizer = build_tiny_policy(Config())
    save_policy(model, tokenizer, tmp_path / "policy")
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{tmp_path / "policy"}"\nwarmstart = false\n')
    first, second = bc.machine_probe(str(config), []), bc.machine_probe(str(config), [])
    assert 0 < first < 1e7 and 0 < second < 1e7
    assert math.isnan(bc.machine_probe(str(tmp_path / "missing.toml"), []))      # a reading, never an error
