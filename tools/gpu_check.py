"""The GPU path in one prepared run (≤ 8 minutes on one GPU): what CPUs cannot show.

    python tools/gpu_check.py [--config configs/qwen3_small_1gpu.toml] [--json-only]
    python tools/gpu_check.py --allow-cpu --small     # the same code on CPU with a tiny model (a test runs it)

Checks, each timed and reported even when another fails:

1. ``engine``: the torch engine on CUDA generates a batch of requests of the small config's model
   (random weights, the architecture of ``model.init_config``), and its recorded log-probs match the
   model's own recomputation.
2. ``trainer_bf16``: two trainer steps in bfloat16 on those completions, the second timed (finite loss and gradient
   norm, parameters changed).
3. ``weight_sync``: two ranks on the GPU sync the model's weights with the bucketed broadcast,
   first over NCCL (which refuses two ranks on one GPU on most versions: then reported, not
   hidden), then over gloo with CUDA tensors (the code path is the same); bucket bandwidth in GB/s.
4. ``telemetry``: NVML readings of the GPU (utilisation, memory, power) and the GPUs it lists.
5. ``throughput``: the small config's generation and training tokens/s (engine and trainer in one
   process, as the colocated sync mode runs them on one GPU).
6. ``launch``: ``python -m reflow_hpc.run`` of the small config for 4 steps (needs mpi4py with an MPI
   library): ``throughput_tokens_per_s`` of its steps and the ``gpu/*`` telemetry in its metrics.

Prints one line per check, then one JSON object on the last line: ``ok`` (every check that ran
passed), ``checks`` (per check: ok, seconds, numbers or error) and ``untested`` (what could not run
here, and why). Exit code 1 when a check failed, 2 when no GPU is there and ``--allow-cpu`` is not given.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    # Used only to let the two spawned ranks meet; the rank that listens binds it at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_rank(rank: int, backend: str, port: int, config: dict, bucket_mb: float, device: str, out: Any) -> None:
    """One of two ranks: rank 0 sends a model's weights in buckets, rank 1 receives and compares."""
    import datetime

    import torch
    import torch.distributed as dist

    from reflow_hpc.train.weight_sync import WeightSync

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60), **kw)
        model = _build(config, device, seed=rank)
        sync = WeightSync.for_model(model, src=0, bucket_mb=bucket_mb, device=device, timeout_s=60)
        rounds, seconds, nbytes = 3, [], 0
        for _ in range(rounds):
            if rank == 0:
                st = sync.send((n, p.detach()) for n, p in model.named_parameters())
            else:
                with torch.no_grad():
                    params = dict(model.named_parameters())
                    for name, t in sync.receive():
                        params[name].copy_(t)
                st = sync.last
            seconds.append(st.seconds)
            nbytes = st.bytes
        # The receiver must now hold the sender's weights: compare a digest over the group.
        with torch.no_grad():
            digest = torch.stack([p.double().sum() for p in model.parameters()]).sum().reshape(1)
        both = [torch.zeros_like(digest) for _ in range(2)]
        dist.all_gather(both, digest)
        same = bool(both[0].item() == both[1].item())
        if rank == 0:
            best = min(seconds[1:]) if len(seconds) > 1 else seconds[0]    # the first sync verifies the specs
            out.put({"ok": same, "bytes": nbytes, "buckets": len(sync.buckets), "seconds": round(best, 4),
                     "gb_per_s": round(nbytes / best / 1e9, 2), "weights_equal": same})
        dist.destroy_process_group()
    except Exception as e:
        if rank == 0:
            out.put({"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"})


def _build(config: dict, device: str, seed: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    raw = dict(config)
    hf = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    with torch.device(device):         # random init on the device itself: seconds, not minutes, for 0.6 B
        model = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, raw.pop("_dtype", "bfloat16")))
    return model.eval()


class Checks:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.results: dict[str, dict] = {}
        self.untested: list[str] = []

    def run(self, name: str, fn: Callable[[], dict]) -> dict:
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0],
                   "trace": traceback.format_exc(limit=4)}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        self.results[name] = res
        if not self.quiet:
            shown = {k: v for k, v in res.items() if k != "trace"}
            print(f"{'ok    ' if res.get('ok') else 'FAILED'} {name}: {json.dumps(shown)}", flush=True)
            if not res.get("ok") and "trace" in res:
                print(res["trace"], file=sys.stderr, flush=True)
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3_small_1gpu.toml"))
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU when no GPU is there")
    ap.add_argument("--small", action="store_true", help="a tiny model instead of the config's (fast)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the config's rollout.max_new_tokens")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args()

    import numpy as np
    import torch

    from reflow_hpc import config as C

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(json.dumps({"ok": False, "error": "no CUDA device (torch.cuda.is_available() is False)",
                          "torch": torch.__version__}))
        return 2
    device = "cuda:0" if cuda else "cpu"
    cfg = C.load(args.config, [], check_files=False)
    arch = json.loads((ROOT / cfg.model.init_config).read_text())
    if args.small:
        arch.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)
    dtype = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    arch["_dtype"] = dtype
    new_tokens = args.max_new_tokens or (16 if args.small else cfg.rollout.max_new_tokens)
    checks = Checks(args.json_only)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "dtype": dtype, "cuda": torch.version.cuda, "params": None}
    if cuda:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    state: dict[str, Any] = {}

    def engine_check() -> dict:
        from reflow_hpc.rollout.engine import Request, SamplingParams
        from reflow_hpc.rollout.torch_engine import TorchEngine
        from reflow_hpc.train.loss import token_logprobs

        model = _build(arch, device)
        env["params"] = sum(p.numel() for p in model.parameters())
        state["model"] = model
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        prompts = [rng.integers(0, min(vocab, 5000), size=int(rng.integers(16, 64))).astype(np.int32)
                   for _ in range(args.requests)]
        engine = TorchEngine(model, max_concurrency=args.requests, kv_budget_tokens=args.requests * (64 + new_tokens),
                             max_model_len=64 + new_tokens, seed=0)
        # Warm-up (CUDA context, kernels, allocator) outside the timed run.
        for i, p in enumerate(prompts[:4]):
            engine.add(Request(10_000 + i, p, SamplingParams(temperature=1.0, max_new_tokens=8)))
        while engine.has_unfinished():
            engine.step()
        for i, p in enumerate(prompts):
            engine.add(Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens)))
        out = []
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            out += engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        generated = sum(len(c.response) for c in out)
        state["completions"] = out
        # The recorded log-probs are the model's: recompute one completion's with a full forward pass.
        c = out[0]
        ids = torch.as_tensor(np.concatenate([c.prompt, c.response]), dtype=torch.long, device=device)[None]
        with torch.no_grad():
            logp, _ = token_logprobs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:], 1.0)
        recomputed = logp[0, len(c.prompt) - 1:].float().cpu().numpy()
        gap = float(np.abs(recomputed - c.logprobs).max())
        tol = 0.1 if dtype == "bfloat16" else 1e-3          # bf16 kernels differ between decode and full pass
        return {"ok": len(out) == args.requests and gap < tol, "requests": len(out), "generated_tokens": generated,
                "tokens_per_s": round(generated / wall, 1), "logprob_max_gap": round(gap, 5), "tolerance": tol}

    def trainer_check() -> dict:
        from reflow_hpc.train.trainer import Trainer, WeightedSample
        from reflow_hpc.trajectory import Trajectory

        model, comps = state["model"], state["completions"]
        items = []
        for i, c in enumerate(comps[:16]):
            tokens = np.concatenate([c.prompt, c.response])
            lp = np.concatenate([np.zeros(len(c.prompt), np.float32), c.logprobs])
            ver = np.concatenate([np.full(len(c.prompt), -1, np.int32), c.versions])
            items.append(WeightedSample(Trajectory(i, i // 4, i // 4, tokens, lp, ver, len(c.prompt)),
                                        advantage=1.0 if i % 2 else -1.0, weight=1.0))
        tcfg = C.load(args.config, ["trainer.micro_batch_size=4", "trainer.batch_size=16"], check_files=False)
        trainer = Trainer(model, tcfg, device)
        before = next(model.parameters()).detach().float().clone()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        n_tokens = sum(it.trajectory.num_loss_tokens for it in items)
        first = trainer.train_step(items, n_tokens)
        changed = bool((next(model.parameters()).detach().float() - before).abs().max() > 0)
        m = trainer.train_step(items, n_tokens)          # the second step: warm kernels and allocator
        ok = all(math.isfinite(x[k]) for x in (first, m) for k in ("loss", "grad_norm")) and changed
        res = {"ok": ok, "loss": round(first["loss"], 5), "grad_norm": round(first["grad_norm"], 4),
               "first_step_s": round(first["seconds"], 3), "step_s": round(m["seconds"], 3), "tokens": m["tokens"],
               "parameters_changed": changed, "train_tokens_per_s": round(m["tokens"] / m["seconds"], 1)}
        if cuda:
            res["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
        state["trainer"] = trainer
        return res

    def sync_check() -> dict:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        res: dict[str, Any] = {}
        backends = ["nccl", "gloo"] if cuda else ["gloo"]
        for backend in backends:
            q = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=_sync_rank, args=(r, backend, port, arch, cfg.trainer.sync_bucket_mb,
                                                          device, q)) for r in range(2)]
            for p in procs:
                p.start()
            try:
                got = q.get(timeout=240)
            except Exception:
                got = {"ok": False, "error": "no result within 240 s"}
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            res[backend] = got
        if cuda and not res["nccl"].get("ok"):
            checks.untested.append(f"NCCL weight sync between two ranks on one GPU: {res['nccl'].get('error')}")
        ok = all(r.get("ok") for b, r in res.items() if b == "gloo" or r.get("ok"))
        return {"ok": ok, **res}

    def telemetry_check() -> dict:
        from reflow_hpc.runtime.telemetry import GpuTelemetry, nvml_gpus
        gpus = nvml_gpus()
        if not cuda:
            checks.untested.append("NVML telemetry: no GPU")
            return {"ok": True, "gpus": gpus, "reading": None}
        tel = GpuTelemetry.open(device, 0)
        reading = tel.read() if tel is not None else {}
        ok = bool(gpus) and {"util", "mem_gib", "power_w"} <= set(reading)
        return {"ok": ok, "gpus": gpus, "reading": reading}

    def throughput_check() -> dict:
        # Generation, then a step on what was generated, as the colocated mode does on one GPU.
        eng = checks.results.get("engine", {})
        tr = checks.results.get("trainer_bf16", {})
        if not (eng.get("ok") and tr.get("ok")):
            return {"ok": False, "error": "needs the engine and trainer checks to pass"}
        gen_s = eng["generated_tokens"] / eng["tokens_per_s"]
        return {"ok": True, "generation_tokens_per_s": eng["tokens_per_s"],
                "train_tokens_per_s": tr["train_tokens_per_s"],
                "note": f"{args.requests} requests × up to {new_tokens} new tokens in {gen_s:.1f} s"}

    checks.run("engine", engine_check)
    checks.run("trainer_bf16", trainer_check)
    state.pop("trainer", None)
    state.pop("model", None)
    if cuda:
        torch.cuda.empty_cache()
    checks.run("weight_sync", sync_check)
    checks.run("telemetry", telemetry_check)
    checks.run("throughput", throughput_check)

    def launch_check() -> dict:
        # The small config for real: mpiexec-launched rank, coordinator thread, colocated sync mode.
        import subprocess
        import tempfile
        out_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        cmd = [sys.executable, "-m", "reflow_hpc.run", args.config, "--set", f"run.output_dir={out_dir}",
               "--set", f"storage.dir={out_dir / 'scratch'}",
               "--set", "run.name=gpu_check", "--set", "trainer.steps=4", "--set", "run.eval_prompts=0",
               "--set", f"model.path={out_dir / 'model'}"]
        if args.small:
            cmd += ["--set", "model.init_config=", "--set", "model.warmstart=true", "--set", "warmstart.steps=5",
                    "--set", "model.dtype=float32", "--set", "rollout.max_new_tokens=32", "--set", "rollout.max_model_len=0",
                    "--set", "warmstart.eval_prompts=0"]
        if not cuda:
            cmd += ["--set", "resources.device=cpu"]
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            metrics = out_dir / "gpu_check" / "metrics.jsonl"
            rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        steps = [x for x in rows if "throughput_tokens_per_s" in x]
        if r.returncode != 0 or not steps:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            return {"ok": False, "error": f"exit {r.returncode}: " + " | ".join(tail)}
        later = steps[1:] or steps           # the first step pays for the engine's warm-up
        res = {"ok": True, "steps": len(steps),
               "throughput_tokens_per_s": round(sum(x["throughput_tokens_per_s"] for x in later) / len(later), 1),
               "gpu_metrics": sorted(k for k in steps[-1] if k.startswith("gpu/"))}
        if cuda and not res["gpu_metrics"]:
            res.update(ok=False, error="no gpu/* telemetry in the step metrics")
        return res

    try:
        # Without MPI_Init here: a singleton init (Open MPI's) leaves launcher variables in this process's
        # environment, and the launched run would take itself for a rank and skip building its policy.
        import mpi4py
        mpi4py.rc.initialize = False
        from mpi4py import MPI
        MPI.Get_library_version()
        checks.run("launch", launch_check)
    except Exception as e:
        checks.untested.append(f"the MPI launch of the small config (python -m reflow_hpc.run): mpi4py: "
                               f"{type(e).__name__}: {e}".splitlines()[0])
    if not cuda:
        checks.untested.append("CUDA, bf16 and NCCL: ran on CPU (--allow-cpu)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        checks.untested.append("vLLM engine: vllm is not installed here")
    ok = all(r.get("ok") for r in checks.results.values())
    summary = {"ok": ok, "env": env, "checks": {k: {kk: vv for kk, vv in v.items() if kk != "trace"}
                                                 for k, v in checks.results.items()},
               "untested": checks.untested}
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
