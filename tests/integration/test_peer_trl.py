"""The TRL peer: our config mapped onto GRPOConfig, and a two-step run on a tiny random policy."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from reflow_hpc import config as C
from conftest import ROOT

pytestmark = pytest.mark.usefixtures("offline")

pytest.importorskip("trl", reason="TRL belongs to the bench extra")

_spec = importlib.util.spec_from_file_location("peer_trl", ROOT / "tools" / "peer_trl.py")
peer_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_trl)

# A policy of a few 10k parameters and a run of two steps: the test checks the plumbing, not learning.
TINY = ["model.tiny_hidden_size=32", "model.tiny_layers=1", "model.tiny_heads=2", "model.tiny_kv_heads=1",
        "model.tiny_head_dim=16", "model.tiny_intermediate_size=64",
        "algorithm.group_size=4", "trainer.batch_size=8", "trainer.micro_batch_size=4",
        "rollout.max_new_tokens=12", "run.eval_prompts=4", "task.max_terms=3"]


def test_grpo_config_mirrors_our_keys(tmp_path):
    import trl

    cfg = C.load(None, ["model.warmstart=true", "algorithm.group_size=4", "trainer.batch_size=16",
                        "trainer.micro_batch_size=4", "trainer.lr=2e-5", "algorithm.clip_low=0.1",
                        "algorithm.clip_high=0.28", "algorithm.kl_coef=0.01", "rollout.temperature=0.9",
                        "rollout.top_p=0.95", "rollout.max_new_tokens=40", "run.seed=7", "trainer.grad_clip=0.5",
                        "trainer.schedule=cosine", "trainer.warmup_steps=2", "trainer.min_lr_ratio=0.2"],
                 check_files=False)
    args = trl.GRPOConfig(**peer_trl.trl_args(cfg, steps=5, output_dir=str(tmp_path)))
    assert args.num_generations == 4 and args.generation_batch_size == 16
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    assert args.steps_per_generation == args.gradient_accumulation_steps and args.num_iterations == 1
    assert (args.learning_rate, args.epsilon, args.epsilon_high, args.beta) == (2e-5, 0.1, 0.28, 0.01)
    assert (args.temperature, args.top_p, args.top_k, args.max_completion_length) == (0.9, 0.95, 0, 40)
    assert (args.seed, args.max_steps, args.max_grad_norm, args.loss_type) == (7, 5, 0.5, "dapo")
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.2} and args.warmup_steps == 2
    assert args.use_cpu and not args.use_vllm and not args.bf16 and args.report_to == []
    assert not args.shuffle_dataset and args.scale_rewards == "group"
    notes = peer_trl.mismatches(cfg)
    assert any("warm-up" in n for n in notes) and any("cosine" in n for n in notes)


@pytest.mark.parametrize("name, loss_type, level, eps", [
    ("grpo", "dapo", "token", (0.2, 0.2)), ("dr_grpo", "dr_grpo", "token", (0.2, 0.2)),
    ("dapo", "dapo", "token", (0.2, 0.28)), ("gspo", "grpo", "sequence", (3e-4, 4e-4)),
    ("cispo", "cispo", "token", (0.2, 5.0))])
def test_each_objective_maps_to_trls_loss(name, loss_type, level, eps, tmp_path):
    import trl

    cfg = C.load(None, ["model.warmstart=true", f"algorithm.name={name}"], check_files=False)
    args = trl.GRPOConfig(**peer_trl.trl_args(cfg, steps=1, output_dir=str(tmp_path)))
    assert (args.loss_type, args.importance_sampling_level) == (loss_type, level)
    assert (args.epsilon, args.epsilon_high) == pytest.approx(eps)


@pytest.mark.parametrize("override, key", [("trainer.batch_size=10", "trainer.batch_size"),
                                           ("trainer.micro_batch_size=3", "trainer.micro_batch_size"),
                                           ("algorithm.group_size=1", "algorithm.group_size"),
                                           ("algorithm.name=rloo", "algorithm.name"),
                                           ("algorithm.loss_agg=seq_mean_token_sum", "algorithm.loss_agg")])
def test_configs_trl_cannot_run_name_the_key(override, key, tmp_path):
    with pytest.raises(C.ConfigError) as e:     # a group of one is refused at load, the others by TRL's rules
        cfg = C.load(None, ["model.warmstart=true", "trainer.batch_size=8", "algorithm.group_size=4",
                            "trainer.micro_batch_size=4", override], check_files=False)
        peer_trl.trl_args(cfg, steps=1, output_dir=str(tmp_path))
    assert e.value.key == key


def test_trl_tokenizes_prompts_like_our_engine():
    from reflow_hpc.envs import make_task, prompt_token_ids
    from reflow_hpc.envs.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    task = make_task(C.load(None, ["model.warmstart=true"], check_files=False))
    texts = [task.prompt(i).text for i in range(4)]
    # GRPOTrainer tokenizes raw-text prompts with processing_class(text=prompts).
    assert tok(text=texts)["input_ids"] == [prompt_token_ids(tok, t) for t in texts]


def test_two_steps_end_to_end(tmp_path, capsys, monkeypatch):
    from reflow_hpc.envs import make_task, prompt_token_ids
    from reflow_hpc.policy import build_tiny_policy, save_policy

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")   # main() sets it for the process otherwise
    overrides = TINY + [f"model.path={tmp_path / 'policy'}"]
    model, tok = build_tiny_policy(C.load(None, overrides + ["model.warmstart=true"], check_files=False))
    save_policy(model, tok, tmp_path / "policy")
    cfg_file = tmp_path / "peer.toml"
    cfg_file.write_text("")
    rc = peer_trl.main([str(cfg_file), "--steps", "2", "--threads", "1", "--json",
                        *[a for o in overrides for a in ("--set", o)]])
    stdout = capsys.readouterr().out
    assert rc == 0
    out = json.loads(stdout.strip().splitlines()[-1])
    assert set(peer_trl.RESULT_KEYS) <= set(out) and out["system"] == "trl"
    assert out["steps"] == 2 and out["samples"] == 2 * 8          # one generation batch per step
    assert 8 * 2 <= out["generated_tokens"] <= 2 * 8 * 12
    # Trained tokens = prompt + completion tokens; prompts are train indices 0..3, each in a group of 4.
    task = make_task(C.load(None, overrides, check_files=False))
    prompt_tokens = sum(4 * len(prompt_token_ids(tok, task.prompt(i, "train").text)) for i in range(4))
    assert out["trained_tokens"] == prompt_tokens + out["generated_tokens"]
    assert math.isclose(out["throughput_tokens_per_s"], out["trained_tokens"] / out["wall_seconds"])
    for k in ("reward_first_steps", "reward_last_steps", "eval/task/start_reward", "eval/task/final_reward",
              "eval/held_out/start_greedy", "eval/held_out/final_greedy"):
        assert 0.0 <= out[k] <= 1.0
    assert "task reward" in stdout and "held-out reward" in stdout and "trl step 2/2" in stdout


def test_missing_policy_is_a_config_error(tmp_path):
    cfg = C.load(None, TINY + [f"model.path={tmp_path / 'none'}", "model.warmstart=false"], check_files=False)
    with pytest.raises(C.ConfigError) as e:
        peer_trl.run_trl(cfg, steps=1, log=lambda _: None)
    assert e.value.key == "model.path"
