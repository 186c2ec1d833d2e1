"""The simulator's engine: the coordinator's guarantees hold on simulated runs of every mode, token by
token, and the processor-sharing engine agrees with a step-by-step decode of the same requests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from reflow_hpc.config import notices
from reflow_hpc.core.commands import Train, TrainSample
from reflow_hpc.core.modes import MODES, rules
from reflow_hpc.sim.costs import Costs
from reflow_hpc.sim.engine import Request, Simulation
from reflow_hpc.sim.lengths import SampleShape
from reflow_hpc.sim.report import simulate, summarise
from reflow_hpc.sim.workload import build_coordinator, load_mode, placement

from conftest import ROOT, ended_every_sample

LAMINAR = str(ROOT / "configs" / "sim_laminar_7b.toml")
QWEN3 = str(ROOT / "configs" / "sim_qwen3_8b_dapo.toml")
QWEN3_32B = str(ROOT / "configs" / "sim_qwen3_32b_dapo.toml")
# A small workload on the calibrated cost model: 16 prompts × 8 samples per step.
SMALL = ["trainer.batch_size=128", "algorithm.group_size=8", "trainer.steps=6", "sim.warmup_steps=0",
         "rollout.max_concurrency=64", "scheduler.queue_samples=128"]


class Observed:
    """What a run showed: every trained share's token segments, every finished sample, every command."""

    def __init__(self):
        self.trained: list[tuple] = []          # (step, version, [segments per sample])
        self.finished: dict[int, tuple] = {}    # sample -> (generated, tokens in its segments, planned tokens)
        self.commands: list = []

    def on_train(self, cmd, segments, now):
        self.trained.append((cmd.step, cmd.version, segments))

    def on_finished(self, worker, requests, now):
        for r in requests:
            self.finished[r.sid] = (r.generated, sum(n for _, n in r.segments), sum(r.turns))

    def on_command(self, cmd, now):
        self.commands.append((now, cmd))


def run(mode, *sets, gpus=16, config=LAMINAR, timeline=False, **kw):
    obs = Observed()
    res = simulate(config, mode, [*SMALL, *sets], gpus, timeline=timeline, on_train=obs.on_train,
                   on_finished=obs.on_finished, on_command=obs.on_command, **kw)
    return res, obs


def check_guarantees(res, obs):
    """The invariants of every mode on a finished simulated run."""
    sim, s = res.sim, res.sim.coordinator.summary()
    cfg = sim.cfg
    r = rules(s["mode"])
    assert s["phase"] == "finished" and s["steps"] == cfg.trainer.steps
    assert s["accounting_ok"], s["accounting"]
    assert ended_every_sample(s)                                          # every sample ended, with a reason
    for rec in sim.records:
        assert len(rec.batch) == cfg.trainer.batch_size
        assert rec.batch.replay_fraction <= cfg.reflow.sigma + 1e-12       # σ bound
    # The mode's guarantee on every trained token (each segment is tokens of one version).
    pairs = [(step, version - v) for step, version, shares in obs.trained for segs in shares for v, n in segs if n]
    assert pairs and all(r.staleness_ok(s, cfg.reflow.delta, step) for step, s in pairs)
    # Tokens are conserved: what a sample generated is what its segments hold, and what was planned.
    assert obs.finished and all(g == seg == planned for g, seg, planned in obs.finished.values())
    # Throughput accounting: the steps' tokens are the trained tokens.
    assert sum(rec.replicas[0].stats["tokens"] for rec in sim.records) == sim.trained_tokens
    for row in res.records:
        assert 0.0 <= row["idle_ratio/trainer"] <= 1.0 and 0.0 <= row["idle_ratio/rollout"] <= 1.0
    return pairs


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_keeps_its_guarantees_on_the_calibrated_workload(mode):
    res, obs = run(mode, timeline=mode == "sync")
    pairs = check_guarantees(res, obs)
    if mode == "sync":
        assert {s for _, s in pairs} == {0}
        gen = [(a.start, a.end) for a in res.sim.timeline if a.kind == "generate"]
        train = [(a.start, a.end) for a in res.sim.timeline if a.kind == "train"]
        assert gen and train
        assert not any(g0 < t1 and t0 < g1 for g0, g1 in gen for t0, t1 in train)   # never both at once
    if mode == "one_step_off":
        assert all(s == 1 for step, s in pairs if step > 0)
        assert all(len([v for v, n in segs if n]) == 1 for _, _, shares in obs.trained for segs in shares)
    if mode in ("fully_async", "reflow"):
        assert res.summary["partial_rollouts"] > 0
    if mode == "reflow":
        assert any(rec.batch.num_replay for rec in res.sim.records)


@pytest.mark.parametrize("mode", list(MODES))
def test_tensor_parallel_instances_keep_every_modes_guarantees(mode):
    """The 32B config's instances of two GPUs (colocated sync included): every mode keeps its guarantees and
    each simulated worker is a whole number of instances."""
    res, obs = run(mode, "trainer.steps=4", "sim.max_workers=8", gpus=16, config=QWEN3_32B)
    check_guarantees(res, obs)
    place = res.sim.place
    assert place.tp == 2 and place.engines * place.tp == place.worker_gpus, place


@pytest.mark.parametrize("mode", ["fully_async", "reflow"])
@pytest.mark.parametrize("sync_kv", ["recompute", "keep"])
def test_partial_rollouts_train_tokens_of_two_versions(mode, sync_kv):
    """Samples in flight at a sync continue under the new weights and are trained with tokens of both.
    (A fast trainer and no cap mass: otherwise mostly long stragglers span syncs, and δ evicts them.)"""
    res, obs = run(mode, "sim.length_cap_prob=0", "sim.train_minibatches=1", "sim.train_update_overhead_s=0.1",
                   f"rollout.sync_kv={sync_kv}")
    check_guarantees(res, obs)
    spans = [len({v for v, n in segs if n}) for _, _, shares in obs.trained for segs in shares]
    assert sum(1 for n in spans if n > 1) > 10
    # The requests a sync held re-prefilled under the new weights, and that stall is accounted; an
    # in-flight update keeps their KV, so no sync stalls them.
    share = res.summary["prefill_share"]
    assert 0.0 < share["first"] < 1.0
    assert (0.0 < share["sync"] < 1.0) if sync_kv == "recompute" else share["sync"] == 0.0


def test_processor_sharing_agrees_with_a_step_by_step_decode():
    """One colocated worker decodes one group: completion times equal the sum of the per-step times."""
    lengths = [37, 400, 401, 1200, 5, 2500, 2500, 90]
    cfg = load_mode(LAMINAR, "sync", ["resources.workers=2", "resources.trainer_replicas=2",
                                      "resources.rollout_instances=0", "trainer.batch_size=8", "algorithm.group_size=8",
                                      "trainer.steps=1", "sim.setup_s=0"])

    class Fixed:
        def group(self, prompt_id, size, version=0):
            return [SampleShape(100, (n,), 0.5) for n in lengths]

    done: dict[int, float] = {}
    place = placement(cfg)
    sim = Simulation(cfg, *build_coordinator(cfg, place), place, lengths=Fixed(),
                     on_finished=lambda w, rs, now: done.update({r.generated: now for r in rs}))
    sim.run()
    c = Costs.from_config(cfg)
    t = c.prefill_time(1, c.prefill_flops_of(100))          # the group's prompt, once (prefix cache)
    running = sorted(lengths)
    ctx = {i: 100 for i in range(len(running))}
    made = 0
    want = {}
    while running:
        t += c.decode_step_time(1, len(running), sum(ctx[i] for i in range(len(running))))
        made += 1
        for i in range(len(running)):
            ctx[i] += 1
        while running and running[0] == made:
            want[running.pop(0)] = t
            ctx = {i: ctx[i + 1] for i in range(len(running))}
    assert set(done) == set(want)
    for n in want:
        assert done[n] == pytest.approx(want[n], rel=1e-9), n


def test_kv_pressure_preempts_and_recomputes_without_losing_tokens():
    res, obs = run("fully_async", "sim.kv_memory_fraction=0.3", "trainer.batch_size=64", "scheduler.queue_samples=64",
                   "reflow.b_max=128", config=QWEN3, gpus=4)
    check_guarantees(res, obs)
    assert res.summary["preemptions"] > 0
    roomy, _ = run("fully_async", "trainer.batch_size=64", "scheduler.queue_samples=64", "reflow.b_max=128",
                   config=QWEN3, gpus=4)
    assert roomy.summary["preemptions"] < res.summary["preemptions"]
    assert roomy.summary["throughput_tokens_per_s"] > res.summary["throughput_tokens_per_s"]
    # Recomputing the preempted contexts is what the tight cache costs.
    assert res.summary["prefill_share"]["reprefill"] > roomy.summary["prefill_share"]["reprefill"]


def test_multi_turn_samples_wait_for_their_tools():
    plain, _ = run("reflow")
    res, obs = run("reflow", "sim.tool_calls_mean=2", "task.max_turns=4", "sim.tool_latency_median_s=5")
    check_guarantees(res, obs)
    assert res.summary["step_s"] > plain.summary["step_s"]


def test_tool_calls_queue_behind_the_workers_executor():
    """As on a rollout worker: at most task.tool_concurrency calls run at once, the rest queue; more
    slots, the same guarantees and a shorter step (the engine decodes the others meanwhile)."""
    tools = ["sim.tool_calls_mean=2", "task.max_turns=4", "sim.tool_latency_median_s=5"]
    one, obs = run("reflow", *tools, "task.tool_concurrency=1")
    check_guarantees(one, obs)
    many, obs = run("reflow", *tools, "task.tool_concurrency=64")
    check_guarantees(many, obs)
    assert many.summary["step_s"] < one.summary["step_s"]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_keeps_its_guarantees_when_messages_take_time(mode):
    """Commands and reports in flight for 0.5 s cross each other (a cancel and the sample's finish, a
    sync and a report under the old version); checkpoints every 2 steps and, in reflow, two role
    switches happen meanwhile."""
    switches = ["scheduler.placement_schedule=[\"2:10\", \"4:8\"]", "scheduler.elastic=false", "reflow.b_max=512",
                "reflow.delta=3"] if mode == "reflow" else []
    res, obs = run(mode, "sim.message_latency_s=0.5", "checkpoint.every_steps=2", *switches,
                   check_invariants=True)
    check_guarantees(res, obs)
    plain, _ = run(mode, "checkpoint.every_steps=2", *switches)
    assert res.summary["simulated_s"] > plain.summary["simulated_s"]
    if mode == "reflow":
        assert res.sim.coordinator.summary()["placements"] == [[2, 10], [4, 8]]


def test_the_elastic_pool_switches_roles_in_the_simulator():
    """A schedule moves two rollout workers to training after step 2 and back after step 4: the
    samples they held finish elsewhere, tokens and versions intact."""
    res, obs = run("reflow", "scheduler.placement_schedule=[\"2:10\", \"4:8\"]", "scheduler.elastic=false",
                   "reflow.b_max=512", "reflow.delta=3")
    check_guarantees(res, obs)
    assert res.sim.coordinator.summary()["placements"] == [[2, 10], [4, 8]]
    assert res.sim.handed_off, "no sample was in flight on a worker leaving rollout"
    resumed = [s.sample_id for _, cmd in obs.commands if type(cmd).__name__ == "Resume" for s in cmd.samples]
    assert set(resumed) <= {sid for sid, _ in res.sim.handed_off}
    switches = [sw for rec in res.sim.records for sw in rec.switches]
    assert [(sw["trainers"], sw["rollouts"]) for sw in switches] == [(10, 6), (8, 8)]
    assert all(sw["seconds"] > 0 for sw in switches)


def test_a_role_timeline_covers_every_worker():
    res, _ = run("reflow", timeline=True)
    workers = {a.worker for a in res.sim.timeline}
    assert workers == set(range(res.summary["workers"]))
    assert {"generate", "train", "sync"} <= {a.kind for a in res.sim.timeline}
    assert all(a.end > a.start for a in res.sim.timeline)


def test_summaries_leave_out_the_warm_up_steps():
    res, _ = run("reflow", "sim.warmup_steps=3")
    assert res.summary["measured_steps"] == 3 and res.summary["steps"] == 6
    again = summarise(res.sim)
    assert again.summary["throughput_tokens_per_s"] == res.summary["throughput_tokens_per_s"]


def test_a_cpu_config_runs_unchanged_on_its_ranks():
    """sim.gpus = 0: the [resources] split of a real config, one simulated worker per rank."""
    res = simulate(str(ROOT / "configs" / "cpu_bench.toml"), "reflow",
                   ["trainer.steps=4", "sim.warmup_steps=0", "sim.model_params=1.6e6", "sim.model_layers=4",
                    "sim.model_hidden=192", "sim.kv_bytes_per_token=1024"])
    assert res.summary["workers"] == 4 and res.summary["trainers_start"] == 2
    assert res.sim.coordinator.summary()["steps"] == 4


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(list(MODES)), seed=st.integers(0, 1000), sigma=st.sampled_from([0.25, 0.5, 0.75]),
       sync_every=st.integers(1, 3), gpus=st.sampled_from([4, 8, 16]), b_max=st.sampled_from([0, 192]))
def test_random_simulated_runs_keep_the_guarantees(mode, seed, sigma, sync_every, gpus, b_max):
    r = rules(mode)
    sync_every = 1 if r.exact_staleness is not None else sync_every
    sets = [f"run.seed={seed}", f"reflow.sigma={sigma if r.replays else 0}", f"reflow.sync_every={sync_every}",
            f"reflow.delta={sync_every}", "trainer.steps=4"]
    if not r.batch_level:
        sets.append(f"reflow.b_max={b_max}")
    res, obs = run(mode, *sets, gpus=gpus, check_invariants=True)
    check_guarantees(res, obs)


def test_a_large_simulation_runs():
    """Speed smoke test (no time is asserted; tools/bench_sim.py measures): 1,024 GPUs, a few steps."""
    res = simulate(QWEN3, "reflow", ["trainer.steps=2", "sim.warmup_steps=0", "trainer.batch_size=1024"], 1024)
    assert res.sim.coordinator.summary()["steps"] == 2 and res.summary["workers"] == 32 and res.summary["events"] > 1024


def test_costs_replaced_for_a_what_if_run():
    cfg = load_mode(LAMINAR, "reflow", SMALL, 16)
    place = placement(cfg)
    fast = dataclasses.replace(Costs.from_config(cfg), train_update_overhead_s=0.0)
    a = summarise(Simulation(cfg, *build_coordinator(cfg, place), place).run()).summary
    b = summarise(Simulation(cfg, *build_coordinator(cfg, place), place, costs=fast).run()).summary
    assert b["simulated_s"] < a["simulated_s"]


def test_the_collector_setting_changes_speed_only_and_is_restored(monkeypatch):
    import gc
    import json

    import reflow_hpc.sim.engine as engine
    before = gc.get_threshold()
    runs = []
    for young in (700, engine.GC_YOUNG_THRESHOLD):
        monkeypatch.setattr(engine, "GC_YOUNG_THRESHOLD", young)
        res = simulate(QWEN3, "reflow", ["trainer.steps=3", "sim.warmup_steps=0", "trainer.batch_size=256"], 64)
        runs.append(json.dumps(res.summary, sort_keys=True, default=str))
        assert gc.get_threshold() == before
    assert runs[0] == runs[1]


def test_replay_needs_delta_two_as_the_config_notice_says():
    """At δ = 1 a streaming batch trains samples one step stale, which the next step evicts: nothing is
    replayed on a workload whose trainers do not starve (config.notices says so); δ = 2 replays."""
    longer = ["trainer.steps=16", "sim.warmup_steps=4"]
    at1, _ = run("reflow", "reflow.delta=1", *longer)
    at2, _ = run("reflow", "reflow.delta=2", *longer)
    assert at1.summary["replay_fraction"] < 0.02 < 0.05 < at2.summary["replay_fraction"]
    assert at1.summary["staleness_mean"] >= 0.99
    assert any("reflow.delta = 1" in line for line in notices(at1.sim.cfg))
    assert notices(at2.sim.cfg) == []


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(list(MODES)), delta=st.integers(1, 4), step=st.integers(0, 6),
       staleness=st.lists(st.integers(-2, 8), min_size=1, max_size=6))
def test_a_share_keeps_its_guarantee_when_its_extremes_do(mode, delta, step, staleness):
    """The simulator checks a share's least and greatest staleness only (``check_staleness``): every
    mode's allowed staleness is an interval, so the extremes decide for every token."""
    r = rules(mode)
    assert all(r.staleness_ok(s, delta, step) for s in staleness) == (
        r.staleness_ok(min(staleness), delta, step) and r.staleness_ok(max(staleness), delta, step))


def test_a_token_staler_than_the_mode_allows_stops_the_run_and_names_its_sample():
    sim = run("sync")[0].sim
    sid = 10 ** 6                       # a payload of a sample that no step drew
    r = sim.samples[sid] = Request(sid, 0, 0, SampleShape(prompt_tokens=4, turns=(8,), reward=1.0), prompt_cached=False)
    # Tokens of versions 0 and 2 (as the engine records them when the sample finishes), trained at
    # version 2: 2 and 0 steps behind.
    r.segments, r.oldest, r.newest = [[0, 3], [2, 5]], 0, 2
    share = Train(0, 2, 2, (TrainSample(sid, 0, 0.0, 1.0, False, 0),), 8, 0, 1)
    with pytest.raises(RuntimeError, match=rf"step 2: sample {sid} has 3 token\(s\) 2 step\(s\) behind version 2"):
        sim.check_staleness(share)
    r.segments, r.oldest, r.newest = [[2, 8]], 2, 2
    assert sim.check_staleness(share) == (0, 0)        # sync at step 2: exactly 0 behind
