"""tools/bench_elastic.py: a repeat's ratios, and the machine probe that says when an arm ran on a slower machine."""

from __future__ import annotations

import json
import math
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_common  # noqa: E402
import bench_elastic  # noqa: E402


def arm(run, tok_s, probe, idle_t=0.1, gen=1000.0):
    return {"run": run, "throughput_tokens_per_s": tok_s, "generation_tokens_per_s": gen, "idle_ratio/trainer": idle_t,
            "idle_ratio/rollout": 0.05, "coverage_error": 0.2, "step_error": 0.1, "machine_probe": probe}


def test_a_repeat_compares_elastic_with_the_best_and_worst_static_arm_and_their_machines():
    rows = [arm("elastic", 1800.0, 600.0, gen=900.0), arm("static n_T=1", 1500.0, 1000.0),
            arm("static n_T=2", 2000.0, 900.0), arm("static n_T=3", 1700.0, 1200.0),
            arm("elastic, fixed caps", 1900.0, 1000.0)]
    x = bench_elastic.ratios(rows)
    assert (x["best_static"], x["worst_static"]) == ("static n_T=2", "static n_T=1")
    assert math.isclose(x["elastic_over_best_static"], 0.9) and math.isclose(x["elastic_over_worst_static"], 1.2)
    assert math.isclose(x["probe_elastic_over_best"], 600 / 900)
    assert math.isclose(x["adaptive_over_fixed_generation"], 0.9)


def test_the_machine_speed_of_a_run_is_the_mean_of_its_probes_and_none_without_them(tmp_path):
    (tmp_path / bench_common.PROBE_FILE).write_text(json.dumps({"before": 600.0, "after": 700.0}))
    assert bench_common.machine_speed(tmp_path) == 650.0
    assert bench_common.machine_speed(tmp_path / "missing") is None
    (tmp_path / bench_common.PROBE_FILE).write_text(json.dumps({"before": float("nan"), "after": float("nan")}))
    assert bench_common.machine_speed(tmp_path) is None
