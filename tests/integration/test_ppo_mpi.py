"""ppo's critic on real MPI ranks: trainer replicas through role switches both ways stay bit-identical, critic
included; a replica FSDP2-sharded over 2 ranks equals an unsharded one; a 4-rank ReFlow run (σ = 0.5, forced switches both ways, replicas checked after every step) killed
with SIGKILL resumes with the critic the checkpoint holds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid

import pytest
import torch

from conftest import ROOT, leftover_processes, run_mpi
from loop_common import run, run_argv, terminal
from reflow_hpc.metrics import read_jsonl

pytestmark = pytest.mark.mpi


def test_critic_replicas_stay_bit_identical_through_role_switches_both_ways():
    r = run_mpi("train_ppo_replicas.py", "--timeout", "60", ranks=3, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    phases = res["phases"]
    assert [p["trainers"] for p in phases] == [[0, 1], [0, 1, 2], [0, 2], [0, 1, 2]]
    assert [p["step"] for p in phases] == [2, 4, 5, 7]
    assert all(p["identical"] and p["critic_moved"] for p in phases)
    # A joining replica's critic was another before its state arrived: the transfer made it identical.
    assert [p["critic_identical_before"] for p in phases] == [True, False, True, False]
    m = res["metrics"]
    assert [x["critic/policy_frozen"] for x in m[:2]] == [1.0, 0.0] and m[0]["loss"] == 0.0
    assert [x["critic/step"] for x in m] == [float(s) for s in range(1, 8)]


def test_a_sharded_ppo_replica_equals_an_unsharded_one_critic_included():
    r = run_mpi("train_ppo_sharded.py", "--timeout", "60", ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert res["shards"] == 2 and res["frozen"] == [1.0, 0.0, 0.0] and res["critic_step"] == 3
    assert res["critic_moved"] > 1e-4
    assert res["policy_diff"] < 1e-10 and res["critic_diff"] < 1e-10 and res["critic_adam_diff"] < 1e-10
    assert res["worst_metric_rel_diff"] < 1e-9


@pytest.mark.slow
def test_ppo_run_with_switches_and_replay_resumes_after_kill_9_with_its_critic(tmp_path, policy_dir):
    name = f"ppo{uuid.uuid4().hex[:6]}"
    sets = ["algorithm.name=ppo", "reflow.mode=reflow", "reflow.sigma=0.5", "reflow.delta=3",
            "trainer.batch_size=16", "algorithm.group_size=4", "rollout.max_concurrency=1", "reflow.sync_every=1",
            "scheduler.elastic=false", 'scheduler.placement_schedule=["2:3","4:1","6:2"]',
            "trainer.check_replicas_every=1", "trainer.steps=9", "checkpoint.every_steps=2",
            "checkpoint.keep_last=0", "storage.flush_rows=1", "run.eval_prompts=0"]
    args = run_argv(tmp_path, policy_dir, name, *sets, timeout_s=90)
    run_dir = tmp_path / name
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:   # the split of 1 trainer checkpointed, then kill
        if (run_dir / "checkpoints" / "step_000006" / "meta.json").is_file():
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the kill"
    victim = random.randrange(4)
    os.kill(json.loads((run_dir / "topology.json").read_text())["ranks"][victim]["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, 2), out[-2000:] + err[-3000:]
    assert leftover_processes(name) == []
    m1 = read_jsonl(run_dir / "metrics.jsonl")
    # Pools 2 -> 3 -> 1 -> 2 trainers; after every step the replicas compared policy and critic state.
    assert [m["pool/trainers"] for m in m1[:6]] == [2, 2, 3, 3, 1, 1]
    assert all(m["trainer/critic/step"] == m["step"] for m in m1)
    ckpt = run_dir / "checkpoints" / "step_000006"
    critic = torch.load(ckpt / "trainer.pt", weights_only=True)["trainer"]["critic"]
    assert critic["step"] == 6 and "value_head.weight" in critic["model"] and critic["optimizer"]["state"]

    _, m2, s2, r2 = run(tmp_path, policy_dir, *sets, name=name)
    assert "resuming from" in r2.stdout and "holds no critic" not in r2.stdout
    resumed_from = int(r2.stdout.split("resuming from")[1].split("step_")[1][:6])
    assert resumed_from >= 6
    after = m2[len(m1):]                                  # the resumed process's steps, appended
    assert [m["step"] for m in after] == list(range(resumed_from + 1, 10))
    # The critic continued where the checkpoint left it: its update count, not a fresh critic's.
    assert [m["trainer/critic/step"] for m in after] == [float(s) for s in range(resumed_from + 1, 10)]
    assert all(m["trainer/critic/policy_frozen"] == 0 for m in m2)
    for k in ("value_loss", "explained_var", "values_mean", "vf_clipfrac"):
        assert all(f"trainer/critic/{k}" in m for m in m2)
    # Generation one sample at a time per worker is slower than training: batches are completed with replayed
    # samples (σ = 0.5), whose values and advantages the critic recomputed at the step that trained them.
    assert sum(m["trainer/replay_samples"] for m in m1 + m2) > 0, "no sample was replayed"
    assert s2["steps"] == 9 and s2["buffer"]["buffer/created"] == terminal(s2) and s2["buffer"]["buffer/lost"] == 0
