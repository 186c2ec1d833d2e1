"""Conformance checks of the rollout :class:`~reflow_hpc.rollout.engine.Engine` interface, written once
and run against every engine: ``tests/integration/test_engine_conformance.py`` (torch engine, main suite) and
``tests/cluster/test_vllm_engine.py`` (vLLM, in ``.venv-vllm``).

A check gets a :class:`Harness`, whose ``reset(state, version)`` hands out an engine that is empty,
runs ``state`` (Hugging Face names) at ``version``, has its concurrency cap at ``max_concurrency``
and the :data:`LIMITS` below. The torch engine builds a new one each time; the vLLM engine is built
once per module and reset by ``abort_all`` + ``load_weights``, so counters in its stats are
compared as differences.

The referee is the trainer: ``reflow_hpc.train.loss.token_logprobs`` on one forward pass of a
``transformers`` model holding the same weights over prompt + response, at the sample's temperature
(1 for greedy). Engines must match it within :data:`TOL` (absolute, per token, float32 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from reflow_hpc.rollout.engine import Completion, Engine, Request, SamplingParams

LIMITS = dict(max_concurrency=4, kv_budget_tokens=1024, max_model_len=128)
TOL = 1e-4
MAX_STEPS = 2000        # every run loop is bounded: a stuck engine fails, it does not hang


# --------------------------------------------------------------------------------------------
# The policy and its weights
# --------------------------------------------------------------------------------------------

def tiny_policy(directory: Path):
    """(model, saved directory): the tiny Qwen3 of a default Config, its weights widened (std 0.1)
    so that sampling distributions are far from uniform, saved as a Hugging Face directory."""
    from reflow_hpc.config import Config
    from reflow_hpc.policy import build_tiny_policy, load_policy, save_policy

    model, tokenizer = build_tiny_policy(Config())
    widened = perturbed(model.state_dict(), scale=0.1, seed=0)
    model.load_state_dict(widened)
    save_policy(model, tokenizer, directory)
    model, _ = load_policy(directory)
    return model, directory


def snapshot(model: torch.nn.Module) -> dict:
    """A copy of ``model.state_dict()`` in which names that share a tensor (tied embeddings) still do."""
    return perturbed(model.state_dict(), scale=0.0, seed=0)


def perturbed(state: dict, scale: float, seed: int) -> dict:
    """``state`` plus Gaussian noise of std ``scale`` on every matrix (norm weights kept). Names that
    share one tensor (tied embeddings) keep sharing one value."""
    g = torch.Generator().manual_seed(seed)
    out, done = {}, {}
    for name, value in state.items():
        key = (value.data_ptr(), tuple(value.shape))
        if key not in done:
            v = value.detach().clone()
            if v.ndim >= 2 and scale:
                v += torch.randn(v.shape, generator=g, dtype=v.dtype) * scale
            done[key] = v
        out[name] = done[key]
    return out


@dataclass
class Harness:
    reset: Callable[[dict, int], Engine]
    base: dict                               # the weights the policy directory holds
    template: torch.nn.Module                # a model of the architecture (its weights are replaced)
    vocab: int
    _referees: dict = field(default_factory=dict)

    def referee(self, state: dict) -> torch.nn.Module:
        """A trainer-side model holding ``state`` (cached by identity; the cache keeps ``state`` alive
        so that its id is not reused)."""
        hit = self._referees.get(id(state))
        if hit is None or hit[0] is not state:
            import copy
            m = copy.deepcopy(self.template)
            m.load_state_dict(state)
            hit = self._referees[id(state)] = (state, m.eval())
        return hit[1]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def reloading_reset(engine: Engine) -> Callable[[dict, int], Engine]:
    """A :attr:`Harness.reset` for an engine built once (vLLM: one per process): abort everything, load
    the state, restore the cap."""
    def reset(state: dict, version: int) -> Engine:
        engine.abort_all()
        engine.load_weights(state, version)
        engine.set_concurrency_cap(engine.max_concurrency)
        assert not engine.has_unfinished()
        return engine
    return reset


def prompt(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n).astype(np.int32)


def run(engine: Engine, into: dict | None = None) -> dict[int, Completion]:
    """Step until the engine is empty; completions by request id (each id at most once)."""
    out = {} if into is None else into
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return out
        for c in engine.step():
            assert c.request_id not in out, f"request {c.request_id} finished twice"
            out[c.request_id] = c
        s = engine.stats()
        assert s.kv_tokens_used <= s.kv_tokens_budget, s
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps: {engine.stats()}")


@torch.no_grad()
def recompute(model: torch.nn.Module, c: Completion, temperature: float) -> np.ndarray:
    """The trainer's log-prob of every response token: token_logprobs(logits, targets, T)."""
    from reflow_hpc.train.loss import token_logprobs

    ids = torch.from_numpy(np.concatenate([c.prompt, c.response]).astype(np.int64))[None]
    p, n = len(c.prompt), len(c.response)
    logits = model(ids).logits[:, p - 1:p - 1 + n]
    logp, _ = token_logprobs(logits, ids[:, p:], temperature if temperature > 0 else 1.0)
    return logp[0].numpy()


def assert_matches_trainer(c: Completion, temperature: float, models: dict[int, torch.nn.Module]) -> float:
    """Tokens of each version match the trainer's log-probs under that version's weights; max error."""
    assert len(c.response) == len(c.logprobs) == len(c.versions)
    worst = 0.0
    for version, model in models.items():
        mine = c.versions == version
        if mine.any():
            err = float(np.abs(recompute(model, c, temperature)[mine] - c.logprobs[mine]).max())
            assert err < TOL, f"request {c.request_id} version {version}: log-prob error {err:.2e} ≥ {TOL}"
            worst = max(worst, err)
    assert np.isin(c.versions, list(models)).all(), c.versions
    return worst


def assert_valid(c: Completion, sp: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """Lengths, finish reason and stop ids of one finished completion."""
    n = len(c.response)
    assert len(c.prompt) == prompt_len and 1 <= n <= sp.max_new_tokens
    assert len(c.logprobs) == len(c.versions) == n
    assert np.isfinite(c.logprobs).all() and (c.logprobs <= 1e-6).all()
    stops = set(sp.stop_ids)
    assert not stops.intersection(c.response[:-1].tolist()), "generation went on past a stop id"
    if c.finish_reason == "stop":
        assert int(c.response[-1]) in stops
    else:
        assert c.finish_reason == "length", c.finish_reason
        assert n == sp.max_new_tokens or prompt_len + n == max_model_len


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

SETTINGS = [1.0, 0.7, 1.3, 0.0]      # temperatures; 0 = greedy


def check_completions_valid_and_reproducible(h: Harness) -> None:
    """Same prompts and seed: valid completions, the same tokens on a second run; stop ids end a
    request and are kept as its last token."""
    rng = np.random.default_rng(0)
    reqs = [Request(i, prompt(rng, h.vocab, 2 + 3 * i),
                    SamplingParams(temperature=SETTINGS[i % 4], max_new_tokens=8 + 6 * i, stop_ids=(5, 6)))
            for i in range(8)]
    results = []
    for _ in range(2):
        engine = h.reset(h.base, 0)
        for r in reqs:
            engine.add(r)
        results.append(run(engine))
    first, second = results
    assert sorted(first) == list(range(8))
    for r in reqs:
        c = first[r.request_id]
        assert_valid(c, r.sampling, len(r.prompt), LIMITS["max_model_len"])
        assert (c.versions == 0).all()
        np.testing.assert_array_equal(c.prompt, r.prompt)
        np.testing.assert_array_equal(c.response, second[r.request_id].response)
        np.testing.assert_allclose(c.logprobs, second[r.request_id].logprobs, atol=TOL)

    # A stop id taken from a free run ends the same request at its first occurrence, and is kept.
    engine = h.reset(h.base, 0)
    p = prompt(rng, h.vocab, 6)
    engine.add(Request(7, p, SamplingParams(temperature=1.0, max_new_tokens=40)))
    free = run(engine)[7]
    assert free.finish_reason == "length" and len(free.response) == 40
    stop = int(free.response[10])
    cut = int(np.flatnonzero(free.response == stop)[0])
    engine.add(Request(7, p, SamplingParams(temperature=1.0, max_new_tokens=40, stop_ids=(h.vocab + 5, stop))))
    stopped = run(engine)[7]
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.response, free.response[:cut + 1])
    np.testing.assert_allclose(stopped.logprobs, free.logprobs[:cut + 1], atol=TOL)


def check_logprobs_match_the_trainer(h: Harness) -> float:
    """Every token's log-prob equals the trainer's recomputation; greedy picks the argmax. Returns
    the largest error seen."""
    engine = h.reset(h.base, 0)
    rng = np.random.default_rng(1)
    temps = {}
    for i in range(8):
        temps[i] = SETTINGS[i % 4]
        engine.add(Request(i, prompt(rng, h.vocab, 1 + 4 * i), SamplingParams(temperature=temps[i],
                                                                               max_new_tokens=12 + 6 * i)))
    out = run(engine)
    model = h.referee(h.base)
    worst = 0.0
    for i, c in out.items():
        assert c.finish_reason == "length" and len(c.response) == 12 + 6 * i
        worst = max(worst, assert_matches_trainer(c, temps[i], {0: model}))
        if temps[i] == 0:
            with torch.no_grad():
                ids = torch.from_numpy(np.concatenate([c.prompt, c.response]).astype(np.int64))[None]
                logits = model(ids).logits[0, len(c.prompt) - 1:-1]
            np.testing.assert_array_equal(logits.argmax(-1).numpy(), c.response)
    return worst


def mid_run(h: Harness, seed: int, n: int, sp: SamplingParams, steps: int) -> Engine:
    """An engine at the base weights (version 0) and a cap of 2, given ``n`` requests of random prompts
    (4 + i tokens, from ``seed``) and stepped ``steps`` times, none of them finished yet."""
    engine = h.reset(h.base, 0)
    engine.set_concurrency_cap(2)
    rng = np.random.default_rng(seed)
    for i in range(n):
        engine.add(Request(i, prompt(rng, h.vocab, 4 + i), sp))
    for _ in range(steps):
        assert engine.step() == []
    return engine


def check_abort_then_resume_across_a_weight_load(h: Harness, new: dict) -> None:
    """abort_all returns partials and empties the engine; after load_weights the continuations keep
    their prefix (tokens, log-probs, version 0) and their new tokens carry version 1, each matching
    the trainer under the weights of its version."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=30)
    engine = mid_run(h, 2, 3, sp, 8)
    partials = engine.abort_all()
    s = engine.stats()
    assert not engine.has_unfinished() and s.running == 0 and s.queued == 0 and s.kv_tokens_used == 0
    assert sorted(c.request_id for c in partials) == [0, 1, 2]
    assert all(c.finish_reason == "abort" for c in partials)
    by_id = {c.request_id: c for c in partials}
    # the cap let two in; each sampled one token per step
    assert len(by_id[0].response) == len(by_id[1].response) == 8 and len(by_id[2].response) == 0
    for c in partials:
        assert (c.versions == 0).all()
        if len(c.response):
            assert_matches_trainer(c, 1.0, {0: h.referee(h.base)})

    engine.load_weights(new, version=1)
    assert engine.version == 1 and engine.stats().version == 1
    for c in partials:
        engine.add(c.as_request(sp))
    out = run(engine)
    assert sorted(out) == [0, 1, 2]
    models = {0: h.referee(h.base), 1: h.referee(new)}
    for i, c in out.items():
        k = len(by_id[i].response)
        assert c.finish_reason == "length" and len(c.response) == 30
        np.testing.assert_array_equal(c.response[:k], by_id[i].response)
        np.testing.assert_array_equal(c.logprobs[:k], by_id[i].logprobs)
        assert (c.versions[:k] == 0).all() and (c.versions[k:] == 1).all()
        assert_matches_trainer(c, 1.0, models)
    assert sum(set(c.versions.tolist()) == {0, 1} for c in out.values()) == 2


def check_weight_load_while_requests_run(h: Harness, new: dict) -> None:
    """load_weights between steps: requests go on under the new weights, from the next token on."""
    engine = h.reset(h.base, 0)
    rng = np.random.default_rng(3)
    for i in range(3):
        engine.add(Request(i, prompt(rng, h.vocab, 3 + 2 * i), SamplingParams(temperature=0.9, max_new_tokens=24)))
    out: dict[int, Completion] = {}
    for _ in range(6):
        for c in engine.step():
            out[c.request_id] = c
    items = list(new.items())
    engine.load_weights(iter(items), version=1)
    run(engine, out)
    models = {0: h.referee(h.base), 1: h.referee(new)}
    for c in out.values():
        assert len(c.response) == 24 and (np.diff(c.versions) >= 0).all()
        assert (c.versions[:6] == 0).all() and (c.versions[6:] == 1).all()
        assert_matches_trainer(c, 0.9, models)


def check_abort_ends_only_those_requests(h: Harness) -> None:
    """abort(ids) ends a running and a queued request without returning them; the others run to their end
    as the trainer would sample them, and ids the engine does not hold are ignored."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=20)
    engine = mid_run(h, 6, 4, sp, 5)
    engine.abort([1, 3, 99])                  # 1 runs, 3 is queued behind the cap, 99 was never added
    st = engine.stats()                       # at once, not after the next step
    assert (st.running, st.queued) == (1, 1), st
    out = run(engine)
    assert sorted(out) == [0, 2]
    for c in out.values():
        assert c.finish_reason == "length" and len(c.response) == 20
        assert_matches_trainer(c, 1.0, {0: h.referee(h.base)})
    engine.add(Request(1, prompt(np.random.default_rng(7), h.vocab, 4), sp))     # an aborted id may come back
    assert sorted(run(engine)) == [1]


@torch.no_grad()
def continued(old: torch.nn.Module, new: torch.nn.Module, c: Completion, kept: int) -> np.ndarray:
    """Log-probs of the response tokens after the first ``kept`` when ``old`` computed the KV of every token
    before them and ``new`` goes on from there over that cache: an in-flight weight update's referee."""
    from reflow_hpc.train.loss import token_logprobs

    ids = torch.from_numpy(np.concatenate([c.prompt, c.response]).astype(np.int64))[None]
    cut = len(c.prompt) + kept - 1        # the KV the engine held: every token but the last sampled one
    cache = old(ids[:, :cut], use_cache=True).past_key_values
    logits = new(ids[:, cut:-1], past_key_values=cache).logits
    logp, _ = token_logprobs(logits, ids[:, cut + 1:], 1.0)
    return logp[0].numpy()


def check_inflight_weight_load_keeps_kv(h: Harness, new: dict) -> None:
    """sync_kv = "keep": a load between steps leaves running requests where they are. Their later tokens
    are what the new weights give over the KV the old weights computed (not a re-prefill: that would
    differ), a request admitted after the load is the new weights' alone, and reloading the weights a
    run already holds leaves every token as an undisturbed run samples it."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)

    def generate(load: dict | None) -> dict[int, Completion]:
        if load is None:
            return run(mid_run(h, 5, 3, sp, 0))
        engine = mid_run(h, 5, 3, sp, 8)
        # The mode is flipped on the engine at hand (vLLM allows one engine per process); its prefix
        # cache, which keep turns off at construction, cannot matter here: no two prompts share a block.
        engine.sync_kv = "keep"
        try:
            engine.load_weights(load, version=1)
            return run(engine)
        finally:
            engine.sync_kv = "recompute"

    out, same, plain = generate(new), generate(h.base), generate(None)
    old_m, new_m = h.referee(h.base), h.referee(new)
    stale = 0.0
    for i in (0, 1):
        c = out[i]
        assert len(c.response) == 24 and (c.versions[:8] == 0).all() and (c.versions[8:] == 1).all()
        err = float(np.abs(recompute(old_m, c, 1.0)[:8] - c.logprobs[:8]).max())
        assert err < TOL, f"request {i}: version-0 log-prob error {err:.2e}"
        err = float(np.abs(continued(old_m, new_m, c, 8) - c.logprobs[8:]).max())
        assert err < TOL, f"request {i}: log-probs after the load are not the new weights over the kept KV ({err:.2e})"
        stale = max(stale, float(np.abs(recompute(new_m, c, 1.0)[8:] - c.logprobs[8:]).max()))
    assert stale > 10 * TOL, "a re-prefill gives the same log-probs: the check would not see the KV being kept"
    assert (out[2].versions == 1).all()
    assert_matches_trainer(out[2], 1.0, {1: new_m})
    for i, c in same.items():
        np.testing.assert_array_equal(c.response, plain[i].response)
        np.testing.assert_allclose(c.logprobs, plain[i].logprobs, atol=TOL)


def check_loaded_weights_are_the_weights_used(h: Harness, other: dict) -> None:
    """After loading other weights, greedy output is the argmax path of a fresh model holding them,
    and its log-probs match it (and not the old weights)."""
    engine = h.reset(other, 5)
    rng = np.random.default_rng(4)
    prompts = [prompt(rng, h.vocab, 5 + i) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add(Request(i, p, SamplingParams(temperature=0.0, max_new_tokens=20)))
    out = run(engine)
    fresh, old = h.referee(other), h.referee(h.base)
    differs = 0.0
    for i, p in enumerate(prompts):
        c = out[i]
        assert (c.versions == 5).all()
        want = p.astype(np.int64).tolist()
        with torch.no_grad():
            for _ in range(20):
                want.append(int(fresh(torch.tensor([want])).logits[0, -1].argmax()))
        np.testing.assert_array_equal(c.response, np.asarray(want[len(p):]))
        assert_matches_trainer(c, 0.0, {5: fresh})
        differs = max(differs, float(np.abs(recompute(old, c, 1.0) - c.logprobs).max()))
    assert differs > 100 * TOL, "the old weights give the same log-probs: the check would not see a stale model"


def check_prefix_counts_towards_max_new_tokens(h: Harness) -> None:
    engine = h.reset(h.base, 0)
    p = np.arange(3, dtype=np.int32) + 10
    prefix = np.array([15, 16, 17, 18], np.int32)
    engine.add(Request(0, p, SamplingParams(max_new_tokens=4), prefix, np.full(4, -1.5, np.float32),
                       np.zeros(4, np.int32)))
    engine.add(Request(1, p, SamplingParams(max_new_tokens=6), prefix))      # no log-probs: not generated
    out = run(engine)
    assert out[0].finish_reason == "length" and out[0].response.tolist() == prefix.tolist()
    assert out[0].logprobs.tolist() == [-1.5] * 4 and out[0].versions.tolist() == [0] * 4
    assert out[1].response[:4].tolist() == prefix.tolist() and len(out[1].response) == 6
    assert out[1].versions.tolist()[:4] == [-1] * 4 and (out[1].versions[4:] == 0).all()
    # the generated tokens follow the prefix they were conditioned on
    c = out[1]
    err = np.abs(recompute(h.referee(h.base), c, 1.0)[4:] - c.logprobs[4:]).max()
    assert err < TOL, f"continuation log-prob error {err:.2e}"


def check_cap_and_stats(h: Harness) -> None:
    """At most ``cap`` requests run; queued ones wait in FIFO order; stats add up."""
    engine = h.reset(h.base, 0)
    before = engine.stats()
    engine.set_concurrency_cap(2)
    rng = np.random.default_rng(5)
    lengths = {i: 6 + 3 * i for i in range(5)}
    for i, n in lengths.items():
        engine.add(Request(i, prompt(rng, h.vocab, 4), SamplingParams(max_new_tokens=n)))
    order: list[int] = []
    out: dict[int, Completion] = {}
    engine.step()
    s = engine.stats()
    assert (s.running, s.queued) == (2, 3), s
    assert 0 < s.kv_tokens_used <= s.kv_tokens_budget and s.kv_tokens_budget >= LIMITS["kv_budget_tokens"]
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for c in engine.step():
            out[c.request_id] = c
            order.append(c.request_id)
        assert engine.stats().running <= 2
    assert order == [0, 1, 2, 3, 4]
    assert {i: len(c.response) for i, c in out.items()} == lengths
    s = engine.stats()
    assert (s.running, s.queued, s.kv_tokens_used) == (0, 0, 0)
    assert s.generated_tokens - before.generated_tokens >= sum(lengths.values())
    assert s.preemptions == before.preemptions


def check_bad_input_gets_a_one_line_error(h: Harness) -> None:
    import pytest

    engine = h.reset(h.base, 0)
    v, m = h.vocab, LIMITS["max_model_len"]
    engine.add(Request(1, np.arange(3, dtype=np.int32)))
    cases = [
        (Request(1, np.arange(3, dtype=np.int32)), "request 1: .*already"),
        (Request(2, np.zeros(0, np.int32)), "request 2: prompt must be a non-empty"),
        (Request(3, np.array([1, v], np.int32)), rf"request 3: token ids must be in \[0, {v}\)"),
        (Request(4, np.zeros(m + 1, np.int32)), f"request 4: .*{m + 1} tokens exceeds rollout.max_model_len"),
        (Request(5, np.arange(3, dtype=np.int32), SamplingParams(temperature=-1.0)), "request 5: temperature"),
        (Request(6, np.arange(3, dtype=np.int32), response_prefix=np.arange(2), prefix_logprobs=np.zeros(3)),
         "request 6: response_prefix has 2 tokens"),
    ]
    for req, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            engine.add(req)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown tensor 'model.nope'") as e:
        engine.load_weights({"model.nope": torch.zeros(1)}, version=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))], version=1)
    assert engine.version == 0
    # The engine is still whole: the queued request runs under the weights it had.
    out = run(engine)
    assert list(out) == [1] and len(out[1].response) == SamplingParams().max_new_tokens
    assert_matches_trainer(out[1], 1.0, {0: h.referee(h.base)})


ALL_CHECKS = ("check_completions_valid_and_reproducible", "check_logprobs_match_the_trainer",
              "check_abort_then_resume_across_a_weight_load", "check_weight_load_while_requests_run",
              "check_inflight_weight_load_keeps_kv", "check_abort_ends_only_those_requests",
              "check_loaded_weights_are_the_weights_used", "check_prefix_counts_towards_max_new_tokens",
              "check_cap_and_stats", "check_bad_input_gets_a_one_line_error")


class ConformanceTests:
    """Every check above as a pytest test. A test module subclasses this (``class TestConformance``)
    and provides a module fixture ``harness``; the tensor-parallel program calls the checks itself."""

    @pytest.fixture(scope="class")
    def new_weights(self, harness) -> dict:
        return perturbed(harness.base, scale=0.05, seed=1)

    def test_completions_valid_and_reproducible(self, harness):
        check_completions_valid_and_reproducible(harness)

    def test_logprobs_match_the_trainer(self, harness):
        worst = check_logprobs_match_the_trainer(harness)
        print(f"largest log-prob error against the trainer: {worst:.2e} (tolerance {TOL})")

    def test_abort_then_resume_across_a_weight_load(self, harness, new_weights):
        check_abort_then_resume_across_a_weight_load(harness, new_weights)

    def test_weight_load_while_requests_run(self, harness, new_weights):
        check_weight_load_while_requests_run(harness, new_weights)

    def test_abort_ends_only_those_requests(self, harness):
        check_abort_ends_only_those_requests(harness)

    def test_inflight_weight_load_keeps_kv(self, harness, new_weights):
        check_inflight_weight_load_keeps_kv(harness, new_weights)

    def test_loaded_weights_are_the_weights_used(self, harness):
        check_loaded_weights_are_the_weights_used(harness, perturbed(harness.base, scale=0.1, seed=2))

    def test_prefix_counts_towards_max_new_tokens(self, harness):
        check_prefix_counts_towards_max_new_tokens(harness)

    def test_cap_and_stats(self, harness):
        check_cap_and_stats(harness)

    def test_bad_input_gets_a_one_line_error(self, harness):
        check_bad_input_gets_a_one_line_error(harness)

    def test_every_check_runs_here(self):
        names = {n.removeprefix("test_") for n in dir(self) if n.startswith("test_")}
        assert {n.removeprefix("check_") for n in ALL_CHECKS} <= names
