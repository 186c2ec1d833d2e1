"""The vLLM rollout engine, for real on CPU: the shared conformance checks (tests/helpers/engine_conformance.py),
what is vLLM's own (factory, top-p refusal, fused-layer loads, sleep on CPU), two ranks of a
torch.distributed job building their engines, a tensor-parallel instance over two ranks, and the main
job's loop on 4 MPI ranks with one-rank instances (tensor-parallel instances in the main job:
tests/cluster/test_vllm_tensor_parallel.py).

Runs in the environment that tools/vllm_env.sh builds: ``.venv-vllm/bin/python -m pytest -m vllm
tests/cluster/test_vllm_engine.py`` (tests/cluster/test_vllm_env.py does that from the main suite). Skipped where
vLLM is not importable. One engine for the module: vLLM allows one per process. The engine is
built the way a rollout worker builds it: after torch.distributed is initialised (a one-rank gloo
group here), through ``build_engine`` over a model loaded from the policy directory.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import engine_conformance as conf
from conftest import HELPERS

pytest.importorskip("vllm", reason="vLLM is not installed in this Python (tools/vllm_env.sh builds .venv-vllm)")

from reflow_hpc.config import RolloutConfig  # noqa: E402
from reflow_hpc.rollout.engine import Request, SamplingParams  # noqa: E402
from reflow_hpc.rollout.factory import build_engine  # noqa: E402
from reflow_hpc.rollout.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine, harness, start seconds)."""
    import torch.distributed as dist

    from reflow_hpc.policy import load_policy

    tmp = tmp_path_factory.mktemp("vllm")
    model, path = conf.tiny_policy(tmp / "policy")
    base = conf.snapshot(model)
    if not dist.is_initialized():     # as on a rollout worker: the job's process group exists first
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    loaded, _ = load_policy(path)
    t0 = time.perf_counter()
    engine = build_engine(loaded, RolloutConfig(engine="vllm", **conf.LIMITS), device="cpu", seed=0, version=0)
    start_s = time.perf_counter() - t0
    print(f"vllm engine built in {start_s:.1f} s")

    yield engine, conf.Harness(reset=conf.reloading_reset(engine), base=base, template=model,
                               vocab=model.config.vocab_size), start_s


@pytest.fixture(scope="module")
def engine(built) -> VllmEngine:
    return built[0]


@pytest.fixture(scope="module")
def harness(built) -> conf.Harness:
    return built[1]


@pytest.fixture(scope="module")
def new_weights(harness) -> dict:
    return conf.perturbed(harness.base, scale=0.05, seed=1)


# --------------------------------------------------------------------------------------------
# The shared conformance checks
# --------------------------------------------------------------------------------------------

class TestConformance(conf.ConformanceTests):
    """The shared checks (tests/helpers/engine_conformance.py) on this engine."""


# --------------------------------------------------------------------------------------------
# vLLM's own
# --------------------------------------------------------------------------------------------

def test_factory_builds_from_the_rollout_section(built):
    engine, _, start_s = built
    assert isinstance(engine, VllmEngine)
    assert (engine.max_concurrency, engine.max_model_len, engine.seed) == (4, 128, 0)
    # the KV budget is vLLM's block count: 1024 tokens in blocks of its size
    assert engine.kv_tokens_budget == -(-1024 // engine.block_size) * engine.block_size
    assert engine.stats().kv_tokens_budget == engine.kv_tokens_budget
    assert start_s < 300


def test_top_p_below_one_is_refused(harness):
    engine = harness.reset(harness.base, 0)
    with pytest.raises(ValueError, match="request 3: top_p = 0.9: the vllm engine needs 1") as e:
        engine.add(Request(3, np.arange(4, dtype=np.int32), SamplingParams(top_p=0.9)))
    assert "\n" not in str(e.value)


def test_fused_layer_tensors_must_come_together(harness, new_weights):
    engine = harness.reset(harness.base, 0)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"q_proj.weight without .*k_proj.weight.*same call") as e:
        engine.load_weights({q: new_weights[q], "model.norm.weight": new_weights["model.norm.weight"]}, version=1)
    assert "\n" not in str(e.value) and engine.version == 0
    # A whole layer alone is fine: q, k and v of layer 0 from the new weights, the rest as it was.
    mixed = dict(harness.base)
    part = {n: new_weights[n] for n in new_weights if n.startswith("model.layers.0.self_attn.") and "_proj" in n}
    mixed.update(part)
    engine.load_weights(part, version=1)
    engine.add(Request(0, np.arange(6, dtype=np.int32) + 20, SamplingParams(temperature=1.0, max_new_tokens=16)))
    c = conf.run(engine)[0]
    # norm.weight was refused above with its call: the model is base + layer 0's attention only
    conf.assert_matches_trainer(c, 1.0, {1: harness.referee(mixed)})


def test_sleep_on_cpu_keeps_requests_and_refuses_steps(harness):
    rng = np.random.default_rng(7)
    reqs = [Request(i, conf.prompt(rng, harness.vocab, 5 + i), SamplingParams(max_new_tokens=20)) for i in range(3)]
    engine = harness.reset(harness.base, 0)
    for r in reqs:
        engine.add(r)
    want = conf.run(engine)
    engine = harness.reset(harness.base, 0)
    for r in reqs:
        engine.add(r)
    for _ in range(5):
        engine.step()
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake()
    got = conf.run(engine)
    for i in range(3):
        np.testing.assert_array_equal(got[i].response, want[i].response)
        np.testing.assert_allclose(got[i].logprobs, want[i].logprobs, atol=conf.TOL)


def test_torch_threads_after_the_engine_started(engine):
    # vLLM's CPU worker swaps torch.set_num_threads for a no-op: the trainer's thread setting cannot
    # follow; documented in the engine's module docstring.
    assert torch.get_num_threads() >= 1


def _ranks(script: str, args: list[list[str]], timeout_s: float) -> list[dict]:
    """Start one process per argument list running tests/helpers/``script`` and return each one's RESULT."""
    import json
    import subprocess
    import sys

    path = HELPERS / script
    procs = [subprocess.Popen([sys.executable, str(path), *a], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for a in args]
    results = []
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {i} of {script} did not finish in {timeout_s:.0f} s")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"rank {i} of {script}:\n" + out[-3000:]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


def test_every_rank_of_a_job_builds_its_engine(tmp_path):
    """Two ranks of a torch.distributed job each build an engine after the job's world exists, as
    rollout workers do at setup (vLLM's group set-up is collective over that world), generate, and
    the job's world still works afterwards."""
    policy = tmp_path / "policy"
    conf.tiny_policy(policy)
    results = _ranks("vllm_ranks.py", [[str(r), "2", str(tmp_path / "pg"), str(policy)] for r in range(2)], 300)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["tokens"] == 8 and r["reason"] == "length" and r["sum"] == 3.0 for r in results), results


def test_a_tensor_parallel_instance_passes_every_conformance_check(tmp_path):
    """Two ranks of a job form one vLLM instance with tensor parallelism 2 (vLLM's TP group over the
    job's world): each rank runs every shared conformance check, making the same calls in the same
    order, and both see the same completions (tokens, versions and log-probs)."""
    policy = tmp_path / "policy"
    conf.tiny_policy(policy)
    results = _ranks("vllm_tp_ranks.py", [[str(r), "2", "2", str(tmp_path / "pg"), str(policy)] for r in range(2)],
                     400)
    for r in results:
        assert r["engine_tp"] == 2 and r["tp_group"] == [0, 1], r
        assert not r["failed"], f"rank {r['rank']}: " + "; ".join(f"{k}: {v}" for k, v in r["failed"].items())
        assert r["worst_logprob_error"] <= conf.TOL and r["completions"] > 20, r
    assert results[0]["fingerprint"] == results[1]["fingerprint"], "the instance's ranks generated differently"


def test_tensor_parallel_needs_the_jobs_world(built):
    """``tp`` > 1 without a world of a multiple of ``tp`` ranks is a one-line error naming the key, before
    vLLM is touched (this process's world has one rank)."""
    engine = built[0]
    with pytest.raises(ValueError, match=r"resources.rollout_tp_size = 2: needs the job's torch.distributed world"):
        VllmEngine._check_tp(2, type("C", (), {"num_attention_heads": 4})(), "cpu")
    with pytest.raises(ValueError, match=r"rollout_tp_size = 4: the model's 6 attention heads do not split"):
        VllmEngine._check_tp(4, type("C", (), {"num_attention_heads": 6})(), "cpu")
    assert engine.tp == 1


# A short fully_async run whose syncs find requests in flight, with a checkpoint of every version.
SPANS_SYNCS = ("rollout.engine=vllm", "reflow.mode=fully_async", "reflow.sigma=0", "trainer.steps=4",
               "trainer.batch_size=16", "algorithm.group_size=4", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
               "reflow.sync_every=1", "rollout.max_new_tokens=96", "rollout.max_concurrency=32", "reflow.b_max=1024",
               "reflow.delta=2")


def test_a_job_with_vllm_rollout_workers_spans_a_sync_under_new_weights(tmp_path, policy_dir):
    """The main job's loop on 4 MPI ranks with ``rollout.engine = "vllm"`` (each rank builds its engine
    at setup, weights arrive by the trainer's weight sync): samples interrupted by a sync carry two
    versions, and the tokens of each version are what that version's checkpoint gives, as
    tests/integration/test_loop_mpi.py checks for the torch engine."""
    from loop_common import check_logprobs_by_version, run, shard_samples

    run_dir, metrics, summary, _ = run(tmp_path, policy_dir, *SPANS_SYNCS)
    assert summary["steps"] == 4 and summary["accounting_ok"], summary
    assert metrics[-1]["partial_rollouts"] > 0, "no sync found requests in flight"
    samples = [t for t in shard_samples(run_dir) if len(set(t.versions[t.versions >= 0].tolist())) > 1]
    assert samples, "no sample carries tokens of two versions"
    assert check_logprobs_by_version(run_dir, policy_dir, samples[:4]) >= 2
