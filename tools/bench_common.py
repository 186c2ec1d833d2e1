"""What the run-based benchmarks share: one real run of ``python -m reflow_hpc.run``, a text table, the mean,
median and standard error, and the per-rank accounts of a run (``reflow_hpc/runtime/rankstats.py``: summary.json's
``ranks``) with the flags that compare them between modes and against the CPU cap."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reflow_hpc.metrics import read_jsonl  # noqa: E402
from reflow_hpc.sim.report import table  # noqa: E402,F401  (rows, [(header, key, format)]) -> right-aligned text


# The machine's own speed drifts on a shared host (the same mode's tokens per CPU second differed by 40 %
# between runs minutes apart: docs/results.md, 2026-12-06), so every run is bracketed by a fixed probe.
PROBE_CPU_S = 1.0            # CPU seconds of fixed generation per probe (back to back, probes agree within ~8 %)
_probe_engine: dict = {}


def run_arguments(ap, timeout: float | None) -> None:
    """The options every run-based benchmark takes: config overrides, where the runs go, a run's time
    limit (None: the benchmark sets each run's own), and one JSON object on the last line."""
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for every run (repeatable)")
    ap.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    if timeout is not None:
        ap.add_argument("--timeout", type=float, default=timeout, help="seconds one run may take")
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")


def machine_probe(config: str, sets: list[str]) -> float:
    """Tokens per CPU second of a fixed generation by the run's policy in this process
    (the same prompts and seed every time, at most 2 running requests, one torch thread): the machine's speed
    now, to compare a rank's tokens per CPU second against. nan when the policy cannot be loaded here (a
    vLLM-only config)."""
    import numpy as np
    import torch

    from reflow_hpc.rollout.engine import Request, SamplingParams
    try:
        from reflow_hpc.config import load
        cfg = load(config, sets)
        key = (str(Path(cfg.model.path).resolve()), cfg.model.dtype)
        if key not in _probe_engine:
            from reflow_hpc.policy import load_policy
            from reflow_hpc.rollout.torch_engine import TorchEngine
            model, _ = load_policy(cfg.model.path, cfg.model.dtype, "cpu")
            length = min(64, model.config.max_position_embeddings - 16)
            _probe_engine[key] = (TorchEngine(model, max_concurrency=2, kv_budget_tokens=4 * (length + 16),
                                              max_model_len=length + 16, seed=0), length)
            machine_probe(config, sets)           # the first probe warms the allocator and caches up: not counted
        engine, length = _probe_engine[key]
    except Exception:  # noqa: BLE001 - a probe is a reading, never a failed benchmark
        return math.nan
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens, t0, i = 0, time.thread_time(), 0
        while time.thread_time() - t0 < PROBE_CPU_S:
            for k in range(2):
                engine.add(Request(i * 2 + k, np.arange(4, 12, dtype=np.int32),
                                   SamplingParams(temperature=1.0, max_new_tokens=length, seed=k)))
            while engine.has_unfinished():
                tokens += sum(len(c.response) for c in engine.step())
            i += 1
        return tokens / (time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)


PROBE_FILE = "machine_probe.json"


def probed_run(config: str, sets: list[str], run_dir: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m reflow_hpc.run config --set …`` (``sets`` name the run's directory, ``run_dir``), bracketed by
    the machine probe, whose readings go to ``run_dir/machine_probe.json`` (``before``, ``after``: tokens per
    CPU second); (the finished process, its wall seconds)."""
    args = [sys.executable, "-m", "reflow_hpc.run", config]
    for s in sets:
        args += ["--set", s]
    before = machine_probe(config, sets)
    t0 = time.monotonic()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    if r.returncode == 0 and Path(run_dir).is_dir():
        (Path(run_dir) / PROBE_FILE).write_text(json.dumps({"before": before, "after": machine_probe(config, sets)}))
    return r, wall


def run(config: str, name: str, sets: list[str], out: Path, timeout: float) -> tuple[Path, list[dict], dict, float]:
    """One run in ``out/name`` (no resume, shards under ``out/scratch``); (run dir, step metrics, summary, wall s).
    A failed run ends the benchmark with its output. The summary's ``ranks`` carry the machine probe around
    the run (:func:`rank_records`)."""
    run_dir = out / name
    r, wall = probed_run(config, [f"run.output_dir={out}", f"run.name={name}", f"storage.dir={out / 'scratch' / name}",
                                  "checkpoint.resume=false", *sets], run_dir, timeout)
    if r.returncode != 0:
        raise SystemExit(f"{Path(sys.argv[0]).name}: run {name} failed (exit {r.returncode}):\n"
                         f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["ranks"] = rank_records(run_dir, summary)
    return run_dir, read_jsonl(run_dir / "metrics.jsonl"), summary, wall


def prepare(config: str, sets: list[str]):
    """The config with the benchmark's overrides, its policy warm-started first if it asks for that
    (one warm start shared by every run of the benchmark)."""
    from reflow_hpc.config import load
    cfg = load(config, sets)
    if cfg.model.warmstart:
        from reflow_hpc.warmstart import ensure_policy
        ensure_policy(cfg)
    return cfg


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def median(xs) -> float:
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def se(xs) -> float:
    """Standard error of the mean (sample standard deviation ÷ √n); nan below two values."""
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


# ----------------------------------------------------------------------------------------------
# Per-rank accounts (reflow_hpc/runtime/rankstats.py: summary.json's ``ranks``)
# ----------------------------------------------------------------------------------------------

RANK_TOLERANCE = 0.25        # a difference between modes (or runs) above this is flagged
DRIFT_TOLERANCE = 0.10       # machine speed around one arm's runs against the reference's: above it, the arms'
                             # time ratios lean toward the arm that met the faster machine


def rank_records(run_dir: Path, summary: dict) -> list[dict]:
    """A run's per-rank records: summary.json's ``ranks``, else the ``ranks/`` files ([] for a run made
    before the runtime kept them); each with ``machine_tokens_per_cpu_s``, the mean of the machine probe
    before and after the run (None for a run without one)."""
    out = [dict(r) for r in summary.get("ranks") or []]
    if not out:
        for p in sorted((Path(run_dir) / "ranks").glob("rank*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
    speed = machine_speed(run_dir)
    for rec in out:
        rec["machine_tokens_per_cpu_s"] = speed
    return out


def machine_speed(run_dir: Path) -> float | None:
    """The machine probe's tokens per CPU second around a run (mean of before and after); None without one."""
    try:
        probe = json.loads((Path(run_dir) / PROBE_FILE).read_text())
        speed = mean([probe.get("before"), probe.get("after")])
    except (OSError, ValueError, AttributeError):
        return None
    return None if math.isnan(speed) else speed


def rank_cpu_s(rec: dict) -> float | None:
    """The rank's CPU seconds: its cgroup's where the cgroup accounts them, else its process's."""
    v = rec.get("cgroup_cpu_s")
    return v if v is not None else rec.get("cpu_s")


def rank_cpu_share(rec: dict) -> float:
    """CPU seconds ÷ wall seconds: the share of one core the rank used (≤ its cap under a CPU quota)."""
    cpu, wall = rank_cpu_s(rec), rec.get("wall_s")
    return cpu / wall if cpu is not None and wall else math.nan


def busy_rate(rec: dict) -> float:
    """The rank's busy generation rate (tokens ÷ seconds with requests in flight); nan if it generated nothing."""
    v = rec.get("busy_generation_tokens_per_s")
    return v if v is not None and rec.get("generated_tokens") else math.nan


def gen_cpu_share(rec: dict) -> float:
    """The share of a core the rank's main thread got while it generated (nan without generation)."""
    cpu, wall = rec.get("generate_cpu_s"), rec.get("generate_s")
    return cpu / wall if cpu is not None and wall and rec.get("generated_tokens") else math.nan


def tokens_per_cpu_s(rec: dict) -> float:
    """Tokens per CPU second of generation: the engine's cost per token, whatever share it got (nan if none)."""
    v = rec.get("generation_tokens_per_cpu_s")
    return v if v is not None and rec.get("generated_tokens") else math.nan


def service_cpu_s(rec: dict) -> float:
    """CPU seconds of the rank's service thread (commands, heartbeats, fetches it answers); nan if unrecorded."""
    threads = rec.get("thread_cpu_s")
    return sum(v for k, v in threads.items() if k.startswith("service")) if threads is not None else math.nan


def tokens_per_cpu_s_vs_machine(rec: dict) -> float:
    """The rank's tokens per CPU second of generation ÷ the machine probe's around its run: its engine's
    speed with the machine's drift taken out (nan without either)."""
    probe = rec.get("machine_tokens_per_cpu_s")
    v = tokens_per_cpu_s(rec)
    return v / probe if probe and not math.isnan(probe) else math.nan


def mean_batch(rec: dict) -> float:
    """Generated tokens per decode forward: the mean running requests of the rank's engine (nan if uncounted)."""
    steps = rec.get("decode_steps")
    return rec["generated_tokens"] / steps if steps and rec.get("generated_tokens") else math.nan


def prefill_per_token(rec: dict) -> float:
    """Prefilled tokens per generated token: prompts, and the re-prefills aborts and preemptions cost."""
    pre = rec.get("prefilled_tokens")
    return pre / rec["generated_tokens"] if pre is not None and rec.get("generated_tokens") else math.nan


def rank_profile(records: list[dict]) -> dict:
    """Medians over some ranks' records (one run's, or every run of a mode): busy generation rate of the
    ranks that generated, CPU share, throttled share of the wall time, OS and torch threads."""
    def med(f):
        return median([f(r) for r in records])
    return {"ranks": len(records),
            "busy_gen_tokens_per_s": med(busy_rate),
            "gen_cpu_share": med(gen_cpu_share),
            "gen_tokens_per_cpu_s": med(tokens_per_cpu_s),
            "gen_speed_vs_machine": med(tokens_per_cpu_s_vs_machine),
            "cpu_share": med(rank_cpu_share),
            "throttled_share": med(lambda r: r["throttled_s"] / r["wall_s"]
                                   if r.get("throttled_s") is not None and r.get("wall_s") else math.nan),
            "threads": med(lambda r: r.get("threads")),
            "torch_threads": med(lambda r: r.get("torch_threads")),
            "machine_probe": med(lambda r: r.get("machine_tokens_per_cpu_s"))}


FLAGGED_PROFILE = (("busy_gen_tokens_per_s", "per-rank busy generation rate", "{:.0f} tok/s"),
                   ("gen_speed_vs_machine", "generation tokens per CPU second ÷ the machine probe's", "{:.2f}"),
                   ("gen_cpu_share", "CPU share of generation while busy", "{:.2f}"),
                   ("threads", "threads per rank", "{:.0f}"), ("torch_threads", "torch threads per rank", "{:.0f}"))


def _off_reference(profiles: dict[str, dict], key: str, reference: str | None, tolerance: float,
                   median_fallback: bool) -> Iterator[tuple[str, float, float, str]]:
    """(mode, its value, the reference value, the reference's name) for every mode whose profile value ``key``
    differs from ``reference``'s by more than ``tolerance``; without a reference value, the median over the
    modes stands in when ``median_fallback``, else nothing is compared."""
    values = {m: p.get(key, math.nan) for m, p in profiles.items()}
    values = {m: v for m, v in values.items() if v is not None and not math.isnan(v)}
    if reference in values:
        ref, ref_name = values[reference], reference
    elif median_fallback and len(values) >= 2:
        ref, ref_name = median(values.values()), "the median over the modes"
    else:
        return
    if not ref:
        return
    for mode, v in values.items():
        if mode != reference and abs(v / ref - 1) > tolerance:
            yield mode, v, ref, ref_name


def mode_flags(profiles: dict[str, dict], reference: str | None = None, tolerance: float = RANK_TOLERANCE) -> list[str]:
    """"FLAG: …" lines for every mode whose per-rank busy generation rate or thread counts differ by more
    than ``tolerance`` from ``reference``'s (default: the median over the modes). The modes of one
    benchmark run at equal caps (the same ``resources.cpu_quota`` on every rank), so at equal caps a
    rank should generate as fast in any mode; its CPU share may differ (a rank that waits uses less)."""
    return [f"FLAG: {mode}: {what} {fmt.format(v)} differs by {v / ref - 1:+.0%} from "
            f"{ref_name}'s {fmt.format(ref)} (more than {tolerance:.0%} at equal caps)"
            for key, what, fmt in FLAGGED_PROFILE
            for mode, v, ref, ref_name in _off_reference(profiles, key, reference, tolerance, True)]


def drift_flags(profiles: dict[str, dict], reference: str | None, tolerance: float = DRIFT_TOLERANCE) -> list[str]:
    """"FLAG: …" lines for every mode whose runs met a machine faster or slower than ``reference``'s runs did:
    the median machine probe (tokens per CPU second, read before and after each run) differs by more than
    ``tolerance``. Ranks are held to a CPU share, not to a speed: on a shared VM the same share buys
    more or less work from one hour to the next, and a mode whose runs met the faster machine gains in
    every time ratio. Run the modes in one invocation (seeds outermost) to spread the drift alike."""
    return [f"FLAG: {mode}: the machine probe read {v:.0f} tokens per CPU second around its runs, "
            f"{v / ref - 1:+.0%} against {ref_name}'s {ref:.0f} (more than {tolerance:.0%}): its time "
            f"ratios lean {'toward' if v > ref else 'against'} it"
            for mode, v, ref, ref_name in _off_reference(profiles, "machine_probe", reference, tolerance, False)]


def cap_flags(name: str, records: list[dict], cpu_quota: float, tolerance: float = RANK_TOLERANCE) -> list[str]:
    """"FLAG: …" lines for a run whose ranks were not held to their CPU cap: no CPU cgroup although a
    quota was asked for, or a CPU share above the cap by more than ``tolerance``."""
    if cpu_quota <= 0 or not records:
        return []
    flags = []
    uncapped = [r["rank"] for r in records if not r.get("cpu_group")]
    if uncapped:
        flags.append(f"FLAG: {name}: rank(s) {', '.join(map(str, uncapped))} ran in no CPU cgroup of their own "
                     f"although the cap is {cpu_quota:g} of a core (quota not applied?)")
    over = [(r["rank"], rank_cpu_share(r)) for r in records if rank_cpu_share(r) > cpu_quota * (1 + tolerance)]
    if over:
        flags.append(f"FLAG: {name}: rank(s) " + ", ".join(f"{k} ({s:.2f})" for k, s in over) +
                     f" used more than their cap of {cpu_quota:g} of a core")
    return flags


def per_rank(records: list[dict], f, spec: str) -> str:
    """One figure per rank, ``/``-separated in rank order ('-' where there is none)."""
    out = []
    for r in sorted(records, key=lambda r: r.get("rank", 0)):
        v = f(r)
        out.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec))
    return "/".join(out) if out else "-"


def ranks_table(runs: list[tuple[str, list[dict]]]) -> str:
    """One row per rank of each (run label, rank records): role, busy generation rate, CPU seconds and
    share of a core, throttled time, threads."""
    rows = []
    for label, records in runs:
        for r in sorted(records, key=lambda r: r.get("rank", 0)):
            rows.append({"run": label, "rank": r.get("rank"), "role": r.get("role"), "busy": busy_rate(r),
                         "gen_s": r.get("generate_s"), "gen_share": gen_cpu_share(r), "per_cpu": tokens_per_cpu_s(r),
                         "batch": mean_batch(r), "prefill": prefill_per_token(r),
                         "probe": r.get("machine_tokens_per_cpu_s"), "vs_probe": tokens_per_cpu_s_vs_machine(r),
                         "cpu": rank_cpu_s(r), "share": rank_cpu_share(r), "service": service_cpu_s(r),
                         "other": r.get("other_threads_cpu_s"), "children": r.get("children_cpu_s"),
                         "throttled": r.get("throttled_s"), "threads": r.get("threads"),
                         "torch": r.get("torch_threads")})
    return table(rows, [("run", "run", "{}"), ("rank", "rank", "{}"), ("role", "role", "{}"),
                        ("busy gen tok/s", "busy", "{:.0f}"), ("gen s", "gen_s", "{:.1f}"),
                        ("gen CPU share", "gen_share", "{:.2f}"), ("gen tok/CPU s", "per_cpu", "{:.0f}"),
                        ("probe tok/CPU s", "probe", "{:.0f}"), ("÷ probe", "vs_probe", "{:.2f}"),
                        ("batch", "batch", "{:.2f}"), ("prefill/gen", "prefill", "{:.2f}"),
                        ("CPU s", "cpu", "{:.1f}"), ("CPU share", "share", "{:.2f}"), ("service CPU s", "service", "{:.1f}"),
                        ("other threads CPU s", "other", "{:.1f}"), ("children CPU s", "children", "{:.1f}"),
                        ("throttled s", "throttled", "{:.1f}"),
                        ("threads", "threads", "{}"), ("torch threads", "torch", "{}")])
