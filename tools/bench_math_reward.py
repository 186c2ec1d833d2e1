"""Latency of one math_reward call, by path, side by side in one run.

    python tools/bench_math_reward.py              # a table
    python tools/bench_math_reward.py --json       # and one JSON object on the last line

Paths: ``fast_equal`` (the normalised answer equals the reference: no other process),
``fast_integer`` (two different integers: no other process), ``verify`` (math-verify in its own
process: the answer is written differently from the reference; four pairs repeated), ``verify_new``
(the same, every pair new: math-verify caches its parses), ``verify_thread`` (``verify_new`` from a
non-main thread) and ``deadline`` (an answer that runs to the 2 s bound; the process is killed and a
fresh one is started and waited for by the next call, which this row includes). Each row is the
median and the 95th percentile of ``--calls`` calls (fewer for ``deadline``), after the process has
started. The ratio of ``verify_new`` to ``fast_equal`` says what the fast path saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from reflow_hpc.envs import math_reward
from reflow_hpc.envs.math_score import equivalence_process

CASES = {
    "fast_equal": [("Step by step ...\nAnswer: 34", "34"), (r"so \boxed{\frac{1}{2}}", r"\frac12")],
    "fast_integer": [("Step by step ...\nAnswer: 35", "34"), (r"\boxed{-7}", "7")],
    "verify": [(r"Answer: \frac{\sqrt2}{2}", r"\frac{1}{\sqrt2}"), ("Answer: 2^{10}", "1024"),
               (r"Answer: 3\sqrt2", r"\sqrt{18}"), (r"Answer: \{2,1\}", r"\{1,2\}")],
}


def distinct(k: int) -> tuple[str, str]:
    """A new pair each call: math-verify caches its parses, and a run rarely repeats an answer."""
    return [(rf"Answer: \frac{{{k}\sqrt2}}{{2}}", rf"\frac{{{k}}}{{\sqrt2}}"), (f"Answer: 2^{{{k}}}", str(2 ** k)),
            (rf"Answer: {k}\sqrt2", rf"\sqrt{{{2 * k * k}}}"), (rf"Answer: \{{{k},1\}}", rf"\{{1,{k}\}}")][k % 4]


def _time(cases, calls: int, first: int = 0) -> list[float]:
    out = []
    for i in range(first, first + calls):
        response, reference = cases(i) if callable(cases) else cases[i % len(cases)]
        t = time.perf_counter()
        math_reward(response, reference)
        out.append(time.perf_counter() - t)
    return out


def _row(name: str, xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"path": name, "calls": len(xs), "median_ms": 1e3 * statistics.median(xs),
            "p95_ms": 1e3 * xs[min(len(xs) - 1, int(0.95 * len(xs)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--deadline-calls", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args()
    t = time.perf_counter()
    equivalence_process().start()
    start_s = time.perf_counter() - t
    rows = [_row(name, _time(cases, args.calls)) for name, cases in CASES.items()]
    rows.append(_row("verify_new", _time(distinct, args.calls, first=2)))
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("xs", _time(distinct, args.calls, first=2 + args.calls)))
    th.start()
    th.join()
    rows.append(_row("verify_thread", box["xs"]))
    tower = [(r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "4")]
    xs = []
    for _ in range(args.deadline_calls):
        xs += _time(tower, 1)
        xs[-1] += _time(CASES["verify"][:1], 1)[0]   # the next call waits for the fresh process
    rows.append(_row("deadline", xs))
    print(f"{'path':<14} {'calls':>6} {'median ms':>10} {'p95 ms':>10}")
    for r in rows:
        print(f"{r['path']:<14} {r['calls']:>6} {r['median_ms']:>10.3f} {r['p95_ms']:>10.3f}")
    ratio = rows[3]["median_ms"] / rows[0]["median_ms"]
    print(f"process start {start_s:.2f} s; verify_new / fast_equal median: {ratio:.0f}x")
    if args.json:
        print(json.dumps({"rows": rows, "start_s": start_s, "verify_over_fast": ratio}))


if __name__ == "__main__":
    main()
