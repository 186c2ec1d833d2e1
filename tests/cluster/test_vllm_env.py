"""The vLLM engine from the main suite: its tests run in their own environment (.venv-vllm, built
by tools/vllm_env.sh), and where vLLM is absent the factory and the config say so in one line.

Without the venv the environment test is skipped, unless REFLOW_REQUIRE_VLLM=1 (CI builds the venv
first), where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from conftest import ROOT
from reflow_hpc.config import ConfigError, RolloutConfig, load
from reflow_hpc.rollout.factory import build_engine

VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# The modules that need vLLM, run in its environment.
MODULES = ("tests/cluster/test_vllm_engine.py", "tests/cluster/test_vllm_tensor_parallel.py")
TIMEOUT_S = 1500     # measured ≈ 8 min on 2 cores; a hung engine fails the test instead of the suite


def test_vllm_conformance_in_its_own_env(policy_dir):
    if not VENV_PYTHON.exists():
        why = f"{VENV_PYTHON} is missing: run tools/vllm_env.sh to build the vLLM environment"
        if os.environ.get("REFLOW_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["REFLOW_TEST_POLICY"] = policy_dir                # one warm start for both environments
    args = [str(VENV_PYTHON), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "vllm", *MODULES]
    try:
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-6000:]
        pytest.fail(f"vLLM tests did not finish in {TIMEOUT_S} s:\n{out.decode(errors='replace') if isinstance(out, bytes) else out}")
    tail = (r.stdout[-8000:] + "\n" + r.stderr[-4000:]).strip()
    assert r.returncode == 0, f"vLLM tests failed (exit {r.returncode}):\n{tail}"
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], tail


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this Python")
def test_missing_vllm_is_a_one_line_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.engine = \"vllm\": .*tools/vllm_env.sh") as e:
        build_engine(object(), RolloutConfig(engine="vllm"))
    assert "\n" not in str(e.value)


def test_vllm_engine_needs_top_p_one():
    with pytest.raises(ConfigError, match=r"rollout.top_p = 0.9: the vllm engine needs 1") as e:
        load(None, ["rollout.engine=vllm", "rollout.top_p=0.9"], check_files=False)
    assert "\n" not in str(e.value)
    cfg = load(None, ["rollout.engine=vllm", "rollout.vllm_kv_cache_gb=2", "rollout.vllm_enforce_eager=false"],
               check_files=False)
    assert (cfg.rollout.vllm_kv_cache_gb, cfg.rollout.vllm_enforce_eager) == (2.0, False)
    with pytest.raises(ConfigError, match="rollout.vllm_gpu_memory_utilization"):
        load(None, ["rollout.vllm_gpu_memory_utilization=1.5"], check_files=False)


def test_the_torch_engine_refuses_tensor_parallelism():
    with pytest.raises(ConfigError, match=r"resources.rollout_tp_size = 2: the torch engine runs one model per rank"):
        build_engine(object(), RolloutConfig(engine="torch"), tp=2)
