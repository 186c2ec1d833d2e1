"""Time to reward: the four modes from the same warm start, for the same training-time budget, over seeds.

    python tools/bench_learning.py [CONFIG] [--modes sync,one_step_off,fully_async,reflow] [--seeds 0,1,2]
                                   [--algorithms grpo,dapo,...] [--budget-s 120] [--eval-every-steps 20]
                                   [--cpu-quota 0.45] [--peer trl] [--out DIR] [--summarise-only]
                                   [--plot FILE.png] [--set section.key=value ...] [--json]

ReFlow's claim is *the same final reward, reached sooner*. Each (mode, seed) is one real run
(``python -m reflow_hpc.run``: MPI ranks, engine, trainer, shards) of CONFIG (default: the main job,
``configs/cpu_tiny.toml``) from its warm-started policy, stopped after ``--budget-s`` seconds of
training (``trainer.time_budget_s``). The modes are their namesakes (``tools/bench_modes.py``:
every mode syncs after every step, the baselines train without replay) and every rank is held to
``--cpu-quota`` of one core, so a waiting rank loses its time as on a GPU. The runs snapshot their
weights every ``--eval-every-steps`` steps and score each snapshot after training, on the same task
prompts never drawn in training (``eval/task/reward``: the mean reward of ``run.eval_samples``
samples per prompt), stamped with the training time and the optimizer step at which it was taken;
with ``--set run.eval_curve=held_out`` on the distinct held-out texts instead (``eval/held_out``: the
coding workload, whose task prompts repeat the short problems its warm start already solves).
``--summarise-only`` reads the runs already in ``--out`` (named as this benchmark names them:
``learn-<arm>-s<seed>``) instead of making them.

**Same prompts, same start, per seed.** Every run of a seed starts from the one warm-started policy
at ``model.path`` (made once, before the first run; the warm start follows ``warmstart.seed``, not
``run.seed``, and a run refuses a policy warm-started with other settings) and draws the same prompt
sequence: the coordinator dispatches prompt indices 0, 1, 2, … in order and the task maps an index to a
prompt by ``run.seed`` alone (``envs/task.py``); the eval prompts (``eval/task``) are the prompts at
indices from 2^40 on, which no run reaches (``evaluation.prompt_sets``), likewise drawn by ``run.seed``
and sampled with seed ``run.seed + 1``, so the start policy's eval reward is the same in every mode of a
seed (and the seeds differ in prompts as well as in sampling). Modes differ only in which samples train
when (and the baselines in σ = 0).

**Targets and per-seed times.** Two reward levels, both from the reference arm (``sync``; with
``--algorithms`` and no sync arm, grpo's): ``sync_final``, the mean over seeds of its final eval reward,
and ``sync_gain_90``, its mean start reward plus 90 % of its mean gain. For every run and level the
*time to target* is the first training time at which the run's own eval curve (linear between its
snapshots) reaches the level; the *steps to target* the same on the optimizer-step axis. A run that
never reaches it is **censored**: counted at the budget (or at its last snapshot, when the step in
flight ended after the budget) on the time axis, and at its last snapshot's step on the step axis;
both are lower bounds, so a mean with censored seeds flatters the mode, and the censored seeds are
counted and named. Per arm and level: the mean, standard error and median over seeds of those
times; then, paired by seed with the reference, the mean ± s.e. (and median) of the per-seed
differences (arm − reference, seconds or steps) and of the per-seed ratios (arm ÷ reference; a seed
whose reference time is 0 is left out of the ratios). The time axis carries system and algorithmic
effects together, the step axis the algorithmic ones alone (the paper's Fig. 12 and 13).

**Resolution.** The eval set is ``eval/<set>/prompts`` × ``run.eval_samples`` samples; one eval point's
standard error is at most √(p(1−p)/n) at the observed reward p (the binomial bound: the prompts are
fixed, samples of a prompt independent); at a target level, divided by the reference curve's slope
where its seeds cross that level (median), it is the crossing time's jitter from eval noise alone —
large where the curve is flat, as near its final reward. The smallest difference in
final reward the seeds resolve is 2 × the s.e. of the paired per-seed difference; a 10 % difference in
time to reward is resolved when 2 × the s.e. of the paired ratio is at most 0.10 (else the line says
about how many seeds would be, scaling the s.e. by 1/√n). More eval prompts: ``--set run.eval_prompts=N``.

**Per run.** From its metrics.jsonl and summary.json: steps done, samples generated per sample trained
((``buffer/created`` − ``buffer/pending``) ÷ ``buffer/trained_samples`` at the last step), training uses
per trained sample, the mean replay fraction in each quarter of the run's steps, the generation rate
(``rollout/generated_tokens_per_s``, weighted by step time), the training rate (trainer tokens ÷ step
time; and ÷ the trainer's busy time), idle ratios; and per rank (``reflow_hpc/runtime/rankstats.py``,
summary.json's ``ranks``): busy generation rate (tokens ÷ seconds with requests in flight), CPU share of
a core (cgroup CPU seconds, or the process's where the cgroup does not account them, ÷ wall seconds),
threads, and tokens per CPU second of generation ÷ the machine probe run in this process before and after
each run (``machine_probe.json`` in its directory: the machine's own speed drifts between runs). A run
whose generation or training rate differs by more than 25 % from the median of its arm's runs is flagged (a line ``FLAG: …``), and so is an arm whose per-rank busy generation rate or thread
count differs by more than 25 % from the reference's: every run is held to the same ``--cpu-quota``
(equal caps), so a rank should generate as fast in every mode; so is a rank with no CPU cgroup or above
its cap; and so is an arm whose runs met a machine more than 10 % faster or slower than the reference's
(the median probe): a CPU share buys more work in one hour than in another on a shared VM, so arms made
in separate invocations, one after the other, compare machines as much as modes. A run made before the runtime kept rank records shows ``-`` there. Where the task has a form
rule (``eval/<set>/well_formed``), each run's share of well-formed eval answers at its start, lowest
and final snapshot is shown, and a run whose final share is more than 0.05 below its start is flagged:
its late rewards then measure a broken answer form, not the mode's speed. The *pool's busy share* is the
ranks' generating plus training seconds (``generate_s`` + ``train_s`` of their records) ÷ (ranks × training
time): 1 − it is the pool's capacity lost to waiting, and in sync 1 ÷ it bounds how much faster any mode that
overlaps generation with training can make a step of the same work.

**Outputs.** Tables of the above, a PNG with two panels (eval reward against training time and against
optimizer steps, mean ± s.e. over seeds, with both levels), and with ``--json`` one JSON object (the
last line): ``modes`` (per arm: ``final_reward``, ``final_reward_se``, ``final_reward_median``,
``start_reward``, ``seeds``, ``final_vs_ref`` — paired ``diff``, ``diff_se``, ``diff_median``, ``pairs`` —,
``time_to_90pct_of_sync_gain_s`` (mean per-seed time, censored as above), ``time_over_sync`` (mean
per-seed ratio to the reference at that level), and ``targets.<level>.<time|steps>``: ``per_seed``,
``censored``, ``censored_seeds``, ``mean``, ``se``, ``median`` and ``vs_ref``: ``pairs``, ``diff``,
``diff_se``, ``diff_median``, ``ratio``, ``ratio_se``, ``ratio_median``, ``both_censored`` — the seeds
censored in the arm and in the reference, whose ratio is about 1 by construction — and
``ratio_without_both_censored``), ``reference``, ``levels``,
``gain_level``, ``sync_final_level``; with both a sync and a reflow arm ``reflow_over_sync_time`` (mean
per-seed ratio of the times to sync's final reward) with ``_se`` and ``_median``,
``reflow_minus_sync_time_s`` with ``_se``, ``reflow_over_sync_steps`` with ``_se``, ``final_gap`` and
``final_gap_se`` (reflow − sync final reward, mean ± s.e. of the per-seed differences) and
``final_gap_resolution`` (2 s.e.); ``resolution`` (``eval_prompts``, ``samples_per_prompt``,
``eval_samples``, per arm ``point_se`` and ``final_diff_resolution``, per level and arm
``time_ratio_resolution`` — ``two_se``, ``pairs``, ``seeds_for_10pct`` —, and per level ``eval_time_jitter_s``);
``rank_profiles`` (per arm medians over its runs'
ranks); ``flags``; ``runs`` (each run's curves, diagnostics and rank records). The goal it measures:
reflow reaches sync's final reward in ≤ 0.6× sync's time, and ends within one standard error (or 0.02)
of it.

``--algorithms a,b,…`` runs every objective (``algorithm.name``) in each mode of ``--modes`` from the
same warm start, seeds and budget; the arms are then named by objective (``mode:objective`` with more
than one mode). An arm may carry its own settings, ``cispo[cispo_clip_low=1;cispo_clip_high=2]``
(``section.key=value``; a bare key is in ``[algorithm]``), so variants of one objective compare side by
side with the others. The JSON object's ``algorithms`` maps each to ``final``, ``final_se`` (eval reward at the
end, mean ± s.e. over seeds), ``gain``, ``gain_se`` (final minus the start policy's sampled eval reward,
per seed), ``well_formed_gain`` (the same among samples already in the verifier's answer form, which
separates learning the task from learning its format), ``vs_grpo`` and ``vs_grpo_se`` (final minus
grpo's, paired by seed), the means of the run's ``rollout_is/*`` metrics, and ``at_uses`` / ``at_generated``
(± ``_se``): the eval reward, interpolated on each run's curve, at the fewest training uses
(``common_uses``: distinct samples trained plus replayed uses) and the fewest generated samples
(``common_generated``) any run of the benchmark reached — at equal uses a replayed use worth less than a
fresh one shows as a lower reward, at equal generated samples replay that saves generation as a higher.

A mode may carry settings of its own the same way, ``--modes "sync,reflow,reflow[batch_fill=fixed_share]"``
(a bare key is in ``[reflow]``): each such arm is paired with the reference like a mode, and named as
written.

``--peer trl`` adds TRL's GRPOTrainer (``tools/peer_trl.py``) for the same budget, held to the same
total CPU share; it reports only its start and final score (TRL has no snapshot scoring here).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_common import (busy_rate, cap_flags, drift_flags, median, mode_flags, per_rank, probed_run, rank_cpu_s,  # noqa: E402
                          rank_cpu_share, rank_profile, rank_records, run_arguments)
from bench_modes import MODES, mode_sets  # noqa: E402

from reflow_hpc.config import load  # noqa: E402
from reflow_hpc.metrics import read_jsonl  # noqa: E402

GAIN_FRACTION = 0.9          # "time to reach 90 % of sync's final gain"
GRID_POINTS = 200            # common grid the seeds' curves are averaged on (plot only)
DEFAULT_BUDGET_S = 120.0     # a run's training time when --budget-s is not given
RESOLVE = 0.10               # the difference in time to reward the benchmark should decide
RUN_TOLERANCE = 0.25         # a run's rate this far from its arm's median is flagged
FORMAT_DROP = 0.05           # a run whose share of well-formed eval answers ends this far below its start is flagged
EPS = 1e-9                   # a curve within this of a level reaches it (a mean of equal finals is not exact)
LEVELS = ("sync_final", "sync_gain_90")


def level_name(level: str, ref: str | None) -> str:
    """``sync_final`` / ``sync_gain_90`` in words, for the reference arm ``ref``."""
    ref = ref or "sync"
    return f"{ref}'s final reward" if level == "sync_final" else f"{GAIN_FRACTION:.0%} of {ref}'s gain"


# ----------------------------------------------------------------------------------------------
# Curves and statistics (pure: the unit tests drive these)
# ----------------------------------------------------------------------------------------------

def interpolate(points: list[tuple[float, float]], t: float) -> float:
    """A seed's curve at ``t``: linear between its snapshots, its first value before the first one and
    its last value after the last one."""
    if t <= points[0][0]:
        return points[0][1]
    for (t0, y0), (t1, y1) in zip(points, points[1:]):
        if t <= t1:
            return y0 if t1 == t0 else y0 + (y1 - y0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def mean_curve(runs: list[list[tuple[float, float]]], horizon: float) -> list[tuple[float, float, float]]:
    """(x, mean, standard error) over the seeds on a common grid from 0 to ``horizon`` (for the plot)."""
    out = []
    for i in range(GRID_POINTS + 1):
        t = horizon * i / GRID_POINTS
        ys = [interpolate(r, t) for r in runs]
        out.append((t, _mean(ys), _se(ys)))
    return out


def reach(points: list[tuple[float, float]], level: float, censor_at: float = 0.0) -> tuple[float, bool]:
    """(x, censored): the first x at which the curve (linear between its points) reaches ``level``; for a
    curve that never does, (the larger of ``censor_at`` and its last x, True)."""
    if not points:
        return math.nan, True
    if points[0][1] >= level - EPS:
        return points[0][0], False
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= level - EPS:                    # y0 < level - EPS <= y1
            return min(x1, x0 + (x1 - x0) * (level - y0) / (y1 - y0)), False
    return max(censor_at, points[-1][0]), True


def crossing_slope(points: list[tuple[float, float]], level: float) -> float:
    """The curve's slope (reward per x) on the segment where it first reaches ``level``; nan when it
    starts there or never gets there."""
    if not points or points[0][1] >= level - EPS:
        return math.nan
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= level - EPS:
            return (y1 - y0) / (x1 - x0) if x1 > x0 else math.nan
    return math.nan


def seed_times(runs: dict[int, list[tuple[float, float]]], level: float, censor_at: float = 0.0) -> dict:
    """Per seed, the x at which its curve reaches ``level`` (censored as :func:`reach`), and their mean,
    standard error and median over seeds, with the censored seeds named."""
    per: dict[int, float] = {}
    censored: list[int] = []
    for seed in sorted(runs):
        if not runs[seed]:
            continue
        x, cut = reach(runs[seed], level, censor_at)
        per[seed] = x
        if cut:
            censored.append(seed)
    xs = list(per.values())
    return {"per_seed": per, "censored_seeds": censored, "censored": len(censored), "seeds": len(per),
            "mean": _mean(xs), "se": _se(xs), "median": median(xs)}


def paired(values: dict[int, float], ref: dict[int, float]) -> dict:
    """Paired by seed: mean ± s.e. and median of the per-seed differences (value − ref) and of the ratios
    (value ÷ ref, over the seeds whose ref is not 0)."""
    seeds = sorted(set(values) & set(ref))
    diffs = [values[s] - ref[s] for s in seeds]
    ratios = [values[s] / ref[s] for s in seeds if ref[s]]
    return {"pairs": len(seeds), "diff": _mean(diffs), "diff_se": _se(diffs), "diff_median": median(diffs),
            "ratio": _mean(ratios), "ratio_se": _se(ratios), "ratio_median": median(ratios), "ratio_pairs": len(ratios)}


def _by_seed(runs) -> dict[int, list]:
    """``{seed: points}`` from itself or from a list of curves (seeds by position)."""
    return dict(runs) if isinstance(runs, dict) else dict(enumerate(runs))


def reference_label(labels: list[str]) -> str | None:
    """The arm the others are paired with: ``sync``; else sync's grpo arm; else the grpo arm; else none."""
    if "sync" in labels:
        return "sync"
    for want in ("sync:grpo", "grpo"):
        if want in labels:
            return want
    return None


def arm_targets(curves: dict, steps: dict | None, levels: dict, budget: float, ref_targets: dict | None) -> dict:
    """Per level and axis (time; steps where known), one arm's per-seed times to the level, paired by seed
    with the reference arm's ``ref_targets`` unless this arm is the reference."""
    targets: dict[str, dict] = {}
    for name, level in levels.items():
        axes = {"time": seed_times(curves, level, budget)}
        if steps:
            axes["steps"] = seed_times(steps, level)
        for axis, block in axes.items():
            if ref_targets is None or axis not in ref_targets[name]:
                continue
            theirs = ref_targets[name][axis]
            block["vs_ref"] = paired(block["per_seed"], theirs["per_seed"])
            # A pair censored on both sides has ratio ~1 by construction: name it, and the mean ratio
            # without such pairs beside the one with them.
            both = sorted(set(block["censored_seeds"]) & set(theirs["censored_seeds"]))
            rest = {sd: v for sd, v in block["per_seed"].items() if sd not in both}
            block["vs_ref"].update(both_censored=both, ratio_without_both_censored=paired(rest, theirs["per_seed"])["ratio"])
        targets[name] = axes
    return targets


def reflow_headline(row: dict) -> dict:
    """The headline keys of reflow's row against sync: time and steps to sync's final, and the final gap."""
    t = row["targets"]["sync_final"]["time"]["vs_ref"]
    head = dict(reflow_over_sync_time=t["ratio"], reflow_over_sync_time_se=t["ratio_se"],
                reflow_over_sync_time_median=t["ratio_median"], reflow_minus_sync_time_s=t["diff"],
                reflow_minus_sync_time_s_se=t["diff_se"])
    s = row["targets"]["sync_final"].get("steps", {}).get("vs_ref")
    if s:
        head.update(reflow_over_sync_steps=s["ratio"], reflow_over_sync_steps_se=s["ratio_se"])
    gap = row["final_vs_ref"]
    head.update(final_gap=gap["diff"], final_gap_se=gap["diff_se"], final_gap_resolution=2 * gap["diff_se"])
    return head


def summarise(curves: dict, budget: float, step_curves: dict | None = None, reference: str | None = None) -> dict:
    """The per-seed statistics of the module docstring. ``curves``: per arm, ``{seed: [(training s,
    reward), ...]}`` (or a list of curves, seeds by position); ``step_curves`` the same against optimizer
    steps; ``budget``: the training-time budget (the censoring time); ``reference``: the arm the others
    are paired with (default: :func:`reference_label`)."""
    curves = {m: _by_seed(c) for m, c in curves.items()}
    steps = {m: _by_seed(c) for m, c in (step_curves or {}).items()}
    ref = reference if reference in curves else reference_label(list(curves))
    rows: dict[str, dict] = {}
    finals: dict[str, dict[int, float]] = {}
    for mode, runs in curves.items():
        finals[mode] = {s: r[-1][1] for s, r in runs.items() if r}
        vals = list(finals[mode].values())
        rows[mode] = {"seeds": len(vals), "final_reward": _mean(vals), "final_reward_se": _se(vals),
                      "final_reward_median": median(vals),
                      "start_reward": _mean([r[0][1] for r in runs.values() if r])}
    out: dict = {"modes": rows, "reference": ref, "budget_s": budget}
    if ref is None:
        return out
    start, final = rows[ref]["start_reward"], rows[ref]["final_reward"]
    levels = {"sync_final": final, "sync_gain_90": start + GAIN_FRACTION * (final - start)}
    out.update(levels=levels, gain_level=levels["sync_gain_90"], sync_final_level=final)
    for mode in [ref] + [m for m in curves if m != ref]:        # the reference first: the others pair with it
        row = rows[mode]
        row["final_vs_ref"] = {k: v for k, v in paired(finals[mode], finals[ref]).items() if not k.startswith("ratio")}
        row["targets"] = arm_targets(curves[mode], steps.get(mode), levels, budget,
                                     None if mode == ref else rows[ref]["targets"])
        gain = row["targets"]["sync_gain_90"]["time"]
        row["time_to_90pct_of_sync_gain_s"] = gain["mean"]
        row["time_over_sync"] = 1.0 if mode == ref else gain.get("vs_ref", {}).get("ratio", math.nan)
    if "reflow" in curves and ref == "sync":
        out.update(reflow_headline(rows["reflow"]))
    return out


def censored_lines(result: dict) -> list[str]:
    """One line per arm, level and axis with seeds that never reached the level."""
    lines = []
    for mode, row in result["modes"].items():
        for name, axes in row.get("targets", {}).items():
            for axis, block in axes.items():
                if block["censored"]:
                    where = f"the budget ({result['budget_s']:g} s)" if axis == "time" else "their last step"
                    lines.append(f"censored: {mode}, {level_name(name, result.get('reference'))} ({axis}): "
                                 f"{block['censored']} of "
                                 f"{block['seeds']} seeds never reached it (seed(s) "
                                 f"{', '.join(map(str, block['censored_seeds']))}), counted at {where}")
                both = block.get("vs_ref", {}).get("both_censored")
                if both and axis == "time":
                    lines.append(f"censored on both sides: {mode} and {result.get('reference')}, "
                                 f"{level_name(name, result.get('reference'))}: seed(s) {', '.join(map(str, both))}, "
                                 f"ratio ≈ 1 by construction; mean ratio without them "
                                 f"{_fmt(block['vs_ref']['ratio_without_both_censored'], '.2f')}")
    return lines


def binomial_se(p: float, n: float) -> float:
    """√(p(1−p)/n): the standard error of a mean of n rewards in [0, 1] with mean p, at most."""
    return math.sqrt(p * (1 - p) / n) if n and n > 0 and 0 <= p <= 1 else math.nan


def resolution(result: dict, curves: dict, eval_prompts: float, samples_per_prompt: float) -> dict:
    """The eval set's size and what it and the seeds resolve (module docstring, "Resolution")."""
    n = eval_prompts * samples_per_prompt if eval_prompts and samples_per_prompt else math.nan
    out: dict = {"eval_prompts": eval_prompts, "samples_per_prompt": samples_per_prompt, "eval_samples": n,
                 "point_se": {m: binomial_se(r["final_reward"], n) for m, r in result["modes"].items()},
                 "final_diff_resolution": {}, "time_ratio_resolution": {}, "eval_time_jitter_s": {}}
    ref = result.get("reference")
    for mode, row in result["modes"].items():
        if mode == ref or "targets" not in row:
            continue
        out["final_diff_resolution"][mode] = 2 * row["final_vs_ref"]["diff_se"]
        for level, axes in row["targets"].items():
            blk = axes["time"].get("vs_ref")
            if not blk:
                continue
            r, k = 2 * blk["ratio_se"], blk["ratio_pairs"]
            need = (math.nan if math.isnan(r) or not k else k if r <= RESOLVE
                    else math.ceil(k * (r / RESOLVE) ** 2 - 1e-9))          # the s.e. shrinks as 1/√seeds
            out["time_ratio_resolution"].setdefault(level, {})[mode] = {"two_se": r, "pairs": k,
                                                                        "seeds_for_10pct": need}
    for level, value in result.get("levels", {}).items() if ref in curves else ():
        slopes = [crossing_slope(c, value) for c in _by_seed(curves[ref]).values()]
        slope = median([s for s in slopes if s > 0])
        out["eval_time_jitter_s"][level] = (binomial_se(value, n) / slope if slope and not math.isnan(slope)
                                            else math.nan)
    return out


def resolution_lines(res: dict, result: dict) -> list[str]:
    ref = result.get("reference")
    lines = [f"eval set: {_fmt(res['eval_prompts'], '.0f')} prompts x {_fmt(res['samples_per_prompt'], '.0f')} samples "
             f"= {_fmt(res['eval_samples'], '.0f')}; one eval point's s.e. ≤ √(p(1-p)/n) at the final reward: " +
             ", ".join(f"{m} {_fmt(v, '.4f')}" for m, v in res["point_se"].items())]
    for level, jitter in res["eval_time_jitter_s"].items():
        if math.isnan(jitter):
            continue
        t = result["modes"][ref]["targets"][level]["time"]["mean"]
        share = f" ({jitter / t:.1%} of its mean time to it)" if t else ""
        lines.append(f"eval noise alone moves {ref}'s crossing of {level_name(level, ref)} by about "
                     f"±{jitter:.1f} s{share}")
    for mode, r in res["final_diff_resolution"].items():
        lines.append(f"{mode} - {ref}, final reward: the seeds resolve a difference of {_fmt(r, '.3f')} (2 s.e.)")
    for level, modes in res["time_ratio_resolution"].items():
        for mode, r in modes.items():
            ok = not math.isnan(r["two_se"]) and r["two_se"] <= RESOLVE
            more = "" if ok or math.isnan(r["seeds_for_10pct"]) else f"; about {r['seeds_for_10pct']} seeds would"
            lines.append(f"{mode} ÷ {ref}, time to {level_name(level, ref)}: 2 s.e. of the paired ratio "
                         f"{_fmt(r['two_se'], '.3f')} over {r['pairs']} seeds: "
                         f"{'resolves' if ok else 'does not resolve'} a {RESOLVE:.0%} difference{more}")
    return lines


# ----------------------------------------------------------------------------------------------
# Per run diagnostics and flags (pure)
# ----------------------------------------------------------------------------------------------

def quarters(values: list[float]) -> list[float]:
    """Mean of each quarter of ``values`` in order (nan for an empty quarter)."""
    n = len(values)
    return [_mean(values[n * q // 4: n * (q + 1) // 4]) for q in range(4)]


def training_uses(gauges: dict) -> int:
    """Distinct samples trained plus their replayed uses, from a step's ``buffer/*`` gauges."""
    return gauges.get("buffer/trained_samples", 0) + gauges.get("buffer/replayed_uses", 0)


def generated_samples(gauges: dict) -> int:
    """Samples whose generation finished (created less those still pending), from ``buffer/*`` gauges."""
    return gauges.get("buffer/created", 0) - gauges.get("buffer/pending", 0)


def run_diagnostics(steps: list[dict], summary: dict | None = None) -> dict:
    """A run's rates and sample economy from its step records (module docstring, "Per run")."""
    last = steps[-1] if steps else {}
    buf = {**(summary or {}).get("buffer", {}), **{k: v for k, v in last.items() if k.startswith("buffer/")}}
    trained = buf.get("buffer/trained_samples")
    generated = generated_samples(buf) if "buffer/created" in buf else None
    created = buf.get("buffer/created")
    seconds = sum(m.get("step_seconds", 0.0) for m in steps)
    busy = sum(m.get("trainer/seconds") or 0.0 for m in steps)
    tokens = sum(m.get("tokens", 0.0) for m in steps)
    gen = sum((m.get("rollout/generated_tokens_per_s") or 0.0) * m.get("step_seconds", 0.0) for m in steps
              if not math.isnan(m.get("rollout/generated_tokens_per_s") or 0.0))
    return {"steps": len(steps),
            "generated_samples": generated, "trained_samples": trained,
            "generated_per_trained": generated / trained if generated is not None and trained else math.nan,
            "uses_per_trained": training_uses(buf) / trained if trained else math.nan,
            "evicted_unused_fraction": buf.get("buffer/evicted_unused", 0) / created if created else math.nan,
            "replay_quarters": quarters([m.get("replay_fraction", math.nan) for m in steps]),
            "gen_tokens_per_s": gen / seconds if seconds else math.nan,
            "train_tokens_per_s": tokens / seconds if seconds else math.nan,
            "busy_train_tokens_per_s": tokens / busy if busy else math.nan,
            "idle_ratio/trainer": _mean([m.get("idle_ratio/trainer", math.nan) for m in steps]),
            "idle_ratio/rollout": _mean([m.get("idle_ratio/rollout", math.nan) for m in steps])}


def pool_busy_share(ranks: list[dict], seconds: float | None) -> float:
    """The ranks' generating plus training seconds ÷ (ranks × ``seconds`` of training); nan without records.
    A rank holds one role at a time, so its two busy times do not overlap."""
    if not seconds or not any("generate_s" in r or "train_s" in r for r in ranks):
        return math.nan
    busy = sum((r.get("generate_s") or 0.0) + (r.get("train_s") or 0.0) for r in ranks)
    return busy / (len(ranks) * seconds)


RUN_FLAGGED = (("gen_tokens_per_s", "generation rate"), ("train_tokens_per_s", "training rate"))


def run_flags(runs: list[dict], tolerance: float = RUN_TOLERANCE) -> list[str]:
    """"FLAG: …" for a run whose generation or training rate differs by more than ``tolerance`` from the
    median of its arm's runs (runs: ``mode``, ``seed``, ``diagnostics``)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("diagnostics"):
            by.setdefault(r["mode"], []).append(r)
    flags = []
    for mode, rs in by.items():
        for key, what in RUN_FLAGGED:
            med = median([r["diagnostics"].get(key, math.nan) for r in rs])
            if len(rs) < 2 or not med or math.isnan(med):
                continue
            for r in rs:
                v = r["diagnostics"].get(key, math.nan)
                if not math.isnan(v) and abs(v / med - 1) > tolerance:
                    flags.append(f"FLAG: {mode} seed {r['seed']}: {what} {v:.0f} tok/s differs by {v / med - 1:+.0%} "
                                 f"from the median of {mode}'s runs ({med:.0f} tok/s)")
    return flags


def rank_profiles(runs: list[dict]) -> dict[str, dict]:
    """Per arm, the medians over every rank record of its runs (bench_common.rank_profile)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], []).extend(r.get("ranks") or [])
    return {m: rank_profile(recs) for m, recs in by.items() if recs}


# ----------------------------------------------------------------------------------------------
# Objectives
# ----------------------------------------------------------------------------------------------

def summarise_algorithms(runs: list[dict], labels: list[str]) -> dict:
    """Per objective (arm label): final eval reward, gain over the start policy, the same gain among
    well-formed samples and the difference to grpo's arm, each mean ± s.e. over seeds (paired by seed)."""
    by: dict[str, dict[int, dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], {})[r["seed"]] = r
    out: dict[str, dict] = {}
    ref = next((lab for lab in labels if lab.split(":")[-1] == "grpo"), None)
    # Reward at a common count of training uses and of generated samples: the fewest any run reached,
    # so every curve is read inside its range (a replayed use worth less shows at equal uses; replay
    # that saves generation shows at equal generated samples).
    common = {k: min((r[k][-1][0] for r in runs if r.get(k)), default=math.nan)
              for k in ("uses_curve", "generated_curve")}
    for label in labels:
        seeds = by.get(label, {})
        finals = [r["curve"][-1][1] for r in seeds.values()]
        gains = [r["curve"][-1][1] - r["curve"][0][1] for r in seeds.values()]
        wf = [r["well_formed_curve"][-1][1] - r["well_formed_curve"][0][1] for r in seeds.values()
              if r.get("well_formed_curve")]
        row = {"final": _mean(finals), "final_se": _se(finals), "gain": _mean(gains), "gain_se": _se(gains),
               "well_formed_gain": _mean(wf), "well_formed_gain_se": _se(wf), "seeds": len(finals)}
        if ref is not None:
            diffs = [r["curve"][-1][1] - by[ref][sd]["curve"][-1][1] for sd, r in seeds.items() if sd in by[ref]]
            row["vs_grpo"], row["vs_grpo_se"] = _mean(diffs), _se(diffs)
        is_keys = sorted({k for r in seeds.values() for k in r.get("rollout_is", {})})
        for k in is_keys:
            row[k] = _mean([r["rollout_is"][k] for r in seeds.values() if k in r.get("rollout_is", {})])
        for k, name in (("uses_curve", "uses"), ("generated_curve", "generated")):
            vals = [interpolate(r[k], common[k]) for r in seeds.values() if r.get(k) and common[k] > 0]
            row[f"at_{name}"], row[f"at_{name}_se"], row[f"common_{name}"] = _mean(vals), _se(vals), common[k]
        out[label] = row
    return out


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------

def _text_table(head: list[str], rows: list[list[str]]) -> str:
    lines = [head] + rows
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def algorithms_table(rows: dict[str, dict]) -> str:
    first = next(iter(rows.values()), {})
    head = ["objective", "seeds", "final", "± s.e.", "gain", "± s.e.", "well-formed gain", "vs grpo", "± s.e.",
            "IS mean", f"at {_fmt(first.get('common_uses'), '.0f')} uses", "± s.e.",
            f"at {_fmt(first.get('common_generated'), '.0f')} generated", "± s.e."]
    return _text_table(head, [[label, str(r["seeds"]), f"{r['final']:.3f}", _fmt(r["final_se"], ".3f"),
                               f"{r['gain']:+.3f}", _fmt(r["gain_se"], ".3f"), _fmt(r["well_formed_gain"], "+.3f"),
                               _fmt(r.get("vs_grpo"), "+.3f"), _fmt(r.get("vs_grpo_se"), ".3f"),
                               _fmt(r.get("rollout_is/mean"), ".4f"), _fmt(r.get("at_uses"), ".3f"),
                               _fmt(r.get("at_uses_se"), ".3f"), _fmt(r.get("at_generated"), ".3f"),
                               _fmt(r.get("at_generated_se"), ".3f")] for label, r in rows.items()])


def table(result: dict) -> str:
    """Final reward per arm, paired with the reference."""
    ref = result.get("reference") or "ref"
    head = ["arm", "seeds", "start", "final reward", "± s.e.", "median", f"- {ref}", "± s.e.", "t to 90% gain (s)",
            f"÷ {ref}"]
    rows = []
    for mode, r in result["modes"].items():
        gap = r.get("final_vs_ref", {})
        rows.append([mode, str(r["seeds"]), _fmt(r.get("start_reward"), ".3f"), _fmt(r["final_reward"], ".3f"),
                     _fmt(r["final_reward_se"], ".3f"), _fmt(r.get("final_reward_median"), ".3f"),
                     _fmt(gap.get("diff"), "+.3f"), _fmt(gap.get("diff_se"), ".3f"),
                     _fmt(r.get("time_to_90pct_of_sync_gain_s"), ".0f"), _fmt(r.get("time_over_sync"), ".2f")])
    return _text_table(head, rows)


def targets_table(result: dict) -> str:
    """Per arm, level and axis: per-seed times to the level, and paired with the reference."""
    ref = result.get("reference") or "ref"
    head = ["arm", "target", "axis", "mean", "± s.e.", "median", "censored", f"- {ref}", "± s.e.", f"÷ {ref}",
            "± s.e.", "median ÷"]
    rows = []
    for mode, r in result["modes"].items():
        for name, axes in r.get("targets", {}).items():
            for axis, b in axes.items():
                v = b.get("vs_ref", {})
                spec = ".1f" if axis == "time" else ".0f"
                rows.append([mode, level_name(name, ref), axis, _fmt(b["mean"], spec), _fmt(b["se"], spec),
                             _fmt(b["median"], spec), f"{b['censored']}/{b['seeds']}", _fmt(v.get("diff"), "+" + spec),
                             _fmt(v.get("diff_se"), spec), _fmt(v.get("ratio"), ".2f"), _fmt(v.get("ratio_se"), ".2f"),
                             _fmt(v.get("ratio_median"), ".2f")])
    return _text_table(head, rows)


def format_share(run: dict) -> tuple[float, float, float]:
    """(start, lowest, final) share of a run's eval samples in the verifier's answer form (nan where the task
    has no form rule)."""
    shares = [wf for _, _, wf in run.get("well_formed_curve") or []]
    shares = [x for x in shares if not math.isnan(x)]
    return (shares[0], min(shares), shares[-1]) if shares else (math.nan, math.nan, math.nan)


def format_flags(runs: list[dict], drop: float = FORMAT_DROP) -> list[str]:
    """"FLAG: …" for a run whose eval share of well-formed answers ends more than ``drop`` below its start:
    training broke the answers' form (on the coding task, code that no longer parses), so its later
    rewards measure that loss, not how fast the mode learns."""
    flags = []
    for r in runs:
        start, low, final = format_share(r)
        if not math.isnan(start) and start - final > drop:
            flags.append(f"FLAG: {r['mode']} seed {r['seed']}: the share of well-formed eval answers fell "
                         f"{start:.3f} -> {final:.3f} (lowest {low:.3f}): training is breaking the answers' form")
    return flags


def runs_table(runs: list[dict]) -> str:
    """One row per run: its sample economy, rates and per-rank figures, so an outlier shows."""
    head = ["arm", "seed", "steps", "final", "well-formed start/low/final", "gen/trained", "uses/trained",
            "replay by quarter", "gen tok/s", "train tok/s", "busy train", "idle T", "idle R",
            "pool busy", "busy gen tok/s per rank", "CPU s per rank", "CPU share per rank", "threads per rank"]
    rows = []
    for r in runs:
        d = r.get("diagnostics") or {}
        ranks = r.get("ranks") or []
        rows.append([r["mode"], str(r["seed"]), _fmt(d.get("steps"), "d"), _fmt(r["curve"][-1][1], ".3f"),
                     "/".join(_fmt(x, ".2f") for x in format_share(r)),
                     _fmt(d.get("generated_per_trained"), ".2f"), _fmt(d.get("uses_per_trained"), ".2f"),
                     " ".join(_fmt(q, ".2f") for q in d.get("replay_quarters", [])) or "-",
                     _fmt(d.get("gen_tokens_per_s"), ".0f"), _fmt(d.get("train_tokens_per_s"), ".0f"),
                     _fmt(d.get("busy_train_tokens_per_s"), ".0f"), _fmt(d.get("idle_ratio/trainer"), ".1%"),
                     _fmt(d.get("idle_ratio/rollout"), ".1%"), _fmt(d.get("pool_busy"), ".0%"),
                     per_rank(ranks, busy_rate, ".0f"),
                     per_rank(ranks, rank_cpu_s, ".0f"), per_rank(ranks, rank_cpu_share, ".2f"),
                     per_rank(ranks, lambda x: x.get("threads"), "d")])
    return _text_table(head, rows)


def idle_lines(runs: list[dict]) -> list[str]:
    """Idle ratios as the paper defines them (the fraction of each step a worker is idle, averaged over
    the steps of the runs), per arm over its seeds, beside the paper's Fig. 14."""
    from reflow_hpc.sim.report import PAPER_IDLE
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], []).append(r.get("diagnostics") or {})
    out = []
    for arm, ds in by.items():
        t = [d.get("idle_ratio/trainer", math.nan) for d in ds]
        ro = [d.get("idle_ratio/rollout", math.nan) for d in ds]
        busy = [d.get("pool_busy", math.nan) for d in ds]
        out.append(f"idle ratio, {arm}: trainer {_fmt(_mean(t), '.1%')} ± {_fmt(_se(t), '.1%')}, rollout "
                   f"{_fmt(_mean(ro), '.1%')} ± {_fmt(_se(ro), '.1%')} ({len(ds)} seeds)"
                   + ("" if math.isnan(_mean(busy)) else f"; pool busy {_mean(busy):.0%} ± {_fmt(_se(busy), '.0%')}"))
    out += [f"paper (Fig. 14, VeRL-async → ReFlow, {k}): trainer {a[0]} % → {b[0]} %, rollout {a[1]} % → {b[1]} %"
            for k, (a, b) in PAPER_IDLE.items()]
    return out


def profiles_table(profiles: dict[str, dict]) -> str:
    head = ["arm", "rank records", "busy gen tok/s", "probe tok/CPU s", "gen tok/CPU s ÷ probe", "CPU share",
            "throttled", "threads", "torch threads"]
    return _text_table(head, [[m, str(p["ranks"]), _fmt(p["busy_gen_tokens_per_s"], ".0f"),
                               _fmt(p.get("machine_probe"), ".0f"),
                               _fmt(p["gen_speed_vs_machine"], ".2f"), _fmt(p["cpu_share"], ".2f"),
                               _fmt(p["throttled_share"], ".1%"), _fmt(p["threads"], ".0f"),
                               _fmt(p["torch_threads"], ".0f")] for m, p in profiles.items()])


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec == "d":
        return str(int(v))
    return format(v, spec)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _se(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

def split_arm(arm: str, section: str) -> tuple[str, list[str]]:
    """An arm ``name`` or ``name[key=value;section.key=value]``: its name and ``--set`` values (a bare
    key is in ``[section]``)."""
    name, _, rest = arm.partition("[")
    extra = [kv.strip() for kv in rest.rstrip("]").split(";") if kv.strip()]
    return name.strip(), [kv if "." in kv.split("=")[0] else f"{section}.{kv}" for kv in extra]


def arm_sets(arm: str) -> list[str]:
    """``--set`` values of an ``--algorithms`` arm (:func:`split_arm`, bare keys in ``[algorithm]``)."""
    name, extra = split_arm(arm, "algorithm")
    return [f"algorithm.name={name}", *extra]


def mode_arm_sets(arm: str) -> list[str]:
    """``--set`` values of a ``--modes`` arm: the mode's own (``bench_modes.mode_sets``), then the arm's
    (:func:`split_arm`, bare keys in ``[reflow]``)."""
    name, extra = split_arm(arm, "reflow")
    if name not in MODES:
        raise SystemExit(f"bench_learning: --modes {arm!r}: {name!r} is not a mode ({', '.join(MODES)})")
    return [*mode_sets(name), *extra]


def parse_algorithms(spec: str | None) -> list[str | None]:
    """``--algorithms`` or ``--modes``: comma-separated arms, an arm's ``[...]`` settings kept whole."""
    return [a.strip() for a in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", spec)] if spec else [None]


def run_name(label: str, seed: int) -> str:
    return "learn-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") + f"-s{seed}"


def read_run(run_dir: Path, label: str, seed: int) -> dict:
    """One finished run's curves, diagnostics and rank records, from its run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise SystemExit(f"bench_learning: {run_dir}: no finished run there (no summary.json)")
    evals = read_jsonl(run_dir / "metrics.jsonl", "eval")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    if not evals:
        raise SystemExit(f"bench_learning: {run_dir}: no eval records in metrics.jsonl (run.eval_prompts = 0?)")
    is_keys = sorted({k for m in steps for k in m if k.startswith("trainer/rollout_is/")})
    diag = run_diagnostics(steps, summary)
    ranks = rank_records(run_dir, summary)
    diag["pool_busy"] = pool_busy_share(ranks, summary.get("train_seconds"))
    at = {m["step"]: m for m in steps if "step" in m}      # an eval point's gauges: its step's (none before step 1)
    curve_set = summary.get("eval/curve_set", "task")       # the set the snapshots were scored on (run.eval_curve)
    ev = f"eval/{curve_set}/"
    evals = [e for e in evals if ev + "reward" in e]
    topology = run_dir / "topology.json"
    budget = (json.loads(topology.read_text()).get("config", {}).get("trainer", {}).get("time_budget_s")
              if topology.is_file() else None)
    return {"mode": label, "seed": seed, "run_dir": str(run_dir), "steps": summary.get("steps"),
            "curve_set": curve_set, "budget_s": budget,
            "train_seconds": summary.get("train_seconds"),
            "curve": [(e["eval/elapsed_s"], e[ev + "reward"]) for e in evals],
            "step_curve": [(e["step"], e[ev + "reward"]) for e in evals],
            "uses_curve": [(training_uses(at.get(e["step"], {})), e[ev + "reward"]) for e in evals],
            "generated_curve": [(generated_samples(at.get(e["step"], {})), e[ev + "reward"]) for e in evals],
            "well_formed_curve": [(e["eval/elapsed_s"], e.get(ev + "well_formed_reward", math.nan),
                                   e.get(ev + "well_formed", math.nan)) for e in evals],
            "rollout_is": {k.removeprefix("trainer/"): _mean([m[k] for m in steps if k in m]) for k in is_keys},
            "greedy": [(e["eval/elapsed_s"], e[ev + "greedy"]) for e in evals],
            "eval_prompts": evals[-1].get(ev + "prompts", summary.get(ev + "prompts")),
            "samples_per_prompt": summary.get("eval/samples_per_prompt"),
            "throughput_tokens_per_s": diag["train_tokens_per_s"],
            "idle_ratio/trainer": diag["idle_ratio/trainer"], "idle_ratio/rollout": diag["idle_ratio/rollout"],
            "diagnostics": diag, "ranks": ranks}


def runs_budget(runs: list[dict], given: float | None, out: Path) -> float:
    """The budget the runs read back trained for (the censoring time); ``given`` (``--budget-s``) must agree."""
    budgets = sorted({r["budget_s"] for r in runs if r.get("budget_s")})
    if len(budgets) > 1:
        listed = ", ".join(f"{b:g} s" for b in budgets)
        raise SystemExit(f"bench_learning: the runs in {out} trained for different budgets ({listed}); "
                         f"summarise the runs of one budget together")
    if given is not None and budgets and budgets[0] != given:
        raise SystemExit(f"bench_learning: --budget-s {given:g}, but the runs in {out} trained for {budgets[0]:g} s "
                         f"(trainer.time_budget_s)")
    return given if given is not None else budgets[0] if budgets else DEFAULT_BUDGET_S


def run_one(config: str, mode: str, seed: int, args: argparse.Namespace, out: Path,
            algorithm: str | None = None, label: str | None = None) -> dict:
    label = label or mode
    name = run_name(label, seed)
    if args.summarise_only:
        return read_run(out / name, label, seed)
    chosen = arm_sets(algorithm) if algorithm else []
    sets = [*mode_arm_sets(mode), *chosen, f"run.seed={seed}", f"trainer.time_budget_s={args.budget_s}",
            "trainer.steps=1000000", f"run.eval_every_steps={args.eval_every_steps}",
            f"resources.cpu_quota={args.cpu_quota}", f"run.output_dir={out}", f"run.name={name}",
            f"storage.dir={out / 'scratch' / name}", "checkpoint.resume=false", "checkpoint.every_steps=0",
            *args.sets]
    r, wall = probed_run(config, sets, out / name, timeout=args.budget_s * 4 + 900)
    if r.returncode != 0:
        raise SystemExit(f"bench_learning: {name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return {**read_run(out / name, label, seed), "wall_seconds": wall}


def run_peer(config: str, seed: int, args: argparse.Namespace, workers: int) -> dict:
    """TRL for the same budget, held to the same total CPU share as our ranks together."""
    from peer_trl import run_trl_held
    res = run_trl_held(config, [f"run.seed={seed}", *args.sets], cpu_share=workers * args.cpu_quota,
                       steps=1_000_000, max_seconds=args.budget_s, timeout=args.budget_s * 4 + 900)
    return {"mode": "trl", "seed": seed, "steps": res.get("steps"), "train_seconds": res["wall_seconds"],
            "curve": [(0.0, res["eval/task/start_reward"]), (res["wall_seconds"], res["eval/task/final_reward"])],
            "throughput_tokens_per_s": res.get("throughput_tokens_per_s")}


def plot(curves: dict, step_curves: dict, budget: float, path: Path, levels: dict | None,
         reference: str | None = "sync", curve_set: str = "task") -> None:
    """Two panels: eval reward against training time and against optimizer steps (mean ± s.e. over
    seeds), with the target levels. Runs make different numbers of steps in the budget: the step panel's
    mean ends at the last step every seed reached, and each seed's last point is a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, data, xlabel, title in ((axes[0], curves, "training time (s)", "against training time"),
                                    (axes[1], step_curves, "optimizer step", "against optimizer steps")):
        for mode, runs in data.items():
            runs = list(_by_seed(runs).values())
            if not runs:
                continue
            if mode == "trl":
                ax.scatter([r[-1][0] for r in runs], [r[-1][1] for r in runs], marker="x",
                           label="TRL GRPOTrainer (final)")
                continue
            if ax is axes[0]:
                horizon = max([budget] + [r[-1][0] for r in runs])
            else:
                horizon = min(r[-1][0] for r in runs)
            c = mean_curve(runs, horizon)
            t, m = [p[0] for p in c], [p[1] for p in c]
            se = [0.0 if math.isnan(p[2]) else p[2] for p in c]
            line, = ax.plot(t, m, label=f"{mode} ({len(runs)} seeds)")
            ax.fill_between(t, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)], alpha=0.2)
            if ax is axes[1]:
                ax.scatter([r[-1][0] for r in runs], [r[-1][1] for r in runs], s=12, color=line.get_color())
        for name, style in (("sync_gain_90", "--"), ("sync_final", ":")):
            level = (levels or {}).get(name)
            if level is not None and not math.isnan(level):
                ax.axhline(level, color="grey", lw=0.8, ls=style, label=level_name(name, reference))
        ax.set_xlabel(xlabel)
        ax.set_title(f"Eval reward {title}", fontsize=10)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("eval reward, " + ("distinct held-out problems" if curve_set == "held_out"
                                          else "task prompts never trained on"))
    fig.suptitle("mean ± s.e. over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "cpu_tiny.toml"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algorithms", default=None, help="objectives (algorithm.name) to compare, comma-separated")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"training time of every run (seconds; default {DEFAULT_BUDGET_S:g}, or with --summarise-only "
                         f"the runs' own)")
    ap.add_argument("--eval-every-steps", type=int, default=25)
    ap.add_argument("--cpu-quota", type=float, default=0.45)
    ap.add_argument("--peer", choices=("trl",), default=None)
    ap.add_argument("--summarise-only", action="store_true",
                    help="read the runs already in --out instead of making them")
    ap.add_argument("--plot", default=None, help="PNG path (default: OUT/bench_learning.png)")
    run_arguments(ap, timeout=None)        # a run's limit follows from --budget-s
    args = ap.parse_args(argv)
    if args.summarise_only and not args.out:
        ap.error("--summarise-only reads the runs of --out DIR")
    if args.budget_s is None and not args.summarise_only:
        args.budget_s = DEFAULT_BUDGET_S
    return args


def bench_arms(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(label, mode, objective) of every arm: by mode alone, or by objective (and mode, with several)."""
    modes = [m for m in parse_algorithms(args.modes) if m]
    for m in modes:
        mode_arm_sets(m)                           # an unknown mode fails before the first run
    return [(mode if alg is None else alg if len(modes) == 1 else f"{mode}:{alg}", mode, alg)
            for alg in parse_algorithms(args.algorithms) for mode in modes]


def make_runs(args: argparse.Namespace, arms: list, seeds: list[int], out: Path) -> list[dict]:
    """Every arm for every seed (or, with --summarise-only, the records already in ``out``; then
    ``args.budget_s`` becomes the runs' own budget unless given)."""
    cfg = None
    if not args.summarise_only:
        cfg = load(args.config, args.sets)
        if cfg.model.warmstart:
            from reflow_hpc.warmstart import ensure_policy
            ensure_policy(cfg)                     # one warm start shared by every run
        out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for seed in seeds:                         # seeds outermost: a drifting machine hits every arm alike
        for label, mode, alg in arms:
            if not args.summarise_only:
                print(f"bench_learning: {label}, seed {seed}, {args.budget_s:g} s ...", file=sys.stderr, flush=True)
            runs.append(run_one(args.config, mode, seed, args, out, alg, label))
        if args.peer == "trl" and cfg is not None:
            print(f"bench_learning: TRL, seed {seed} ...", file=sys.stderr, flush=True)
            runs.append(run_peer(args.config, seed, args, cfg.resources.workers))
    if args.peer and args.summarise_only:
        print("bench_learning: --summarise-only: the TRL peer's runs are not kept, so not read back", file=sys.stderr)
    if args.summarise_only:
        args.budget_s = runs_budget(runs, args.budget_s, out)
    return runs


def bench_result(args: argparse.Namespace, arms: list, runs: list[dict], png: Path) -> dict:
    """The summary, with resolution, rank profiles and flags, of ``runs``; draws the plot to ``png``."""
    curves: dict[str, dict[int, list]] = {}
    step_curves: dict[str, dict[int, list]] = {}
    for r in runs:
        curves.setdefault(r["mode"], {})[r["seed"]] = r["curve"]
        if r.get("step_curve"):
            step_curves.setdefault(r["mode"], {})[r["seed"]] = r["step_curve"]
    ours = {m: c for m, c in curves.items() if m != "trl"}
    labels = [label for label, _, _ in arms]
    result = summarise(ours, args.budget_s, step_curves, reference_label(labels))
    if args.algorithms:
        result["algorithms"] = summarise_algorithms(runs, labels)
    if "trl" in curves:
        finals = [c[-1][1] for c in curves["trl"].values()]
        result["modes"]["trl"] = {"final_reward": _mean(finals), "final_reward_se": _se(finals),
                                  "final_reward_median": median(finals), "seeds": len(finals),
                                  "start_reward": _mean([c[0][1] for c in curves["trl"].values()])}
    mine = [r for r in runs if r["mode"] != "trl"]
    result["resolution"] = resolution(result, ours, median([r.get("eval_prompts") for r in mine]),
                                      median([r.get("samples_per_prompt") for r in mine]))
    result["rank_profiles"] = rank_profiles(mine)
    flags = (run_flags(mine) + mode_flags(result["rank_profiles"], result.get("reference"))
             + drift_flags(result["rank_profiles"], result.get("reference"))
             + format_flags(mine))
    for r in mine:
        flags += cap_flags(f"{r['mode']} seed {r['seed']}", r.get("ranks") or [], args.cpu_quota)
    result["flags"] = flags
    sets = {r.get("curve_set", "task") for r in mine}
    plot(curves, step_curves, args.budget_s, png, result.get("levels"), result.get("reference"),
         sets.pop() if len(sets) == 1 else "task")
    return result


def print_report(result: dict, mine: list[dict], png: Path) -> None:
    """The tables, censoring, resolution, per-run and per-rank lines and flags of one bench."""
    print(table(result))
    print()
    print(targets_table(result))
    for line in censored_lines(result):
        print(line)
    if "algorithms" in result:
        print()
        print(algorithms_table(result["algorithms"]))
    print()
    for line in resolution_lines(result["resolution"], result):
        print(line)
    print()
    print(runs_table(mine))
    for line in idle_lines(mine):
        print(line)
    if result["rank_profiles"]:
        print()
        print(profiles_table(result["rank_profiles"]))
    else:
        print("per-rank records: none (runs made before the runtime kept ranks/rank<NNNNN>.json)")
    for line in result["flags"]:
        print(line)
    if "reflow_over_sync_time" in result:
        print(f"reflow reaches sync's final eval reward in {_fmt(result['reflow_over_sync_time'], '.2f')} "
              f"± {_fmt(result['reflow_over_sync_time_se'], '.2f')}x sync's time (mean of per-seed ratios; median "
              f"{_fmt(result['reflow_over_sync_time_median'], '.2f')}; goal ≤ 0.6); in "
              f"{_fmt(result.get('reflow_over_sync_steps'), '.2f')} ± "
              f"{_fmt(result.get('reflow_over_sync_steps_se'), '.2f')}x "
              f"its steps; final gap reflow - sync {_fmt(result['final_gap'], '+.3f')} ± "
              f"{_fmt(result['final_gap_se'], '.3f')} (goal: within one s.e. or 0.02)")
    print(f"plot: {png}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = bench_arms(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_learning-"))
    runs = make_runs(args, arms, seeds, out)
    png = Path(args.plot) if args.plot else out / "bench_learning.png"
    result = bench_result(args, arms, runs, png)
    print_report(result, [r for r in runs if r["mode"] != "trl"], png)
    if args.json:
        print(json.dumps({"config": args.config, "budget_s": args.budget_s, "seeds": seeds, "cpu_quota": args.cpu_quota,
                          "plot": str(png), "out": str(out), **result, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
