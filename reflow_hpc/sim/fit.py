"""Fit the CPU cost model to the machine of one ``tools/bench_modes.py`` run, from what every mode
measured of the same primitives — never from the throughputs the cross-check compares.

    python -m reflow_hpc.sim --crosscheck BENCH_JSON      # fits first when the run directories exist

``tools/bench_modes.py --json`` names its output directory (``out``); each mode's run left its
``metrics.jsonl`` there (``bench-<mode>/``, and ``bench-<mode>-<k>/`` for the passes of ``--repeat``,
listed in the row's ``runs``). Over the measured steps (after the bench's warm-up) of
all modes together:

trainer compute → ``sim.train_mfu``
    Σ ``trainer/forward_backward_seconds`` against Σ of each step's replica share of the cost model's
    FLOPs, ``6·(tokens/replicas)·(N + n_l·d·L̄)`` with ``L̄`` the step's tokens per sample.
optimizer step → ``sim.train_update_overhead_s``
    the mean of ``trainer/optimizer_seconds + trainer/allreduce_seconds`` per optimizer update.
weight sync → ``sim.sync_base_s`` and ``sim.sync_colocated_base_s``
    the mean ``sync_seconds`` of the split-pool modes, and of the colocated one.
payload fetch → ``sim.fetch_s_per_sample``
    Σ ``fetch_seconds`` ÷ Σ samples of a replica's share.
engine step → ``sim.decode_base_s``
    scaled until the simulated generation rate of a busy rollout worker (tokens generated ÷ rollout
    seconds not idle) matches the measured one: by the geometric mean over the modes of simulated ÷
    measured, again until it changes by less than ``DECODE_TOLERANCE`` (the decode step's compute
    term does not scale, and the waits it shortens change the running counts).
    The rate is the engine's, not the pipeline's: it leaves out the time a worker waits for work.

Every mode weighs by its measured steps. What the fit returns are ``--set`` lines of the simulator's
config (:func:`fit`) and the per-mode primitives it read (:func:`measure`), so that a primitive that
depends on the mode shows as such. The cross-check then also fits each mode to its own runs alone
(``own_primitives`` in :func:`reflow_hpc.sim.calibrate.crosscheck`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..config import load
from ..core.modes import rules
from ..metrics import read_jsonl
from .report import simulate
from .workload import load_mode, placement

DECODE_TOLERANCE = 1e-3          # relative change of the engine step at which its fit stops
DECODE_MAX_ITERATIONS = 20


@dataclass
class ModeMeasure:
    """The primitives one mode's measured steps show."""
    mode: str
    steps: int
    fb_s: float                    # Σ forward-backward seconds
    share_tokens: float            # Σ tokens of a replica's share
    flops: float                   # Σ the cost model's FLOPs of a replica's share
    update_s: float                # mean optimizer + all-reduce seconds per step
    fetch_s: float                 # Σ fetch seconds
    share_samples: float           # Σ samples of a replica's share
    sync_s: float                  # mean weight-sync seconds (nan: none measured)
    rate: float                    # generated tokens per busy rollout-worker second

    def as_dict(self) -> dict:
        return {"mode": self.mode, "steps": self.steps, "trainer_ms_per_token": 1e3 * self.fb_s / self.share_tokens,
                "update_s": self.update_s, "sync_s": self.sync_s,
                "fetch_ms_per_sample": 1e3 * self.fetch_s / self.share_samples,
                "generation_rate_per_busy_worker": self.rate}


def busy_rate(records: list[dict]) -> float:
    """Generated tokens per second of a rollout worker that is not idle, over ``records``."""
    tokens = busy = 0.0
    for r in records:
        dt = r["step_seconds"]
        tokens += r["rollout/generated_tokens_per_s"] * dt
        busy += r["pool/rollouts"] * dt * (1.0 - r["idle_ratio/rollout"])
    return tokens / busy if busy > 0 else math.nan


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def measure(bench: dict, config: str) -> list[ModeMeasure]:
    """The primitives of every reflow_hpc mode of ``bench`` (bench_modes' JSON object), read from the run
    directories it names. Raises ``FileNotFoundError`` naming the missing file."""
    out = Path(bench.get("out") or "")
    warm = int(bench.get("warmup_steps", 5))
    s = load(config, check_files=False).sim
    per_token = s.model_params
    quad = s.model_layers * s.model_hidden
    found = []
    for row in bench["rows"]:
        if row.get("system") != "reflow_hpc":
            continue
        mode = row["mode"]
        steps = []
        for name in row.get("runs") or [f"bench-{mode}"]:        # one per pass of ``--repeat``
            path = out / name / "metrics.jsonl"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no metrics of the bench's {mode} run (bench_modes.py names its "
                                        f"run directories in \"out\" and \"runs\"; they are needed to fit the "
                                        f"cost model)")
            steps += [r for r in read_jsonl(path) if r["step"] > warm]
        fb = flops = upd = share = fetch = share_samples = 0.0
        syncs = []
        for r in steps:
            replicas = max(1, int(r["pool/trainers"]))
            tokens = r["trainer/tokens"]
            length = tokens / max(1.0, r["trainer/samples"])
            fb += r["trainer/forward_backward_seconds"]
            share += tokens / replicas
            share_samples += r["trainer/samples"] / replicas
            fetch += r["fetch_seconds"] if _finite(r.get("fetch_seconds")) else 0.0
            flops += 6.0 * tokens / replicas * (per_token + quad * length)
            upd += r["trainer/optimizer_seconds"] + r["trainer/allreduce_seconds"]
            if _finite(r.get("sync_seconds")):
                syncs.append(r["sync_seconds"])
        if not steps:
            raise ValueError(f"{path}: no step after the bench's {warm} warm-up steps")
        found.append(ModeMeasure(mode, len(steps), fb, share, flops, upd / len(steps), fetch, share_samples,
                                 sum(syncs) / len(syncs) if syncs else math.nan, busy_rate(steps)))
    return found


def fit(bench: dict, config: str, sets: list[str]) -> tuple[list[str], list[ModeMeasure]]:
    """``--set`` lines that fit ``config``'s cost model to ``bench``'s machine (module docstring): one
    cost model from every mode's steps, as dedicated GPUs would give; and what each mode measured.
    ``sets`` are the cross-check's own settings (steps, warm-up, sync period)."""
    found = measure(bench, config)
    s = load(config, check_files=False).sim
    fb = sum(m.fb_s for m in found)
    flops = sum(m.flops for m in found)
    steps = sum(m.steps for m in found)
    if not fb > 0:
        raise ValueError(f"the bench's {', '.join(m.mode for m in found)} run(s) measured no forward-backward time")
    gpus = placement(load_mode(config, found[0].mode, sets)).worker_gpus
    mfu = flops / fb / (gpus * s.gpu_flops)
    update = sum(m.update_s * m.steps for m in found) / steps / max(1, s.train_minibatches)
    split = [m for m in found if not rules(m.mode).colocated and _finite(m.sync_s)]
    coloc = [m for m in found if rules(m.mode).colocated and _finite(m.sync_s)]
    fetch = sum(m.fetch_s for m in found) / sum(m.share_samples for m in found)
    out = [f"sim.train_mfu={mfu:.6g}", f"sim.train_update_overhead_s={update:.6g}", f"sim.fetch_s_per_sample={fetch:.6g}"]
    if split:
        out.append(f"sim.sync_base_s={sum(m.sync_s * m.steps for m in split) / sum(m.steps for m in split):.6g}")
    if coloc:
        out.append(f"sim.sync_colocated_base_s={sum(m.sync_s * m.steps for m in coloc) / sum(m.steps for m in coloc):.6g}")
    decode = s.decode_base_s
    for _ in range(DECODE_MAX_ITERATIONS):
        logs = []
        for m in found:
            if not (_finite(m.rate) and m.rate > 0):
                continue
            res = simulate(config, m.mode, [*sets, *out, f"sim.decode_base_s={decode:.6g}"])
            warm = res.sim.cfg.sim.warmup_steps
            rate = busy_rate([r for r in res.records if r["step"] > warm] or res.records)
            if _finite(rate) and rate > 0:
                logs.append(math.log(rate / m.rate))
        if not logs:
            break
        step = math.exp(sum(logs) / len(logs))
        decode *= step
        if abs(step - 1.0) < DECODE_TOLERANCE:
            break
    out.append(f"sim.decode_base_s={decode:.6g}")
    return out, found
