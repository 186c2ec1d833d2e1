"""Reading shards back: verify segments, recover what was flushed, report what was lost.

Rules:
- A row is *recovered* only when the batch that wrote it is present, its extents agree with the
  datasets (contiguous batches, offsets inside the token data) and both of its XXH3-64 checksums
  match. Every other row that the file or the manifest knows of is reported in a :class:`LostRows`
  with the reason; nothing is dropped silently and nothing raises.
- A file that HDF5 refuses to open is *unreadable*; its rows (and sample ids, from the manifest when
  it was closed) are reported lost. A file that is merely shorter than HDF5 expects (truncated) is
  read through a view that pads it with zeros, so every batch written before the cut is recovered.
- Samples that were appended but never flushed left no trace on disk; they are absent, not lost —
  the writer (or the coordinator's index) is the only place that knew them.
- Reading never modifies a file: offline analysis of a copied directory is safe.
- Reading is bounded by the file and by a budget (``storage.read_budget_mib``), never by what the
  file declares: a dataset is read no further than the file's size can hold (a small file that
  declares millions of rows is damaged, its extra rows reported lost), the offset and batch tables
  are read in pieces, and one batch (or one read of adjacent rows) larger than the budget is
  reported lost instead of read. A verified row also agrees with its offsets (``num_tokens``) and
  has a prompt no longer than itself, so later readers can size arrays by its fields.
- Only regular files are opened (a FIFO or device named like a segment would hang or flood a
  reader); the manifest is read bounded (:mod:`reflow_hpc.storage.jsonl`).
"""

from __future__ import annotations

import io
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from reflow_hpc.config import StorageConfig
from reflow_hpc.storage import jsonl, schema
from reflow_hpc.storage.manifest import Manifest, SegmentEntry, read_manifest
from reflow_hpc.storage.schema import (BATCH_DTYPE, ROW_DTYPE, Location, StorageError, hash_rows, hash_tokens,
                                       parse_segment_name, trajectory_from_row)
from reflow_hpc.trajectory import Trajectory

_TRUNCATED_RE = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")

MIB = 1 << 20
BUDGET_MIB = StorageConfig.read_budget_mib      # the default of readers not given storage.read_budget_mib
PIECE_BYTES = 1 << 20                            # one read of the offset or batch table (or the budget if less)
TOKEN_BYTES = 12                                 # tokens + logprobs + versions of one token
DTYPES = {"tokens": np.dtype("<i4"), "logprobs": np.dtype("<f4"), "versions": np.dtype("<i4"),
          "offsets": np.dtype("<i8"), "rows": ROW_DTYPE, "batches": BATCH_DTYPE}


@dataclass
class LostRows:
    """Rows of one segment that cannot be read back."""
    file: str
    rows: tuple[int, int] | None    # [start, end) row range; None when even that is unknown
    sample_ids: list[int]           # ids of those rows when known (manifest, or a row table that verified)
    reason: str
    ids_trusted: bool = True        # False: ids read from a row table whose checksum failed
    declared: bool = False          # True: `rows` is what the file declares, more than it can hold

    def describe(self) -> str:
        where = f"rows {self.rows[0]}–{self.rows[1] - 1}" if self.rows and self.rows[1] > self.rows[0] else "rows"
        n = f"{len(self.sample_ids)} samples" if self.sample_ids else "unknown samples"
        return f"{self.file} {where} ({n}): {self.reason}"

    def count(self) -> int | None:
        """Samples in these rows: the ids when known, else the rows, unless only declared (None)."""
        if self.sample_ids:
            return len(self.sample_ids)
        return None if self.rows is None or self.declared else self.rows[1] - self.rows[0]


@dataclass
class SegmentScan:
    """The result of verifying one segment file."""
    file: str
    index: int
    owner: int
    was_open: bool                  # the file still had its `.open` name (its writer did not close it)
    rows: int = 0                   # rows found in the row table
    locations: dict[int, Location] = field(default_factory=dict)    # verified rows only
    order: list[int] = field(default_factory=list)                   # verified sample ids, row order
    lost: list[LostRows] = field(default_factory=list)
    error: str | None = None        # set when the file could not be read at all
    padded: bool = False            # read through a zero-padded view (the file was truncated)
    flushes: list[tuple[int, int, float]] = field(default_factory=list)   # verified batches: rows, tokens, time

    @property
    def readable(self) -> bool:
        return self.error is None


@dataclass
class ScanReport:
    """Everything a directory of shards holds: verified sample locations, lost rows, bad files."""
    directory: str
    segments: list[SegmentScan] = field(default_factory=list)
    manifest: Manifest | None = None
    manifest_error: str | None = None

    @property
    def lost(self) -> list[LostRows]:
        return [lr for s in self.segments for lr in s.lost]

    @property
    def unreadable(self) -> dict[str, str]:
        return {s.file: s.error for s in self.segments if s.error is not None}

    def lost_ids(self) -> list[int]:
        return sorted({i for lr in self.lost for i in lr.sample_ids})

    def locations(self) -> dict[int, tuple[SegmentScan, Location]]:
        return {i: (s, loc) for s in self.segments for i, loc in s.locations.items()}

    def summary(self) -> str:
        ok = sum(len(s.locations) for s in self.segments)
        lost = self.lost
        text = (f"{self.directory}: {len(self.segments)} segments, {ok} samples recovered, "
                f"{sum(lr.count() or 0 for lr in lost)} rows lost "
                f"in {len(lost)} ranges, {len(self.unreadable)} unreadable segments")
        return "\n".join([text] + ["  lost: " + lr.describe() for lr in lost])


# ---------------------------------------------------------------------------------------- opening

class _ZeroPadded(io.RawIOBase):
    """A read-only view of a truncated file that reads zeros from its end up to `size` bytes."""

    def __init__(self, path: str | os.PathLike, size: int):
        self._f = open(path, "rb")
        self._real = os.fstat(self._f.fileno()).st_size
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        real = max(0, min(n, self._real - self._pos))
        if real:
            self._f.seek(self._pos)
            got = self._f.readinto(view[:real])
            real = got or 0
        view[real:n] = bytes(n - real)
        self._pos += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def open_segment(path: str | os.PathLike) -> tuple[h5py.File, bool]:
    """Open a segment read-only; a truncated file is opened through a zero-padded view.

    Returns (file, padded). Raises OSError when it is not a regular file or HDF5 cannot open it.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):     # HDF5 would block on a FIFO, read a device forever
        raise OSError(f"{path}: not a regular file")
    try:
        return h5py.File(path, "r"), False
    except OSError as e:
        m = _TRUNCATED_RE.search(str(e))
        if m is None:
            raise
        view = _ZeroPadded(path, int(m.group(2)))
        try:
            return h5py.File(view, "r"), True
        except Exception:
            view.close()
            raise


# --------------------------------------------------------------------------------------- verifying

def scan_segment(path: str | os.PathLike, *, entry: SegmentEntry | None = None, verify: bool = True,
                 budget_mib: float = BUDGET_MIB) -> SegmentScan:
    """Verify one segment file. `entry` is its manifest record, if any (names ids of unreadable rows).

    verify=False trusts the token checksums without reading the token data (extents and the row
    checksums are still checked). `budget_mib` bounds one read (module rules).
    """
    path = Path(path)
    parsed = parse_segment_name(path.name)
    owner, index, was_open = parsed if parsed else (-1, -1, False)
    name = path.name[:-len(schema.OPEN_SUFFIX)] if was_open else path.name
    scan = SegmentScan(file=name, index=index, owner=owner, was_open=was_open)
    try:
        size = os.path.getsize(path)
        f, scan.padded = open_segment(path)
    except Exception as e:
        scan.error = f"unreadable: {e.__class__.__name__}: {e}"
        scan.lost.append(_lost_all(name, entry, scan.error))
        return scan
    try:
        _verify(f, scan, entry, verify, _Bounds(size, max(1, int(budget_mib * MIB))))
    except Exception as e:  # a damaged structure HDF5 only notices while reading
        scan.error = f"unreadable: {e.__class__.__name__}: {e}"
        scan.locations.clear()
        scan.order.clear()
        scan.flushes.clear()
        scan.lost = [_lost_all(name, entry, scan.error)]
    finally:
        f.close()
    if scan.padded:
        for lr in scan.lost:
            lr.reason = f"file truncated to {size} bytes: {lr.reason}"
    return scan


def _lost_all(name: str, entry: SegmentEntry | None, reason: str) -> LostRows:
    if entry is None:
        return LostRows(name, None, [], reason)
    return LostRows(name, (0, entry.rows), list(entry.sample_ids), reason)


@dataclass(frozen=True)
class _Bounds:
    """What a read of one file may take: the file's bytes on disk and the budget of one read."""
    file_bytes: int
    budget: int

    @property
    def piece(self) -> int:
        return min(PIECE_BYTES, self.budget)


def _dataset(f: h5py.File, name: str, bounds: _Bounds, declared: list) -> tuple[h5py.Dataset, int]:
    """A 1-D dataset of the format and the length to read of it: what it declares, but no more than the
    file's bytes can hold (an honest writer's every element lies in the file; a truncated file's
    missing tail is zeros that fail their checksums anyway). An excess is noted in ``declared``."""
    ds = f[name]
    if not isinstance(ds, h5py.Dataset) or len(ds.shape) != 1:
        raise StorageError(f"{name} is not a one-dimensional dataset")
    want = DTYPES.get(name)
    if want is not None and ds.dtype != want:
        raise StorageError(f"{name} has dtype {ds.dtype}, not {want}")
    n = int(ds.shape[0])
    fits = bounds.file_bytes // max(1, ds.dtype.itemsize)
    if n > fits:
        declared.append((name, n, fits))
    return ds, min(n, fits)


def _declared_text(declared: list[tuple[str, int, int]], file_bytes: int) -> str:
    """One clause for the datasets that declare more entries than the file can hold."""
    name, n, fits = next((d for d in declared if d[0] == "rows"), declared[0])
    more = [d[0] for d in declared if d[0] != name]
    return (f"the file ({file_bytes} bytes) declares {n} entries in {name} (at most {fits} fit)"
            + (f", and too many {', '.join(more)}" if more else ""))


class _Window:
    """Reads of a large 1-D dataset in pieces: ``get(a, b)`` returns ``ds[a:b]``, reading a piece of
    at least ``piece`` entries from ``a`` when the last piece does not hold [a, b)."""

    def __init__(self, ds: h5py.Dataset, piece: int):
        self.ds, self.piece = ds, max(1, piece)
        self.start, self.data = 0, ds[0:0]

    def get(self, a: int, b: int) -> np.ndarray:
        if not (self.start <= a and b <= self.start + len(self.data)):
            self.start, self.data = a, self.ds[a:max(b, a + self.piece)]
        return self.data[a - self.start:b - self.start]


def _verify(f: h5py.File, scan: SegmentScan, entry: SegmentEntry | None, verify: bool, bounds: _Bounds) -> None:
    if f.attrs.get("format") not in (schema.FORMAT, schema.FORMAT.encode()):
        raise StorageError(f"not a {schema.FORMAT} file (format attribute {f.attrs.get('format')!r})")
    version = int(f.attrs.get("format_version", -1))
    if version != schema.FORMAT_VERSION:
        raise StorageError(f"format_version {version}; this reader reads version {schema.FORMAT_VERSION}")
    if scan.owner < 0:
        scan.owner = int(f.attrs.get("owner", -1))
        scan.index = int(f.attrs.get("segment", -1))
    declared: list[tuple[str, int, int]] = []     # datasets longer than the file can hold
    (tokens, nt), (logprobs, nl), (versions, nv), (offsets_ds, no), (rows_ds, nr), (meta_ds, nm), (batch_ds, nb) = (
        _dataset(f, k, bounds, declared) for k in ("tokens", "logprobs", "versions", "offsets", "rows", "meta",
                                                   "batches"))
    n_tok = min(nt, nl, nv)
    n_rows = min(nr, nm, no - 1)
    scan.rows = rows_ds.shape[0]
    row_bytes = ROW_DTYPE.itemsize + 8 + 8          # record, offset, meta reference (its text comes on top)
    manifest_ids = entry.sample_ids if entry is not None and entry.state == "closed" else None
    id_cap = bounds.budget // 64                    # ids of unverified rows: a hint, never a budget's worth

    def ids_of(r0: int, r1: int, trusted_rows: np.ndarray | None) -> tuple[list[int], bool]:
        if manifest_ids is not None and r1 <= len(manifest_ids):
            return list(manifest_ids[r0:r1]), True
        if trusted_rows is not None:
            return trusted_rows["sample_id"].tolist(), True
        r1 = min(r1, nr)
        if r1 - r0 > id_cap:
            return [], False
        try:
            return rows_ds.fields("sample_id")[r0:r1].tolist(), False
        except Exception:
            return [], False

    offsets = _Window(offsets_ds, bounds.piece // 8)
    row_end, tok_end = 0, 0
    for p0 in range(0, nb, max(1, bounds.piece // BATCH_DTYPE.itemsize)):
        stop = False
        for b in batch_ds[p0:min(nb, p0 + max(1, bounds.piece // BATCH_DTYPE.itemsize))]:
            r0, r1, t0, t1 = int(b["row_start"]), int(b["row_end"]), int(b["token_start"]), int(b["token_end"])
            # A writer never flushes an empty batch: an empty record is zeros past a cut, or a lie.
            if not (r0 == row_end and t0 == tok_end and r0 < r1 <= n_rows and t0 <= t1 <= n_tok):
                stop = True     # extents out of line: this batch record and everything after it are untrustworthy
                break
            if (r1 - r0) * row_bytes + ((t1 - t0) * TOKEN_BYTES if verify else 0) > bounds.budget:
                ids, trusted = ids_of(r0, r1, None)
                scan.lost.append(LostRows(scan.file, (r0, r1), ids, f"batch of {r1 - r0} rows and {t1 - t0} tokens "
                                          f"is larger than the read budget ({bounds.budget / MIB:g} MiB)", trusted))
                row_end, tok_end = r1, t1
                continue
            bad = None
            try:
                offs = offsets.get(r0, r1 + 1)
                if offs[0] != t0 or offs[-1] != t1 or np.any(np.diff(offs) < 0):
                    bad = "offsets outside the batch's token data"
                rows = rows_ds[r0:r1]
                meta = meta_ds[r0:r1].tolist()
                if bad is None and hash_rows(offs[1:], rows, meta) != int(b["xxh3_rows"]):
                    bad = "row checksum mismatch"
                if bad is None and verify and hash_tokens(tokens[t0:t1], logprobs[t0:t1],
                                                          versions[t0:t1]) != int(b["xxh3_tokens"]):
                    ids, trusted = ids_of(r0, r1, rows)
                    scan.lost.append(LostRows(scan.file, (r0, r1), ids, "token checksum mismatch", trusted))
                    row_end, tok_end = r1, t1
                    continue
                if bad is None:
                    bad = _implausible(rows, offs)
            except Exception as e:
                bad = f"read error: {e.__class__.__name__}: {e}"
            if bad is not None:
                ids, trusted = ids_of(r0, r1, None)
                scan.lost.append(LostRows(scan.file, (r0, r1), ids, bad, trusted))
            else:
                for i, row in enumerate(rows):
                    sid = int(row["sample_id"])
                    scan.locations[sid] = Location(scan.index, r0 + i, int(offs[i]), int(offs[i + 1]))
                    scan.order.append(sid)
                scan.flushes.append((r1 - r0, t1 - t0, float(b["unix_time"])))
            row_end, tok_end = r1, t1
        if stop:
            break
    known = max(scan.rows, entry.rows if entry is not None else 0)
    if row_end < known:
        why = "not covered by a valid checksummed batch"
        if declared:
            why += "; " + _declared_text(declared, bounds.file_bytes)
            id_cap = 0          # a row table that lies about its length names no samples
        ids, trusted = ids_of(row_end, known, None)
        scan.lost.append(LostRows(scan.file, (row_end, known), ids, why, trusted, declared=bool(declared)))


def _implausible(rows: np.ndarray, offs: np.ndarray) -> str | None:
    """Why rows whose checksums match cannot be what a writer wrote, or None. The checksums guard
    against damage, not against a forged file: these keep a reader that sizes arrays by a row's
    fields (lengths, prompt lengths) within what the file holds."""
    n, p = rows["num_tokens"].astype(np.int64), rows["prompt_len"].astype(np.int64)
    if np.any(n != np.diff(offs)):
        return "rows disagree with their offsets (num_tokens)"
    if np.any((p < 0) | (p > n)):
        return "rows with a prompt longer than the row"
    return None


def scan_directory(directory: str | os.PathLike, *, verify: bool = True, budget_mib: float = BUDGET_MIB) -> ScanReport:
    """Verify every segment under `directory`: the manifest's and any other segment file found.

    Never raises for damaged data; see ScanReport. A directory that does not exist raises StorageError.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise StorageError(f"{directory}: no such shard directory")
    report = ScanReport(directory=str(directory))
    try:
        report.manifest = read_manifest(directory)
    except StorageError as e:
        report.manifest_error = str(e)
    entries = {s.file: s for s in report.manifest.segments} if report.manifest else {}
    files = {}
    for p in directory.iterdir():
        parsed = parse_segment_name(p.name)
        if parsed is not None:
            files[p.name[:-len(schema.OPEN_SUFFIX)] if parsed[2] else p.name] = p
    for name in sorted(set(files) | set(entries)):
        entry = entries.get(name)
        if name not in files:
            parsed = parse_segment_name(name)
            scan = SegmentScan(file=name, index=parsed[1] if parsed else -1, owner=parsed[0] if parsed else -1,
                               was_open=False, error="file missing (listed in the manifest)")
            scan.lost.append(_lost_all(name, entry, scan.error))
        else:
            scan = scan_segment(files[name], entry=entry, verify=verify, budget_mib=budget_mib)
        report.segments.append(scan)
    return report


# ----------------------------------------------------------------------------------------- reading

def read_rows(f: h5py.File, locations: list[Location], sample_ids: list[int] | None = None, *,
              budget_mib: float = BUDGET_MIB) -> list[Trajectory]:
    """Read the rows at `locations` from an open segment, in the given order.

    Adjacent rows are read with one h5py call per dataset, as many at a time as `budget_mib` allows.
    `sample_ids`, when given, are checked against the row table (a mismatch means the location map
    and the file disagree). A row whose meta nests too deeply raises StorageError naming it.
    """
    budget = max(1, int(budget_mib * MIB))
    out: list[Trajectory | None] = [None] * len(locations)
    order = sorted(range(len(locations)), key=lambda k: locations[k].row)
    i = 0
    while i < len(order):
        j = i + 1
        t0 = locations[order[i]].token_start
        while (j < len(order) and locations[order[j]].row - locations[order[j - 1]].row in (0, 1)
               and (locations[order[j]].token_end - t0) * TOKEN_BYTES <= budget):
            j += 1
        first, last = locations[order[i]], locations[order[j - 1]]
        r0 = first.row
        rows = f["rows"][r0:last.row + 1]
        meta = f["meta"][r0:last.row + 1]
        tokens = f["tokens"][t0:last.token_end]
        logprobs = f["logprobs"][t0:last.token_end]
        versions = f["versions"][t0:last.token_end]
        single = j - i == 1 and last.row == r0
        for k in order[i:j]:
            loc = locations[k]
            row = rows[loc.row - r0]
            if sample_ids is not None and int(row["sample_id"]) != sample_ids[k]:
                raise StorageError(f"{f.filename}: row {loc.row} holds sample {int(row['sample_id'])}, "
                                   f"expected sample {sample_ids[k]}")
            m = meta[loc.row - r0]
            if m and not jsonl.depth_ok(m if isinstance(m, bytes) else m.encode("utf-8")):
                raise StorageError(f"{f.filename}: row {loc.row}: meta nested deeper than {jsonl.MAX_DEPTH} levels")
            a, b = loc.token_start - t0, loc.token_end - t0
            # Copies, so that one fetched sample does not keep a whole run of rows alive.
            sl = (lambda x: x[a:b]) if single else (lambda x: x[a:b].copy())
            out[k] = trajectory_from_row(row, m, sl(tokens), sl(logprobs), sl(versions))
        i = j
    return out  # type: ignore[return-value]


class ShardReader:
    """Offline access to a directory of shards: ``ids()``, ``get(ids)``, ``report`` (what was lost).

        with ShardReader("/scratch/run/rank00003") as r:
            print(r.report.summary())
            trajs = r.get(r.ids()[:10])
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = True, budget_mib: float = BUDGET_MIB):
        self.report = scan_directory(directory, verify=verify, budget_mib=budget_mib)
        self.budget_mib = budget_mib
        self.directory = Path(directory)
        self._where = self.report.locations()
        self._files: dict[str, h5py.File] = {}

    def ids(self) -> list[int]:
        """Recovered sample ids, in segment and row order."""
        return [i for s in self.report.segments for i in s.order]

    def location(self, sample_id: int) -> tuple[str, Location] | None:
        hit = self._where.get(sample_id)
        return (hit[0].file, hit[1]) if hit else None

    def get(self, ids: list[int]) -> list[Trajectory]:
        by_file: dict[str, list[int]] = {}
        for k, sid in enumerate(ids):
            hit = self._where.get(sid)
            if hit is None:
                lost = next((lr for lr in self.report.lost if sid in lr.sample_ids), None)
                if lost is not None:
                    raise schema.LostSampleError(f"sample {sid} was lost: {lost.describe()}")
                raise schema.UnknownSampleError(f"sample {sid} is not in the shards under {self.directory}")
            by_file.setdefault(hit[0].file, []).append(k)
        out: list[Trajectory | None] = [None] * len(ids)
        for name, ks in by_file.items():
            got = read_rows(self._file(name), [self._where[ids[k]][1] for k in ks], [ids[k] for k in ks],
                            budget_mib=self.budget_mib)
            for k, t in zip(ks, got):
                out[k] = t
        return out  # type: ignore[return-value]

    def _file(self, name: str) -> h5py.File:
        if name not in self._files:
            path = self.directory / name
            if not path.exists():
                path = self.directory / (name + schema.OPEN_SUFFIX)
            self._files[name] = open_segment(path)[0]
        return self._files[name]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
