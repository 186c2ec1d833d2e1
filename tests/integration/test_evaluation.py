"""The end-of-run evaluation's prompt sets and scores, on the real tiny policy and engine."""

from __future__ import annotations

import collections

from reflow_hpc import config as C
from reflow_hpc.envs import make_task
from reflow_hpc.evaluation import FRESH_INDEX, evaluate, prompt_sets, report_lines
from reflow_hpc.policy import build_tiny_policy


def test_held_out_texts_are_distinct_and_never_in_training():
    cfg = C.load(None, ["model.warmstart=true"])
    task = make_task(cfg)
    fresh, held = prompt_sets(task, 64)
    assert (fresh.name, fresh.split, held.name, held.split) == ("task", "train", "held_out", "eval")
    assert fresh.indices == list(range(FRESH_INDEX, FRESH_INDEX + 64))
    texts = [p.text for p in held.prompts]
    assert len(held.indices) == 64 and len(set(texts)) == 64
    assert all(task.prompt(i, "eval").text == t for i, t in zip(held.indices, texts))
    train = {task.prompt(i, "train").text for i in range(3000)}
    assert not train & set(texts)
    # Drawn with repeats, the eval split is mostly a few short texts: the reason for distinct texts.
    with_repeats = collections.Counter(task.prompt(i, "eval").text for i in range(64))
    assert len(with_repeats) < 48


def test_a_small_eval_split_gives_what_it_has():
    cfg = C.load(None, ["model.warmstart=true", "task.max_terms=2", "task.eval_fraction=0.05"])
    _, held = prompt_sets(make_task(cfg), 64)      # one-digit a+b: 100 texts, about 5 held out
    assert 0 < len(held.indices) < 20 and len({p.text for p in held.prompts}) == len(held.indices)


def test_evaluate_scores_every_set_and_model():
    cfg = C.load(None, ["model.warmstart=true", "run.eval_prompts=6", "run.eval_samples=2",
                        "rollout.max_new_tokens=24", "model.tiny_layers=1"])
    model, tok = build_tiny_policy(cfg)
    out = evaluate(cfg, make_task(cfg), tok, {"start": model, "final": model})
    for s in ("task", "held_out"):
        assert out[f"eval/{s}/prompts"] == 6
        for tag in ("start", "final"):
            assert 0.0 <= out[f"eval/{s}/{tag}_reward"] <= 1.0 and 0.0 <= out[f"eval/{s}/{tag}_greedy"] <= 1.0
        assert out[f"eval/{s}/start_greedy"] == out[f"eval/{s}/final_greedy"]   # same weights, greedy
    lines = report_lines(out)
    assert len(lines) == 2 and "start policy" in lines[0] and "held-out texts" in lines[1]


def test_sampled_scores_split_the_answer_form_from_the_answer(policy_dir):
    """The reward among samples in the verifier's form: for arithmetic, whose reward needs that form,
    reward = (fraction well formed) x (reward among them) exactly, and a form rule counts every sample."""
    from reflow_hpc.evaluation import sampled_scores
    from reflow_hpc.policy import load_policy

    cfg = C.load(None, [f"model.path={policy_dir}", "run.eval_samples=4", "rollout.max_new_tokens=64"])
    task = make_task(cfg)
    model, tok = load_policy(policy_dir, "float32", "cpu")
    fresh, _ = prompt_sets(task, 16)
    out = sampled_scores(cfg, model, tok, task, fresh)
    assert 0.0 < out["well_formed"] <= 1.0, out
    assert abs(out["reward"] - out["well_formed"] * out["well_formed_reward"]) < 1e-12, out
    assert task.well_formed(fresh.prompts[0], "1+2 = 3\n#### 3") and not task.well_formed(fresh.prompts[0], "answer: 3")


def test_sampled_scores_split_samples_that_called_a_tool(policy_dir):
    """A multi-turn task's scores say how many samples called a tool, and the reward of those that did and
    did not: together they make up the mean exactly."""
    from reflow_hpc.evaluation import sampled_scores
    from reflow_hpc.policy import load_policy

    cfg = C.load(None, [f"model.path={policy_dir}", "run.eval_samples=4", "rollout.max_new_tokens=64",
                        "task.name=calculator_tool"])
    task = make_task(cfg)
    model, tok = load_policy(policy_dir, "float32", "cpu")
    fresh, _ = prompt_sets(task, 16)
    out = sampled_scores(cfg, model, tok, task, fresh)
    f = out["tool_fraction"]
    assert 0.0 <= f <= 1.0, out
    parts = [(f, out["tool_reward"]), (1 - f, out["no_tool_reward"])]
    assert abs(out["reward"] - sum(w * r for w, r in parts if w > 0)) < 1e-12, out
    assert "tool_fraction" not in sampled_scores(C.load(None, [f"model.path={policy_dir}", "run.eval_samples=1"]),
                                                 model, tok, make_task(C.load(None, [f"model.path={policy_dir}"])),
                                                 fresh)
