"""Tool calls off the engine loop, over the real torch engine and a random-weight tiny Qwen3: a slow tool
does not stall the other samples, a call past its time limit is answered with an error, observations
rendered with a chat template carry no loss across turns, and a sample that crosses a tool call, a
weight sync, a hand-off and a resume (through a checkpoint's partials file) trains exactly the token ids
the engines sampled."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from reflow_hpc.config import load
from reflow_hpc.envs import make_task
from reflow_hpc.envs.task import Observation, Prompt, Task
from reflow_hpc.envs.tools import ObservationRenderer
from reflow_hpc.policy import build_tiny_policy
from reflow_hpc.rollout.engine import SamplingParams
from reflow_hpc.rollout.episodes import EpisodeRunner
from reflow_hpc.rollout.factory import build_engine
from reflow_hpc.storage.partials import load_partials, save_partials

pytestmark = pytest.mark.usefixtures("one_thread")

TURN_END = ("\n", "=", "#")

# A Qwen3-like chat template (tool messages as a user turn of <tool_response> blocks), in characters
# the tiny policy's tokenizer has.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Recording:
    """An engine wrapper that records, per sample, the ids, log-probs and versions the engine sampled."""

    def __init__(self, engine, log: dict):
        self.engine, self.log, self._prefix = engine, log, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, request):
        self._prefix[request.request_id] = 0 if request.response_prefix is None else len(request.response_prefix)
        self.engine.add(request)

    def _record(self, completions):
        for c in completions:
            k = self._prefix.pop(c.request_id)
            self.log.setdefault(c.request_id, []).append((c.response[k:].copy(), c.logprobs[k:].copy(),
                                                          c.versions[k:].copy()))
        return completions

    def step(self):
        return self._record(self.engine.step())

    def abort_all(self):
        return self._record(self.engine.abort_all())


class SlowTool(Task):
    """Every sample's first turn is a tool call; ``sleep(prompt_id)`` says how long its tool takes."""

    multi_turn = True

    def __init__(self, cfg, sleep):
        super().__init__(cfg)
        self.sleep, self.calls = sleep, []

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return Prompt(index, f"{index}+1=", "")

    def stop_token_ids(self, tokenizer):
        return (int(tokenizer.eos_token_id),) + tuple(int(tokenizer.convert_tokens_to_ids(c)) for c in TURN_END)

    def observe(self, episode, turn_text):
        if episode.turns == 1:
            self.calls.append((episode.prompt.prompt_id, time.monotonic()))
            time.sleep(self.sleep(episode.prompt.prompt_id))
            return Observation(f"slept for prompt {episode.prompt.prompt_id}", done=False, tool="sleep")
        return Observation(done=True, finish_reason="stop")

    def reward(self, prompt, response):
        return float(len(response))


def setup(*sets, seed=3):
    cfg = load(None, ["model.warmstart=true", "model.tiny_layers=2", "model.tiny_hidden_size=64",
                      "model.tiny_intermediate_size=128", *sets])
    model, tok = build_tiny_policy(cfg)
    return cfg, model.eval(), tok


def drain(runner, limit=20000, timeout_s=60.0):
    out, t0 = [], time.monotonic()
    for _ in range(limit):
        if not runner.has_work():
            break
        assert time.monotonic() - t0 < timeout_s, "runner did not finish"
        out += runner.step()
    return out


def perturbed(model, scale=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_a_slow_tool_does_not_stall_the_other_samples():
    cfg, model, tok = setup()
    engine = build_engine(model, cfg.rollout, seed=3)
    task = SlowTool(cfg, lambda pid: 1.0 if pid == 0 else 0.0)
    runner = EpisodeRunner(engine, task, tok, SamplingParams(max_new_tokens=64), owner=0)
    for sid in range(8):
        runner.add(sid, sid, sid)
    finished_at = {}
    t0 = time.monotonic()
    while runner.has_work():
        for t in runner.step():
            finished_at[t.sample_id] = time.monotonic()
        assert time.monotonic() - t0 < 60
    slow_call = next(t for pid, t in task.calls if pid == 0)
    others = [finished_at[s] for s in range(1, 8)]
    # Every other sample made its call and finished while sample 0's tool slept (no stall).
    assert max(others) < slow_call + 1.0 <= finished_at[0]
    assert runner.tool_stats.calls == 8 and runner.tool_stats.samples == 8
    assert max(runner.tool_stats.tool_seconds) >= 1.0


def test_a_tool_past_its_time_limit_is_answered_with_an_error():
    cfg, model, tok = setup("task.turn_timeout_s=0.2")
    engine = build_engine(model, cfg.rollout, seed=3)
    task = SlowTool(cfg, lambda pid: 2.0 if pid == 1 else 0.0)
    runner = EpisodeRunner(engine, task, tok, SamplingParams(max_new_tokens=200), owner=0)
    for sid in range(3):
        runner.add(sid, sid, sid)
    t0 = time.monotonic()
    done = {t.sample_id: t for t in drain(runner)}
    assert time.monotonic() - t0 < 1.8              # nobody waited for the stuck call
    assert sorted(done) == [0, 1, 2] and runner.tool_stats.timeouts == 1
    text = tok.decode(done[1].tokens[done[1].prompt_len:].tolist(), skip_special_tokens=True)
    assert "error: timed out after 0.2 s" in text and "slept for prompt 1" not in text


def test_chat_template_observations_carry_no_loss_across_turns():
    cfg, model, tok = setup("task.name=calculator_tool", "task.chat_template=true", "rollout.temperature=1.5",
                            "task.max_obs_tokens=40")
    tok.chat_template = TEMPLATE
    engine = build_engine(model, cfg.rollout, seed=5)
    log: dict = {}
    runner = EpisodeRunner(Recording(engine, log), make_task(cfg), tok,
                           SamplingParams(temperature=1.5, max_new_tokens=160), owner=0, chat_template=True)
    renderer = ObservationRenderer(tok, chat_template=True, max_obs_tokens=40)
    for sid in range(48):
        runner.add(sid, sid, sid)
    done = drain(runner)
    assert len(done) == 48
    multi = [t for t in done if t.meta["turns"] > 1]
    assert multi, "no sample took a second turn"
    for t in done:
        resp, v, lp = t.tokens[t.prompt_len:], t.versions[t.prompt_len:], t.logprobs[t.prompt_len:]
        sampled = np.concatenate([r for r, _, _ in log[t.sample_id]])
        assert resp[v >= 0].tolist() == sampled.tolist()            # the model's ids, never re-tokenised
        assert (lp[v < 0] == 0).all()                               # observations: no loss
    for t in multi:
        resp, v = t.tokens[t.prompt_len:], t.versions[t.prompt_len:]
        starts = np.flatnonzero((v[1:] < 0) & (v[:-1] >= 0)) + 1
        assert len(starts) == t.meta["turns"] - 1 or len(resp) == 160
        first = starts[0]
        end = first + np.argmax(v[first:] >= 0) if (v[first:] >= 0).any() else len(v)
        obs = tok.decode(resp[first:end].tolist(), skip_special_tokens=False)
        assert obs.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
        assert obs.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n") or end == len(v)
        assert end - first <= 40 + len(renderer.encode(''.join(renderer.wrap())))


def test_a_sample_across_a_tool_call_a_sync_a_hand_off_and_a_resume_trains_the_sampled_ids(tmp_path):
    cfg, model, tok = setup()
    log: dict = {}
    engine_a = build_engine(model, cfg.rollout, seed=11)
    slow = {1, 3}                               # these samples' calls are still running at the hand-off
    task_a = SlowTool(cfg, lambda pid: 30.0 if pid in slow else 0.0)
    sampling = SamplingParams(max_new_tokens=120)
    a = EpisodeRunner(Recording(engine_a, log), task_a, tok, sampling, owner=0)
    for sid in range(6):
        a.add(sid, sid, sid)
    # Until the fast samples are back from their tool call and decoding their second turn.
    t0 = time.monotonic()
    while not (len(task_a.calls) == 6 and any(s.turn_start > 0 and s.pending is None for s in a._live.values())):
        a.step()
        assert time.monotonic() - t0 < 30
    for _ in range(3):
        a.step()
    assert a.waiting() >= 2                     # the slow ones wait outside the engine
    # A weight sync: in-flight requests are held, the weights load, they resume (partial rollout).
    a.interrupt()
    engine_a.load_weights(perturbed(model, seed=1), 1)
    a.resume()
    for _ in range(4):
        a.step()
    # The worker leaves rollout: everything in flight is handed over, saved as a checkpoint's partials.
    partials = a.hand_off()
    assert {p.sample_id for p in partials} >= slow
    assert all(p.meta["handoff"].get("pending") == "turn" for p in partials if p.sample_id in slow)
    save_partials(tmp_path / "partials" / "rank0.npz", partials)
    loaded = load_partials(tmp_path / "partials")
    # Another worker (other weights, version 2) resumes them; the pending calls are run again there.
    engine_b = build_engine(model, cfg.rollout, seed=12)
    engine_b.load_weights(perturbed(model, seed=2), 2)
    task_b = SlowTool(cfg, lambda pid: 0.0)
    b = EpisodeRunner(Recording(engine_b, log), task_b, tok, sampling, owner=1)
    for p in partials:
        b.resume_partial(loaded[p.sample_id])
    done = {t.sample_id: t for t in drain(b)}
    assert sorted(done) == sorted(p.sample_id for p in partials)
    assert {pid for pid, _ in task_b.calls} == slow            # re-run once each, on the worker that resumed
    crossed = 0
    for sid, t in done.items():
        resp, v, lp = t.tokens[t.prompt_len:], t.versions[t.prompt_len:], t.logprobs[t.prompt_len:]
        ids = np.concatenate([r for r, _, _ in log[sid]])
        lps = np.concatenate([x for _, x, _ in log[sid]])
        vers = np.concatenate([x for _, _, x in log[sid]])
        # Trained tokens (version ≥ 0) are exactly the ids the engines sampled, with their log-probs and versions.
        assert resp[v >= 0].tolist() == ids.tolist()
        assert np.array_equal(lp[v >= 0], lps) and np.array_equal(v[v >= 0], vers)
        assert (lp[v < 0] == 0).all() and (v < 0).any()           # the observation: inserted, no loss
        assert t.meta["handed_from"] == 0 and t.meta["turns"] == 2
        crossed += set(v[v >= 0].tolist()) >= {0, 1, 2}
    assert crossed >= 1, "no sample carries tokens of all three versions"
