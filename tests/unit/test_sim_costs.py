"""The simulator's cost model against the published numbers it was built from (shared/notes/cost-model.md),
and the closed forms of decode time against step-by-step sums."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings, strategies as st

from reflow_hpc.config import load
from reflow_hpc.sim.costs import Costs, decode_steps, decode_time
from conftest import ROOT


def costs(name: str, *sets: str) -> Costs:
    return Costs.from_config(load(str(ROOT / "configs" / name), list(sets), check_files=False))


def test_decode_step_reproduces_laminar_fig4():
    """Qwen2.5-7B TP1 on H800, context 4096: 7.0 / 8.4 / 12.6 / 18.1 / 29.6 ms at batch 1 / 16 / 64 / 128 / 256."""
    c = costs("sim_laminar_7b.toml")
    for n, ms in ((1, 7.0), (16, 8.4), (64, 12.6), (128, 18.1), (256, 29.6)):
        assert c.decode_step_time(1, n, n * 4096) * 1e3 == pytest.approx(ms, rel=0.03)


def test_kv_capacity_of_qwen3_8b_is_about_350k_tokens_per_gpu():
    c = costs("sim_qwen3_8b_dapo.toml")
    assert c.kv_capacity(1) == pytest.approx(350e3, rel=0.02)
    assert c.kv_capacity(2) > 2 * c.kv_capacity(1)          # the weights are split over the TP group


def test_pooled_engines_run_their_share_of_the_requests():
    """m engines holding n requests step like one engine holding n/m."""
    c = costs("sim_qwen3_8b_dapo.toml")
    assert c.decode_step_time(1, 400, 400 * 3000, engines=4) == pytest.approx(c.decode_step_time(1, 100, 100 * 3000))


def test_h20_decode_is_compute_bound_for_large_batches():
    c = costs("sim_verl_h20_7b.toml")
    a, _, comp = c.decode_terms(1, 1024, 1024 * 500)
    assert comp > a                                          # 148 TFLOP/s: the FLOPs of 1,024 tokens dominate
    a, _, comp = c.decode_terms(1, 1, 500)
    assert a > comp


def test_training_time_terms():
    c = costs("sim_laminar_7b.toml")
    base = dataclasses.replace(c, train_update_overhead_s=0.0, logprob_recompute_modes=())
    lengths = [1000] * 64
    flops = sum(n * (6 * c.params + 6 * c.layers * c.hidden * n) for n in lengths)
    assert base.train_time(8, lengths, "reflow") == pytest.approx(flops / (8 * c.train_mfu * c.flops))
    # the old log-prob pass is a forward: a third of a training pass
    assert c.train_time(8, lengths, "sync") - c.train_time(8, lengths, "reflow") == pytest.approx(
        base.train_time(8, lengths, "reflow") / 3)
    assert c.train_time(8, [], "reflow") == pytest.approx(c.train_minibatches * c.train_update_overhead_s)


def test_sync_and_switch_costs_match_their_sources():
    c = costs("sim_qwen3_8b_dapo.toml")
    lam = costs("sim_laminar_7b.toml")
    assert lam.sync_time(8) < 0.2 < lam.sync_time(16)      # in one node vs across nodes
    assert lam.colocated_sync_time() == pytest.approx(5.0, rel=0.35)      # RollPacker: ~5 s for 7B
    to_rollout = c.role_switch_time("to_rollout", trainer_gpus=8, tp=1) + c.sync_time(32)
    assert to_rollout == pytest.approx(5.72, rel=0.05)      # ReFlow Table 2
    assert c.role_switch_time("to_trainer", trainer_gpus=8, tp=1) > c.role_switch_time("to_rollout", trainer_gpus=8,
                                                                                            tp=1)
    with pytest.raises(ValueError):
        c.role_switch_time("sideways", trainer_gpus=8, tp=1)


def test_prefill_charges_attention_over_cached_context():
    c = costs("sim_laminar_7b.toml")
    assert c.prefill_flops_of(100, 10_000) > c.prefill_flops_of(100, 0) > 2 * c.params * 100 - 1
    assert c.prefill_time(1, 0.0) == 0.0
    assert c.prefill_time(2, 1e15) < c.prefill_time(1, 1e15)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-4, 0.05), b=st.floats(0.0, 1e-5), c=st.floats(1e-4, 0.08), k=st.integers(0, 3000))
def test_decode_time_is_the_sum_of_its_steps(a, b, c, k):
    brute = sum(max(a + b * i, c) for i in range(k))
    assert decode_time(a, b, c, k) == pytest.approx(brute, rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-4, 0.05), b=st.floats(0.0, 1e-5), c=st.floats(1e-4, 0.08), k=st.floats(0.0, 5000.0))
# Half a step that is compute-bound by one ulp: it was counted as a whole step.
@example(a=0.0001, b=9.043972983221978e-06, c=0.00010000000000000002, k=0.5)
def test_decode_steps_inverts_decode_time(a, b, c, k):
    assert decode_steps(a, b, c, decode_time(a, b, c, k)) == pytest.approx(k, rel=1e-7, abs=1e-7)
