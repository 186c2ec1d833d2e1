"""Tensor-parallel vLLM instances (``resources.rollout_tp_size = 2``) in the main job, for real on CPU:
the two ways weights reach an instance on 4 MPI ranks (colocated ``sync`` and split ``reflow``), and a role
switch of a whole instance both ways on 6.

An instance is a fixed block of two ranks from rank 0; its first rank (the leader) drives both
engines and the second (the follower) repeats its calls (rollout/tensor_parallel.py). Colocated, each
rank of a block trains too, and a weight sync has every rank load its own trainer's weights; in split
pools the leader receives the weights and passes them on. Either way, if a rank of an instance held
other weights than its leader, the tensor-parallel all-reduces would mix them and the tokens of a
version would not be what that version's checkpoint gives: each test recomputes them.

Runs in the environment that tools/vllm_env.sh builds: ``.venv-vllm/bin/python -m pytest -m vllm
tests/cluster/test_vllm_tensor_parallel.py`` (tests/cluster/test_vllm_env.py does that from the main
suite). Skipped where vLLM is not importable. Each job takes about a minute on 2 cores (start-up
about half of it); the 6-rank one about 90 s and 4.7 GB of memory in all.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from conftest import ended_every_sample
from reflow_hpc.core.modes import rules
from loop_common import check_logprobs_by_version, run, shard_samples
from vllm_jobs import clear_stale_shm

pytest.importorskip("vllm", reason="vLLM is not installed in this Python (tools/vllm_env.sh builds .venv-vllm)")

pytestmark = pytest.mark.vllm

# Two trainer ranks and one instance of two ranks (split modes); colocated, two blocks that each train and
# generate. A checkpoint of every version, for the log-prob check.
TP4 = ("rollout.engine=vllm", "resources.workers=4", "resources.trainer_replicas=2", "resources.rollout_instances=1",
       "resources.rollout_tp_size=2", "trainer.batch_size=16", "algorithm.group_size=4", "reflow.sync_every=1",
       "checkpoint.every_steps=1", "checkpoint.keep_last=0", "run.eval_prompts=0", "rollout.max_new_tokens=96")
# Streaming: a window far beyond one step's samples, so that every sync finds requests in flight.
STREAMING = ("reflow.b_max=1024", "rollout.max_concurrency=32", "reflow.delta=2")
# Colocated (every rank of a block loads its own trainer's weights) and split with partial rollouts (the leader
# receives and passes them on, mid-request). one_step_off and fully_async send weights as reflow does; their own
# guarantees do not depend on the engine and are checked per mode in tests/integration/test_loop_mpi.py.
MODES = {
    "sync": ("reflow.mode=sync", "reflow.sigma=0", "reflow.delta=1", "rollout.max_concurrency=16"),
    "reflow": ("reflow.mode=reflow", *STREAMING),            # the elastic pool on (one split is feasible here)
}
STEPS = 4


def followed(stdout: str) -> dict[int, tuple[int, int, int]]:
    """follower rank -> (its leader, engine calls, weight loads), from the lines each follower prints at the end."""
    return {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for m in
            re.finditer(r"rank (\d+): followed tensor-parallel rank (\d+): (\d+) engine calls, (\d+) weight loads",
                        stdout)}


def versions(t) -> set[int]:
    return set(t.versions[t.versions >= 0].tolist())


@pytest.mark.parametrize("mode", list(MODES))
def test_a_tensor_parallel_instance_runs_colocated_and_split(tmp_path, policy_dir, mode):
    """4 ranks, instances of 2. The run takes its steps; every trained token kept the mode's staleness
    guarantee (the trainer checks each one and ends the run otherwise; the metrics say the same); every
    sample ended once; only leaders own samples; followers made their leader's calls and every weight
    load; tokens of each version are that version's, and where the mode has partial rollouts a sample
    spans a sync with tokens of both versions."""
    clear_stale_shm()
    run_dir, metrics, summary, proc = run(tmp_path, policy_dir, *TP4, *MODES[mode], f"trainer.steps={STEPS}")
    assert summary["steps"] == STEPS and [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert summary["accounting_ok"] and ended_every_sample(summary), summary["buffer"]
    assert summary["buffer"]["buffer/lost"] == summary["buffer"]["buffer/failed"] == 0
    lo = [m["trainer/token_staleness_min"] for m in metrics]
    hi = [m["trainer/token_staleness_max"] for m in metrics]
    if mode == "sync":
        assert lo == hi == [0] * STEPS
    else:
        assert min(lo) >= 0 and max(hi) <= 2
    follows = followed(proc.stdout)
    print(mode, {r: f"follows {f[0]}: {f[1]} calls, {f[2]} loads" for r, f in follows.items()})
    assert set(follows) == {1, 3} and follows[1][0] == 0 and follows[3][0] == 2, proc.stdout[-2000:]
    leaders = {0, 2} if mode == "sync" else {2}
    for rank in leaders:            # generating blocks: every step's calls and every weight sync's load
        calls, loads = follows[rank + 1][1:]
        assert calls > 50 and loads >= STEPS, (rank + 1, follows)
    samples = shard_samples(run_dir)
    assert samples and {t.owner for t in samples} <= leaders, "samples must come from the instances' leaders"
    if mode == "sync":
        assert {t.owner for t in samples} == leaders
    spanning = [t for t in samples if len(versions(t)) > 1]
    if rules(mode).partial_rollouts:
        assert metrics[-1]["partial_rollouts"] > 0, "no sync found requests in flight"
        assert spanning, "no sample carries tokens of two versions"
        checked = spanning[:4]
    else:
        assert not spanning, "a mode without partial rollouts has a sample of two versions"
        newest: dict[int, object] = {}
        for t in samples:                       # one sample of each version: every load reached both ranks
            newest.setdefault(min(versions(t)), t)
        checked = [newest[v] for v in sorted(newest)[-3:]]
    assert check_logprobs_by_version(run_dir, policy_dir, checked) >= 2


# 6 ranks: blocks {0,1} {2,3} {4,5}. Four trainers and the instance {4,5}; after step 2 the block {2,3}
# becomes an instance (2 trainers, 2 instances), after step 4 it trains again and hands its samples over;
# four more steps give the receiver time to finish some of them (they are admitted first, but each step
# is short and a slow host finishes few samples in two).
SWITCH6 = ("rollout.engine=vllm", "reflow.mode=reflow", "resources.workers=6", "resources.trainer_replicas=4",
           "resources.rollout_instances=1", "resources.rollout_tp_size=2", "trainer.steps=8", "trainer.batch_size=16",
           "algorithm.group_size=4", "reflow.sync_every=1", "reflow.delta=2", "rollout.max_concurrency=16",
           "rollout.max_new_tokens=96", "reflow.b_max=256", "scheduler.elastic=false",
           'scheduler.placement_schedule=["2:2","4:4"]',
           # The replicas compare parameters and optimizer state after every step: a trainer that joined
           # from an instance and is not an exact copy ends the run.
           "trainer.check_replicas_every=1",
           "checkpoint.every_steps=1", "checkpoint.keep_last=0", "run.eval_prompts=0")


def test_an_instance_switches_roles_both_ways_on_six_ranks(tmp_path, policy_dir):
    """(4 trainers, 1 instance) -> (2 trainers, 2 instances) -> (4 trainers, 1 instance): the block {2,3}
    wakes and follows its leader, then sleeps and trains again. Samples the leaving instance held finish
    on the other one with their tokens and versions; the replicas stay identical; nothing is lost."""
    clear_stale_shm()
    run_dir, metrics, summary, proc = run(tmp_path, policy_dir, *SWITCH6, timeout=600)
    assert summary["steps"] == 8 and summary["accounting_ok"] and ended_every_sample(summary), summary["buffer"]
    assert summary["buffer"]["buffer/lost"] == summary["buffer"]["buffer/failed"] == 0
    assert summary["placements"] == [[2, 2], [4, 4]]
    assert [m["pool/trainers"] for m in metrics] == [4, 4, 2, 2, 4, 4, 4, 4]
    assert [(m["role/2"], m["role/3"]) for m in metrics] == \
        [("trainer", "trainer")] * 2 + [("rollout", "rollout")] * 2 + [("trainer", "trainer")] * 4
    switched = [m["step"] for m in metrics if "role_switch_seconds/to_trainer" in m
                or "role_switch_seconds/to_rollout" in m]
    assert switched == [3, 5]
    follows = followed(proc.stdout)
    print({r: f"follows {f[0]}: {f[1]} calls, {f[2]} loads" for r, f in follows.items()})
    assert {r: f[0] for r, f in follows.items()} == {1: 0, 3: 2, 5: 4}
    assert follows[3][2] >= 2 and follows[5][2] >= 6, follows      # {2,3} loaded at the syncs while it generated
    assert follows[1][2] == 0                                       # {0,1} never generated
    samples = shard_samples(run_dir)
    # Whether {2,3} finishes a sample of its own in its two steps depends on the host's speed; what it
    # generated reaches the samples it handed over, checked below token by token.
    assert {t.owner for t in samples} <= {2, 4}
    counts = Counter(t.sample_id for t in samples)
    assert not [sid for sid, n in counts.items() if n > 1], "a sample was finished twice"
    assert summary["handed_over"] > 0
    handed = [t for t in samples if "handed_from" in t.meta]
    assert handed and all(t.meta["handed_from"] == 2 and t.owner == 4 for t in handed)
    assert check_logprobs_by_version(run_dir, policy_dir, handed[:4]) >= 2
    hi = [m["trainer/token_staleness_max"] for m in metrics]
    assert max(hi) <= 2
