"""The GPU path as far as CPUs can check it: the cluster configs, the random-weight policy of the
1-GPU config, NVML telemetry's absence on CPU, and tools/gpu_check.py's code on CPU."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT, python_m, run_cmd
from reflow_hpc import config as C

BIG = str(ROOT / "configs" / "qwen3_8b_dapo_128gpu.toml")
SMALL = str(ROOT / "configs" / "qwen3_small_1gpu.toml")


def test_128_gpu_config_validates_without_its_files_and_holds_the_papers_settings():
    r = python_m("reflow_hpc.config", BIG, "--no-files")
    assert r.returncode == 0, r.stderr
    cfg = C.load(BIG, check_files=False)
    res = cfg.resources
    assert (res.workers, res.trainer_replicas, res.trainer_shard_size, res.rollout_instances) == (128, 8, 8, 64)
    # δ = 3 optimizer steps: the paper's δ = 1 counted in weight syncs made every 2 steps (README, Simulator).
    assert (cfg.reflow.mode, cfg.reflow.sigma, cfg.reflow.tau, cfg.reflow.delta, cfg.reflow.b_max,
            cfg.reflow.sync_every) == ("reflow", 0.5, 0.5, 3, 0, 1)
    assert C.notices(cfg) == []
    assert (cfg.trainer.batch_size, cfg.algorithm.group_size) == (512 * 16, 16)
    assert (cfg.rollout.engine, cfg.model.dtype, cfg.task.name) == ("vllm", "bfloat16", "math_boxed")


def test_128_gpu_config_with_files_checked_names_the_missing_model_in_one_line():
    r = python_m("reflow_hpc.config", BIG)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('config error: model.path = "models/Qwen3-8B"'), r.stderr


def test_128_gpu_config_reads_dapo_math_rows(tmp_path):
    """Its data keys read a row laid out as DAPO-Math-17k's (chat-message prompt, nested ground truth)."""
    from reflow_hpc.envs.math_boxed import load_rows
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the answer in \\boxed{{}}."}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
             "data_source": "math_dapo"} for i in range(5)]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = C.load(BIG, [f"data.path={path}"], check_files=False)
    got = load_rows(cfg)
    assert got[3][:2] == ("What is 3 + 3? Put the answer in \\boxed{}.", "6")
    assert got[3].messages == (("user", "What is 3 + 3? Put the answer in \\boxed{}."),)


def test_submit_dry_run_shows_the_128_gpu_job():
    r = python_m("reflow_hpc.submit", BIG, "--nodes", "16", "--dry-run")
    assert r.returncode == 0, r.stderr
    for line in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=USR2@180", "--mpi=pmi2"):
        assert line in r.stdout, (line, r.stdout)


def test_submit_dry_run_still_checks_every_other_rule():
    r = python_m("reflow_hpc.submit", BIG, "--nodes", "16", "--dry-run", "--set", "reflow.sigma=1.5")
    assert r.returncode == 2 and "reflow.sigma" in r.stderr, r.stderr


def test_1_gpu_config_validates_with_its_files():
    r = python_m("reflow_hpc.config", SMALL)
    assert r.returncode == 0, r.stderr
    cfg = C.load(SMALL)
    assert (cfg.resources.workers, cfg.reflow.mode, cfg.resources.device) == (1, "sync", "cuda")


def test_1_gpu_config_architecture_is_qwen3_0_6b():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    raw = json.loads((ROOT / "configs" / "arch" / "qwen3-0.6b.json").read_text())
    hf = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    n = sum(p.numel() for p in model.parameters())
    assert 590e6 < n < 600e6, n          # 0.6 B with tied embeddings


def test_random_policy_is_built_once_and_loads(tmp_path):
    """model.init_config: the architecture with random weights, saved as a Hugging Face directory."""
    from reflow_hpc.policy import load_policy
    from reflow_hpc.warmstart import ensure_policy
    raw = json.loads((ROOT / "configs" / "arch" / "qwen3-0.6b.json").read_text())
    raw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256)
    arch = tmp_path / "arch.json"
    arch.write_text(json.dumps(raw))
    model_dir = tmp_path / "model"
    cfg = C.load(SMALL, [f"model.init_config={arch}", f"model.path={model_dir}", "model.dtype=float32"])
    logs: list[str] = []
    assert ensure_policy(cfg, log=logs.append) == model_dir
    assert "random weights" in logs[0]
    model, tok = load_policy(model_dir)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 1000
    assert model.config.eos_token_id == tok.eos_token_id
    logs.clear()
    ensure_policy(cfg, log=logs.append)          # present: not built again
    assert logs == []


def test_init_config_and_warmstart_together_is_a_config_error():
    with pytest.raises(C.ConfigError, match="model.init_config"):
        C.load(SMALL, ["model.warmstart=true"])


def test_telemetry_is_absent_without_noise_on_cpu(capsys):
    from reflow_hpc.runtime.telemetry import GpuTelemetry, nvml_gpus, step_metrics
    assert GpuTelemetry.open("cpu", 0) is None
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert nvml_gpus() == []
    assert capsys.readouterr() == ("", "")
    assert step_metrics({1: {"util": 87.0, "power_w": 410.5}, 0: {"util": 3.0}}) == \
        {"gpu/util/0": 3.0, "gpu/util/1": 87.0, "gpu/power_w/1": 410.5}


def test_gpu_check_without_a_gpu_fails_loudly():
    r = run_cmd(["bash", str(ROOT / "tools" / "gpu_check.sh")], timeout=120)
    if r.returncode == 0:
        pytest.skip("a GPU is here: the check ran for real")
    assert r.returncode == 2, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["error"].startswith("no CUDA device")
    assert "FAILED" in r.stderr


@pytest.mark.slow
def test_gpu_check_code_runs_on_cpu():
    """Every check of the prepared GPU script, on CPU with a tiny model, so the script does not rot
    between the sessions that have a GPU."""
    r = run_cmd([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--allow-cpu", "--small", "--json-only"],
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    checks = out["checks"]
    assert set(checks) == {"engine", "trainer_bf16", "weight_sync", "telemetry", "throughput", "launch"}, checks
    assert checks["engine"]["logprob_max_gap"] < 1e-3
    assert checks["weight_sync"]["gloo"]["weights_equal"]
    assert checks["launch"]["steps"] == 4 and checks["launch"]["throughput_tokens_per_s"] > 0
    assert any("ran on CPU" in u for u in out["untested"])
