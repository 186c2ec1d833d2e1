"""One simulated run end to end, and what is reported of it.

:func:`simulate` builds the config of a mode, its placement and its coordinator
(:mod:`reflow_hpc.sim.workload`), runs the engine (:mod:`reflow_hpc.sim.engine`) and summarises the
coordinator's step records with the runtime's own :class:`~reflow_hpc.metrics.StepMetrics`. The
averages leave out the first ``sim.warmup_steps`` steps, as ``tools/bench_modes.py`` and the paper
(§7.2: five warm-up steps, then measured ones) do:

- ``throughput_tokens_per_s`` = Σ tokens trained ÷ Σ step seconds (the paper's metric);
- ``step_s``, ``idle_trainer``, ``idle_rollout``, ``replay_fraction``, ``staleness_mean``, ``sync_s``: means;
- ``staleness_max``: the largest over the measured steps; ``token_staleness``: [min, max] over the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.shaping import OverlongShaping
from ..metrics import StepMetrics
from .engine import Simulation
from .workload import build_coordinator, load_mode, placement


@dataclass
class RunResult:
    summary: dict
    records: list[dict]                 # StepMetrics records, every step
    sim: Simulation


def simulate(path: str | None, mode: str, overrides: list[str] = (), gpus: int | None = None, *,
             timeline: bool = False, check_invariants: bool = False, **kw: Any) -> RunResult:
    """Simulate ``mode`` on the config at ``path`` (module docstring); ``kw`` goes to :class:`Simulation`.
    ``check_invariants``: the replay index checks every invariant after every event (tests)."""
    cfg = load_mode(path, mode, list(overrides), gpus)
    place = placement(cfg)
    sim = Simulation(cfg, *build_coordinator(cfg, place, check_invariants=check_invariants), place,
                     timeline=timeline, **kw)
    sim.run()
    return summarise(sim)


def summarise(sim: Simulation) -> RunResult:
    cfg, place, c = sim.cfg, sim.place, sim.coordinator.summary()
    metrics = StepMetrics(c["mode"], overlong=OverlongShaping.of(cfg))
    records = [metrics(r) for r in sim.records]
    warm = cfg.sim.warmup_steps
    measured = [r for r in records if r["step"] > warm] or records
    tokens = sum(r["tokens"] for r in measured)
    seconds = sum(r["step_seconds"] for r in measured)
    trainers = [r["pool/trainers"] for r in records] or [len(place.trainers)]
    summary = {
        "mode": c["mode"], "gpus": place.total_gpus if cfg.sim.gpus else place.world,
        "workers": place.world, "worker_gpus": place.worker_gpus,
        "trainers_start": len(place.trainers) if not place.colocated else place.world,
        "trainers_end": trainers[-1] if not place.colocated else place.world,
        "steps": len(records), "measured_steps": len(measured),
        "throughput_tokens_per_s": tokens / seconds if seconds else math.nan,
        "step_s": _mean(r["step_seconds"] for r in measured),
        "idle_trainer": _mean(r["idle_ratio/trainer"] for r in measured),
        "idle_rollout": _mean(r["idle_ratio/rollout"] for r in measured),
        "replay_fraction": _mean(r["replay_fraction"] for r in measured),
        "staleness_mean": _mean(r["staleness/mean"] for r in measured),
        "staleness_max": max((r["staleness/max"] for r in measured), default=0),
        "token_staleness": [min((r.get("trainer/token_staleness_min", 0) for r in records), default=0),
                            max((r.get("trainer/token_staleness_max", 0) for r in records), default=0)],
        "sync_s": (_mean(sim.sync_seconds) if sim.sync_seconds else
                   sim.costs.colocated_sync_time() if place.colocated else math.nan),
        "train_s": _mean(sim.train_seconds[-len(measured):]),
        "response_length": _mean(r["response_length/mean"] for r in measured),
        "generated_tokens_per_s": _mean(r["rollout/generated_tokens_per_s"] for r in measured),
        "preemptions": sim.preemptions, "partial_rollouts": c["partial_rollouts"],
        "prefill_share": prefill_share(sim, records, place.colocated),
        "evicted_unused": c["buffer"].get("buffer/evicted_unused", 0),
        "switches": len(c["placements"]), "placements": c["placements"],
        "coverage_error": median_error(measured, "placement/coverage_predicted", "placement/coverage_observed"),
        "step_error": median_error(measured, "placement/step_predicted_s", "step_seconds"),
        "simulated_s": sim.now, "events": sim.events,
    }
    return RunResult(summary, records, sim)


def prefill_share(sim: Simulation, records: list[dict], colocated: bool) -> dict[str, float]:
    """The rollout workers' time that prefill stalls took, by cause (``SimWorker.prefill_s`` and the
    two re-prefill clocks), over the whole run: its rollout time is Σ step seconds × rollout workers.
    Empty for a colocated pool, whose workers are not rollout workers between generation phases."""
    rollout_s = sum(r["step_seconds"] * r.get("pool/rollouts", 0) for r in records)
    if colocated or not rollout_s:
        return {}
    return {k: v / rollout_s for k, v in sim.prefill_seconds().items()}


def median_error(records: list[dict], predicted: str, observed: str) -> float:
    """The placement planner's median |predicted / observed − 1| over ``records`` (nan: no planner)."""
    pairs = ((r.get(predicted), r.get(observed)) for r in records)
    errors = sorted(abs(p / o - 1) for p, o in pairs if p is not None and p == p and o)
    return errors[len(errors) // 2] if errors else math.nan


def _mean(xs: Any) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


COLUMNS = [("GPUs", "gpus", "{}"), ("mode", "mode", "{}"), ("tok/s", "throughput_tokens_per_s", "{:,.0f}"),
           ("step s", "step_s", "{:.1f}"), ("idle T", "idle_trainer", "{:.1%}"), ("idle R", "idle_rollout", "{:.1%}"),
           ("replay", "replay_fraction", "{:.2f}"), ("stale", "staleness_mean", "{:.2f}"),
           ("T:R", "split", "{}"), ("sync s", "sync_s", "{:.2f}"), ("resp len", "response_length", "{:,.0f}"),
           ("preempt", "preemptions", "{}"), ("cov err", "coverage_error", "{:.1%}"),
           ("step err", "step_error", "{:.1%}")]


def table(rows: list[dict], columns: list = COLUMNS) -> str:
    """A plain-text table of summaries."""
    def cell(row: dict, key: str, fmt: str) -> str:
        if key == "split":
            if row.get("mode") == "sync":
                return "coloc"
            a, b = row.get("trainers_start"), row.get("trainers_end")
            w = row.get("workers", 0)
            return f"{a}:{w - a}" if a == b else f"{a}:{w - a}→{b}:{w - b}"
        v = row.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return fmt.format(v)
    data = [[h for h, _, _ in columns]] + [[cell(r, k, f) for _, k, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in data) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in data]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratios(rows: list[dict]) -> dict:
    """reflow ÷ each baseline's throughput among ``rows`` (one GPU count)."""
    by = {r["mode"]: r["throughput_tokens_per_s"] for r in rows}
    out = {}
    if "reflow" in by:
        for base in ("sync", "one_step_off", "fully_async"):
            if base in by and by[base]:
                out[f"reflow/{base}"] = by["reflow"] / by[base]
    return out


# Fig. 14 of the paper (§7.5): idle ratio = the fraction of each step a worker is idle, averaged over the
# steps of the convergence runs; VeRL-async → ReFlow, (trainer, rollout) in percent.
PAPER_IDLE = {"Qwen3-8B, 32 GPUs": ((55.8, 3.5), (15.5, 0.2)), "Qwen3-14B, 64 GPUs": ((46.5, 8.4), (15.8, 0.4))}


def idle_beside_paper(rows: list[dict]) -> list[str]:
    """fully_async → reflow idle ratios per GPU count (the same definition), beside the paper's."""
    by = {(r["gpus"], r["mode"]): r for r in rows}
    out = []
    for (gpus, mode), r in by.items():
        base = by.get((gpus, "fully_async"))
        if mode == "reflow" and base is not None:
            out.append(f"{gpus} GPUs: idle trainer / rollout, fully_async → reflow: {base['idle_trainer']:.1%} → "
                       f"{r['idle_trainer']:.1%} / {base['idle_rollout']:.1%} → {r['idle_rollout']:.1%}")
    if out:
        out += [f"paper (Fig. 14, VeRL-async → ReFlow, {k}): {a[0]} % → {b[0]} % / {a[1]} % → {b[1]} %"
                for k, (a, b) in PAPER_IDLE.items()]
    return out
