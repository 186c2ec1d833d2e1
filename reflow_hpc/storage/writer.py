"""The shard writer: one per worker, appending finished samples to node-local HDF5 segments.

Rules it implements (layout in :mod:`reflow_hpc.storage.schema`, user docs in docs/storage.md):
- ``append`` only buffers samples in memory; nothing touches HDF5 per sample (one h5py call costs
  ~160 µs). The pending samples are written as one *batch* — the per-token arrays go into their
  chunks' file space with one pwritev per chunk, each per-row dataset gets one low-level write, and
  an XXH3-64 hash covers the batch — and the file is flushed when ``storage.flush_rows`` samples
  are pending or the oldest pending one waited ``storage.flush_s`` seconds (checked on every append
  and by ``maybe_flush``).
  A process that dies loses only its pending samples; the file opens with every flushed batch.
- After a flush, a segment holding ``storage.segment_mib`` MiB or more of sample data is closed:
  its file is renamed from ``<name>.open`` to ``<name>`` (``os.replace``) and recorded in the
  manifest, which is itself replaced atomically. The next batch starts a new segment.
- Every sample's location (segment, row, token span) is fixed when it is appended and can be
  reported at once (``location``), before it is flushed.
- No SWMR and no ``libver="latest"``: a file left behind by a killed writer must open with plain
  ``h5py.File(path, "r")``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable

import h5py
import numpy as np
import xxhash

from reflow_hpc.config import StorageConfig
from reflow_hpc.private import private_dir
from reflow_hpc.storage import schema
from reflow_hpc.storage.manifest import Manifest, SegmentEntry, fsync_dir, write_manifest
from reflow_hpc.storage.schema import (BATCH_DTYPE, ROW_DTYPE, Location, StorageError, hash_rows,
                                       finish_reason_bytes, meta_json, row_table, segment_name)
from reflow_hpc.trajectory import Trajectory

MIB = 1 << 20
PAYLOAD_BYTES_PER_TOKEN = 12   # int32 token + float32 logprob + int32 version
NEW_SUFFIX = ".new"     # a segment file under construction (not yet a valid `.open` segment)
TOKEN_COLUMNS = ("tokens", "logprobs", "versions")   # in hash_tokens order


class ShardWriter:
    """Appends samples of worker `owner` to segments under `directory` (see the module rules)."""

    def __init__(self, directory: str | os.PathLike, owner: int, cfg: StorageConfig, *,
                 first_segment: int = 0, manifest: Manifest | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.directory = Path(directory)
        self.owner = owner
        self.cfg = cfg
        self.clock = clock
        self.manifest = manifest if manifest is not None else Manifest(owner=owner)
        self.locations: dict[int, Location] = {}
        self.segment = first_segment        # index of the segment the next batch goes to
        self.file: h5py.File | None = None  # the open segment, created lazily by the first flush
        self._fsync_fd: int | None = None
        self._rows = 0                      # rows and tokens in the current segment (flushed + pending)
        self._tokens = 0
        self._flushed_rows = 0
        self._bytes = 0                     # payload bytes flushed into the current segment
        self._batches = 0
        self._pending: list[Trajectory] = []
        self._pending_by_id: dict[int, Trajectory] = {}
        self._pending_reasons: list[bytes] = []
        self._pending_meta: list[str] = []
        self._pending_since: float | None = None
        self._segment_ids: list[int] = []   # sample ids of the current segment's flushed rows, row order
        self._closed = False
        self._failed: str | None = None     # why a write failed; the writer refuses further work
        self._columns: dict[str, _TokenColumn] = {}
        self._rows_columns: dict[str, _RowColumn] = {}
        self.flushed_total = 0              # rows flushed by this writer, all segments together
        private_dir(self.directory, what=f"rank {owner}: shard directory")

    # ---------------------------------------------------------------------------------- appending

    def append(self, trajs: Iterable[Trajectory], now: float | None = None) -> list[Location]:
        """Buffer samples for the next batch; flushes when a bound is reached. Returns their locations."""
        if self._failed is not None or self._closed:
            self._check_usable()
        trajs = trajs if isinstance(trajs, list) else list(trajs)
        # Check and encode everything first: a bad sample fails this call and appends nothing.
        locations = self.locations
        encoded = []
        for t in trajs:
            if t.sample_id in locations:
                raise StorageError(f"rank {self.owner}: sample {t.sample_id} was already appended")
            encoded.append((finish_reason_bytes(t), meta_json(t)))
        if len(trajs) > 1 and len({t.sample_id for t in trajs}) < len(trajs):
            dup = next(t.sample_id for k, t in enumerate(trajs) if t.sample_id in
                       {u.sample_id for u in trajs[:k]})
            raise StorageError(f"rank {self.owner}: sample {dup} was already appended")
        out = []
        for t, (reason, meta) in zip(trajs, encoded):
            n = len(t.tokens)
            loc = Location(self.segment, self._rows, self._tokens, self._tokens + n)
            self._pending.append(t)
            self._pending_by_id[t.sample_id] = t
            self._pending_reasons.append(reason)
            self._pending_meta.append(meta)
            locations[t.sample_id] = loc
            self._rows += 1
            self._tokens += n
            out.append(loc)
        if self._pending_since is None and self._pending:
            self._pending_since = self.clock() if now is None else now
        if len(self._pending) >= self.cfg.flush_rows:
            self.flush()
        elif self._pending_since is not None:
            self.maybe_flush(now)
        return out

    def maybe_flush(self, now: float | None = None) -> bool:
        """Flush when the oldest pending sample waited `flush_s`; returns whether it flushed."""
        if self._pending_since is None:
            return False
        if (self.clock() if now is None else now) - self._pending_since < self.cfg.flush_s:
            return False
        self.flush()
        return True

    def pending(self, sample_id: int) -> Trajectory | None:
        """The sample if it is appended but not yet flushed."""
        return self._pending_by_id.get(sample_id)

    @property
    def pending_rows(self) -> int:
        return len(self._pending)

    def location(self, sample_id: int) -> Location | None:
        return self.locations.get(sample_id)

    # ----------------------------------------------------------------------------------- flushing

    def flush(self) -> int:
        """Write the pending samples as one checksummed batch and flush the file; returns the rows."""
        if not self._pending:
            return 0
        self._check_usable()
        if self.file is None:
            self._open_segment()
        n = len(self._pending)
        try:
            self._write_batch(self.file)
        except Exception as e:
            # The file may now hold part of a batch; a reader reports those rows as lost. Writing
            # on would misplace every later row, so this writer stops here.
            self._failed = (f"writing a batch of {n} samples to {self.file.filename} failed: "
                            f"{e.__class__.__name__}: {e}")
            raise StorageError(f"rank {self.owner}: {self._failed}") from e
        self._flushed_rows += n
        self.flushed_total += n
        self._segment_ids.extend(t.sample_id for t in self._pending)
        self._pending.clear()
        self._pending_by_id.clear()
        self._pending_reasons.clear()
        self._pending_meta.clear()
        self._pending_since = None
        if self._bytes >= self.cfg.segment_mib * MIB:
            self.close_segment()
        return n

    def _write_batch(self, f: h5py.File) -> None:
        n = len(self._pending)
        r0, t0 = self._flushed_rows, self.locations[self._pending[0].sample_id].token_start
        lengths = np.fromiter((len(t.tokens) for t in self._pending), dtype=np.int64, count=n)
        total = int(lengths.sum())
        # Data first, the batch record last: a batch record only describes data written before it.
        offsets_end = t0 + np.cumsum(lengths)
        h = xxhash.xxh3_64()
        self._columns["tokens"].append([t.tokens for t in self._pending], total, h)
        self._columns["logprobs"].append([t.logprobs for t in self._pending], total, h)
        # Versions are also needed in one array, for the rows' version ranges; it is written as it is.
        versions = np.concatenate([t.versions for t in self._pending])
        self._columns["versions"].append([versions], total, h)
        rows = row_table(self._pending, self._pending_reasons, versions, offsets_end - lengths - t0, lengths,
                         self.owner)
        t1 = t0 + total
        self._rows_columns["offsets"].append(offsets_end)
        self._rows_columns["rows"].append(rows)
        self._rows_columns["meta"].append(np.array(self._pending_meta, dtype=object))
        batch = np.array([(r0, r0 + n, t0, t1, h.intdigest(), hash_rows(offsets_end, rows, self._pending_meta),
                           time.time())],
                         dtype=BATCH_DTYPE)
        self._rows_columns["batches"].append(batch)
        f.flush()
        if self.cfg.fsync:
            os.fsync(self._fsync_fd)
        self._bytes += PAYLOAD_BYTES_PER_TOKEN * total
        self._batches += 1

    def close_segment(self) -> SegmentEntry | None:
        """Flush, close the open segment, rename it to its final name and record it in the manifest."""
        self.flush()
        if self.file is None:
            return None
        f = self.file
        f.attrs["closed"] = True
        f.attrs["rows"] = self._flushed_rows
        f.close()
        self.file = None
        self._columns = {}
        self._rows_columns = {}
        if self._fsync_fd is not None:
            if self.cfg.fsync:
                os.fsync(self._fsync_fd)
            os.close(self._fsync_fd)
            self._fsync_fd = None
        name = segment_name(self.owner, self.segment)
        os.replace(self.directory / (name + schema.OPEN_SUFFIX), self.directory / name)
        if self.cfg.fsync:
            fsync_dir(self.directory)
        entry = SegmentEntry(file=name, index=self.segment, state="closed", rows=self._flushed_rows,
                             tokens=self._tokens, bytes=self._bytes, batches=self._batches,
                             closed_unix=time.time(), sample_ids=self._segment_ids)
        self.manifest.segments.append(entry)
        write_manifest(self.directory, self.manifest, fsync=self.cfg.fsync)
        self.segment += 1
        self._rows = self._tokens = self._flushed_rows = self._bytes = self._batches = 0
        self._segment_ids = []
        return entry

    def close(self) -> None:
        """Flush pending samples and close the open segment (it then appears in the manifest)."""
        if self._closed:
            return
        if self._failed is None:
            self.close_segment()
        elif self.file is not None:
            try:
                self.file.close()
            except Exception:  # the failed file stays as it is, for the reader to judge
                pass
        self._closed = True

    @property
    def failed(self) -> str | None:
        """Why this writer stopped (a failed batch write), or None."""
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise StorageError(f"rank {self.owner}: shard writer stopped: {self._failed}")
        if self._closed:
            raise StorageError(f"rank {self.owner}: shard writer in {self.directory} is closed")

    # ------------------------------------------------------------------------------------ helpers

    def _open_segment(self) -> None:
        path = self.directory / segment_name(self.owner, self.segment, open_=True)
        # The empty file is built under a scratch name and renamed when complete, so a crash while
        # creating it never leaves a half-made `.open` segment behind.
        new = path.with_name(path.name + NEW_SUFFIX)
        if path.exists():
            raise StorageError(f"rank {self.owner}: shard segment {path} already exists")
        try:
            # A leftover of a crash is removed (unlink never follows a symlink) and the file created
            # exclusively ("x": O_EXCL), so h5py never writes through a symlink planted at the name.
            try:
                os.unlink(new)
            except FileNotFoundError:
                pass
            f = h5py.File(new, "x", rdcc_nbytes=0)    # no chunk cache: see _TokenColumn
        except OSError as e:
            raise StorageError(f"rank {self.owner}: cannot create shard segment {new}: {e}") from None
        # Dirty metadata stays in memory until the next flush instead of being evicted to disk at
        # arbitrary moments: a process killed between two flushes leaves the file as of the last one.
        mdc = f.id.get_mdc_config()
        mdc.evictions_enabled = False
        mdc.incr_mode = mdc.flash_incr_mode = mdc.decr_mode = 0   # required when evictions are off
        f.id.set_mdc_config(mdc)
        f.attrs["format"] = schema.FORMAT
        f.attrs["format_version"] = schema.FORMAT_VERSION
        f.attrs["owner"] = self.owner
        f.attrs["segment"] = self.segment
        f.attrs["created_unix"] = time.time()
        f.attrs["closed"] = False
        ct, cr = self.cfg.chunk_tokens, self.cfg.chunk_rows
        for name, dtype, chunk in (("tokens", "<i4", ct), ("logprobs", "<f4", ct), ("versions", "<i4", ct),
                                   ("offsets", "<i8", cr), ("rows", ROW_DTYPE, cr),
                                   ("meta", h5py.string_dtype("utf-8"), cr), ("batches", BATCH_DTYPE, cr)):
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            if name in TOKEN_COLUMNS:     # chunks get their file space when the extent grows, unfilled
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            d = f.create_dataset(name, shape=(1 if name == "offsets" else 0,), maxshape=(None,),
                                 chunks=(chunk,), dtype=dtype, dcpl=dcpl)
            d.attrs["doc"] = schema.DATASET_DOCS[name]
        f["offsets"][0] = 0
        f.flush()
        os.replace(new, path)
        self.file = f
        fd = f.id.get_vfd_handle()
        self._columns = {name: _TokenColumn(f[name], ct, fd) for name in TOKEN_COLUMNS}
        self._rows_columns = {name: _RowColumn(f[name]) for name in ("offsets", "rows", "meta", "batches")}
        if self.cfg.fsync:
            self._fsync_fd = os.open(path, os.O_RDONLY)


class _RowColumn:
    """Appends to a per-row dataset through h5py's low-level calls (a slice assignment costs
    0.2–0.8 ms for compound types, mostly in type handling that is the same for every batch)."""

    def __init__(self, ds: h5py.Dataset):
        self.ds = ds
        self.size = ds.shape[0]
        self.mtype = h5py.h5t.py_create(ds.dtype)

    def append(self, data: np.ndarray) -> None:
        n = len(data)
        self.ds.id.set_extent((self.size + n,))
        space = self.ds.id.get_space()
        space.select_hyperslab((self.size,), (n,))
        self.ds.id.write(h5py.h5s.create_simple((n,)), space, data, self.mtype)
        self.size += n


class _TokenColumn:
    """Appends to a per-token dataset by writing the samples' own arrays into the file (pwritev).

    The dataset allocates its chunks when it is extended (early allocation, never filled), so the
    file address of every element is known once the extent grows. A batch is then written with
    one ``pwritev`` per chunk it touches, straight from the arrays: no staging copy, and no chunk is
    rewritten (the raw write of the same bytes is what is left). HDF5 sees no raw-data write, which
    is why the writer's file has no chunk cache: a read of the open segment goes to the file.
    """

    def __init__(self, ds: h5py.Dataset, chunk: int, fd: int):
        self.ds, self.chunk, self.fd = ds, chunk, fd
        self.dtype = ds.dtype
        self.size = ds.shape[0]

    def append(self, arrays: list[np.ndarray], total: int, hasher: "xxhash.xxh3_64") -> None:
        """Write `arrays` (``total`` elements together) behind the column's end and hash them in order."""
        if total == 0:
            return
        c, start = self.chunk, self.size
        self.ds.id.set_extent((start + total,))
        k, first = divmod(start, c)        # chunk of the first new element, and its offset in that chunk
        room, iov = c - first, []
        for a in arrays:
            a = np.ascontiguousarray(a, self.dtype)
            hasher.update(a)
            i, n = 0, len(a)
            while n - i >= room:           # `a` fills the current chunk
                iov.append(a[i:i + room])
                i += room
                self._write(k, first, iov)
                k, first, room, iov = k + 1, 0, c, []
            if i < n:
                iov.append(a[i:] if i else a)
                room -= n - i
        if iov:
            self._write(k, first, iov)
        self.size = start + total

    def _write(self, k: int, first: int, iov: list[np.ndarray]) -> None:
        address = self.ds.id.get_chunk_info_by_coord((k * self.chunk,)).byte_offset
        offset = address + first * self.dtype.itemsize
        for i in range(0, len(iov), _IOV_MAX):
            part = iov[i:i + _IOV_MAX]
            want = sum(x.nbytes for x in part)
            done = os.pwritev(self.fd, part, offset)
            if done != want:
                raise OSError(f"short write to {self.ds.name}: {done} of {want} bytes at offset {offset}")
            offset += want


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
