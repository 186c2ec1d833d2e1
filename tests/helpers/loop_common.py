"""Helpers of the tests that run the loop on real MPI ranks: one run, its terminal counts, its shards,
and the check that every token carries the version of the weights that made it."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import numpy as np

from conftest import ROOT, leftover_processes, run_cmd
from reflow_hpc.metrics import read_jsonl

CFG = str(ROOT / "configs" / "cpu_tiny.toml")
TERMINAL = ("trained", "filtered", "evicted_stale", "aborted", "failed", "lost", "uninformative")


def run_argv(tmp_path: Path, policy: str, name: str, *sets: str, timeout_s: float = 90) -> list[str]:
    """The command of one run of the main job's config on 4 ranks, short and small, writing under ``tmp_path``
    (``sets`` after the common ones, so they win)."""
    common = [f"run.output_dir={tmp_path}", f"run.name={name}", f"model.path={policy}", "model.warmstart=false",
              f"run.timeout_s={timeout_s}", f"storage.dir={tmp_path / 'scratch'}", "trainer.micro_batch_size=8"]
    return [sys.executable, "-m", "reflow_hpc.run", CFG, *[x for s in (*common, *sets) for x in ("--set", s)]]


def run(tmp_path: Path, policy: str, *sets: str, name: str | None = None, timeout: float = 420):
    """One run (run_argv, 16 evaluation prompts) to its end; (run dir, step metrics, summary, process)."""
    name = name or f"loop{uuid.uuid4().hex[:8]}"
    r = run_cmd(run_argv(tmp_path, policy, name, "run.eval_prompts=16", *sets), timeout=timeout)
    run_dir = tmp_path / name
    assert r.returncode == 0, f"run failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert leftover_processes(name) == []
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, metrics, summary, r


def terminal(summary: dict) -> int:
    b = summary["buffer"]
    return sum(b[f"buffer/{k}"] for k in TERMINAL)


def shard_samples(run_dir: Path) -> list:
    """Every sample in the run's collected shards, every rank's."""
    from reflow_hpc.storage.reader import ShardReader
    out = []
    for d in sorted((run_dir / "shards").glob("rank*")):
        reader = ShardReader(d)
        out += reader.get(list(reader.ids()))
    return out


def logprob_errors_by_version(run_dir: Path, policy_dir: str, samples: list, temperature: float = 1.0) -> dict:
    """{(sample id, version): largest difference between the recorded log-prob of a token of that version
    and what that version's weights give over the whole context in one forward pass}: per-step
    checkpoints (checkpoint.every_steps = 1, keep_last = 0) hold the versions."""
    import torch

    from reflow_hpc.policy import load_policy
    from reflow_hpc.train.checkpoint import load_model_weights
    from reflow_hpc.train.loss import token_logprobs

    by_version: dict[int, list] = {}
    versions_of = {}                             # sample id -> its token versions, ascending
    for t in samples:
        versions_of[t.sample_id] = sorted(set(t.versions[t.versions >= 0].tolist()))
        for v in versions_of[t.sample_id]:
            by_version.setdefault(v, []).append(t)
    model, _ = load_policy(policy_dir, "float32", "cpu")          # version 0
    errors, weights = {}, {}
    for v in sorted(by_version):                 # each version's checkpoint read once, whatever its samples
        if v > 0:
            load_model_weights(model, run_dir / "checkpoints" / f"step_{v:06d}" / "model")
        weights[v] = torch.cat([p.detach().flatten() for p in model.parameters()])
        for t in by_version[v]:
            with torch.no_grad():
                ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
                logits = model(input_ids=ids).logits[0, :-1]
                logp, _ = token_logprobs(logits, ids[0, 1:], temperature)
            mask = t.versions[1:] == v
            errors[(t.sample_id, v)] = float(np.max(np.abs(t.logprobs[1:][mask] - logp.numpy()[mask])))
    # Versions whose weights are equal (steps without a learning signal) cannot be told apart: the check
    # would pass whichever weights sampled a token.
    for t in samples:
        versions = versions_of[t.sample_id]
        for a, b in zip(versions, versions[1:]):
            assert not torch.equal(weights[a], weights[b]), (
                f"sample {t.sample_id}: versions {a} and {b} have the same weights (no learning signal in "
                f"between?), so its tokens cannot show which of them sampled them")
    return errors


def check_logprobs_by_version(run_dir: Path, policy_dir: str, samples: list, temperature: float = 1.0) -> int:
    """Tokens of each version are exactly what that version's weights produce: log-probs recomputed with
    the per-step checkpoints match the recorded ones. Returns how many (sample, version) pairs were checked."""
    errors = logprob_errors_by_version(run_dir, policy_dir, samples, temperature)
    for key, err in errors.items():
        assert err < 1e-4, (*key, err)
    return len(errors)
