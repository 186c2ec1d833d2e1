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
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from reflow_hpc.storage import schema
from reflow_hpc.storage.manifest import Manifest, SegmentEntry, read_manifest
from reflow_hpc.storage.schema import (Location, StorageError, hash_rows, hash_tokens, parse_segment_name,
                                       trajectory_from_row)
from reflow_hpc.trajectory import Trajectory

_TRUNCATED_RE = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")


@dataclass
class LostRows:
    """Rows of one segment that cannot be read back."""
    file: str
    rows: tuple[int, int] | None    # [start, end) row range; None when even that is unknown
    sample_ids: list[int]           # ids of those rows when known (manifest, or a row table that verified)
    reason: str
    ids_trusted: bool = True        # False: ids read from a row table whose checksum failed

    def describe(self) -> str:
        where = f"rows {self.rows[0]}–{self.rows[1] - 1}" if self.rows and self.rows[1] > self.rows[0] else "rows"
        n = f"{len(self.sample_ids)} samples" if self.sample_ids else "unknown samples"
        return f"{self.file} {where} ({n}): {self.reason}"


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
                f"{sum((lr.rows[1] - lr.rows[0]) if lr.rows else len(lr.sample_ids) for lr in lost)} rows lost "
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

    Returns (file, padded). Raises OSError when HDF5 cannot open it at all.
    """
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

def scan_segment(path: str | os.PathLike, *, entry: SegmentEntry | None = None, verify: bool = True) -> SegmentScan:
    """Verify one segment file. `entry` is its manifest record, if any (names ids of unreadable rows).

    verify=False trusts the token checksums without reading the token data (extents and the row
    checksums are still checked).
    """
    path = Path(path)
    parsed = parse_segment_name(path.name)
    owner, index, was_open = parsed if parsed else (-1, -1, False)
    name = path.name[:-len(schema.OPEN_SUFFIX)] if was_open else path.name
    scan = SegmentScan(file=name, index=index, owner=owner, was_open=was_open)
    try:
        f, scan.padded = open_segment(path)
    except Exception as e:
        scan.error = f"unreadable: {e.__class__.__name__}: {e}"
        scan.lost.append(_lost_all(name, entry, scan.error))
        return scan
    try:
        _verify(f, scan, entry, verify)
    except Exception as e:  # a damaged structure HDF5 only notices while reading
        scan.error = f"unreadable: {e.__class__.__name__}: {e}"
        scan.locations.clear()
        scan.order.clear()
        scan.lost = [_lost_all(name, entry, scan.error)]
    if scan.padded:
        size = os.path.getsize(path)
        for lr in scan.lost:
            lr.reason = f"file truncated to {size} bytes: {lr.reason}"
    f.close()
    return scan


def _lost_all(name: str, entry: SegmentEntry | None, reason: str) -> LostRows:
    if entry is None:
        return LostRows(name, None, [], reason)
    return LostRows(name, (0, entry.rows), list(entry.sample_ids), reason)


def _verify(f: h5py.File, scan: SegmentScan, entry: SegmentEntry | None, verify: bool) -> None:
    if f.attrs.get("format") not in (schema.FORMAT, schema.FORMAT.encode()):
        raise StorageError(f"not a {schema.FORMAT} file (format attribute {f.attrs.get('format')!r})")
    version = int(f.attrs.get("format_version", -1))
    if version != schema.FORMAT_VERSION:
        raise StorageError(f"format_version {version}; this reader reads version {schema.FORMAT_VERSION}")
    if scan.owner < 0:
        scan.owner = int(f.attrs.get("owner", -1))
        scan.index = int(f.attrs.get("segment", -1))
    tokens, logprobs, versions = f["tokens"], f["logprobs"], f["versions"]
    n_tok = min(tokens.shape[0], logprobs.shape[0], versions.shape[0])
    offsets = f["offsets"][:]
    rows_ds, meta_ds = f["rows"], f["meta"]
    n_rows = min(rows_ds.shape[0], meta_ds.shape[0], len(offsets) - 1)
    scan.rows = rows_ds.shape[0]
    batches = f["batches"][:]
    manifest_ids = entry.sample_ids if entry is not None and entry.state == "closed" else None

    def ids_of(r0: int, r1: int, trusted_rows: np.ndarray | None) -> tuple[list[int], bool]:
        if manifest_ids is not None and r1 <= len(manifest_ids):
            return list(manifest_ids[r0:r1]), True
        if trusted_rows is not None:
            return trusted_rows["sample_id"].tolist(), True
        try:
            return rows_ds.fields("sample_id")[r0:min(r1, rows_ds.shape[0])].tolist(), False
        except Exception:
            return [], False

    row_end, tok_end = 0, 0
    for b in batches:
        r0, r1, t0, t1 = int(b["row_start"]), int(b["row_end"]), int(b["token_start"]), int(b["token_end"])
        if not (r0 == row_end and t0 == tok_end and r0 <= r1 <= n_rows and t0 <= t1 <= n_tok):
            break   # extents out of line: this batch record and everything after it are untrustworthy
        bad = None
        try:
            offs = offsets[r0:r1 + 1]
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
        row_end, tok_end = r1, t1
    known = max(scan.rows, entry.rows if entry is not None else 0)
    if row_end < known:
        ids, trusted = ids_of(row_end, known, None)
        scan.lost.append(LostRows(scan.file, (row_end, known), ids,
                                  "not covered by a valid checksummed batch", trusted))


def scan_directory(directory: str | os.PathLike, *, verify: bool = True) -> ScanReport:
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
            scan = scan_segment(files[name], entry=entry, verify=verify)
        report.segments.append(scan)
    return report


# ----------------------------------------------------------------------------------------- reading

def read_rows(f: h5py.File, locations: list[Location], sample_ids: list[int] | None = None) -> list[Trajectory]:
    """Read the rows at `locations` from an open segment, in the given order.

    Adjacent rows are read with one h5py call per dataset. `sample_ids`, when given, are checked
    against the row table (a mismatch means the location map and the file disagree).
    """
    out: list[Trajectory | None] = [None] * len(locations)
    order = sorted(range(len(locations)), key=lambda k: locations[k].row)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and locations[order[j]].row - locations[order[j - 1]].row in (0, 1):
            j += 1
        first, last = locations[order[i]], locations[order[j - 1]]
        r0, t0 = first.row, first.token_start
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
            a, b = loc.token_start - t0, loc.token_end - t0
            # Copies, so that one fetched sample does not keep a whole run of rows alive.
            sl = (lambda x: x[a:b]) if single else (lambda x: x[a:b].copy())
            out[k] = trajectory_from_row(row, meta[loc.row - r0], sl(tokens), sl(logprobs), sl(versions))
        i = j
    return out  # type: ignore[return-value]


class ShardReader:
    """Offline access to a directory of shards: ``ids()``, ``get(ids)``, ``report`` (what was lost).

        with ShardReader("/scratch/run/rank00003") as r:
            print(r.report.summary())
            trajs = r.get(r.ids()[:10])
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = True):
        self.report = scan_directory(directory, verify=verify)
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
            got = read_rows(self._file(name), [self._where[ids[k]][1] for k in ks], [ids[k] for k in ks])
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
