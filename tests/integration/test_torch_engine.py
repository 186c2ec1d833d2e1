"""The embedded torch rollout engine: a real random-weight Qwen3, real engine, HF forward as referee."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from reflow_hpc.config import ConfigError, RolloutConfig, load
from reflow_hpc.rollout.engine import Completion, Engine, Request, SamplingParams
from reflow_hpc.rollout.factory import build_engine, sampling_params
from reflow_hpc.rollout.sampling import sample, stream_key, uniform_reference, uniforms
from reflow_hpc.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 100
TOL = 1e-4


def make_model(seed: int) -> Qwen3ForCausalLM:
    """2 layers, GQA 4:2, tied embeddings; a wide init so that distributions are far from uniform."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.1, rope_theta=10000.0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def weights() -> tuple[dict, dict]:
    """Two different weight sets (versions 0 and 1) as HF state dicts."""
    return ({k: v.clone() for k, v in make_model(0).state_dict().items()},
            {k: v.clone() for k, v in make_model(1).state_dict().items()})


@pytest.fixture(scope="module")
def referees(weights) -> tuple[Qwen3ForCausalLM, Qwen3ForCausalLM]:
    """Trainer-side models holding the same two weight sets."""
    out = []
    for state in weights:
        m = make_model(0)
        m.load_state_dict(state)
        out.append(m)
    return tuple(out)


def engine_with(state: dict, **kw) -> TorchEngine:
    model = make_model(0)
    model.load_state_dict(state)
    kw.setdefault("max_concurrency", 4)
    kw.setdefault("kv_budget_tokens", 1024)
    kw.setdefault("max_model_len", 128)
    return TorchEngine(model, **kw)


def prompt(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n).astype(np.int32)


def run(engine: TorchEngine, max_steps: int = 10_000) -> dict[int, Completion]:
    out = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for c in engine.step():
            assert c.request_id not in out
            out[c.request_id] = c
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")


@torch.no_grad()
def recompute(model: Qwen3ForCausalLM, c: Completion, temperature: float) -> np.ndarray:
    """What a trainer computes: one forward over prompt + response, log_softmax(logits / T) at the response."""
    ids = torch.from_numpy(np.concatenate([c.prompt, c.response]).astype(np.int64))[None]
    logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    p = len(c.prompt)
    resp = torch.from_numpy(c.response.astype(np.int64))
    return logp[p - 1:p - 1 + len(resp)].gather(-1, resp[:, None])[:, 0].numpy()


def assert_parity(c: Completion, temperature: float, models_by_version: dict[int, Qwen3ForCausalLM]) -> None:
    assert len(c.response) == len(c.logprobs) == len(c.versions)
    for version, model in models_by_version.items():
        mine = c.versions == version
        if mine.any():
            err = np.abs(recompute(model, c, temperature)[mine] - c.logprobs[mine]).max()
            assert err < TOL, f"request {c.request_id} version {version}: log-prob error {err:.2e}"
    assert np.isin(c.versions, list(models_by_version)).all(), c.versions


# --------------------------------------------------------------------------------------------
# Sampling primitives
# --------------------------------------------------------------------------------------------

def test_counter_hash_matches_its_plain_python_twin():
    keys = [stream_key(0, 0), stream_key(7, 123456789), stream_key(3), stream_key(-5, 2**40)]
    counters = [0, 1, 17, 2**31]
    kt = torch.tensor([k for k in keys for _ in counters], dtype=torch.int64)
    ct = torch.tensor([c for _ in keys for c in counters], dtype=torch.int64)
    got = uniforms(kt, ct).tolist()
    want = [uniform_reference(k, c) for k in keys for c in counters]
    assert got == want
    assert all(0 <= u < 1 for u in got) and len(set(got)) == len(got)
    assert stream_key(0, 1) != stream_key(1, 0) and stream_key(5) != stream_key(5, 0)


def test_sampler_draws_from_the_tempered_nucleus_and_reports_pre_truncation_logprob():
    n = 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).repeat(n, 1)
    u = uniforms(torch.full((n,), stream_key(11), dtype=torch.int64), torch.arange(n))
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)]:
        tok, lp = sample(logits, torch.full((n,), temperature), torch.full((n,), top_p), u,
                         any_top_p=top_p < 1, any_greedy=False)
        p = torch.softmax(logits[0] / temperature, -1)
        assert torch.allclose(lp, torch.log(p)[tok], atol=1e-6)       # before truncation
        keep = (torch.cumsum(p, 0) - p) < top_p
        want = torch.where(keep, p, torch.zeros_like(p))
        want = want / want.sum()
        freq = torch.bincount(tok, minlength=6).double() / n
        assert (freq[~keep] == 0).all()
        assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / n), (temperature, top_p, freq, want)
    tok, lp = sample(logits[:3], torch.zeros(3), torch.ones(3), u[:3], any_top_p=False, any_greedy=True)
    assert tok.tolist() == [0, 0, 0] and torch.allclose(lp, torch.log_softmax(logits[0], -1)[0].expand(3))


# --------------------------------------------------------------------------------------------
# Log-prob parity with the trainer's recomputation
# --------------------------------------------------------------------------------------------

SETTINGS = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.8)]


def test_logprobs_match_a_trainer_forward_pass(weights, referees):
    engine = engine_with(weights[0], max_concurrency=3)
    assert isinstance(engine, Engine)
    rng = np.random.default_rng(0)
    temps = {}
    for i in range(8):
        t, top_p = SETTINGS[i % 4]
        temps[i] = t
        engine.add(Request(i, prompt(rng, 1 + 3 * i), SamplingParams(temperature=t, top_p=top_p,
                                                                      max_new_tokens=10 + 7 * i)))
    out = run(engine)
    assert sorted(out) == list(range(8))
    for i, c in out.items():
        assert c.finish_reason == "length" and len(c.response) == 10 + 7 * i
        assert (c.versions == 0).all()
        assert_parity(c, temps[i], {0: referees[0]})


def test_parity_holds_under_preemption_and_across_a_weight_load(weights, referees):
    # 6 requests of up to 12 + 60 tokens in a 160-token budget: preemption is unavoidable.
    engine = engine_with(weights[0], max_concurrency=4, kv_budget_tokens=160, max_model_len=80)
    rng = np.random.default_rng(1)
    temps = {}
    for i in range(6):
        t, top_p = SETTINGS[i % 4]
        temps[i] = t
        engine.add(Request(i, prompt(rng, 4 + 2 * i), SamplingParams(temperature=t, top_p=top_p, max_new_tokens=60)))
    out = {}
    for _ in range(30):
        for c in engine.step():
            out[c.request_id] = c
        s = engine.stats()
        assert s.kv_tokens_used <= s.kv_tokens_budget and s.running <= 4
    # Bucketed load of the new weights as (name, tensor) pairs, in two parts, while requests run.
    items = list(weights[1].items())
    engine.load_weights(iter(items[: len(items) // 2]), version=1)
    engine.load_weights(iter(items[len(items) // 2:]), version=1)
    out.update(run(engine))
    assert engine.stats().preemptions > 0
    assert sorted(out) == list(range(6))
    mixed = 0
    for i, c in out.items():
        assert len(c.response) == 60
        assert_parity(c, temps[i], {0: referees[0], 1: referees[1]})
        assert (np.diff(c.versions) >= 0).all()
        mixed += len(set(c.versions.tolist())) == 2
    assert mixed >= 1


# --------------------------------------------------------------------------------------------
# Scheduling
# --------------------------------------------------------------------------------------------

def test_continuous_batching_admits_new_requests_while_others_run(weights):
    engine = engine_with(weights[0], max_concurrency=2)
    rng = np.random.default_rng(2)
    engine.add(Request(0, prompt(rng, 5), SamplingParams(max_new_tokens=60)))
    for _ in range(5):
        assert engine.step() == []
    engine.add(Request(1, prompt(rng, 5), SamplingParams(max_new_tokens=5)))
    engine.add(Request(2, prompt(rng, 5), SamplingParams(max_new_tokens=8)))
    finished_order = []
    engine.step()
    s = engine.stats()
    assert (s.running, s.queued) == (2, 1)           # 1 admitted at once, 2 waits for a slot
    for step in range(100):
        done = engine.step()
        finished_order += [c.request_id for c in done]
        if 1 in finished_order and 2 not in finished_order and not done:
            # the slot request 1 freed went to request 2 on the very next step
            assert engine.stats().running == 2 and engine.stats().queued == 0
        assert engine.stats().running <= 2
        if not engine.has_unfinished():
            break
    assert finished_order == [1, 2, 0]


def test_a_continuation_is_admitted_before_queued_fresh_prompts(weights):
    """A sample handed over (or resumed) with generated tokens goes ahead of fresh prompts that queued
    before it, after continuations that queued earlier: its tokens age against δ while it waits."""
    engine = engine_with(weights[0], max_concurrency=1)
    rng = np.random.default_rng(3)
    engine.add(Request(0, prompt(rng, 5), SamplingParams(max_new_tokens=4)))
    engine.step()                                   # 0 holds the only slot
    for rid in (1, 2):
        engine.add(Request(rid, prompt(rng, 5), SamplingParams(max_new_tokens=4)))
    for rid in (3, 4):                              # continuations, as a hand-over delivers them
        engine.add(Request(rid, prompt(rng, 5), SamplingParams(max_new_tokens=6), np.array([7, 8], np.int32),
                           np.array([-0.5, -0.5], np.float32), np.array([0, 0], np.int32)))
    order = []
    while engine.has_unfinished():
        order += [c.request_id for c in engine.step()]
    assert order == [0, 3, 4, 1, 2]


def test_prefill_token_cap_spreads_admissions_over_steps(weights):
    engine = engine_with(weights[0], max_concurrency=4, max_prefill_tokens=10)
    rng = np.random.default_rng(8)
    for i in range(4):
        engine.add(Request(i, prompt(rng, 8), SamplingParams(max_new_tokens=20)))
    running = []
    for _ in range(4):
        engine.step()
        running.append(engine.stats().running)
    assert running == [1, 2, 3, 4]      # 7 prefill tokens each; a second one would exceed 10
    engine.add(Request(9, prompt(rng, 30), SamplingParams(max_new_tokens=2)))
    assert len(run(engine)) == 5        # a request longer than the cap is still admitted, alone


def test_stop_ids_and_max_new_tokens(weights):
    rng = np.random.default_rng(3)
    p = prompt(rng, 6)
    engine = engine_with(weights[0])
    engine.add(Request(7, p, SamplingParams(max_new_tokens=40)))
    free = run(engine)[7]
    assert free.finish_reason == "length" and len(free.response) == 40
    stop = int(free.response[10])
    first = int(np.flatnonzero(free.response == stop)[0])
    engine.add(Request(7, p, SamplingParams(max_new_tokens=40, stop_ids=(VOCAB + 5, stop))))
    stopped = run(engine)[7]
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.response, free.response[:first + 1])   # stop token kept
    np.testing.assert_array_equal(stopped.logprobs, free.logprobs[:first + 1])


def test_same_request_same_tokens_alone_and_in_a_batch(weights):
    rng = np.random.default_rng(4)
    p = prompt(rng, 9)
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=30)
    alone = engine_with(weights[0], seed=5)
    alone.add(Request(42, p, sp))
    ref = run(alone)[42]
    # In a crowd, admitted last, squeezed by a small budget so that it is preempted on the way.
    crowd = engine_with(weights[0], seed=5, max_concurrency=4, kv_budget_tokens=100, max_model_len=64)
    for i in range(5):
        crowd.add(Request(i, prompt(rng, 3 + 4 * i), SamplingParams(max_new_tokens=20 + 5 * i)))
    crowd.add(Request(42, p, sp))
    got = run(crowd)
    assert crowd.stats().preemptions > 0
    np.testing.assert_array_equal(got[42].response, ref.response)
    np.testing.assert_allclose(got[42].logprobs, ref.logprobs, atol=TOL)
    # Another engine seed changes the stream; an explicit per-request seed ignores the request id.
    other = engine_with(weights[0], seed=6)
    other.add(Request(42, p, sp))
    other.add(Request(1, p, SamplingParams(temperature=0.9, max_new_tokens=30, seed=9)))
    other.add(Request(2, p, SamplingParams(temperature=0.9, max_new_tokens=30, seed=9)))
    res = run(other)
    assert not np.array_equal(res[42].response, ref.response)
    np.testing.assert_array_equal(res[1].response, res[2].response)


def test_preemption_keeps_budget_and_every_request_completes(weights, referees):
    engine = engine_with(weights[0], max_concurrency=8, kv_budget_tokens=120, max_model_len=60)
    rng = np.random.default_rng(5)
    lengths = {i: 15 + 5 * (i % 6) for i in range(12)}
    for i, n in lengths.items():
        engine.add(Request(i, prompt(rng, 2 + i), SamplingParams(temperature=1.0, max_new_tokens=n)))
    out = {}
    while engine.has_unfinished():
        for c in engine.step():
            out[c.request_id] = c
        s = engine.stats()
        assert s.kv_tokens_used <= s.kv_tokens_budget and s.running <= 8
    s = engine.stats()
    assert s.preemptions > 0 and (s.running, s.queued, s.kv_tokens_used) == (0, 0, 0)
    assert s.generated_tokens >= sum(lengths.values())
    assert {i: len(c.response) for i, c in out.items()} == lengths
    for c in out.values():
        assert_parity(c, 1.0, {0: referees[0]})


# --------------------------------------------------------------------------------------------
# Partial rollouts, weight loads, sleep
# --------------------------------------------------------------------------------------------

def test_partial_rollout_continues_under_new_weights(weights, referees):
    engine = engine_with(weights[0], max_concurrency=2)
    rng = np.random.default_rng(6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=30)
    for i in range(3):
        engine.add(Request(i, prompt(rng, 4 + i), sp))
    for _ in range(8):
        assert engine.step() == []
    # 8 decodes of the 2 admitted requests, after prefilling their prompts but the last token (3 + 4)
    assert (engine.stats().decode_steps, engine.stats().prefilled_tokens) == (8, 7)
    partials = engine.abort_all()
    assert not engine.has_unfinished() and engine.stats().running == engine.stats().queued == 0
    assert sorted(c.request_id for c in partials) == [0, 1, 2]
    assert all(c.finish_reason == "abort" for c in partials)
    by_id = {c.request_id: c for c in partials}
    assert len(by_id[0].response) == len(by_id[1].response) == 8 and len(by_id[2].response) == 0

    engine.load_weights(weights[1], version=1)
    assert engine.stats().version == 1
    for c in partials:
        engine.add(c.as_request(sp))
    out = run(engine)
    # the price of the abort: both partial samples prefilled again with their 8 generated tokens (11 + 12)
    assert engine.stats().prefilled_tokens == 7 + 11 + 12 + 5
    # The continuation must be exactly what the new weights produce from the same partial sample.
    fresh = engine_with(weights[1], version=1)
    for c in partials:
        fresh.add(c.as_request(sp))
    want = run(fresh)
    for i, c in out.items():
        k = len(by_id[i].response)
        assert len(c.response) == 30 and c.finish_reason == "length"
        np.testing.assert_array_equal(c.response[:k], by_id[i].response)
        np.testing.assert_array_equal(c.logprobs[:k], by_id[i].logprobs)
        assert (c.versions[:k] == 0).all() and (c.versions[k:] == 1).all()
        np.testing.assert_array_equal(c.response, want[i].response)
        assert_parity(c, 1.0, {0: referees[0], 1: referees[1]})
    assert sum(set(c.versions.tolist()) == {0, 1} for c in out.values()) == 2


def test_prefix_counts_towards_max_new_tokens(weights):
    engine = engine_with(weights[0])
    p = np.arange(3, dtype=np.int32)
    prefix = np.array([5, 6, 7, 8], np.int32)
    engine.add(Request(0, p, SamplingParams(max_new_tokens=4), prefix, np.full(4, -1.5, np.float32),
                       np.zeros(4, np.int32)))
    engine.add(Request(1, p, SamplingParams(max_new_tokens=6), prefix))      # no log-probs: not generated
    out = run(engine)
    assert out[0].finish_reason == "length" and out[0].response.tolist() == [5, 6, 7, 8]
    assert out[1].response[:4].tolist() == [5, 6, 7, 8] and len(out[1].response) == 6
    assert out[1].versions.tolist()[:4] == [-1] * 4 and (out[1].versions[4:] == 0).all()


def test_sleep_and_wake_resume_the_same_samples(weights):
    rng = np.random.default_rng(7)
    reqs = [Request(i, prompt(rng, 5 + i), SamplingParams(max_new_tokens=25)) for i in range(3)]
    straight = engine_with(weights[0])
    for r in reqs:
        straight.add(r)
    want = run(straight)
    engine = engine_with(weights[0])
    for r in reqs:
        engine.add(r)
    for _ in range(6):
        engine.step()
    engine.sleep()
    assert engine.stats().queued == 3 and engine.stats().running == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake()
    got = run(engine)
    for i in range(3):
        np.testing.assert_array_equal(got[i].response, want[i].response)
        np.testing.assert_allclose(got[i].logprobs, want[i].logprobs, atol=TOL)


# --------------------------------------------------------------------------------------------
# Errors and construction
# --------------------------------------------------------------------------------------------

def test_bad_settings_get_a_one_line_error(weights):
    """What this engine refuses beyond the requests and weights every engine refuses (the conformance
    suite, tests/helpers/engine_conformance.py, runs those here too)."""
    engine = engine_with(weights[0], max_model_len=32, kv_budget_tokens=64)
    with pytest.raises(ValueError, match="request 5: top_p") as e:
        engine.add(Request(5, np.arange(3, dtype=np.int32), SamplingParams(top_p=0.0)))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rollout.max_model_len = 300: must be ≤ rollout.kv_budget_tokens"):
        engine_with(weights[0], max_model_len=300, kv_budget_tokens=200)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine_with(weights[0], max_model_len=512, kv_budget_tokens=1024)


def test_factory_builds_from_the_rollout_section(weights):
    cfg = RolloutConfig(max_concurrency=3, kv_budget_tokens=500, max_model_len=0, temperature=0.8, top_p=0.9,
                        max_new_tokens=12)
    model = make_model(0)
    engine = build_engine(model, cfg, device="cpu", seed=3, version=2)
    assert isinstance(engine, TorchEngine)
    assert (engine.max_concurrency, engine.kv_budget_tokens, engine.max_model_len, engine.seed, engine.version) == \
        (3, 500, 256, 3, 2)   # max_model_len 0 = the model's 256 positions
    sp = sampling_params(cfg, stop_ids=(4,))
    assert sp == SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, stop_ids=(4,))
    engine.add(Request(0, np.arange(4, dtype=np.int32), sp))
    c = run(engine)[0]
    assert (c.versions == 2).all() and len(c.response) <= 12
    with pytest.raises(ConfigError, match="rollout.engine"):
        build_engine(model, RolloutConfig(engine="vllm"), device="cpu")
    with pytest.raises(ConfigError, match="rollout.max_model_len = 4096: must be ≤ rollout.kv_budget_tokens"):
        load(None, ["rollout.max_model_len=4096", "rollout.kv_budget_tokens=2048"], check_files=False)
