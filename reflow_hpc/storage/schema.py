"""The on-disk schema of a trajectory shard (docs/storage.md is the user's version of this page).

A worker writes its samples into one HDF5 *segment* file at a time, in CSR layout:

| dataset    | dtype            | shape          | holds                                                   |
| ---------- | ---------------- | -------------- | ------------------------------------------------------- |
| `tokens`   | int32            | [T]            | prompt + response tokens of every row, back to back     |
| `logprobs` | float32          | [T]            | behaviour log-prob per token (0 where not generated)    |
| `versions` | int32            | [T]            | policy version per token (-1 where not generated)       |
| `offsets`  | int64            | [R + 1]        | row i spans `offsets[i]:offsets[i+1]`; `offsets[0] = 0` |
| `rows`     | compound ROW     | [R]            | per-sample metadata (ROW_DTYPE below)                   |
| `meta`     | utf-8 string     | [R]            | the sample's free-form `meta` as JSON                   |
| `batches`  | compound BATCH   | [B]            | one record per flushed batch: extents and checksums     |

Rules:
- Rows are written only in whole *batches* (one per flush). A batch is valid when its two checksums
  match; a reader trusts only rows covered by valid batches, and reports every other row as lost.
- ``xxh3_tokens`` is the 64-bit XXH3 hash (seed 0) of the little-endian bytes of ``tokens[t0:t1]``,
  ``logprobs[t0:t1]`` and ``versions[t0:t1]`` fed in that order; ``xxh3_rows`` hashes
  ``offsets[r0+1:r1+1]`` (int64), the ``rows[r0:r1]`` records (packed ROW_DTYPE) and each ``meta``
  string as UTF-8 followed by one newline byte. XXH3 rather than crc32: it runs at memory speed
  (~25 GB/s against ~3 GB/s here), and crc32 alone cost a third of the spill time.
- A segment being written is named ``<name>.open``; closing it renames it atomically to ``<name>``
  and then records it in ``manifest.json`` (written to a temporary name and renamed).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import numpy as np
import xxhash

from reflow_hpc.trajectory import Trajectory

FORMAT = "reflow_hpc.shard"
FORMAT_VERSION = 2   # 1: crc32 checksums (not readable by this version)
MANIFEST = "manifest.json"
OPEN_SUFFIX = ".open"
FINISH_REASON_BYTES = 16

ROW_DTYPE = np.dtype([
    ("sample_id", "<i8"),
    ("group_id", "<i8"),
    ("prompt_id", "<i8"),
    ("prompt_len", "<i4"),
    ("num_tokens", "<i4"),
    ("reward", "<f8"),
    ("min_version", "<i4"),
    ("max_version", "<i4"),
    ("owner", "<i4"),
    ("finish_reason", f"S{FINISH_REASON_BYTES}"),
])

BATCH_DTYPE = np.dtype([
    ("row_start", "<i8"),
    ("row_end", "<i8"),
    ("token_start", "<i8"),
    ("token_end", "<i8"),
    ("xxh3_tokens", "<u8"),
    ("xxh3_rows", "<u8"),
    ("unix_time", "<f8"),
])

# One-line descriptions stored as the `doc` attribute of each dataset, so `h5ls -v` explains the file.
DATASET_DOCS = {
    "tokens": "int32 prompt+response tokens of all rows, back to back; row i is offsets[i]:offsets[i+1]",
    "logprobs": "float32 behaviour log-prob per token, aligned with tokens; 0 where not generated",
    "versions": "int32 policy version that generated each token, aligned with tokens; -1 where not generated",
    "offsets": "int64 CSR row starts: row i spans tokens[offsets[i]:offsets[i+1]]; offsets[0] = 0",
    "rows": "per-sample metadata, one record per row",
    "meta": "per-sample free-form metadata as a JSON object (UTF-8)",
    "batches": "one record per flushed batch: row and token extents, XXH3-64 hashes, unix time",
}

_SEGMENT_RE = re.compile(r"^seg-r(\d{5})-(\d{6})\.h5(\.open)?$")


class StorageError(Exception):
    """A shard or store problem; the message names the file, the sample or the rank."""


class UnknownSampleError(StorageError, LookupError):
    """A sample id that this worker's store does not hold."""


class LostSampleError(StorageError, LookupError):
    """A sample whose payload was written but cannot be read back (corrupt or missing segment)."""


class Location(NamedTuple):
    """Where a sample's row lives: segment index and row inside it, plus its token span."""
    segment: int
    row: int
    token_start: int
    token_end: int


def segment_name(owner: int, index: int, *, open_: bool = False) -> str:
    """File name of segment `index` of worker `owner` (the open one carries a `.open` suffix)."""
    return f"seg-r{owner:05d}-{index:06d}.h5" + (OPEN_SUFFIX if open_ else "")


def parse_segment_name(name: str) -> tuple[int, int, bool] | None:
    """(owner, index, is_open) of a segment file name, or None for any other file."""
    m = _SEGMENT_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), m.group(3) is not None


def finish_reason_bytes(traj: Trajectory) -> bytes:
    reason = traj.finish_reason.encode("utf-8")
    if len(reason) > FINISH_REASON_BYTES:
        raise StorageError(f"sample {traj.sample_id}: finish_reason {traj.finish_reason!r} is longer than "
                           f"{FINISH_REASON_BYTES} bytes")
    return reason


def row_table(trajs: list[Trajectory], reasons: list[bytes], versions: np.ndarray, starts: np.ndarray,
              lengths: np.ndarray, owner: int) -> np.ndarray:
    """The ROW_DTYPE records of a batch; `versions` is the batch's concatenated versions and row i
    spans ``versions[starts[i]:starts[i] + lengths[i]]`` (version spans are computed in one pass)."""
    n = len(trajs)
    rows = np.zeros(n, ROW_DTYPE)
    rows["sample_id"] = [t.sample_id for t in trajs]
    rows["group_id"] = [t.group_id for t in trajs]
    rows["prompt_id"] = [t.prompt_id for t in trajs]
    rows["prompt_len"] = [t.prompt_len for t in trajs]
    rows["num_tokens"] = lengths
    rows["reward"] = [t.reward for t in trajs]
    rows["owner"] = owner
    rows["finish_reason"] = reasons
    # Same meaning as Trajectory.min_version / max_version: -1 where no token was generated.
    rows["min_version"] = rows["max_version"] = -1
    full = lengths > 0
    if full.any():
        idx = starts[full]   # empty rows in between span nothing, so reduceat sees exactly each row
        # Viewed as uint32, version -1 is the largest value: the minimum is the smallest generated
        # version, or -1 (viewed back as int32) when the row has none. One pass, no mask.
        lo = np.minimum.reduceat(versions.view(np.uint32), idx).view(np.int32)
        rows["min_version"][full] = lo
        rows["max_version"][full] = np.maximum.reduceat(versions, idx)
    return rows


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def meta_json(traj: Trajectory) -> str:
    """The sample's `meta` as compact JSON (never contains a raw newline)."""
    if not traj.meta:
        return "{}"
    try:
        return _JSON.encode(traj.meta)
    except (TypeError, ValueError) as e:
        raise StorageError(f"sample {traj.sample_id}: meta is not JSON-serialisable: {e}") from None


def hash_tokens(tokens: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> int:
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(tokens, "<i4"))
    h.update(np.ascontiguousarray(logprobs, "<f4"))
    h.update(np.ascontiguousarray(versions, "<i4"))
    return h.intdigest()


def hash_rows(offsets_end: np.ndarray, rows: np.ndarray, meta: list) -> int:
    """Hash of a batch's row part; `meta` holds str or bytes (as h5py reads them)."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(offsets_end, "<i8"))
    h.update(np.ascontiguousarray(rows, ROW_DTYPE))
    h.update(b"".join((m.encode("utf-8") if isinstance(m, str) else bytes(m)) + b"\n" for m in meta))
    return h.intdigest()


def trajectory_from_row(row: np.void, meta: str | bytes, tokens: np.ndarray, logprobs: np.ndarray,
                        versions: np.ndarray) -> Trajectory:
    """Rebuild a Trajectory from one `rows` record, its `meta` string and its token span."""
    return Trajectory(
        sample_id=int(row["sample_id"]), group_id=int(row["group_id"]), prompt_id=int(row["prompt_id"]),
        tokens=tokens, logprobs=logprobs, versions=versions, prompt_len=int(row["prompt_len"]),
        reward=float(row["reward"]), finish_reason=bytes(row["finish_reason"]).decode("utf-8"),
        owner=int(row["owner"]), meta=json.loads(meta) if meta else {})


def payload_bytes(traj: Trajectory) -> int:
    """Bytes of a sample's per-token arrays (what the memory cache and the segment bound count)."""
    return traj.tokens.nbytes + traj.logprobs.nbytes + traj.versions.nbytes
