"""Fresh-sample hooks of the replay index (core/fresh.py), dynamic sampling and its generation cap,
ω_i from a plugin, recomputed replay advantages (core/replay_advantage.py), DAPO's overlong reward
shaping (core/shaping.py), and the config keys, mode rules and step metrics that carry them."""

from __future__ import annotations

import json
import math

import pytest

from reflow_hpc import config as C
from reflow_hpc.core import (FreshFilter, ReplayIndex, SampleWeight, build_index, loss_weights, make_fresh_filter,
                             make_replay_filter, make_sample_weight, make_sampler, register_fresh_filter,
                             register_sample_weight)
from reflow_hpc.core.modes import rules
from reflow_hpc.core.shaping import OverlongShaping
from conftest import ROOT


@register_fresh_filter("test_short_only")
class ShortOnly(FreshFilter):
    def keep(self, group):
        return [s.loss_tokens <= 10 for s in group]


@register_sample_weight("test_by_reward")
class ByReward(SampleWeight):
    """ω_i = 1 + 2·reward: a weight that differs inside a group."""

    def weights(self, group):
        return [1.0 + 2.0 * s.reward for s in group]


def make_index(*, group_size=2, batch_size=4, sigma=0.0, tau=0.5, delta=1, b_max=None, fresh="informative_groups",
               weight="uniform", **kw) -> ReplayIndex:
    return ReplayIndex(group_size=group_size, batch_size=batch_size, sigma=sigma, tau=tau, delta=delta,
                       b_max=b_max if b_max is not None else 100 * batch_size, sampler=make_sampler("random"),
                       replay_filter=make_replay_filter("accept_all"), fresh_filter=make_fresh_filter(fresh),
                       sample_weight=make_sample_weight(weight), **kw)


def finish_group(idx, rewards, *, tokens=10, prompt_id=0, version=None):
    """Dispatch one group and finish every member; returns (ids, releases)."""
    g = idx.new_group(prompt_id)
    v = idx.version if version is None else version
    toks = tokens if isinstance(tokens, (list, tuple)) else [tokens] * len(rewards)
    out = []
    for sid, r, n in zip(g.sample_ids, rewards, toks, strict=True):
        out += idx.finished(sid, owner=1, reward=r, min_version=v, max_version=idx.version, loss_tokens=n)
    return g.sample_ids, out


# ------------------------------------------------------------------------------------------------
# dynamic sampling: informative_groups
# ------------------------------------------------------------------------------------------------

def test_a_lost_worker_whose_failure_completes_a_dropped_group_ends_each_sample_once():
    # The failed member completes the group; the filter drops the finished one (all rewards equal)
    # before the scan of the lost worker's samples reaches it.
    idx = make_index()
    g = idx.new_group(0, worker=2)
    assert idx.finished(g.sample_ids[1], owner=2, reward=1.0, min_version=0, max_version=0, loss_tokens=5) == []
    out = idx.worker_lost(2)
    assert [(r.sample_id, r.reason) for r in out] == [(g.sample_ids[0], "failed"), (g.sample_ids[1], "uninformative")]
    assert list(idx.live_ids()) == []


def test_an_all_equal_group_ends_as_uninformative_and_never_reaches_a_batch():
    idx = make_index()
    ids, out = finish_group(idx, [1.0, 1.0])
    assert [(r.sample_id, r.reason, r.has_payload) for r in out] == [(ids[0], "uninformative", True),
                                                                     (ids[1], "uninformative", True)]
    assert ids[0] not in idx and idx.count("ready") == 0
    kept, out = finish_group(idx, [0.0, 1.0])
    assert out == [] and idx.count("ready") == 2
    finish_group(idx, [0.0, 0.0])
    finish_group(idx, [0.5, 1.0])
    b = idx.compose_batch()
    assert b is not None and len(b) == 4 and set(kept) <= set(b.sample_ids)
    acc = idx.accounting()
    assert acc["ok"] and acc["ended"]["uninformative"] == 4 and acc["created"] == 8
    g = idx.gauges()
    assert (g["buffer/uninformative"], g["buffer/groups_completed"], g["buffer/groups_dropped"],
            g["buffer/groups_over_cap"]) == (4, 4, 2, 0)
    idx.check_invariants()


def test_advantages_of_kept_members_use_the_whole_group():
    idx = make_index(fresh="test_short_only", group_size=3, batch_size=2, adv_std_norm=False)
    ids, out = finish_group(idx, [0.0, 1.0, 1.0], tokens=[5, 5, 50])
    assert [(r.sample_id, r.reason) for r in out] == [(ids[2], "uninformative")]
    mean = 2.0 / 3.0
    assert idx.sample(ids[0]).advantage == pytest.approx(-mean)
    assert idx.sample(ids[1]).advantage == pytest.approx(1.0 - mean)


def test_the_cap_lets_declined_groups_through_once_the_step_generated_max_gen_batches():
    # b = 4, cap = 1 batch = 4 samples: two all-equal groups of 2 are dropped, the third goes through
    idx = make_index(max_gen_batches=1)
    _, out1 = finish_group(idx, [1.0, 1.0])
    _, out2 = finish_group(idx, [0.0, 0.0])
    ids3, out3 = finish_group(idx, [1.0, 1.0])
    assert len(out1) == len(out2) == 2 and out3 == []
    assert idx.count("ready") == 2
    ids4, _ = finish_group(idx, [1.0, 1.0])
    b = idx.compose_batch()
    assert b is not None and set(b.sample_ids) == set(ids3) | set(ids4)
    g = idx.gauges()
    assert (g["buffer/groups_dropped"], g["buffer/groups_over_cap"]) == (2, 2)
    _, out = finish_group(idx, [1.0, 1.0])            # a new step: dropping again
    assert [r.reason for r in out] == ["uninformative"] * 2


def test_no_cap_drops_every_declined_group():
    idx = make_index(max_gen_batches=0)
    for _ in range(50):
        assert len(finish_group(idx, [1.0, 1.0])[1]) == 2
    assert idx.gauges()["buffer/groups_over_cap"] == 0


def test_fresh_filter_state_survives_a_checkpoint_and_old_checkpoints_load():
    idx = make_index(max_gen_batches=2, fresh="informative_groups")
    finish_group(idx, [1.0, 1.0])
    finish_group(idx, [1.0, 0.0])
    state = json.loads(json.dumps(idx.state_dict()))
    clone = ReplayIndex.from_state_dict(state, resume=False)
    assert json.dumps(clone.state_dict()) == json.dumps(state)
    assert clone.gauges() == idx.gauges()


def test_a_checkpoint_from_before_the_fresh_hooks_loads():
    idx = make_index(fresh="accept_all")
    finish_group(idx, [1.0, 1.0])
    idx.step_done(idx.compose_batch() or [])
    finish_group(idx, [1.0, 0.0])
    state = json.loads(json.dumps(idx.state_dict()))
    old = {k: v for k, v in state.items() if k not in ("fresh", "latest_groups")}
    old["terminal"] = {k: v for k, v in state["terminal"].items() if k != "uninformative"}
    old["params"] = {k: v for k, v in state["params"].items() if k not in ("max_gen_batches", "replay_advantage")}
    back = ReplayIndex.from_state_dict(old, resume=False)
    assert back.accounting()["ok"] and back.gauges()["buffer/uninformative"] == 0
    assert back.gauges()["buffer/groups_completed"] == 0          # not counted before
    back.check_invariants()
    back = make_index(replay_advantage="recompute")
    back.load_state_dict(old, resume=True)
    assert back.accounting()["ok"] and back._pool.latest.latest == {}


def test_build_index_selects_informative_groups_under_dynamic_sampling():
    reflow = C.ReflowConfig(sigma=0.0, mode="fully_async", delta=1)
    idx = build_index(reflow, group_size=2, batch_size=4, seed=0, dynamic_sampling=True, max_gen_batches=3)
    assert idx._pool.gate.fresh_filter.name == "informative_groups" and idx._pool.gate.cap == 12
    assert build_index(reflow, group_size=2, batch_size=4, seed=0)._pool.gate.active is False


# ------------------------------------------------------------------------------------------------
# ω_i from a plugin
# ------------------------------------------------------------------------------------------------

def test_a_sample_weight_plugin_sets_omega_and_the_loss_weights_follow_the_formula():
    idx = make_index(fresh="accept_all", weight="test_by_reward", group_size=2, batch_size=4)
    a, _ = finish_group(idx, [0.0, 1.0], tokens=[10, 30])
    b, _ = finish_group(idx, [0.5, 0.0], tokens=[20, 40])
    assert [idx.sample(s).base_weight for s in (*a, *b)] == [1.0, 3.0, 2.0, 1.0]
    batch = idx.compose_batch()
    omega = {a[0]: 1.0, a[1]: 3.0, b[0]: 2.0, b[1]: 1.0}
    tokens = dict(zip(batch.sample_ids, batch.loss_tokens))
    z = sum(omega[s] * tokens[s] for s in batch.sample_ids) / sum(tokens.values())
    for sid, w in zip(batch.sample_ids, batch.loss_weights):
        assert w == pytest.approx(omega[sid] / z)
    mean = math.fsum(w * n for w, n in zip(batch.loss_weights, batch.loss_tokens)) / sum(batch.loss_tokens)
    assert mean == pytest.approx(1.0, abs=1e-12)
    assert list(batch.loss_weights) == pytest.approx(loss_weights(batch.is_replay, batch.loss_tokens, 0.5,
                                                                  [omega[s] for s in batch.sample_ids]))


def test_a_replayed_sample_keeps_its_omega_times_tau():
    idx = make_index(fresh="accept_all", weight="test_by_reward", group_size=2, batch_size=4, sigma=0.5, delta=3)
    first, _ = finish_group(idx, [0.0, 1.0])
    finish_group(idx, [1.0, 0.0])
    idx.step_done(idx.compose_batch())
    finish_group(idx, [0.0, 1.0])
    batch = idx.compose_batch()
    assert batch.num_replay == 2
    raw = {sid: (0.5 if rep else 1.0) * idx.sample(sid).base_weight for sid, rep in zip(batch.sample_ids,
                                                                                       batch.is_replay)}
    z = sum(raw[s] * n for s, n in zip(batch.sample_ids, batch.loss_tokens)) / sum(batch.loss_tokens)
    assert list(batch.loss_weights) == pytest.approx([raw[s] / z for s in batch.sample_ids])


def test_a_bad_sample_weight_stops_with_its_name():
    @register_sample_weight("test_negative")
    class Negative(SampleWeight):
        def weights(self, group):
            return [-1.0 for _ in group]

    idx = make_index(fresh="accept_all", weight="test_negative")
    with pytest.raises(RuntimeError, match='sample weight "test_negative"'):
        finish_group(idx, [0.0, 1.0])


# ------------------------------------------------------------------------------------------------
# algorithm.replay_advantage
# ------------------------------------------------------------------------------------------------

def replayed(estimator="group_norm", std_norm=True, mode="recompute"):
    """Groups of prompts 7 ([0, 1]) and 8 ([1, 0]) trained at version 0 sit in replay at version 2."""
    idx = ReplayIndex(group_size=2, batch_size=4, sigma=0.5, tau=0.5, delta=3, b_max=100,
                      sampler=make_sampler("random"), replay_filter=make_replay_filter("accept_all"),
                      adv_std_norm=std_norm, adv_estimator=estimator, replay_advantage=mode)
    finish_group(idx, [0.0, 1.0], prompt_id=7)
    finish_group(idx, [1.0, 0.0], prompt_id=8)
    idx.step_done(idx.compose_batch())
    idx.bump_version()
    idx.bump_version()
    return idx


def replay_advantages(idx, newer_rewards, prompt_id=7):
    """A newer group of ``prompt_id`` completes; the next batch's replay samples → (record, batch advantage)."""
    finish_group(idx, newer_rewards, prompt_id=prompt_id)
    batch = idx.compose_batch()
    assert batch is not None and batch.num_replay == 2
    for sid, adv, rep in zip(batch.sample_ids, batch.advantages, batch.is_replay):
        if not rep:
            assert adv == idx.sample(sid).advantage
    return [(idx.sample(s), adv) for s, adv, rep in zip(batch.sample_ids, batch.advantages, batch.is_replay) if rep]


@pytest.mark.parametrize("estimator,std_norm", [("group_norm", True), ("group_norm", False),
                                                ("group_centre", True), ("leave_one_out", True)])
@pytest.mark.parametrize("seed_prompt", [7, 8])
def test_recompute_judges_a_replayed_sample_against_the_newest_group(estimator, std_norm, seed_prompt):
    idx = replayed(estimator, std_norm)
    for rec, adv in replay_advantages(idx, [1.0, 0.5], prompt_id=seed_prompt):
        if rec.prompt_id != seed_prompt:
            assert adv == rec.advantage                         # no newer group of its prompt
            continue
        centred = rec.reward - 0.75                             # newest group: mean 0.75, std 0.25
        want = centred / (0.25 + 1e-6) if (estimator, std_norm) == ("group_norm", True) else centred
        assert adv == pytest.approx(want)
        assert rec.advantage != pytest.approx(want)             # the record keeps its own group's


def test_recompute_keeps_when_there_is_no_scale_and_centres_without_one():
    idx = replayed("group_norm", True)
    for rec, adv in replay_advantages(idx, [1.0, 1.0]):         # newer, but all equal: no std to divide by
        assert adv == rec.advantage
    idx = replayed("group_centre", True)
    for rec, adv in replay_advantages(idx, [1.0, 1.0]):         # centring needs no scale
        assert adv == (rec.reward - 1.0 if rec.prompt_id == 7 else rec.advantage)
    idx = replayed("none", True)                                # ppo: the trainer's advantages
    for rec, adv in replay_advantages(idx, [1.0, 0.0]):
        assert adv == rec.advantage


def test_keep_is_the_default_and_changes_nothing():
    idx = replayed(mode="keep")
    for rec, adv in replay_advantages(idx, [1.0, 0.5]):
        assert adv == rec.advantage
    assert idx.state_dict()["latest_groups"] == []


def test_latest_groups_are_bounded_and_checkpointed():
    idx = ReplayIndex(group_size=2, batch_size=2, sigma=0.0, tau=0.5, delta=0, b_max=100,
                      sampler=make_sampler("random"), replay_filter=make_replay_filter("accept_all"),
                      replay_advantage="recompute")
    for p in range(5):
        finish_group(idx, [0.0, 1.0], prompt_id=p)
    assert sorted(idx._pool.latest.latest) == [0, 1, 2, 3, 4]
    state = json.loads(json.dumps(idx.state_dict()))
    assert [row[0] for row in state["latest_groups"]] == [0, 1, 2, 3, 4]
    clone = ReplayIndex.from_state_dict(state, resume=False)
    assert clone._pool.latest.latest == idx._pool.latest.latest
    idx.step_done(idx.compose_batch())
    idx.bump_version()                                 # prompts 0 and 1 trained (σ = 0: ended), 2-4 evicted
    assert idx._pool.latest.latest == {}
    old = {k: v for k, v in state.items() if k != "latest_groups"}
    fresh = ReplayIndex(**state["params"], sampler=make_sampler("random"),
                        replay_filter=make_replay_filter("accept_all"))
    fresh.load_state_dict(old, resume=False)
    assert fresh._pool.latest.latest == {}


def test_a_prompt_key_matches_prompts_across_epochs():
    idx = ReplayIndex(group_size=2, batch_size=2, sigma=0.5, tau=0.5, delta=3, b_max=100,
                      sampler=make_sampler("random"), replay_filter=make_replay_filter("accept_all"),
                      adv_estimator="group_centre", replay_advantage="recompute", prompt_key=lambda i: i % 10)
    finish_group(idx, [0.0, 1.0], prompt_id=3)
    idx.step_done(idx.compose_batch())
    idx.bump_version()
    finish_group(idx, [0.0, 0.0], prompt_id=13)        # epoch 2 of the same row
    batch = idx.compose_batch()
    for sid, adv, rep in zip(batch.sample_ids, batch.advantages, batch.is_replay):
        assert adv == (idx.sample(sid).reward if rep else 0.0)


# ------------------------------------------------------------------------------------------------
# overlong shaping
# ------------------------------------------------------------------------------------------------

def test_overlong_shaping_follows_the_formula():
    s = OverlongShaping(max_tokens=100, buffer=20, penalty=2.0)
    assert [s(n) for n in (0, 50, 80)] == [0.0, 0.0, 0.0]
    assert s(81) == pytest.approx((80 - 81) / 20 * 2.0)
    assert s(90) == pytest.approx(-1.0)
    assert s(100) == pytest.approx(-2.0)
    assert s(101) == -2.0 and s(10_000) == -2.0
    assert OverlongShaping.of(C.Config()) is None
    cfg = C.load(None, ["algorithm.overlong_buffer=16", "algorithm.overlong_penalty=0.5"], check_files=False)
    assert OverlongShaping.of(cfg) == OverlongShaping(cfg.rollout.max_new_tokens, 16, 0.5)
    # auto (-1, the default): on for dapo, a fifth of L_max; off for the others; 0 turns dapo's off
    dapo = C.load(None, ["algorithm.name=dapo", "rollout.max_new_tokens=100"], check_files=False)
    assert OverlongShaping.of(dapo) == OverlongShaping(100, 20, 1.0)
    assert OverlongShaping.of(C.load(None, ["algorithm.name=dapo", "algorithm.overlong_buffer=0"],
                                     check_files=False)) is None
    with pytest.raises(ValueError):
        OverlongShaping(10, 0, 1.0)


class _Tok:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("x" for _ in ids)


class _Engine:
    """Answers every request with `n` generated tokens at version 0, stopping for length."""
    version = 0

    def __init__(self, n):
        self.n, self.requests = n, []

    def add(self, request):
        self.requests.append(request)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        import numpy as np

        from reflow_hpc.rollout.engine import Completion
        out = [Completion(r.request_id, r.prompt, np.full(self.n, 5, np.int32), np.zeros(self.n, np.float32),
                          np.zeros(self.n, np.int32), "length") for r in self.requests]
        self.requests = []
        return out


def test_the_runner_shapes_the_reward_and_evaluation_reports_the_task_reward():
    from reflow_hpc.envs.task import Prompt, Task
    from reflow_hpc.rollout.engine import SamplingParams
    from reflow_hpc.rollout.episodes import EpisodeRunner

    class Always(Task):
        name = "test_always"

        def __init__(self):
            super().__init__(C.Config())

        def prompt(self, index, split="train"):
            return Prompt(index, "q", "a")

        def reward(self, prompt, response):
            return 1.0

    shaping = OverlongShaping(max_tokens=16, buffer=8, penalty=1.0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    def one(runner):
        runner.add(0, 0, 0)
        out = []
        while runner.has_work():
            out += runner.step()
        runner.close()
        assert not runner.failed, runner.failed
        (t,) = out
        return t

    t = one(EpisodeRunner(_Engine(12), Always(), _Tok(), sampling, owner=0, shaping=shaping))
    assert t.meta["task_reward"] == 1.0 and t.reward == pytest.approx(1.0 + (8 - 12) / 8)
    t = one(EpisodeRunner(_Engine(12), Always(), _Tok(), sampling, owner=0))      # what evaluation builds
    assert t.reward == 1.0 and "task_reward" not in t.meta
    src = (ROOT / "reflow_hpc" / "evaluation.py").read_text()
    assert "EpisodeRunner(engine, task, tokenizer, sampling, owner=0, chat_template=chat_template)" in src


# ------------------------------------------------------------------------------------------------
# config, mode rules, metrics
# ------------------------------------------------------------------------------------------------

def test_dynamic_sampling_is_auto_on_for_dapo_only():
    at = lambda *sets: C.load(None, list(sets), check_files=False)
    assert not C.dynamic_sampling(at())
    assert C.dynamic_sampling(at("algorithm.name=dapo"))
    assert not C.dynamic_sampling(at("algorithm.name=dapo", "algorithm.dynamic_sampling=off"))
    assert C.dynamic_sampling(at("algorithm.dynamic_sampling=on"))
    assert C.fresh_filter(at("algorithm.name=dapo")) == "informative_groups"
    assert C.fresh_filter(at("algorithm.name=dapo", "reflow.fresh_filter=test_short_only")) == "test_short_only"
    with pytest.raises(C.ConfigError, match="algorithm.dynamic_sampling"):
        at("algorithm.dynamic_sampling=on", "reflow.fresh_filter=test_short_only")
    with pytest.raises(C.ConfigError, match="reflow.fresh_filter"):
        at("reflow.fresh_filter=nope")
    with pytest.raises(C.ConfigError, match="reflow.sample_weight"):
        at("reflow.sample_weight=nope")
    with pytest.raises(C.ConfigError, match="algorithm.overlong_buffer"):
        at("rollout.max_new_tokens=32", "algorithm.overlong_buffer=33")


def test_refills_relax_one_step_off_to_at_most_one_step_and_bound_the_pool():
    plain, refill = rules("one_step_off"), rules("one_step_off", refills=True)
    assert not plain.staleness_ok(0, 1, 5) and refill.staleness_ok(0, 1, 5) and refill.staleness_ok(1, 1, 5)
    assert not refill.staleness_ok(2, 3, 5) and not refill.staleness_ok(1, 1, 0)
    assert rules("sync", refills=True).pool_delta(2) == 0 and refill.pool_delta(3) == 1
    assert rules("reflow", refills=True).pool_delta(3) == 3 and plain.pool_delta(3) == 3


def test_step_metrics_report_the_dropped_fraction_and_the_task_reward():
    from reflow_hpc.metrics import StepMetrics
    from reflow_hpc.sim.report import simulate

    cfg = ROOT / "configs" / "sim_cpu_tiny.toml"
    res = simulate(str(cfg), "reflow", ["trainer.steps=6", "algorithm.dynamic_sampling=on",
                                        "algorithm.max_gen_batches=0", "algorithm.overlong_buffer=16"])
    recs = [StepMetrics("reflow", overlong=OverlongShaping.of(res.sim.cfg))(r) for r in res.sim.records]
    dropped = [r["dynamic_sampling/dropped_fraction"] for r in recs]
    assert all(0.0 <= d <= 1.0 for d in dropped) and any(d > 0 for d in dropped)
    assert all(r["dynamic_sampling/over_cap"] == 0 for r in recs)
    last = recs[-1]
    assert last["buffer/groups_dropped"] > 0 and last["buffer/uninformative"] > 0
    assert res.sim.coordinator.summary()["accounting_ok"]
    for rec, r in zip(res.sim.records, recs):
        assert r["reward/task_mean"] >= r["reward/mean"] - 1e-12
        assert len(rec.batch) == res.sim.cfg.trainer.batch_size
