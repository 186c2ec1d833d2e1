"""Partial samples saved in a checkpoint: what rollout workers were generating when a run stopped early
(a preemption, a time limit), so that the resumed run continues them instead of aborting them.

One file per worker, ``partials/rank<r>.npz`` inside the checkpoint directory (on the shared file
system, so a job that comes back on other nodes still finds them). Arrays, no pickle (the file is
read with ``allow_pickle=False``):

| array | dtype | meaning |
| --- | --- | --- |
| ``sample_id``, ``group_id``, ``prompt_id``, ``prompt_len``, ``length`` | int64 [n] | per sample |
| ``tokens``, ``versions`` | int32 [Σ length] | prompt + partial response of every sample, back to back |
| ``logprobs`` | float32 [Σ length] | behaviour log-prob of each generated token, 0 elsewhere |
| ``meta`` | str (0-d) | JSON list of each sample's ``meta`` (the episode's state for resuming it) |

Per-token versions are kept exactly: a resumed sample carries the tokens of the old weights and then
those of the new ones, like any partial rollout.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from reflow_hpc.private import private_dir, write_atomic
from reflow_hpc.trajectory import Trajectory


def save_partials(path: Path, partials: list[Trajectory]) -> Path:
    """Write ``partials`` to ``path`` atomically (``private.write_atomic``: temp name, then rename)."""
    private_dir(path.parent, what="partials staging directory")
    cat = lambda name, dtype: (np.concatenate([getattr(t, name) for t in partials]).astype(dtype)
                               if partials else np.zeros(0, dtype))
    f = io.BytesIO()        # a few samples per worker: built in memory, then written in one go
    np.savez(f, sample_id=np.array([t.sample_id for t in partials], np.int64),
             group_id=np.array([t.group_id for t in partials], np.int64),
             prompt_id=np.array([t.prompt_id for t in partials], np.int64),
             prompt_len=np.array([t.prompt_len for t in partials], np.int64),
             length=np.array([len(t.tokens) for t in partials], np.int64),
             tokens=cat("tokens", np.int32), versions=cat("versions", np.int32),
             logprobs=cat("logprobs", np.float32), meta=np.array(json.dumps([t.meta for t in partials])))
    write_atomic(path, f.getvalue())
    return path


def load_partials(directory: Path) -> dict[int, Trajectory]:
    """Every partial sample saved in ``directory`` (all workers' files), by sample id."""
    out: dict[int, Trajectory] = {}
    for path in sorted(Path(directory).glob("rank*.npz")):
        with np.load(path, allow_pickle=False) as z:
            metas = json.loads(str(z["meta"]))
            start = 0
            for k, sid in enumerate(z["sample_id"].tolist()):
                end = start + int(z["length"][k])
                owner = int(path.stem.removeprefix("rank"))
                out[sid] = Trajectory(sid, int(z["group_id"][k]), int(z["prompt_id"][k]), z["tokens"][start:end],
                                      z["logprobs"][start:end], z["versions"][start:end], int(z["prompt_len"][k]),
                                      finish_reason="abort", owner=owner, meta=metas[k])
                start = end
    return out
