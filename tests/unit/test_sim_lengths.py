"""The simulator's response lengths: the published DAPO-Math distribution, groups, the cap and drift."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from reflow_hpc.config import load
from reflow_hpc.sim.lengths import LengthModel
from conftest import ROOT


def model(name: str = "sim_qwen3_8b_dapo.toml", *sets: str) -> LengthModel:
    return LengthModel.from_config(load(str(ROOT / "configs" / name), list(sets), check_files=False))


def test_paper_workload_matches_the_notes_dapo_math_row():
    """p10 630, p50 6.1k, p90 9.7k, p99 13.8k, mean 5.45k (Qwen2.5-Math-7B mid-training, DAPO-Math-17k)."""
    lm = model()
    x = np.array([s.response_tokens for p in range(1024) for s in lm.group(p, 16)])
    for q, want in ((10, 630), (50, 6100), (90, 9700), (99, 13800)):
        assert np.percentile(x, q) == pytest.approx(want, rel=0.1), q
    assert x.mean() == pytest.approx(5450, rel=0.1)
    assert x.max() == 16384


def test_a_prompt_draws_the_same_lengths_in_any_order():
    a, b = model(), model()
    first = [a.group(p, 16) for p in (5, 900, 3)]
    again = [b.group(p, 16) for p in (3, 900, 5)][::-1]
    assert first == again
    assert model("sim_qwen3_8b_dapo.toml", "run.seed=1").group(5, 16) != first[0]


def test_lengths_of_one_group_are_correlated():
    lm = model()
    groups = [[np.log(s.response_tokens) for s in lm.group(p, 16) if s.response_tokens < lm.cap] for p in range(400)]
    within = statistics.mean(statistics.pvariance(g) for g in groups if len(g) > 2)
    between = statistics.pvariance([statistics.mean(g) for g in groups if g])
    assert within < between


def test_a_point_mass_at_the_cap():
    lm = model("sim_laminar_7b.toml")
    x = [s.response_tokens for p in range(2000) for s in lm.group(p, 16)]
    capped = sum(1 for n in x if n == lm.cap) / len(x)
    assert capped == pytest.approx(0.004, abs=0.0015)


def test_drift_grows_responses_with_the_policy_version():
    lm = model("sim_laminar_7b.toml", "sim.length_drift=0.0072", "sim.length_cap_prob=0")
    mean = lambda v: statistics.mean(s.response_tokens for p in range(300) for s in lm.group(p, 16, version=v))
    assert mean(320) == pytest.approx(10 * mean(0), rel=0.1)          # RhymeRL: ×10 in 320 steps


def test_multi_turn_samples_split_their_response_into_turns():
    lm = model("sim_laminar_7b.toml", "sim.tool_calls_mean=2", "task.max_turns=4")
    shapes = [s for p in range(200) for s in lm.group(p, 16)]
    assert any(len(s.turns) > 1 for s in shapes)
    assert all(1 <= len(s.turns) <= 4 and all(t >= 1 for t in s.turns) for s in shapes)
    assert all(sum(s.turns) == s.response_tokens for s in shapes)
