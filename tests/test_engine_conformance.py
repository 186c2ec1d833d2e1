"""The shared engine conformance checks (tests/engine_conformance.py) run against the torch engine.

The same checks run against the vLLM engine in its own environment (tests/test_vllm_engine.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import engine_conformance as conf
from reflow_hpc.rollout.torch_engine import TorchEngine


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as a CPU worker runs (tiny ops on 2 shared cores are slower with more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> conf.Harness:
    model, _ = conf.tiny_policy(tmp_path_factory.mktemp("conformance") / "policy")
    base = conf.snapshot(model)

    def reset(state: dict, version: int) -> TorchEngine:
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        return TorchEngine(m, seed=0, version=version, **conf.LIMITS)

    return conf.Harness(reset=reset, base=base, template=model, vocab=model.config.vocab_size)


@pytest.fixture(scope="module")
def new_weights(harness) -> dict:
    return conf.perturbed(harness.base, scale=0.05, seed=1)


def test_completions_valid_and_reproducible(harness):
    conf.check_completions_valid_and_reproducible(harness)


def test_logprobs_match_the_trainer(harness):
    conf.check_logprobs_match_the_trainer(harness)


def test_abort_then_resume_across_a_weight_load(harness, new_weights):
    conf.check_abort_then_resume_across_a_weight_load(harness, new_weights)


def test_weight_load_while_requests_run(harness, new_weights):
    conf.check_weight_load_while_requests_run(harness, new_weights)


def test_loaded_weights_are_the_weights_used(harness):
    conf.check_loaded_weights_are_the_weights_used(harness, conf.perturbed(harness.base, scale=0.1, seed=2))


def test_prefix_counts_towards_max_new_tokens(harness):
    conf.check_prefix_counts_towards_max_new_tokens(harness)


def test_cap_and_stats(harness):
    conf.check_cap_and_stats(harness)


def test_bad_input_gets_a_one_line_error(harness):
    conf.check_bad_input_gets_a_one_line_error(harness)


def test_every_check_runs_here():
    names = {n.removeprefix("test_") for n in globals() if n.startswith("test_") and n != "test_every_check_runs_here"}
    assert names == {n.removeprefix("check_") for n in conf.ALL_CHECKS}
