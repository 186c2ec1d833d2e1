"""Generation throughput of the rollout engines (torch, vLLM) and of transformers ``generate``.

    python tools/bench_engine.py [--engines torch,generate] [--requests 256] [--concurrency 32]
                                 [--threads 1] [--model DIR] [--json]
    .venv-vllm/bin/python tools/bench_engine.py --engines torch,vllm      # vLLM: from its venv

Every engine named by ``--engines`` (``torch``, ``vllm``, ``generate``) runs the same model on the
same workload in the same process: ``--requests`` requests with random prompts and long-tailed
response lengths (log-normal, capped), enforced through each request's ``max_new_tokens`` with no
stop ids, all submitted at t = 0. The torch and vLLM engines run them with continuous batching at
``--concurrency`` (same KV budget and context limit); ``generate`` runs static batches of the same
size in submission order, each batch generating until its longest member is done. Only each
request's own tokens count as useful. Reported per engine: useful tokens/s, time to first token
and request latency (p50/p99, from t = 0), and each throughput as a ratio of the first engine's.
vLLM runs last: its CPU worker pins torch's thread count for the rest of the process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch


def tiny_model(vocab: int, seed: int):
    """A ~3M-parameter random-weight Qwen3 (GQA 8:2, tied embeddings)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3ForCausalLM(cfg).eval()


def workload(n: int, vocab: int, prompt_range: tuple[int, int], median: float, sigma: float, cap: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).astype(np.int32)
               for _ in range(n)]
    lengths = np.clip(np.round(rng.lognormal(math.log(median), sigma, size=n)), 1, cap).astype(int)
    return prompts, lengths.tolist()


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run_engine(engine, prompts, lengths) -> dict:
    """Submit every request at t = 0 to an (empty) engine and step it until all are done."""
    from reflow_hpc.rollout.engine import Request, SamplingParams
    first, finish, produced = {}, {}, 0
    before = engine.stats()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add(Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=n)))
    while engine.has_unfinished():
        done = engine.step()
        now = time.perf_counter() - t0
        for rid in engine.running_ids():
            first.setdefault(rid, now)
        for c in done:
            first.setdefault(c.request_id, now)
            finish[c.request_id] = now
            produced += len(c.response)
    wall = time.perf_counter() - t0
    assert produced == sum(lengths), (produced, sum(lengths))
    stats = engine.stats()
    return {"wall_s": wall, "tokens_per_s": produced / wall, "ttft": list(first.values()),
            "latency": list(finish.values()), "preemptions": stats.preemptions - before.preemptions}


def build_engines(names: list[str], model, concurrency: int, kv_budget: int, max_model_len: int, model_dir: str,
                  eager: bool) -> dict:
    """The continuous-batching engines named, each over its own copy of the model's weights."""
    import copy
    engines = {}
    if "torch" in names:
        from reflow_hpc.rollout.torch_engine import TorchEngine
        engines["torch"] = TorchEngine(copy.deepcopy(model), max_concurrency=concurrency, kv_budget_tokens=kv_budget,
                                       max_model_len=max_model_len, seed=0)
    if "vllm" in names:
        from reflow_hpc.rollout.vllm_engine import VllmEngine
        t0 = time.perf_counter()
        engines["vllm"] = VllmEngine(model_dir, max_concurrency=concurrency, kv_budget_tokens=kv_budget,
                                     max_model_len=max_model_len, seed=0, dtype="float32", enforce_eager=eager)
        engines["vllm"].start_s = time.perf_counter() - t0
    return engines


class _FirstCall:
    """A logits processor that records when generate first samples (the batch's first token)."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def run_generate(model, prompts, lengths, batch: int) -> dict:
    from transformers import LogitsProcessorList
    ttft, latency, useful = [], [], 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        ps, ns = prompts[start:start + batch], lengths[start:start + batch]
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for i, p in enumerate(ps):   # left padding, as generate expects for decoder-only models
            ids[i, width - len(p):] = torch.from_numpy(p.astype(np.int64))
            mask[i, width - len(p):] = 1
        probe = _FirstCall()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max(ns), min_new_tokens=max(ns), pad_token_id=0,
                             logits_processor=LogitsProcessorList([probe]))
        now = time.perf_counter() - t0
        assert out.shape[1] - width == max(ns)
        useful += sum(ns)
        ttft += [probe.at - t0] * len(ps)
        latency += [now] * len(ps)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": useful / wall, "ttft": ttft, "latency": latency}


def summary(r: dict) -> dict:
    out = {"tokens_per_s": round(r["tokens_per_s"], 1), "wall_s": round(r["wall_s"], 3),
           "ttft_p50_s": round(percentile(r["ttft"], 50), 4), "ttft_p99_s": round(percentile(r["ttft"], 99), 4),
           "latency_p50_s": round(percentile(r["latency"], 50), 4),
           "latency_p99_s": round(percentile(r["latency"], 99), 4)}
    if "preemptions" in r:
        out["preemptions"] = r["preemptions"]
    return out


LABELS = {"torch": "torch engine (continuous)", "vllm": "vllm engine (continuous)",
          "generate": "transformers generate (static)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="torch,generate",
                    help="comma-separated, first is the ratios' base: torch, vllm, generate")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32, help="engine slots = generate batch size")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=48)
    ap.add_argument("--median-len", type=float, default=32.0, help="median response length")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of response lengths")
    ap.add_argument("--max-len", type=int, default=256, help="cap on response length")
    ap.add_argument("--kv-budget", type=int, default=0, help="engine KV budget in tokens (0 = no preemption)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--model", default="", help="Hugging Face model directory (default: a tiny Qwen3 built here)")
    ap.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (default: eager)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in LABELS]
    if unknown or not names or len(set(names)) != len(names):
        ap.error(f"--engines {args.engines!r}: a list of distinct names among {', '.join(LABELS)}")
    names.sort(key=lambda n: n == "vllm")     # vLLM last (thread pinning), the base stays first otherwise
    base = [n.strip() for n in args.engines.split(",") if n.strip()][0]

    # vLLM keeps torch at one thread unless OMP_NUM_THREADS says otherwise: the same count for all.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="bench_engine_")
    if args.model:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        model_dir = args.model
    else:
        model = tiny_model(vocab=128, seed=args.seed)
        model_dir = tmp.name
        model.save_pretrained(model_dir)     # vLLM loads from a directory; the same weights
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    prompts, lengths = workload(args.requests, vocab, (args.prompt_min, args.prompt_max), args.median_len,
                                args.sigma, args.max_len, args.seed)
    max_model_len = args.prompt_max + args.max_len
    kv_budget = args.kv_budget or args.concurrency * max_model_len
    engines = build_engines(names, model, args.concurrency, kv_budget, max_model_len, model_dir,
                            eager=not args.vllm_compile)

    results = {}
    with torch.inference_mode():
        for name in names:
            # Warm-up (allocator, kernels) on a few requests, untimed; then the timed run.
            if name == "generate":
                run_generate(model, prompts[:4], [4] * 4, 4)
                results[name] = run_generate(model, prompts, lengths, args.concurrency)
            else:
                run_engine(engines[name], prompts[:4], [4] * 4)
                results[name] = run_engine(engines[name], prompts, lengths)
    tmp.cleanup()

    rows = {name: summary(results[name]) for name in names}
    ratios = {name: results[name]["tokens_per_s"] / results[base]["tokens_per_s"] for name in names}
    print(f"model: {params / 1e6:.2f}M parameters, vocab {vocab}; threads {args.threads}; "
          f"{args.requests} requests, concurrency/batch {args.concurrency}; response lengths "
          f"p50 {int(np.median(lengths))} p99 {int(np.percentile(lengths, 99))} max {max(lengths)}; "
          f"useful tokens {sum(lengths)}")
    if "vllm" in engines:
        print(f"vllm engine: started in {engines['vllm'].start_s:.1f} s "
              f"({'torch.compile' if args.vllm_compile else 'eager'})")
    head = (f"{'engine':32} {'tokens/s':>10} {'ratio':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'lat p50':>8} "
            f"{'lat p99':>8} {'wall s':>8} {'preempt':>8}")
    print(head)
    print("-" * len(head))
    for name in [n.strip() for n in args.engines.split(",") if n.strip()]:
        r = rows[name]
        print(f"{LABELS[name]:32} {r['tokens_per_s']:>10.1f} {ratios[name]:>6.2f}x {r['ttft_p50_s']:>9.3f} "
              f"{r['ttft_p99_s']:>9.3f} {r['latency_p50_s']:>8.3f} {r['latency_p99_s']:>8.3f} {r['wall_s']:>8.2f} "
              f"{r.get('preemptions', '-'):>8}")
    print(f"ratios are tokens/s over the {LABELS[base]}'s")
    if args.json:
        out = {"bench": "engine", "params": params, "threads": args.threads, "requests": args.requests,
               "concurrency": args.concurrency, "useful_tokens": int(sum(lengths)), "base": base}
        out.update({name: dict(rows[name], ratio=round(ratios[name], 3)) for name in names})
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
