"""The shared engine conformance checks (tests/helpers/engine_conformance.py) run against the torch engine.

The same checks run against the vLLM engine in its own environment (tests/cluster/test_vllm_engine.py).
"""

from __future__ import annotations

import copy

import pytest

import engine_conformance as conf
from reflow_hpc.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> conf.Harness:
    model, _ = conf.tiny_policy(tmp_path_factory.mktemp("conformance") / "policy")
    base = conf.snapshot(model)

    def reset(state: dict, version: int) -> TorchEngine:
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        return TorchEngine(m, seed=0, version=version, **conf.LIMITS)

    return conf.Harness(reset=reset, base=base, template=model, vocab=model.config.vocab_size)


class TestConformance(conf.ConformanceTests):
    """The shared checks (tests/helpers/engine_conformance.py) on this engine."""
