"""Supervised warm start of the tiny CPU policy, so that RL on CPU starts from a policy that sometimes
succeeds (GRPO learns nothing from groups whose rewards are all zero).

    python -m reflow_hpc.warmstart CONFIG [--set section.key=value ...] [--out DIR]

Rules:

- The policy is built from the ``model.tiny_*`` keys (:func:`reflow_hpc.policy.build_tiny_policy`)
  and trained on the worked solutions of the configured task (``arithmetic`` or ``calculator_tool``;
  a task without worked solutions, such as ``math_boxed``, falls back to ``arithmetic`` with the same
  knobs). Prompts come from the train split, indices 0, 1, 2, … in order.
- Loss: mean cross-entropy over the solution tokens and the closing eos; prompt tokens and tool
  observations are masked, as in RL. AdamW, linear warm-up then cosine decay to zero.
- ``warmstart.unverifiable_fraction`` of the worked solutions write their answer line as
  ``answer: N`` instead of ``#### N``, which the reward does not accept: a systematic gap in the
  warm start that RL with the verifier's reward can close (the CPU main job uses it, see README).
- Each group of ``warmstart.length_buckets`` batches is drawn at once, sorted by length and cut into
  batches again (in a seeded order), so the long tail does not pad every batch.
- Held-out greedy exact match (the task's reward on the eval split, multi-turn episodes driven with
  their tool observations) is printed before and after training.
- Deterministic given ``warmstart.seed`` (not ``run.seed``: RL runs of several seeds start from the
  same policy) and ``warmstart.threads``. The result is saved atomically to
  ``model.path`` (or ``--out``).

``ensure_policy(cfg)`` is what the launcher calls on rank 0 before any rank loads the model: a no-op
when ``model.path`` holds a ``config.json``, a warm start when ``model.warmstart`` is true, a config
error otherwise. A warm start also writes its recipe (``RECIPE``: the settings the weights depend
on) next to the model; when ``model.warmstart`` is true and the current config asks for another
recipe, ``ensure_policy`` refuses the stale model instead of silently training from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError, TrainerConfig, config_changes, load, main_guard
from .envs import Prompt, Task, make_task, prompt_token_ids
from .envs.arithmetic import ANSWER_MARKER
from .evaluation import exact_match
from .private import write_atomic

if TYPE_CHECKING:
    from .config import Config

IGNORE = -100   # label of tokens without loss (the torch cross-entropy convention)


@dataclass
class WarmstartResult:
    path: Path
    parameters: int
    steps: int
    exact_match_before: float
    exact_match_after: float
    final_loss: float
    seconds: float


def sft_task(cfg: "Config") -> Task:
    """The configured task when it has worked solutions, else arithmetic with the same knobs."""
    task = make_task(cfg)
    if task.solution_segments(task.prompt(0)) is not None:
        return task
    fallback = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, name="arithmetic"))
    return make_task(fallback)


# The answer line the verifier rejects, written instead of ANSWER_MARKER by warmstart.unverifiable_fraction
# of the worked solutions.
UNVERIFIABLE_MARKER = "answer:"


def sft_example(tokenizer: Any, task: Task, prompt: Prompt, chat_template: bool = False,
                unverifiable: bool = False) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one worked solution; labels are IGNORE on prompt and observations.
    ``unverifiable``: its answer line is written with UNVERIFIABLE_MARKER, which the reward rejects."""
    ids = prompt_token_ids(tokenizer, prompt, chat_template)
    labels = [IGNORE] * len(ids)
    segments = task.solution_segments(prompt)
    if unverifiable:
        segments = [(text.replace(ANSWER_MARKER, UNVERIFIABLE_MARKER) if generated else text, generated)
                    for text, generated in segments]
    for text, generated in segments:
        seg = tokenizer.encode(text, add_special_tokens=False)
        ids += seg
        labels += seg if generated else [IGNORE] * len(seg)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def _batches(cfg: "Config", tokenizer: Any, task: Task):
    """Yield (input_ids, labels, attention_mask) tensors for every step, length-bucketed."""
    import torch

    w = cfg.warmstart
    group = w.batch_size * w.length_buckets
    rng = random.Random(f"warmstart:{cfg.run.seed}")
    style = random.Random(f"warmstart-style:{cfg.run.seed}")
    index = 0
    for first in range(0, w.steps, w.length_buckets):
        examples = [sft_example(tokenizer, task, task.prompt(index + i), cfg.task.chat_template,
                                unverifiable=style.random() < w.unverifiable_fraction)
                    for i in range(group)]
        index += group
        examples.sort(key=lambda e: len(e[0]))
        chunks = [examples[i:i + w.batch_size] for i in range(0, group, w.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks[: w.steps - first]:
            width = max(len(ids) for ids, _ in chunk)
            pad = tokenizer.pad_token_id
            ids = torch.tensor([e[0] + [pad] * (width - len(e[0])) for e in chunk])
            labels = torch.tensor([e[1] + [IGNORE] * (width - len(e[1])) for e in chunk])
            mask = torch.tensor([[1] * len(e[0]) + [0] * (width - len(e[0])) for e in chunk])
            yield ids, labels, mask


def warmstart(cfg: "Config", out: str | Path | None = None, log=print) -> WarmstartResult:
    """Build the tiny policy, SFT-train it, save it to ``out`` (default ``model.path``)."""
    import torch

    # Everything the warm start draws (initial weights, prompts, order) follows warmstart.seed.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=cfg.warmstart.seed))

    from .policy import build_tiny_policy, num_parameters, save_policy
    from .train.optim import build_optimizer, build_scheduler

    w = cfg.warmstart
    path = Path(out if out is not None else cfg.model.path)
    threads = torch.get_num_threads()
    torch.set_num_threads(w.threads)
    t0 = time.perf_counter()
    try:
        task = sft_task(cfg)
        model, tokenizer = build_tiny_policy(cfg)
        n_params = num_parameters(model)
        log(f"warm start: tiny Qwen3 with {n_params / 1e6:.2f} M parameters, vocabulary {len(tokenizer)}, "
            f"task {task.name}, {w.steps} steps of {w.batch_size} worked solutions")
        held_out = [task.prompt(i, "eval") for i in range(w.eval_prompts)]

        def measure() -> float:
            return exact_match(model, tokenizer, task, held_out, w.max_new_tokens, w.eval_batch_size,
                               cfg.task.chat_template)

        before = measure()
        torch.manual_seed(cfg.run.seed)
        # The trainer's AdamW and schedule, with a cosine decay to zero at the last step.
        schedule = TrainerConfig(steps=max(1, w.steps), lr=w.lr, weight_decay=w.weight_decay,
                                 warmup_steps=min(w.warmup_steps, max(1, w.steps)), schedule="cosine",
                                 min_lr_ratio=0.0)
        opt = build_optimizer(model.named_parameters(), schedule)
        sched = build_scheduler(opt, schedule)
        model.train()
        loss_value = float("nan")
        for step, (ids, labels, mask) in enumerate(_batches(cfg, tokenizer, task), start=1):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if w.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), w.grad_clip)
            opt.step()
            sched.step()
            loss_value = loss.item()
            if w.log_every and (step % w.log_every == 0 or step == w.steps):
                log(f"warm start step {step}/{w.steps}: loss {loss_value:.4f}, "
                    f"{time.perf_counter() - t0:.0f} s")
        model.eval()
        after = measure()
        if held_out:
            log(f"warm start: held-out greedy exact match {before:.3f} before, {after:.3f} after "
                f"({len(held_out)} {task.name} prompts)")
        else:
            log("warm start: no held-out check (warmstart.eval_prompts = 0)")
        save_policy(model, tokenizer, path)
        write_atomic(path / RECIPE, json.dumps(recipe(cfg), indent=1, sort_keys=True) + "\n")
        log(f"warm start: saved {path} in {time.perf_counter() - t0:.0f} s")
        return WarmstartResult(path, n_params, w.steps, before, after, loss_value, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


RECIPE = "reflow_warmstart.json"
# Warm-start keys that only change what is printed, not the weights.
_NOT_IN_RECIPE = ("eval_prompts", "eval_batch_size", "max_new_tokens", "log_every")


def recipe(cfg: "Config") -> dict:
    """The settings a warm-started policy's weights are determined by, shaped like ``to_dict``'s."""
    return {"task": dataclasses.asdict(cfg.task),
            "warmstart": {k: v for k, v in dataclasses.asdict(cfg.warmstart).items() if k not in _NOT_IN_RECIPE},
            "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k.startswith("tiny_")}}


def ensure_policy(cfg: "Config", log=print) -> Path:
    """``model.path``; when it holds no model, warm-started first (``model.warmstart``) or built with random
    weights (``model.init_config``)."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        if cfg.model.warmstart and (path / RECIPE).is_file():
            now = json.loads(json.dumps(recipe(cfg)))          # tuples as JSON lists, like the saved one
            # A key added since the policy was saved counts at its default, so a newer version of this
            # package does not refuse a policy that its new keys, left at their defaults, would not change.
            saved = json.loads(json.dumps(recipe(type(cfg)())))
            for section, values in json.loads((path / RECIPE).read_text()).items():
                saved.setdefault(section, {}).update(values)
            changed = [k for k, _, _ in config_changes(saved, now)]
            if changed:
                raise ConfigError("model.path", cfg.model.path,
                                  f"holds a policy warm-started with other settings ({', '.join(changed)} differ); "
                                  f"delete it to warm-start again, set another model.path, or use it as it is with "
                                  f"model.warmstart = false")
        return path
    if cfg.model.init_config:
        from .policy import build_random_policy, num_parameters, save_policy
        model, tokenizer = build_random_policy(cfg)
        log(f"policy: {num_parameters(model) / 1e6:.1f} M parameters with random weights, the architecture of "
            f"{cfg.model.init_config}, saved to {path}")
        return save_policy(model, tokenizer, path)
    if not cfg.model.warmstart:
        why = "no such directory" if not path.exists() else "no config.json in this directory"
        raise ConfigError("model.path", cfg.model.path,
                          f"{why} (a Hugging Face model directory; or set model.warmstart = true)")
    return warmstart(cfg, log=log).path


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.warmstart",
                                 description="Build the tiny CPU policy and warm-start it on worked solutions.")
    ap.add_argument("config", nargs="?", help="TOML file (omit for the defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", help="output directory (default: model.path)")
    args = ap.parse_args(argv)
    # Idle OpenMP threads sleep instead of spinning: on a shared CPU node a spinning barrier makes
    # a 2-thread step 10x slower (must be set before torch starts its thread pool).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def go() -> int:
        # The model directory is what this command creates, so it is not required to exist.
        cfg = load(args.config, args.overrides, check_files=False)
        warmstart(cfg, args.out)
        return 0

    return main_guard(go)


if __name__ == "__main__":
    sys.exit(main())
