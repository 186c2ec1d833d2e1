"""Do slow tool calls stall decoding? Engine tokens/s with sleeping tools vs instant ones, side by side.

    python tools/bench_tools.py [--engines torch] [--samples 240] [--concurrency 16] [--tool-fraction 0.2]
                                [--sleep-ms 200] [--repeats 2] [--json]
    .venv-vllm/bin/python tools/bench_tools.py --engines torch,vllm      # vLLM: from its venv

One episode runner (``reflow_hpc.rollout.episodes.EpisodeRunner``, the rollout worker's) over each
engine, a random-weight tiny Qwen3 over the tiny policy's character tokenizer, and a multi-turn task
made for the measurement: a model turn ends on eos or one of three common characters; in
``--tool-fraction`` of the samples (every fifth prompt at 0.2) the first turn is a tool call whose
tool sleeps ``--sleep-ms`` (no CPU) and answers ``<tool_response>ok</tool_response>``, after which the
sample generates a second turn; the other samples end after one turn. The *instant* workload is the
same with a tool that returns at once. ``--samples`` samples run through the runner with the engine
kept full: a new sample is added whenever fewer than ``--concurrency`` requests are in the engine
(samples waiting for a tool are outside it). Reported per engine and workload: engine tokens/s
(tokens the engine generated ÷ wall time of the workload), tool calls and wall time, and the ratio
sleeping ÷ instant. Target: ≥ 0.9 (tool calls never stall decoding). Workloads alternate, ``--repeats``
times each after a warm-up; tokens/s is pooled over each workload's runs (all tokens ÷ all wall time).

Run it on an older checkout to measure the inline behaviour (every tool call on the engine loop): it
only uses what the runner had then (``add``, ``step``, ``in_flight``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]        # tools/ and the checkout this script is in

from bench_engine import build_engines, tiny_model  # noqa: E402

from reflow_hpc.config import load  # noqa: E402
from reflow_hpc.envs.task import Observation, Prompt, Task  # noqa: E402
from reflow_hpc.envs.tokenizer import build_char_tokenizer, vocabulary  # noqa: E402
from reflow_hpc.rollout.engine import SamplingParams  # noqa: E402
from reflow_hpc.rollout.episodes import EpisodeRunner  # noqa: E402

TURN_END = ("\n", "=", "#")       # with eos: a random model ends a turn every ~25 tokens


class SleepyTool(Task):
    """The benchmark's task: a fixed share of samples make one tool call that sleeps."""

    multi_turn = True

    def __init__(self, cfg, sleep_s: float, every: int):
        super().__init__(cfg)
        self.sleep_s, self.every = sleep_s, every
        self.calls = 0

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return Prompt(index, f"{index % 97}+{index % 89}=", "", {"tool": index % self.every == 0})

    def stop_token_ids(self, tokenizer) -> tuple[int, ...]:
        return (int(tokenizer.eos_token_id),) + tuple(int(tokenizer.convert_tokens_to_ids(c)) for c in TURN_END)

    def observe(self, episode, turn_text: str) -> Observation:
        if episode.prompt.meta["tool"] and episode.turns == 1:
            self.calls += 1
            if self.sleep_s > 0:
                time.sleep(self.sleep_s)
            return Observation("<tool_response>ok</tool_response>", done=False)
        return Observation(done=True, finish_reason="stop")

    def reward(self, prompt: Prompt, response: str) -> float:
        return 0.0


def run(engine, cfg, tok, sleep_s: float, every: int, samples: int, concurrency: int, max_new: int,
        first_id: int) -> dict:
    task = SleepyTool(cfg, sleep_s, every)
    runner = EpisodeRunner(engine, task, tok, SamplingParams(temperature=1.0, max_new_tokens=max_new), owner=0)
    waiting = getattr(runner, "waiting", lambda: 0)        # an older runner has no waiting samples
    added, finished = 0, 0
    tokens0 = engine.stats().generated_tokens
    t0 = time.perf_counter()
    while finished < samples:
        while added < samples and runner.in_flight - waiting() < concurrency:
            sid = first_id + added
            runner.add(sid, sid, sid)
            added += 1
        finished += len(runner.step())
        if runner.failed:
            raise RuntimeError(f"samples failed: {runner.failed[:3]}")
    wall = time.perf_counter() - t0
    if hasattr(runner, "close"):
        runner.close()
    tokens = engine.stats().generated_tokens - tokens0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "tool_calls": task.calls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="torch", help="comma-separated: torch, vllm (vllm from .venv-vllm)")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tool-fraction", type=float, default=0.2)
    ap.add_argument("--sleep-ms", type=float, default=200.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    names.sort(key=lambda n: n == "vllm")     # vLLM last: its CPU worker pins torch's threads
    every = max(1, round(1 / args.tool_fraction))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    import reflow_hpc
    tok = build_char_tokenizer(max_length=512)
    cfg = load(None, ["model.warmstart=true"])
    tmp = tempfile.TemporaryDirectory(prefix="bench_tools_")
    model = tiny_model(vocab=len(vocabulary()), seed=0)
    model.save_pretrained(tmp.name)
    max_len = 64 + args.max_new_tokens
    engines = build_engines(names, model, args.concurrency, args.concurrency * max_len, max_len, tmp.name, eager=True)
    print(f"bench_tools: reflow_hpc from {os.path.dirname(reflow_hpc.__file__)}; {args.samples} samples, "
          f"1 in {every} calls a tool, sleep {args.sleep_ms:g} ms, engine concurrency {args.concurrency}")
    out: dict = {"samples": args.samples, "tool_every": every, "sleep_ms": args.sleep_ms, "engines": {}}
    rows = []
    next_id = 0
    with torch.inference_mode():
        for name in names:
            engine = engines[name]
            run(engine, cfg, tok, 0.0, every, 16, args.concurrency, args.max_new_tokens, next_id)   # warm-up
            next_id += 1_000_000
            res: dict[str, list[dict]] = {"instant": [], "sleeping": []}
            for _ in range(args.repeats):
                for kind, sleep_s in (("instant", 0.0), ("sleeping", args.sleep_ms / 1000)):
                    res[kind].append(run(engine, cfg, tok, sleep_s, every, args.samples, args.concurrency,
                                         args.max_new_tokens, next_id))
                    next_id += 1_000_000
            # Pooled over the alternating runs (all tokens ÷ all wall time): other processes' load on a shared
            # machine comes and goes, and alternating spreads it over both workloads alike.
            mean = {k: sum(r["tokens"] for r in v) / sum(r["wall_s"] for r in v) for k, v in res.items()}
            ratio = mean["sleeping"] / mean["instant"]
            out["engines"][name] = {"instant_tokens_per_s": mean["instant"], "sleeping_tokens_per_s": mean["sleeping"],
                                    "ratio": ratio, "runs": res}
            print(f"{name}: per pair (sleeping ÷ instant): " + ", ".join(
                f"{s['tokens_per_s'] / i['tokens_per_s']:.2f}" for i, s in zip(res["instant"], res["sleeping"])))
            for kind in ("instant", "sleeping"):
                r = res[kind]
                rows.append((name, kind, mean[kind], sum(x["wall_s"] for x in r) / len(r),
                             sum(x["tool_calls"] for x in r) / len(r), ratio if kind == "sleeping" else 1.0))
    print(f"{'engine':8} {'tools':9} {'tokens/s':>10} {'wall s':>8} {'calls':>6} {'ratio':>6}")
    for name, kind, tps, wall, calls, ratio in rows:
        print(f"{name:8} {kind:9} {tps:10.0f} {wall:8.2f} {calls:6.0f} {ratio:6.2f}")
    for name, r in out["engines"].items():
        verdict = "ok" if r["ratio"] >= 0.9 else "BELOW 0.9"
        print(f"{name}: sleeping / instant tools = {r['ratio']:.2f} (target ≥ 0.9: {verdict})")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
