"""One rank of tests/cluster/test_vllm_engine.py's tensor-parallel test: a rank of a ``TP``-rank vLLM instance.

    python tests/helpers/vllm_tp_ranks.py RANK WORLD TP PG_FILE POLICY_DIR

The job's torch.distributed world (gloo, file rendezvous) exists first; the rank builds its engine
with ``tp = TP`` through ``build_engine`` (vLLM lays its TP groups of consecutive ranks over that
world) and runs every shared conformance check (tests/helpers/engine_conformance.py) on it. The ranks of an
instance make the same calls in the same order, as vLLM's external-launcher executor needs, so each
rank's checks see the whole instance's output. Every completion is fingerprinted (request id,
tokens, versions, log-probs to 1e-6) so that the test can compare the ranks of an instance. Prints
``RESULT {json}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_conformance as conf  # noqa: E402

from reflow_hpc.config import RolloutConfig  # noqa: E402
from reflow_hpc.policy import load_policy  # noqa: E402
from reflow_hpc.rollout.factory import build_engine  # noqa: E402


def main() -> None:
    rank, world, tp, pg_file, policy = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                        sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=240))
    model, _ = load_policy(policy)
    t0 = time.perf_counter()
    engine = build_engine(model, RolloutConfig(engine="vllm", **conf.LIMITS), device="cpu", seed=0, version=0, tp=tp)
    built_s = time.perf_counter() - t0
    from vllm.distributed.parallel_state import get_tp_group

    digest = hashlib.sha256()
    completions = 0
    step = engine.step

    def fingerprinted_step():
        nonlocal completions
        out = step()
        for c in out:
            completions += 1
            digest.update(json.dumps([int(c.request_id), c.response.tolist(), c.versions.tolist(),
                                      [round(float(x), 6) for x in c.logprobs]]).encode())
        return out

    engine.step = fingerprinted_step

    base = conf.snapshot(model)
    harness = conf.Harness(reset=conf.reloading_reset(engine), base=base, template=model,
                           vocab=model.config.vocab_size)
    extra = {"check_abort_then_resume_across_a_weight_load": (conf.perturbed(base, scale=0.05, seed=1),),
             "check_weight_load_while_requests_run": (conf.perturbed(base, scale=0.05, seed=1),),
             "check_inflight_weight_load_keeps_kv": (conf.perturbed(base, scale=0.05, seed=1),),
             "check_loaded_weights_are_the_weights_used": (conf.perturbed(base, scale=0.1, seed=2),)}
    failed = {}
    worst = None
    for name in conf.ALL_CHECKS:
        try:
            got = getattr(conf, name)(harness, *extra.get(name, ()))
            if name == "check_logprobs_match_the_trainer":
                worst = got
        except AssertionError as e:
            failed[name] = str(e)[:300]
    print("RESULT " + json.dumps({"rank": rank, "built_s": built_s, "tp_group": list(get_tp_group().ranks),
                                  "engine_tp": engine.tp, "completions": completions,
                                  "fingerprint": digest.hexdigest(), "failed": failed, "worst_logprob_error": worst}),
          flush=True)


if __name__ == "__main__":
    main()
