"""tools/bench_modes.py's rows on synthetic runs: the per-rank figures and the flags between modes."""

from __future__ import annotations

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
