"""The replay-driven loop end to end on 4 real MPI ranks with the tiny Qwen3 policy.

Each mode runs a few steps; the tests read what the run left behind — metrics.jsonl, summary.json,
checkpoints, HDF5 shards — and check the invariants of DESIGN §2 and §5, partial rollouts across
a sync, and resume from a checkpoint in a new process set.
"""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import ROOT, leftover_processes
from loop_common import check_logprobs_by_version, logprob_errors_by_version, run, run_argv, shard_samples, terminal
from reflow_hpc.metrics import read_jsonl

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async", "reflow"])
def test_each_mode_runs_with_invariants(tmp_path, policy_dir, mode):
    steps = 4
    delta = 1
    sigma = 0.5 if mode == "reflow" else 0.0
    run_dir, metrics, summary, r = run(tmp_path, policy_dir, f"reflow.mode={mode}", f"trainer.steps={steps}",
                                       "trainer.batch_size=16", "algorithm.group_size=4", "rollout.max_concurrency=16",
                                       "reflow.sync_every=1", f"reflow.sigma={sigma}", f"reflow.delta={delta}",
                                       "run.eval_every_steps=2")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["version"] for m in metrics] == list(range(steps))          # the version counts optimizer steps
    # The mode's guarantee, over every token each trainer replica trained (it also enforces it).
    lo = [m["trainer/token_staleness_min"] for m in metrics]
    hi = [m["trainer/token_staleness_max"] for m in metrics]
    if mode == "sync":
        assert lo == hi == [0] * steps
    elif mode == "one_step_off":
        assert lo == hi == [0] + [1] * (steps - 1)
    else:
        assert min(lo) >= 0 and max(hi) <= delta
    for m in metrics:
        assert m["mode"] == mode
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert m["staleness/max"] <= delta
        assert m["replay_fraction"] <= (sigma if mode == "reflow" else 0.0)
        assert m["throughput_tokens_per_s"] > 0 and m["tokens"] > 0
        assert 0.0 <= m["idle_ratio/trainer"] <= 1.0 and 0.0 <= m["idle_ratio/rollout"] <= 1.0
        assert m["trainer/lr"] > 0
    if mode == "sync":
        assert all(m["staleness/max"] == 0 for m in metrics)
    if mode == "one_step_off":
        assert all(m["staleness/max"] == 1 for m in metrics[1:])
    # Every sample created ended in exactly one terminal state (nothing live after the run).
    assert summary["accounting_ok"] and summary["buffer"]["buffer/created"] == terminal(summary)
    assert summary["buffer"]["buffer/lost"] == 0 and summary["buffer"]["buffer/failed"] == 0
    assert 0 <= summary["buffer"]["buffer/evicted_unused"] <= summary["buffer"]["buffer/evicted_stale"]
    assert "of the evicted never trained" in r.stdout
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["world_size"] == 4 and {r["role"] for r in topo["ranks"]} == (
        {"trainer+rollout"} if mode == "sync" else {"trainer", "rollout"})
    assert (run_dir / "checkpoints" / "latest").is_file()
    shards = sorted((run_dir / "shards").glob("rank*/*.h5"))
    assert shards, "the run directory holds no shards"
    assert "task prompts not drawn in training" in r.stdout and "held-out texts, distinct" in r.stdout
    assert summary["eval/task/prompts"] == 16 and summary["eval/held_out/prompts"] == 16
    # Snapshots every 2 steps, scored after the run: the start (step 0), then steps 2 and 4.
    evals = read_jsonl(run_dir / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [0, 2, 4] and evals[0]["eval/elapsed_s"] == 0.0
    assert all(0.0 <= e["eval/task/reward"] <= 1.0 and 0.0 <= e["eval/task/greedy"] <= 1.0 for e in evals)
    assert 0 < evals[1]["eval/elapsed_s"] < evals[2]["eval/elapsed_s"] <= summary["train_seconds"]
    assert evals[2]["eval/task/reward"] == summary["eval/task/final_reward"]
    assert "eval    2 v2   after" in r.stdout
    for k in ("task/start_reward", "task/final_greedy", "held_out/start_greedy", "held_out/final_reward"):
        assert 0.0 <= summary[f"eval/{k}"] <= 1.0


def test_partial_rollout_spans_a_sync_under_new_weights(tmp_path, policy_dir):
    """A sample interrupted by a sync carries two versions; tokens of each version are exactly what
    that version's weights produce (log-probs recomputed from the per-step checkpoints)."""
    # A sync finds requests in flight only if the step's dispatch window is not used up before the
    # step ends. With b_max = 32 a fast rollout pool often drained it (no partials at 3 of 4 syncs
    # here, none at all on a faster machine); with a window far beyond what the pool generates in one
    # step, every rollout worker sits at its concurrency cap when the sync arrives.
    steps = 4
    run_dir, metrics, summary, _ = run(
        tmp_path, policy_dir, "reflow.mode=fully_async", "reflow.sigma=0", f"trainer.steps={steps}", "trainer.batch_size=16",
        "algorithm.group_size=4", "checkpoint.every_steps=1", "checkpoint.keep_last=0", "reflow.sync_every=1",
        "rollout.max_new_tokens=96", "rollout.max_concurrency=32", "reflow.b_max=1024", "reflow.delta=2")
    partials = [m["partial_rollouts"] for m in metrics]          # cumulative, one entry per step
    assert all(b > a for a, b in zip(partials, partials[1:])), f"a sync resumed nothing: {partials}"
    samples = [t for t in shard_samples(run_dir) if len(set(t.versions[t.versions >= 0].tolist())) > 1]
    assert samples, "no sample carries tokens of two versions"
    assert check_logprobs_by_version(run_dir, policy_dir, samples[:4]) >= 2


def test_inflight_weight_update_keeps_the_kv_of_running_requests(tmp_path, policy_dir):
    """rollout.sync_kv = keep: the requests a sync finds running decode on under the new weights over the KV
    of the old ones. A sample's first version is exact; its later tokens are not what a re-prefill under
    their version gives, and the trainer takes them (the mode's guarantee is on the tokens' versions)."""
    steps = 4
    run_dir, metrics, summary, _ = run(
        tmp_path, policy_dir, "reflow.mode=fully_async", "reflow.sigma=0", f"trainer.steps={steps}", "trainer.batch_size=16",
        "algorithm.group_size=4", "checkpoint.every_steps=1", "checkpoint.keep_last=0", "reflow.sync_every=1",
        "rollout.max_new_tokens=96", "rollout.max_concurrency=32", "reflow.b_max=1024", "reflow.delta=2",
        "rollout.sync_kv=keep", "trainer.lr=1e-3")      # a large step, so that stale KV shows in the log-probs
    partials = [m["partial_rollouts"] for m in metrics]
    assert all(b > a for a, b in zip(partials, partials[1:])), f"a sync found nothing running: {partials}"
    samples = [t for t in shard_samples(run_dir) if len(set(t.versions[t.versions >= 0].tolist())) > 1]
    assert samples, "no sample carries tokens of two versions"
    errors = logprob_errors_by_version(run_dir, policy_dir, samples[:6])
    first = {sid: min(v for s, v in errors if s == sid) for sid, _ in errors}
    assert all(err < 1e-4 for (sid, v), err in errors.items() if v == first[sid]), errors
    later = [err for (sid, v), err in errors.items() if v != first[sid]]
    assert max(later) > 1e-3, f"every later token is what a re-prefill gives: the KV was not kept ({later})"


def test_usr2_checkpoints_then_resume_continues_without_losing_anything(tmp_path, policy_dir):
    """Slurm's USR2 (time limit ahead) stops the run after the step in flight with a checkpoint that also
    holds the samples being generated; a new process set on "other nodes" (empty node-local scratch)
    resumes from it, continues those samples, finds the buffered ones in the run directory's copy of
    the shards, and the accounting identity holds over both."""
    import os
    import signal
    import subprocess
    import time

    name = f"resume{uuid.uuid4().hex[:6]}"
    # A dispatch window far beyond a step's need: rollout workers are busy when the stop comes.
    sets = ["reflow.mode=reflow", "trainer.batch_size=16", "algorithm.group_size=4", "storage.flush_rows=1",
            "trainer.steps=8", "reflow.delta=2", "reflow.b_max=128", "scheduler.elastic=false"]
    args = run_argv(tmp_path, policy_dir, name, "run.eval_prompts=16", "run.eval_every_steps=2", *sets)
    run_dir = tmp_path / name
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:                   # wait until two steps are done, then signal rank 0
        m = run_dir / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    rank0 = json.loads((run_dir / "topology.json").read_text())["ranks"][0]["pid"]
    os.kill(rank0, signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "stop requested" in out
    # The kill is near after a stop signal: the evaluation is left to the resumed run.
    assert "stopped by SIGUSR2: the held-out evaluation is left to the resumed run" in out
    m1 = read_jsonl(run_dir / "metrics.jsonl")
    s1 = json.loads((run_dir / "summary.json").read_text())
    assert 2 <= s1["steps"] < 8 and len(m1) == s1["steps"]
    ckpt = run_dir / "checkpoints" / f"step_{s1['steps']:06d}"
    assert (ckpt / "meta.json").is_file()
    # The samples in flight were saved, not aborted: they are the only ones still live.
    saved = s1["saved_partials"]
    assert saved > 0 and sorted(p.name for p in (ckpt / "partials").glob("rank*.npz"))
    # Nor is what was buffered: the checkpoint keeps every live sample for the resumed run.
    assert s1["buffer"]["buffer/created"] == terminal(s1) + s1["kept_in_checkpoint"]
    assert s1["kept_in_checkpoint"] >= saved
    state = json.loads((ckpt / "extra" / "coordinator.json").read_text())
    assert len(state["partials"]) == saved

    assert not [k for k in s1 if k.startswith("eval/")]
    _, m2, s2, r2 = run(tmp_path, policy_dir, *sets, "run.eval_every_steps=2", f"storage.dir={tmp_path / 'other-node'}",
                        name=name)
    # ... which scores the snapshots of both process sets.
    scored = [p["step"] for p in s2["eval/curve"]]
    assert scored[0] == 0 and 2 in scored and scored[-1] == 8, scored
    assert "resuming from" in r2.stdout
    assert s2["resumed_partials"] == saved
    resumed = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
               if '"resume"' in x and '"source":-1' in x]
    assert sum(len(e["ids"]) for e in resumed) == saved
    assert [m["step"] for m in m2] == list(range(1, 9))      # metrics appended after the first steps
    assert s2["steps"] == 8 and m2[-1]["version"] >= m1[-1]["version"]
    # One accounting identity over both process sets; every flushed sample is back or accounted.
    assert s2["buffer"]["buffer/created"] == terminal(s2)
    assert s2["buffer"]["buffer/created"] > s1["buffer"]["buffer/created"]
    assert s2["buffer"]["buffer/lost"] == 0
    # The event log says how every sample ended, once, across both process sets; every checkpoint round
    # that began was written.
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = [e["id"] for e in events if e["e"] == "end"]
    assert len(ends) == len(set(ends)) == s2["buffer"]["buffer/created"]
    assert ([e["tag"] for e in events if e["e"] == "checkpoint_begin"]
            == [e["tag"] for e in events if e["e"] == "checkpoint"] != [])


def test_kill_9_of_a_rank_mid_training_ends_the_job_naming_it_and_a_rerun_resumes(tmp_path, policy_dir):
    """A rank killed without a word: the launcher names it and what the job was doing, stops the rest
    well before run.timeout_s, and the same command resumes from the newest checkpoint, nothing lost."""
    import os
    import random
    import signal
    import subprocess
    import time

    name = f"kill{uuid.uuid4().hex[:6]}"
    timeout_s = 90
    sets = ["reflow.mode=reflow", "trainer.batch_size=16", "algorithm.group_size=4", "storage.flush_rows=1",
            "trainer.steps=14", "checkpoint.every_steps=4", "scheduler.elastic=false", "run.eval_prompts=0"]
    args = run_argv(tmp_path, policy_dir, name, *sets, timeout_s=timeout_s)
    run_dir = tmp_path / name
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:               # a checkpoint, then a step or two more
        m = run_dir / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 6:
            break
        time.sleep(0.2)
    victim = random.randrange(4)
    pid = json.loads((run_dir / "topology.json").read_text())["ranks"][victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=300)
    assert time.monotonic() - t0 < timeout_s / 2, "the job waited for a timeout instead of ending at once"
    assert proc.returncode not in (0, 2)
    lines = [ln for ln in err.splitlines() if ln.startswith("reflow_hpc: rank")]
    assert lines and f"reflow_hpc: rank {victim} (" in lines[-1] and "killed by signal 9 during training" in lines[-1], \
        (victim, err[-3000:])
    assert "run the same command again to resume" in lines[-1]
    assert leftover_processes(name) == []

    _, m2, s2, r2 = run(tmp_path, policy_dir, *sets, name=name)
    assert "resuming from" in r2.stdout
    assert s2["steps"] == 14
    assert s2["buffer"]["buffer/created"] == terminal(s2) and s2["buffer"]["buffer/lost"] == 0
