"""Deterministic samples for the storage and fetch tests: any process regenerates any rank's samples
from (seed, owner, index), so a requester can check a fetched sample bit for bit."""

from __future__ import annotations

import numpy as np

from reflow_hpc.trajectory import Trajectory

ID_STRIDE = 1_000_000


def sample_id(owner: int, index: int) -> int:
    return owner * ID_STRIDE + index


def make_sample(seed: int, owner: int, index: int, *, max_len: int = 300) -> Trajectory:
    """Prompt + response with per-token versions and log-probs; some responses are empty, some long."""
    rng = np.random.default_rng([seed, owner, index])
    kind = index % 7
    prompt_len = int(rng.integers(0 if kind == 0 else 1, 40))
    if kind in (0, 1):
        response_len = 0                                    # empty response (kind 0: empty sample)
        prompt_len = 0 if kind == 0 else prompt_len
    elif kind == 2:
        response_len = int(rng.integers(max_len, 4 * max_len))   # a long row
    else:
        response_len = int(rng.integers(1, max_len))
    n = prompt_len + response_len
    tokens = rng.integers(0, 151_000, n, dtype=np.int32)
    versions = np.full(n, -1, np.int32)
    logprobs = np.zeros(n, np.float32)
    if response_len:
        v0 = int(rng.integers(0, 5))
        versions[prompt_len:] = v0 + (np.arange(response_len) > response_len // 2)   # a partial rollout
        logprobs[prompt_len:] = -rng.exponential(1.0, response_len).astype(np.float32)
        logprobs[prompt_len] = -0.0                         # bit patterns must survive, not only values
    return Trajectory(
        sample_id=sample_id(owner, index), group_id=sample_id(owner, index // 4), prompt_id=int(rng.integers(1 << 40)),
        tokens=tokens, logprobs=logprobs, versions=versions, prompt_len=prompt_len,
        reward=float(rng.standard_normal()), finish_reason=("stop", "length", "abort", "")[index % 4],
        owner=owner, meta={} if index % 3 == 0 else {"answer": f"{index}", "note": "ünïcode ✓", "turns": [1, 2]})


def same(a: Trajectory, b: Trajectory) -> str | None:
    """None when a and b are bit-for-bit equal; otherwise what differs."""
    for name in ("tokens", "logprobs", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return f"sample {a.sample_id}: {name} differ"
    for name in ("sample_id", "group_id", "prompt_id", "prompt_len", "finish_reason", "owner", "meta"):
        if getattr(a, name) != getattr(b, name):
            return f"sample {a.sample_id}: {name} {getattr(a, name)!r} != {getattr(b, name)!r}"
    if np.float64(a.reward).tobytes() != np.float64(b.reward).tobytes():
        return f"sample {a.sample_id}: reward {a.reward!r} != {b.reward!r}"
    return None
