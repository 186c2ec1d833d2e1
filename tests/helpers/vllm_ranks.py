"""One rank of tests/cluster/test_vllm_engine.py's job test: the way a rollout worker builds its engine.

    python tests/helpers/vllm_ranks.py RANK WORLD PG_FILE POLICY_DIR

The job's torch.distributed world (gloo, file rendezvous) exists first; then the rank builds its
vLLM engine (vLLM builds its own groups over that world, a collective every rank enters), runs one
request and an all-reduce over the job's world to show it still works. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from reflow_hpc.rollout.engine import Request, SamplingParams
from reflow_hpc.rollout.vllm_engine import VllmEngine


def main() -> None:
    rank, world, pg_file, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    t0 = time.perf_counter()
    engine = VllmEngine(policy, max_concurrency=2, kv_budget_tokens=256, max_model_len=64, seed=0)
    built_s = time.perf_counter() - t0
    engine.add(Request(rank, np.arange(5, dtype=np.int32) + 20, SamplingParams(max_new_tokens=8)))
    out = []
    for _ in range(100):                      # bounded: 8 tokens take 8 steps
        out += engine.step()
        if not engine.has_unfinished():
            break
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print("RESULT " + json.dumps({"rank": rank, "built_s": built_s, "tokens": len(out[0].response) if out else 0,
                                  "reason": out[0].finish_reason if out else None, "sum": total.item()}), flush=True)


if __name__ == "__main__":
    main()
