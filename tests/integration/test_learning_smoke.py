"""Learning that shows, short enough for CI: the main job's recipe (a warm start that leaves a gap the
verifier's reward closes, then ReFlow on 4 real MPI ranks) for a few dozen steps instead of 200. The eval is on task prompts never drawn in training, scored greedy and sampled, before and after.
"""

from __future__ import annotations

import pytest

from loop_common import run
from reflow_hpc.metrics import read_jsonl

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 30


def test_a_few_dozen_steps_raise_the_eval_reward_clearly(tmp_path, policy_dir):
    """policy_dir is the main job's own warm start."""
    run_dir, metrics, summary, r = run(tmp_path, policy_dir, f"trainer.steps={STEPS}", "run.eval_prompts=64",
                                       "trainer.micro_batch_size=32", f"run.eval_every_steps={STEPS // 2}",
                                       "checkpoint.every_steps=0", timeout=600)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    evals = read_jsonl(run_dir / "metrics.jsonl", "eval")
    curve = [(e["step"], round(e["eval/task/greedy"], 3), round(e["eval/task/reward"], 3)) for e in evals]
    start, end = evals[0], evals[-1]
    assert [e["step"] for e in evals] == [0, STEPS // 2, STEPS], curve
    # The main job gains ~0.6 greedy and ~0.3 sampled in its first 40 steps (README, "The main job").
    assert end["eval/task/greedy"] - start["eval/task/greedy"] >= 0.25, f"(step, greedy, sampled): {curve}"
    assert end["eval/task/reward"] - start["eval/task/reward"] >= 0.15, f"(step, greedy, sampled): {curve}"
    assert summary["accounting_ok"]
