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


def difference(want: Trajectory, got: Trajectory) -> str | None:
    """None when ``got`` is bit-for-bit ``want``; else the first field that differs, with both values
    (for an array, its first differing element)."""
    for name in ("tokens", "logprobs", "versions"):
        x, y = getattr(want, name), getattr(got, name)
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {y.dtype}{list(y.shape)} received, {x.dtype}{list(x.shape)} expected"
        if x.tobytes() != y.tobytes():
            xb, yb = (np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1) for a in (x, y))
            k = int(np.flatnonzero((xb != yb).any(axis=1))[0])
            return f"{name}[{k}] = {y.flat[k]!r} received, {x.flat[k]!r} expected"
    for name in ("sample_id", "group_id", "prompt_id", "prompt_len", "finish_reason", "owner", "meta"):
        if getattr(want, name) != getattr(got, name):
            return f"{name} = {getattr(got, name)!r} received, {getattr(want, name)!r} expected"
    if np.float64(want.reward).tobytes() != np.float64(got.reward).tobytes():
        return f"reward = {got.reward!r} received, {want.reward!r} expected"
    return None
