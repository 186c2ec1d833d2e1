"""The per-worker sample store: a bounded memory cache in front of the worker's shard.

A worker ``put``s every finished sample here; trainers ``get`` them by id (locally, or through the
service thread's :class:`~reflow_hpc.storage.fetch.FetchServer`). Rules:
- Every sample is written to the shard (batched and flushed by :class:`ShardWriter`'s bounds) and,
  while it fits, also kept in memory. The cache holds at most ``storage.memory_mib`` MiB of payload
  (tokens, logprobs, versions); when it is full the oldest samples (put order) leave memory first and
  are read back from the shard on demand.
- ``get`` looks in memory, then among the samples pending for the next batch, then in the shard.
  An id this worker never held raises :class:`UnknownSampleError`; an id whose row was lost (corrupt
  or missing segment after a restart) raises :class:`LostSampleError`; both name the id and the rank.
- ``release`` drops samples from memory only: their shard rows stay for offline analysis and for a
  later ``get`` (a replayed sample may be asked for again).
- A store opened with ``resume=True`` on a directory with segments restores them: it verifies every
  segment, seals a segment left open by a crash (renamed to its final name, listed in the manifest as
  ``recovered``), serves the recovered samples from disk and reports the lost ones (``restored``).
  Without ``resume`` the directory must hold no segments, so two runs never mix their samples.
- All methods are thread-safe: the worker's main thread puts while its service thread gets.
- Returned Trajectory objects may be the cached ones: treat their arrays as read-only.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable

import h5py

from reflow_hpc.config import StorageConfig
from reflow_hpc.private import private_dir
from reflow_hpc.storage import schema
from reflow_hpc.storage.manifest import Manifest, SegmentEntry, write_manifest
from reflow_hpc.storage.reader import LostRows, ScanReport, open_segment, read_rows, scan_directory
from reflow_hpc.storage.schema import (Location, LostSampleError, StorageError, UnknownSampleError,
                                       parse_segment_name, payload_bytes, segment_name)
from reflow_hpc.storage.writer import MIB, NEW_SUFFIX, PAYLOAD_BYTES_PER_TOKEN, ShardWriter
from reflow_hpc.trajectory import Trajectory


class SampleStore:
    """Samples of worker `owner`: memory cache + shard segments under `directory`."""

    def __init__(self, directory: str | os.PathLike, owner: int, cfg: StorageConfig, *,
                 resume: bool = False, verify: bool = True, clock: Callable[[], float] = time.monotonic):
        self.directory = Path(directory)
        self.owner = owner
        self.cfg = cfg
        self._lock = threading.RLock()
        self._memory: OrderedDict[int, Trajectory] = OrderedDict()
        self._memory_bytes = 0
        self._memory_limit = int(cfg.memory_mib * MIB)
        self._readers: dict[int, h5py.File] = {}
        self._restored: dict[int, Location] = {}
        self._lost: dict[int, LostRows] = {}
        self.restored: ScanReport | None = None
        private_dir(self.directory, what=f"rank {owner}: shard directory")
        existing = sorted(p.name for p in self.directory.iterdir()
                          if parse_segment_name(p.name) or p.name == schema.MANIFEST)
        manifest, next_segment = Manifest(owner=owner), 0
        if existing and not resume:
            raise StorageError(f"rank {owner}: shard directory {self.directory} already holds {existing[0]} "
                               f"(and {len(existing) - 1} more); resume from it or use an empty directory")
        if existing:
            manifest, next_segment = self._restore(verify)
        self.writer = ShardWriter(self.directory, owner, cfg, first_segment=next_segment,
                                  manifest=manifest, clock=clock)

    # -------------------------------------------------------------------------------- public API

    def put(self, trajs: Iterable[Trajectory], now: float | None = None) -> None:
        """Take finished samples: cache them in memory and append them to the shard."""
        trajs = trajs if isinstance(trajs, list) else list(trajs)
        with self._lock:
            if self._restored or self._lost:
                for t in trajs:
                    if t.sample_id in self._restored or t.sample_id in self._lost:
                        raise StorageError(f"rank {self.owner}: sample {t.sample_id} is already held "
                                           f"(restored from {self.directory})")
            self.writer.append(trajs, now)
            for t in trajs:
                t.owner = self.owner
            if self._memory_limit > 0:
                for t in trajs:
                    self._memory[t.sample_id] = t
                    self._memory_bytes += payload_bytes(t)
                if self._memory_bytes > self._memory_limit:
                    self._evict()

    def get(self, ids: Iterable[int]) -> list[Trajectory]:
        """The samples with these ids, in order (memory first, else pending, else the shard)."""
        ids = list(ids)
        out: list[Trajectory | None] = [None] * len(ids)
        with self._lock:
            from_disk: dict[int, list[int]] = {}     # segment -> positions in ids
            for k, sid in enumerate(ids):
                t = self._memory.get(sid) or self.writer.pending(sid)
                if t is not None:
                    out[k] = t
                    continue
                loc = self.writer.location(sid) or self._restored.get(sid)
                if loc is None:
                    if sid in self._lost:
                        raise LostSampleError(f"sample {sid} on rank {self.owner} was lost: "
                                              f"{self._lost[sid].describe()}")
                    raise UnknownSampleError(f"sample {sid} is not held by rank {self.owner}")
                from_disk.setdefault(loc.segment, []).append(k)
            for seg, ks in from_disk.items():
                locs = [self.writer.location(ids[k]) or self._restored[ids[k]] for k in ks]
                try:
                    got = read_rows(self._segment_file(seg), locs, [ids[k] for k in ks],
                                    budget_mib=self.cfg.read_budget_mib)
                except StorageError:
                    raise
                except Exception as e:
                    raise StorageError(f"rank {self.owner}: reading {len(ks)} samples (e.g. sample {ids[ks[0]]}) "
                                       f"from segment {segment_name(self.owner, seg)} failed: "
                                       f"{e.__class__.__name__}: {e}") from e
                for k, t in zip(ks, got):
                    out[k] = t
        return out  # type: ignore[return-value]

    def release(self, ids: Iterable[int]) -> None:
        """Drop samples from memory; their shard rows stay."""
        with self._lock:
            for sid in ids:
                t = self._memory.pop(sid, None)
                if t is not None:
                    self._memory_bytes -= payload_bytes(t)
                elif not self.holds(sid):
                    raise UnknownSampleError(f"sample {sid} is not held by rank {self.owner}")

    def holds(self, sample_id: int) -> bool:
        """Whether `get` can return this sample (in memory, pending or in a readable shard row)."""
        with self._lock:
            return (sample_id in self._memory or self.writer.location(sample_id) is not None
                    or sample_id in self._restored)

    def held_ids(self) -> list[int]:
        """Every sample id `get` can return: restored ones first, then the ones put since."""
        with self._lock:
            return list(self._restored) + list(self.writer.locations)

    def lost_ids(self) -> list[int]:
        """Sample ids found in the directory at restore whose rows could not be read back."""
        with self._lock:
            return sorted(self._lost)

    def location(self, sample_id: int) -> tuple[str, Location] | None:
        """(segment file name, location) of a sample's shard row — known as soon as it is put."""
        with self._lock:
            loc = self.writer.location(sample_id) or self._restored.get(sample_id)
            return (segment_name(self.owner, loc.segment), loc) if loc else None

    def flush(self) -> int:
        """Write the pending samples to the shard now; returns how many."""
        with self._lock:
            return self.writer.flush()

    def maybe_flush(self, now: float | None = None) -> bool:
        """Flush if the oldest pending sample waited `storage.flush_s` (call from a polling loop)."""
        with self._lock:
            return self.writer.maybe_flush(now)

    def close(self) -> None:
        """Flush, close the open segment (it enters the manifest) and every read handle."""
        with self._lock:
            self.writer.close()
            for f in self._readers.values():
                f.close()
            self._readers.clear()
            self._memory.clear()
            self._memory_bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"memory_samples": len(self._memory), "memory_bytes": self._memory_bytes,
                    "pending_samples": self.writer.pending_rows, "flushed_samples": self.writer.flushed_total,
                    "restored_samples": len(self._restored), "lost_samples": len(self._lost),
                    "segment": self.writer.segment}

    def __enter__(self) -> "SampleStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ helpers

    def _evict(self) -> None:
        while self._memory_bytes > self._memory_limit and self._memory:
            _, t = self._memory.popitem(last=False)
            self._memory_bytes -= payload_bytes(t)

    def _segment_file(self, segment: int) -> h5py.File:
        if segment == self.writer.segment and self.writer.file is not None:
            return self.writer.file
        f = self._readers.get(segment)
        if f is None:
            f = self._readers[segment] = open_segment(self.directory / segment_name(self.owner, segment))[0]
        return f

    def _restore(self, verify: bool) -> tuple[Manifest, int]:
        for p in self.directory.glob("*" + NEW_SUFFIX):   # segments whose creation a crash interrupted
            p.unlink()
        report = scan_directory(self.directory, verify=verify, budget_mib=self.cfg.read_budget_mib)
        if report.manifest_error is not None:
            raise StorageError(f"rank {self.owner}: {report.manifest_error}")
        manifest = report.manifest or Manifest(owner=self.owner)
        foreign = [s.file for s in report.segments if s.owner not in (self.owner, -1)]
        if foreign:
            raise StorageError(f"rank {self.owner}: shard directory {self.directory} holds segments of "
                               f"another rank ({foreign[0]})")
        changed = False
        for scan in report.segments:
            for lr in scan.lost:
                for sid in lr.sample_ids:
                    self._lost[sid] = lr
            for sid, loc in scan.locations.items():
                self._restored[sid] = loc
                self._lost.pop(sid, None)
            if manifest.entry(scan.file) is None:
                # Left open by a crash (or closed just before the manifest was written): seal it.
                if scan.was_open:
                    os.replace(self.directory / (scan.file + schema.OPEN_SUFFIX), self.directory / scan.file)
                lost_rows = sum((lr.rows[1] - lr.rows[0]) if lr.rows else 0 for lr in scan.lost)
                manifest.segments.append(SegmentEntry(
                    file=scan.file, index=scan.index, state="recovered" if scan.readable else "unreadable",
                    rows=len(scan.order), tokens=sum(l.token_end - l.token_start for l in scan.locations.values()),
                    bytes=PAYLOAD_BYTES_PER_TOKEN * sum(l.token_end - l.token_start for l in scan.locations.values()),
                    batches=-1, closed_unix=time.time(), sample_ids=list(scan.order), lost_rows=lost_rows))
                changed = True
        if changed:
            manifest.segments.sort(key=lambda s: s.index)
            write_manifest(self.directory, manifest, fsync=self.cfg.fsync)
        self.restored = report
        next_segment = 1 + max((s.index for s in report.segments), default=-1)
        return manifest, next_segment
