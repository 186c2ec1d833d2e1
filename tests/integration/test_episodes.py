"""The episode runner over the real torch engine and a real (random-weight) tiny Qwen3:
rewards, tool observations spliced in as non-generated tokens, partial rollouts across a weight
load, cancellation, and failures confined to one sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reflow_hpc.config import load
from reflow_hpc.envs import make_task
from reflow_hpc.envs.task import prompt_token_ids
from reflow_hpc.policy import build_tiny_policy
from reflow_hpc.rollout.engine import SamplingParams
from reflow_hpc.rollout.episodes import EpisodeRunner
from reflow_hpc.rollout.factory import build_engine
from reflow_hpc.train.loss import token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


def setup(task: str, *sets: str, max_new: int = 48):
    cfg = load(None, ["model.warmstart=true", f"task.name={task}", "model.tiny_layers=2",
                      "model.tiny_hidden_size=64", "model.tiny_intermediate_size=128", *sets])
    model, tok = build_tiny_policy(cfg)
    model.eval()
    engine = build_engine(model, cfg.rollout, seed=3)
    runner = EpisodeRunner(engine, make_task(cfg), tok, SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=max_new),
                           owner=5)
    return cfg, model, tok, engine, runner


def drain(runner, limit=5000):
    out = []
    for _ in range(limit):
        if not runner.has_work():
            break
        out += runner.step()
    return out


def recomputed(model, traj, temperature=1.0):
    ids = torch.from_numpy(traj.tokens.astype(np.int64))[None]
    with torch.no_grad():
        logp, _ = token_logprobs(model(input_ids=ids).logits[0, :-1], ids[0, 1:], temperature)
    return logp.numpy()


def test_single_turn_samples_carry_rewards_and_aligned_arrays():
    cfg, model, tok, engine, runner = setup("arithmetic")
    task = make_task(cfg)
    for sid in range(6):
        runner.add(sid, sid // 3, sid)
    done = drain(runner)
    assert sorted(t.sample_id for t in done) == list(range(6))
    for t in done:
        prompt = task.prompt(t.prompt_id)
        assert t.tokens[:t.prompt_len].tolist() == prompt_token_ids(tok, prompt.text)
        assert (t.versions[:t.prompt_len] == -1).all() and (t.versions[t.prompt_len:] == 0).all()
        assert t.owner == 5 and t.group_id == t.sample_id // 3
        text = tok.decode(t.tokens[t.prompt_len:].tolist(), skip_special_tokens=True)
        assert t.reward == task.reward(prompt, text)
        got = t.logprobs[1:][t.versions[1:] >= 0]
        assert np.abs(got - recomputed(model, t)[t.versions[1:] >= 0]).max() < 1e-4


def test_tool_observations_are_spliced_in_as_non_generated_tokens():
    # Random weights emit the end-of-call token now and then; with many samples some episodes
    # take several turns, each observation inserted between model turns.
    cfg, model, tok, engine, runner = setup("calculator_tool", "rollout.temperature=1.5", max_new=96)
    for sid in range(48):
        runner.add(sid, sid, sid)
    done = drain(runner)
    assert len(done) == 48
    multi = [t for t in done if t.meta["turns"] > 1]
    assert multi, "no sample took a second turn"
    for t in multi:
        resp_v = t.versions[t.prompt_len:]
        assert (resp_v == -1).any() and (resp_v == 0).any()
        assert (t.logprobs[t.prompt_len:][resp_v == -1] == 0).all()
        mask = t.versions[1:] >= 0
        assert np.abs(t.logprobs[1:][mask] - recomputed(model, t, 1.5)[mask]).max() < 1e-4
        assert len(t.tokens) - t.prompt_len <= 96


def test_partial_rollout_continues_under_new_weights():
    cfg, model, tok, engine, runner = setup("arithmetic", max_new=64)
    for sid in range(8):
        runner.add(sid, sid, sid)
    for _ in range(3):
        runner.step()
    held = runner.interrupt()
    assert held > 0 and not runner.engine.has_unfinished()   # rewards may still be on the executor
    new_state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.load_weights(new_state, 1)
    runner.resume()
    done = drain(runner)
    assert sorted(t.sample_id for t in done) == list(range(8))
    spanning = [t for t in done if set(t.versions[t.prompt_len:].tolist()) == {0, 1}]
    assert spanning
    for t in spanning:        # the tokens after the load were produced by the new weights
        mask = t.versions[1:] == 1
        assert np.abs(t.logprobs[1:][mask] - recomputed(model, t)[mask]).max() < 1e-4


def test_cancelled_samples_never_come_back_and_failures_stay_local():
    cfg, model, tok, engine, runner = setup("arithmetic")
    for sid in range(6):
        runner.add(sid, sid, sid)
    runner.cancel([1, 4])
    calls = {"n": 0}
    real_reward = runner.task.reward

    def flaky(prompt, response):
        calls["n"] += 1
        if prompt.prompt_id == 2:
            raise ValueError("reward server said no")
        return real_reward(prompt, response)

    runner.task.reward = flaky
    done = drain(runner)
    assert sorted(t.sample_id for t in done) == [0, 3, 5]
    assert runner.failed == [(2, "ValueError: reward server said no")]
    assert runner.in_flight == 0
