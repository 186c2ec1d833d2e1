"""Offline analysis speed: ``python -m reflow_hpc.analyze`` on a synthesised run of N samples.

    python tools/bench_analyze.py [--samples 1000000] [--dir DIR] [--keep] [--set KEY=VALUE ...] [--json]

1. Synthesise a run directory of ``--samples`` samples without MPI or a model: the coordinator a run
   builds (``runtime/training.py`` ``build_coordinator``, the real ``core/`` code and its event log)
   is driven by a small discrete-event model of the cluster (rollout workers that generate each
   sample in time proportional to its length and record the versions they held; trainer replicas
   whose step takes time proportional to the batch's tokens; syncs and checkpoints answered after a
   fixed delay; each worker trains, syncs and checkpoints one command at a time). Every finished
   sample is written by the project's own ``ShardWriter`` into ``shards/rank*/`` with its tokens,
   log-probs and per-token versions; ``events.jsonl``,
   ``metrics.jsonl``, ``summary.json`` and ``topology.json`` are written as a run writes them.
2. Time the analysis as a user runs it, in a fresh process pinned to one core: the report alone
   (with and without plots), then ``--what-if`` under the run's own settings (which must reproduce
   every batch) and with an override (``reflow.sigma=0.25``, two replays in one pass).

Prints a table (CPU and wall seconds, peak resident memory of the analysis) and with ``--json`` one
object on the last line. The target it measures: 1 M samples analysed in under 60 s on one core. CPU
seconds are that core's work; wall seconds also count the time spent waiting for the core when the
host is shared.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, table  # noqa: E402

from reflow_hpc.config import load, to_dict  # noqa: E402
from reflow_hpc.core import events as ev  # noqa: E402
from reflow_hpc.core.commands import Dispatch, FlushTrajectories, SyncWeights, Train, WriteCheckpoint  # noqa: E402
from reflow_hpc.core.outputs import Outputs  # noqa: E402
from reflow_hpc.metrics import StepMetrics  # noqa: E402
from reflow_hpc.runtime.eventlog import encode  # noqa: E402
from reflow_hpc.runtime.training import build_coordinator, pools  # noqa: E402
from reflow_hpc.storage.writer import ShardWriter  # noqa: E402
from reflow_hpc.trajectory import Trajectory  # noqa: E402

# The synthetic cluster: 8 ranks (2 trainer replicas, 6 rollout workers), GRPO groups of 8, batches
# of 256, σ = τ = 0.5, δ = 2, a sync after every step, a checkpoint every 200 steps. With the speeds
# below the trainer waits about half of the time and a fifth of each batch is replayed.
SETTINGS = ["resources.workers=8", "resources.trainer_replicas=2", "resources.rollout_instances=6",
            "algorithm.group_size=8", "trainer.batch_size=256", "reflow.sync_every=1", "reflow.delta=2",
            "scheduler.elastic=false", "checkpoint.every_steps=200", "storage.segment_mib=64",
            "rollout.max_concurrency=64", "run.name=bench_analyze"]
PROMPT_TOKENS = (8, 25)          # uniform range of prompt lengths
RESPONSE_MEDIAN = 40             # response length: lognormal around this median, capped below
RESPONSE_SIGMA = 0.6
RESPONSE_CAP = 128
DECODE_TOKENS_PER_S = 200.0      # one sample's generation speed on a rollout worker
TRAIN_TOKENS_PER_S = 30_000.0    # a trainer replica's speed (its share of the batch)
SYNC_S = 0.05                    # a weight sync, each member
CHECKPOINT_S = 0.5               # a checkpoint round, each phase


def synthesise(run_dir: Path, samples: int, seed: int = 0, sets: list[str] = ()) -> dict:
    """A run directory of about ``samples`` finished samples (module docstring); returns counts.
    ``sets``: further config overrides (e.g. ``reflow.mode=sync``)."""
    cfg = load(str(ROOT / "configs" / "cpu_tiny.toml"),
               SETTINGS + [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", "trainer.steps=1000000000",
                           *sets], check_files=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    c = build_coordinator(cfg)
    trainers, rollouts = pools(cfg)
    rng, nprng = random.Random(seed), np.random.default_rng(seed)
    writers = {w: ShardWriter(run_dir / "shards" / f"rank{w:05d}", w, cfg.storage) for w in rollouts}
    loaded = {w: 0 for w in rollouts}            # the version each rollout worker holds
    pool_tokens = nprng.integers(3, 60, 1 << 16, dtype=np.int32)
    pool_logp = -nprng.exponential(1.0, 1 << 16).astype(np.float32)
    heap: list = []
    seq = 0

    def later(t: float, *item) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, *item))
        seq += 1

    events = (run_dir / "events.jsonl").open("w")
    metrics = (run_dir / "metrics.jsonl").open("w")
    step_metrics = StepMetrics(cfg.reflow.mode)
    finished = 0
    t0 = 1.8e9                                   # a plausible Unix time for the synthetic clock
    free_since = {w: t0 for w in trainers}       # when each trainer replica last became free
    meta: dict[int, tuple[int, int, int, float]] = {}    # sample id -> (group, prompt, lo version, reward p)

    busy: dict[int, float] = {}                  # a worker trains, syncs and checkpoints one thing at a time

    def serial(w: int, now: float, seconds: float) -> float:
        """Start a command of ``w`` once its previous one is done; returns the start."""
        start = max(now, busy.get(w, now))
        busy[w] = start + seconds
        return start

    version = 0                                  # the trainer's policy version

    def drain(now: float, out: Outputs) -> None:
        nonlocal version
        if out.log:
            events.write("".join(encode(e) + "\n" for e in out.log))
        for rec in out.steps:
            metrics.write(json.dumps({"time": now, **step_metrics(rec)}) + "\n")
            version = rec.version + 1
        for cmd in out.commands:
            if isinstance(cmd, Dispatch):
                for s in cmd.samples:
                    n = int(min(RESPONSE_CAP, max(1, nprng.lognormal(np.log(RESPONSE_MEDIAN), RESPONSE_SIGMA))))
                    p = 0.2 + 0.5 * version / (version + 2000.0)
                    meta[s.sample_id] = (s.group_id, s.prompt_id, loaded[cmd.worker], p)
                    later(now + n / DECODE_TOKENS_PER_S * rng.uniform(0.8, 1.25), "finish", cmd.worker, s.sample_id, n)
            elif isinstance(cmd, Train):
                tokens = len(cmd.samples) * RESPONSE_MEDIAN
                start = serial(cmd.worker, now, tokens / TRAIN_TOKENS_PER_S)
                later(busy[cmd.worker], "step", cmd.worker, cmd.step, tokens, start - free_since[cmd.worker])
            elif isinstance(cmd, SyncWeights):
                serial(cmd.worker, now, SYNC_S)
                later(busy[cmd.worker], "sync", cmd.worker, cmd.version)
            elif isinstance(cmd, FlushTrajectories):
                serial(cmd.worker, now, CHECKPOINT_S)
                later(busy[cmd.worker], "flushed", cmd.worker, cmd.tag)
            elif isinstance(cmd, WriteCheckpoint):
                serial(cmd.worker, now, CHECKPOINT_S)
                later(busy[cmd.worker], "written", cmd.worker, cmd.tag)
            # Drop, Cancel, SetCap, Snapshot: nothing to model

    drain(t0, c.handle(ev.Start(t0)))
    for w in range(cfg.resources.workers):
        drain(t0, c.handle(ev.Ready(w, t0)))
    while heap and finished < samples:
        now, _, kind, w, *rest = heapq.heappop(heap)
        if kind == "finish":
            sid, n = rest
            group, prompt, lo, p = meta.pop(sid)
            hi = loaded[w]
            plen = rng.randint(*PROMPT_TOKENS)
            k = rng.randrange(len(pool_tokens) - plen - n)
            versions = np.full(plen + n, -1, np.int32)
            versions[plen:] = lo
            if hi > lo:                              # a sync landed mid-sample: its tail is newer
                versions[plen + n // 2:] = hi
            reward = float(rng.random() < p)
            span = slice(k, k + plen + n)
            traj = Trajectory(sid, group, prompt, pool_tokens[span], np.where(versions >= 0, pool_logp[span], 0.0),
                              versions, plen, reward, "stop" if n < RESPONSE_CAP else "length", w)
            loc = writers[w].append([traj], now=now)[0]
            finished += 1
            out = c.handle(ev.SamplesFinished(w, now, [ev.FinishedSample(
                sid, reward, lo, hi, n, traj.finish_reason, [loc.segment, loc.row], plen + n)]))
        elif kind == "step":
            step, tokens, idle = rest
            free_since[w] = now
            out = c.handle(ev.StepDone(w, now, step, {"tokens": float(tokens)}, idle))
        elif kind == "sync":
            (published,) = rest
            if w in loaded:
                loaded[w] = published
            out = c.handle(ev.WeightsLoaded(w, now, published, SYNC_S))
        elif kind == "flushed":
            out = c.handle(ev.TrajectoriesFlushed(w, now, rest[0], {}))
        else:
            out = c.handle(ev.CheckpointWritten(w, now, rest[0], str(run_dir / "checkpoints" / rest[0])))
        drain(now, out)
    for wr in writers.values():
        wr.close()
    events.close()
    metrics.close()
    summary = {**c.summary(), "synthetic": True}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    roles = summary["roles"]
    (run_dir / "topology.json").write_text(json.dumps(
        {"world_size": cfg.resources.workers, "ranks": [{"rank": r, "role": roles[r]} for r in sorted(roles)],
         "config": to_dict(cfg)}, indent=1) + "\n")
    return {"samples": finished, "steps": summary["steps"], "created": summary["buffer"]["buffer/created"],
            "shard_bytes": sum(p.stat().st_size for p in (run_dir / "shards").rglob("*.h5")),
            "event_lines": sum(1 for _ in open(run_dir / "events.jsonl", "rb"))}


def timed(args: list[str]) -> dict:
    """One analysis in a fresh process pinned to one core: wall and CPU seconds, peak RSS, its JSON."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)     # CPU time of this child alone: after - before
    core = sorted(os.sched_getaffinity(0))[0] if hasattr(os, "sched_getaffinity") else None
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "reflow_hpc.analyze", *args, "--json"], cwd=ROOT, capture_output=True,
                       text=True, preexec_fn=pin)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"bench_analyze: analysis failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "peak_rss_mib": res["peak_rss_mib"], "result": res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--dir", help="where to synthesise the run (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesised run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override of the synthesised run (e.g. reflow.mode=sync reflow.sigma=0)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_analyze-"))
    run_dir = base / "run"
    try:
        print(f"bench_analyze: synthesising {args.samples} samples in {run_dir} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        synth = synthesise(run_dir, args.samples, args.seed, args.sets)
        synth_s = time.perf_counter() - t0
        runs = [("report, no plots", ["--no-plots"]), ("report + plots", []),
                ("what-if, run's settings", ["--no-plots", "--what-if"]),
                ("what-if sigma=0.25", ["--no-plots", "--what-if", "reflow.sigma=0.25"])]
        rows = []
        for name, extra in runs:
            print(f"bench_analyze: {name} ...", file=sys.stderr, flush=True)
            m = timed([str(run_dir), "--out", str(base / "analysis"), *extra])
            res = m.pop("result")
            rows.append({"analysis": name, **m, "samples": res["samples"],
                         "cpu_per_M_s": m["cpu_s"] * 1e6 / max(1, res["samples"]),
                         "wall_per_M_s": m["wall_s"] * 1e6 / max(1, res["samples"]),
                         "reproduces_run": res.get("reproduces_run"), "unreadable": len(res["unreadable"])})
        print(f"synthesised: {synth['samples']} samples, {synth['steps']} steps, {synth['event_lines']} event lines, "
              f"{synth['shard_bytes'] / 2**20:.0f} MiB of shards in {synth_s:.0f} s")
        print(table(rows, [("analysis", "analysis", "{}"), ("samples", "samples", "{}"), ("wall s", "wall_s", "{:.1f}"),
                           ("cpu s", "cpu_s", "{:.1f}"), ("cpu s per 1M", "cpu_per_M_s", "{:.1f}"),
                           ("wall s per 1M", "wall_per_M_s", "{:.1f}"), ("peak MiB", "peak_rss_mib", "{:.0f}"),
                           ("reproduces", "reproduces_run", "{}"), ("unreadable", "unreadable", "{}")]))
        # CPU time is what one core spends; wall time also counts waiting for a core on a shared host.
        cpu, wall = rows[1]["cpu_per_M_s"], rows[1]["wall_per_M_s"]
        print(f"1 M samples, report + plots, on one core: {cpu:.1f} s of CPU, {wall:.1f} s wall (target < 60 s)")
        if args.json:
            print(json.dumps({"synthesis": {**synth, "seconds": synth_s}, "analyses": rows, "cpu_s_per_million": cpu,
                              "wall_s_per_million": wall, "reproduces_run": rows[2]["reproduces_run"]}))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
