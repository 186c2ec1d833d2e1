"""Request→reply latency of the sandbox's fork servers, per tier available here.

    python tools/bench_sandbox.py                 # a table, one row per usable tier
    python tools/bench_sandbox.py --json          # one JSON object: the best tier's numbers

Each row: ``--clients`` threads (default 2) call ``Sandbox.run("pass")`` back to back on a pool of as
many fork servers (``sandbox.concurrency``), ``--runs`` runs each after ``--warmup``; the latency of a
call is from the request to the reply in the trainer (fork, confinement, execution, collection and
scratch wipe included). Reported: p50 and p99 in ms, and runs per second over all clients. The rlimits
tier is measured too (as if ``sandbox.allow_weak = true``), for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reflow_hpc.config import SandboxConfig  # noqa: E402
from reflow_hpc.sandbox import Sandbox, probe  # noqa: E402


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(tier: str, clients: int, runs: int, warmup: int) -> dict:
    cfg = SandboxConfig(tier=tier, allow_weak=True, concurrency=clients, recycle_every=0)
    with Sandbox(cfg, quiet=True) as sb:
        sb.start()
        for _ in range(warmup):
            r = sb.run("pass")
            if r.exit_code != 0:
                raise SystemExit(f"bench_sandbox: tier {tier}: a run of `pass` failed: {r}")
        lat: list[list[float]] = [[] for _ in range(clients)]
        failed = []

        def client(i: int) -> None:
            for _ in range(runs):
                t = time.perf_counter()
                r = sb.run("pass")
                lat[i].append(time.perf_counter() - t)
                if r.exit_code != 0:
                    failed.append(r)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"bench_sandbox: tier {tier}: {len(failed)} runs failed, first: {failed[0]}")
    all_lat = [x for xs in lat for x in xs]
    return {"tier": tier, "latency_p50_ms": round(_percentile(all_lat, 0.5) * 1e3, 3),
            "latency_p99_ms": round(_percentile(all_lat, 0.99) * 1e3, 3),
            "runs_per_s": round(len(all_lat) / wall, 1), "clients": clients, "runs": len(all_lat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2, help="concurrent clients (and fork servers)")
    ap.add_argument("--runs", type=int, default=500, help="runs per client")
    ap.add_argument("--warmup", type=int, default=20, help="runs before measuring")
    ap.add_argument("--json", action="store_true", help="print the best tier's numbers as one JSON object")
    args = ap.parse_args(argv)
    rows = [measure(p.tier, args.clients, args.runs, args.warmup) for p in probe() if p.usable]
    if args.json:
        print(json.dumps({**rows[0], "tiers": {r["tier"]: {k: r[k] for k in ("latency_p50_ms", "latency_p99_ms",
                                                                              "runs_per_s")} for r in rows}}))
        return 0
    print(f"{'tier':>9} {'p50 ms':>8} {'p99 ms':>8} {'runs/s':>8}  ({args.clients} clients x {args.runs} runs)")
    for r in rows:
        print(f"{r['tier']:>9} {r['latency_p50_ms']:>8.2f} {r['latency_p99_ms']:>8.2f} {r['runs_per_s']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
