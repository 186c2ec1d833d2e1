"""TRL's ``GRPOTrainer`` as a peer system: the same tiny policy, task, reward and hyper-parameters.

    python tools/peer_trl.py CONFIG [--set section.key=value ...] [--steps N] [--max-seconds S]
                             [--threads 2] [--json]

:func:`run_trl` trains our policy with TRL in this process and measures it the way our runs are
measured, so that ``tools/bench_modes.py`` can put it in the same table as our four modes.

Rules:

- Policy: ``model.path`` loaded with :func:`reflow_hpc.policy.load_policy` (warm-started first by
  :func:`reflow_hpc.warmstart.ensure_policy` when the directory is missing). Model and tokenizer
  are handed to TRL as objects; nothing is downloaded (``HF_HUB_OFFLINE=1``).
- Prompts: the train split of the configured task at indices 0, 1, 2, … in that order (the order
  in which our coordinator opens groups), ``batch_size / group_size`` prompts per step. Prompts are
  raw text tokenized like :func:`reflow_hpc.envs.prompt_token_ids` (the tokenizer's bos rule), or
  the prompt's chat messages, whole, when ``task.chat_template`` is true. Only single-turn tasks: TRL's tool loop
  is not our environment protocol.
- Reward: ``task.reward(prompt, completion)`` on the completion text with special tokens removed,
  TRL's only reward function (weight 1).
- Hyper-parameters (ours → TRL): ``algorithm.group_size`` → ``num_generations``;
  ``trainer.batch_size`` completions per optimizer update → ``generation_batch_size`` with
  ``per_device_train_batch_size = trainer.micro_batch_size`` and as many accumulation steps (one
  generation and one update per step, ``num_iterations = 1``); ``trainer.lr`` →
  ``learning_rate``; ``algorithm.clip_low/clip_high`` → ``epsilon/epsilon_high``;
  ``algorithm.kl_coef`` → ``beta`` (k3 estimator in both); ``algorithm.adv_std_norm`` →
  ``scale_rewards = "group" | "none"``; ``rollout.temperature/top_p/max_new_tokens`` →
  ``temperature/top_p/max_completion_length`` (``top_k = 0``, stop at eos);
  ``trainer.grad_clip`` → ``max_grad_norm``; ``weight_decay``, ``adam_beta1/2``, ``adam_eps`` →
  AdamW (``adamw_torch``); ``trainer.schedule/warmup_steps/min_lr_ratio`` → ``constant``,
  ``constant_with_warmup`` or ``cosine_with_min_lr``; ``run.seed`` → ``seed``. The objective
  (``algorithm.name`` with its aggregation, :data:`TRL_OBJECTIVES`) → ``loss_type``,
  ``importance_sampling_level`` and the clip range: grpo and dapo (token_mean) → ``"dapo"``, the
  clipped per-token terms summed and divided by the loss tokens of the whole batch; dr_grpo →
  ``"dr_grpo"``; gspo → ``"grpo"`` at sequence level; cispo → ``"cispo"`` (without our token mask,
  ``algorithm.cispo_clip_low``, which cannot bind there: TRL's ratio is 1); the others, and an
  aggregation TRL has no loss type for, are config errors (tests/unit/test_objectives.py holds
  each pair equal on the same inputs). Parameters in ``model.dtype`` without autocast, no
  gradient checkpointing, CPU, no vLLM, no logging to external services. :func:`mismatches` lists
  what differs for a given config although its keys were mapped.
- By design, TRL is a synchronous on-policy trainer in one process: it generates each step's batch
  with ``generate`` (static batches) on the policy it trains, so its importance ratio is exactly 1
  (it detaches its own log-probs instead of using the sampler's), and it has no workers, replay,
  staleness or weight sync; ``threads`` torch threads run everything.
- Measurements: ``wall_seconds`` is the wall time of ``trainer.train()`` only (the evaluations
  are outside it); ``trained_tokens`` are the prompt + completion tokens of every trained batch
  (no padding) and ``throughput_tokens_per_s = trained_tokens / wall_seconds``, the definition
  of our ``throughput_tokens_per_s``; ``generated_tokens`` are the completion tokens (eos
  included); ``reward_first_steps`` / ``reward_last_steps`` are the mean training reward of the
  first and last tenth of the steps (at least one, at most 50), as in our run summary;
  ``eval/<set>/start_*`` and ``eval/<set>/final_*`` are the mean reward of ``run.eval_samples``
  samples per prompt (``_reward``) and the greedy exact match (``_greedy``) of the start and the
  trained policy on the prompt sets of ``reflow_hpc.evaluation``, exactly as our runs are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from reflow_hpc.config import ConfigError, load, main_guard

if TYPE_CHECKING:
    from reflow_hpc.config import Config

SYSTEM = "trl"
RESULT_KEYS = ("system", "steps", "wall_seconds", "throughput_tokens_per_s", "reward_first_steps",
               "reward_last_steps", "eval/task/start_reward", "eval/task/final_reward", "trained_tokens")


# (algorithm.name, aggregation) → (TRL loss_type, importance_sampling_level); the clip range of each is
# in trl_loss. Equal losses on the same inputs: tests/unit/test_objectives.py (TRL_CASES).
TRL_OBJECTIVES = {
    ("grpo", "token_mean"): ("dapo", "token"),
    ("grpo", "seq_mean_token_mean"): ("grpo", "token"),
    ("dr_grpo", "seq_mean_token_sum_norm"): ("dr_grpo", "token"),
    ("dapo", "token_mean"): ("dapo", "token"),
    ("gspo", "seq_mean_token_mean"): ("grpo", "sequence"),
    ("cispo", "token_mean"): ("cispo", "token"),
}


def trl_loss(cfg: "Config") -> dict[str, Any]:
    """``GRPOConfig`` keywords of the objective: loss_type, importance_sampling_level, epsilon (low) and
    epsilon_high; a config error naming algorithm.name (or loss_agg) for one TRL has no loss for."""
    from reflow_hpc.config import objective_traits

    a = cfg.algorithm
    agg = objective_traits(cfg)[1]
    pair = TRL_OBJECTIVES.get((a.name, agg))
    if pair is None:
        names = sorted({n for n, _ in TRL_OBJECTIVES})
        if a.name not in names:
            raise ConfigError("algorithm.name", a.name, "TRL's GRPOTrainer has no such loss; mapped: " + ", ".join(names))
        raise ConfigError("algorithm.loss_agg", a.loss_agg, f"TRL has no loss type for {a.name} with {agg}")
    low, high = {"dapo": (a.clip_low, a.dapo_clip_high), "gspo": (a.gspo_clip_low, a.gspo_clip_high),
                 "cispo": (a.clip_low, a.cispo_clip_high)}.get(a.name, (a.clip_low, a.clip_high))
    return {"loss_type": pair[0], "importance_sampling_level": pair[1], "epsilon": low, "epsilon_high": high}


def _check(cfg: "Config") -> None:
    """What TRL cannot run, as one-line config errors naming our key."""
    g, b, mb = cfg.algorithm.group_size, cfg.trainer.batch_size, cfg.trainer.micro_batch_size
    if g < 2:
        raise ConfigError("algorithm.group_size", g, "TRL's GRPOTrainer needs at least 2 samples per prompt")
    if b % g:
        raise ConfigError("trainer.batch_size", b, f"TRL needs whole groups per step: a multiple of "
                                                   f"algorithm.group_size ({g})")
    if b % mb:
        raise ConfigError("trainer.micro_batch_size", mb, f"TRL accumulates equal micro-batches: must divide "
                                                          f"trainer.batch_size ({b})")


def trl_args(cfg: "Config", steps: int, output_dir: str) -> dict[str, Any]:
    """Keyword arguments of ``trl.GRPOConfig`` that mirror our config (module docstring)."""
    import trl

    _check(cfg)
    t, a, r = cfg.trainer, cfg.algorithm, cfg.rollout
    # transformers 5 renamed gradient checkpointing; the old name still works but warns.
    fields = trl.GRPOConfig.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    if t.schedule == "cosine":
        schedule, schedule_kwargs = "cosine_with_min_lr", {"min_lr_rate": t.min_lr_ratio}
    else:
        schedule, schedule_kwargs = ("constant_with_warmup" if t.warmup_steps else "constant"), None
    return dict(
        output_dir=output_dir, max_steps=steps, seed=cfg.run.seed, data_seed=cfg.run.seed,
        use_cpu=True, use_vllm=False, bf16=False, fp16=False, **{checkpointing: False},
        report_to="none", save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0, shuffle_dataset=False,
        # One generation of batch_size completions and one optimizer update per step.
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=t.batch_size // t.micro_batch_size,
        num_generations=a.group_size, num_iterations=1,
        learning_rate=t.lr, lr_scheduler_type=schedule, lr_scheduler_kwargs=schedule_kwargs,
        warmup_steps=t.warmup_steps, optim="adamw_torch", weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=t.adam_eps, max_grad_norm=t.grad_clip,
        **trl_loss(cfg), beta=a.kl_coef,
        scale_rewards="group" if a.adv_std_norm else "none", mask_truncated_completions=False,
        temperature=r.temperature, top_p=r.top_p, top_k=0, max_completion_length=r.max_new_tokens,
        model_init_kwargs={"dtype": cfg.model.dtype} if a.kl_coef > 0 else None,   # the reference model
    )


def mismatches(cfg: "Config") -> list[str]:
    """Where TRL's run differs from ours although the keys were mapped (empty = none for this config)."""
    t, a = cfg.trainer, cfg.algorithm
    out = []
    if a.adv_std_norm:
        out.append(f"advantage std: TRL divides by the sample std (n-1) + 1e-4, ours by the population std (n) "
                   f"+ algorithm.adv_eps ({a.adv_eps:g})")
    if t.warmup_steps:
        out.append("warm-up: TRL's factor at update s is s/W (0 at the first update), ours (s+1)/W")
    if t.schedule == "cosine":
        out.append("cosine: TRL reaches lr·min_lr_ratio after the last update, ours at the last update")
    if cfg.rollout.max_model_len:
        out.append("rollout.max_model_len: TRL bounds only the completion (max_completion_length)")
    if a.clip_ratio_c or a.is_cap or a.entropy_coef:
        out.append("algorithm.clip_ratio_c, is_cap, entropy_coef: not mapped (TRL's ratio is 1 on its own samples)")
    if a.kl_coef and a.kl_estimator != "k3":
        out.append(f"algorithm.kl_estimator = {a.kl_estimator}: TRL uses k3")
    return out


def _prompt_row(cfg: "Config", prompt: Any) -> dict:
    return {"prompt": prompt.chat() if cfg.task.chat_template else prompt.raw(), "prompt_id": prompt.prompt_id}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def run_trl(cfg: "Config", *, steps: int | None = None, max_seconds: float | None = None, threads: int = 2,
            log: Callable[[str], Any] = print) -> dict:
    """Train ``model.path`` with TRL's GRPOTrainer on our task; the measurements of the module docstring.

    ``steps`` defaults to ``trainer.steps``; ``max_seconds`` ends training after the first step
    that finishes past that wall time (``steps`` then counts the steps done).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    from reflow_hpc.envs import make_task, prompt_token_ids
    from reflow_hpc.policy import load_policy, num_parameters
    from reflow_hpc.evaluation import evaluate
    from reflow_hpc.warmstart import ensure_policy

    steps = cfg.trainer.steps if steps is None else steps
    if steps < 1:
        raise ConfigError("--steps", steps, "must be ≥ 1")
    _check(cfg)
    task = make_task(cfg)
    if task.multi_turn:
        raise ConfigError("task.name", cfg.task.name, "TRL peer runs single-turn tasks only (no tool observations)")

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ensure_policy(cfg, log=log)
        model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, "cpu")
        group = cfg.algorithm.group_size
        per_step = cfg.trainer.batch_size // group
        prompts = [task.prompt(i, "train") for i in range(steps * per_step)]
        by_id = {p.prompt_id: p for p in prompts}
        prompt_len = {p.prompt_id: len(prompt_token_ids(tokenizer, p, cfg.task.chat_template)) for p in prompts}

        step_rewards: list[float] = []
        counts = {"generated": 0, "trained": 0, "samples": 0}

        def task_reward(completions, completion_ids, prompt_id, **_) -> list[float]:
            """Our task's reward of each completion; also counts the tokens of the batch."""
            rewards = [task.reward(by_id[i], text) for i, text in zip(prompt_id, completions)]
            generated = sum(len(ids) for ids in completion_ids)
            counts["generated"] += generated
            counts["trained"] += generated + sum(prompt_len[i] for i in prompt_id)
            counts["samples"] += len(rewards)
            step_rewards.append(_mean(rewards))
            return rewards

        every = max(1, steps // 10)
        t0 = [0.0]

        class Progress(TrainerCallback):
            """Log every tenth of the run; stop after max_seconds."""

            def on_step_end(self, args, state, control, **kw):
                elapsed = time.perf_counter() - t0[0]
                if max_seconds is not None and elapsed >= max_seconds:
                    control.should_training_stop = True
                if state.global_step % every == 0 or state.global_step == steps or control.should_training_stop:
                    log(f"trl step {state.global_step}/{steps}: reward {step_rewards[-1]:.3f}, "
                        f"{counts['trained'] / elapsed:.0f} tok/s, {elapsed:.0f} s")
                return control

        log(f"trl {trl.__version__} GRPOTrainer: {num_parameters(model) / 1e6:.2f} M parameters, task {task.name}, "
            f"{steps} steps of {cfg.trainer.batch_size} samples ({per_step} prompts × {group}), "
            f"{threads} threads")
        scores = evaluate(cfg, task, tokenizer, {"start": model})   # before training changes the model

        with tempfile.TemporaryDirectory(prefix="peer_trl-") as out, warnings.catch_warnings():
            # Deprecation notices that transformers raises inside TRL: noise in a benchmark's output.
            warnings.simplefilter("ignore", FutureWarning)
            trainer = trl.GRPOTrainer(
                model=model, reward_funcs=task_reward, args=trl.GRPOConfig(**trl_args(cfg, steps, out)),
                train_dataset=Dataset.from_list([_prompt_row(cfg, p) for p in prompts]),
                processing_class=tokenizer, callbacks=[Progress()])
            trainer.remove_callback(PrinterCallback)   # our Progress lines instead of raw log dicts
            t0[0] = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - t0[0]
            done = trainer.state.global_step
            trained_model = trainer.model
        scores.update(evaluate(cfg, task, tokenizer, {"final": trained_model}))

        k = max(1, min(50, len(step_rewards) // 10))
        return {
            "system": SYSTEM, "trl_version": trl.__version__, "steps": done, "wall_seconds": wall,
            "throughput_tokens_per_s": counts["trained"] / wall if wall > 0 else math.nan,
            "reward_first_steps": _mean(step_rewards[:k]), "reward_last_steps": _mean(step_rewards[-k:]),
            **scores,
            "trained_tokens": counts["trained"], "generated_tokens": counts["generated"],
            "samples": counts["samples"], "threads": threads, "mismatches": mismatches(cfg),
        }
    finally:
        torch.set_num_threads(old_threads)


def table(result: dict) -> str:
    rows = [("system", f"{result['system']} {result.get('trl_version', '')} GRPOTrainer"),
            ("steps", f"{result['steps']}"),
            ("wall seconds", f"{result['wall_seconds']:.1f}"),
            ("trained tokens", f"{result['trained_tokens']} ({result['generated_tokens']} generated)"),
            ("throughput tok/s", f"{result['throughput_tokens_per_s']:.0f}"),
            ("training reward", f"{result['reward_first_steps']:.3f} first steps -> "
                                f"{result['reward_last_steps']:.3f} last steps"),
            ("task reward", f"{result['eval/task/start_reward']:.3f} start -> "
                            f"{result['eval/task/final_reward']:.3f} trained ({result['eval/task/prompts']} prompts)"),
            ("held-out reward", f"{result['eval/held_out/start_reward']:.3f} start -> "
                                f"{result['eval/held_out/final_reward']:.3f} trained "
                                f"({result['eval/held_out/prompts']} distinct texts)")]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"differs from ours: {m}" for m in result.get("mismatches", [])]
    return "\n".join(lines)


def run_trl_held(config: str, sets: list[str], *, cpu_share: float, steps: int | None = None,
                 max_seconds: float | None = None, timeout: float = 3600) -> dict:
    """:func:`run_trl` in a subprocess held to ``cpu_share`` cores (``resources.cpu_quota`` of every
    rank times the ranks: the same total CPU as our runs get; 0 = no quota). Returns its result."""
    import subprocess

    from reflow_hpc.runtime import cpuquota

    cmd = [sys.executable, str(Path(__file__).resolve()), config, "--json",
           "--threads", str(max(1, math.ceil(cpu_share)) if cpu_share > 0 else 2)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if max_seconds is not None:
        cmd += ["--max-seconds", str(max_seconds)]
    for s in sets:
        cmd += ["--set", s]
    group = f"reflow-trl-{os.getpid()}"
    held = cpu_share > 0 and cpuquota.available() is None
    if held:
        cmd = [sys.executable, "-m", "reflow_hpc.runtime.cpuquota", str(cpu_share), group, "--", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PMI_RANK="0"))
    finally:
        if held:
            cpuquota.remove(group, 1)
    if r.returncode != 0:
        raise RuntimeError(f"TRL peer failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result["cpu_share"] = cpu_share if held else None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/peer_trl.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: trainer.steps)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop after the step that passes this wall time")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args(argv)
    # Idle OpenMP threads sleep instead of spinning (shared CPU node); set before torch starts its pool.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def go() -> int:
        result = run_trl(load(args.config, args.overrides), steps=args.steps, max_seconds=args.max_seconds,
                         threads=args.threads)
        print(table(result))
        if args.json:
            print(json.dumps(result))
        return 0

    return main_guard(go)


if __name__ == "__main__":
    sys.exit(main())
