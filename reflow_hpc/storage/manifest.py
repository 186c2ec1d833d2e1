"""`manifest.json`: the list of a worker's closed segments, replaced atomically.

Rules:
- The manifest is written to a temp file of unpredictable name and renamed over ``manifest.json``
  (``private.write_atomic``), so a reader sees either the previous or the next version, never a partial
  one, and a symlink planted at either name is never written through.
- A segment enters the manifest only after its file was renamed from ``<name>.open`` to ``<name>``;
  a closed segment missing from the manifest (a crash between the two renames) is still found by a
  directory scan.
- Each entry records the sample ids of the segment, so the ids of a segment that can no longer be
  read are still known and reported as lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from reflow_hpc.private import write_atomic
from reflow_hpc.storage import jsonl
from reflow_hpc.storage.schema import FORMAT, FORMAT_VERSION, MANIFEST, StorageError


@dataclass
class SegmentEntry:
    file: str
    index: int
    state: str              # closed | recovered (sealed after a crash) | unreadable
    rows: int
    tokens: int
    bytes: int              # payload bytes (tokens, logprobs, versions), what segment_mib bounds
    batches: int
    closed_unix: float
    sample_ids: list[int] = field(default_factory=list)
    lost_rows: int = 0      # rows of a recovered segment that failed verification


@dataclass
class Manifest:
    owner: int
    segments: list[SegmentEntry] = field(default_factory=list)

    def entry(self, file: str) -> SegmentEntry | None:
        return next((s for s in self.segments if s.file == file), None)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT + "-manifest", "format_version": FORMAT_VERSION,
                           "owner": self.owner, "segments": [vars(s) for s in self.segments]},
                          separators=(",", ":"))


def read_manifest(directory: str | os.PathLike) -> Manifest | None:
    """The manifest of ``directory``, or None when there is none; read bounded (at most 64 MiB and
    64 levels deep, a regular file) and checked field by field, so that a damaged or planted one
    raises StorageError naming the file, never anything else."""
    path = Path(directory) / MANIFEST
    try:
        data = jsonl.load_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorageError(f"{path}: unreadable manifest ({e.__class__.__name__}: {e})") from None
    try:
        segments = [SegmentEntry(**s) for s in data["segments"]]
        manifest = Manifest(owner=int(data["owner"]), segments=segments)
        for s in segments:
            ints = [s.index, s.rows, s.tokens, s.bytes, s.batches, s.lost_rows, *s.sample_ids]
            if not (isinstance(s.file, str) and isinstance(s.state, str) and isinstance(s.sample_ids, list)
                    and all(type(i) is int for i in ints) and s.rows >= 0):
                raise ValueError(f"segment entry {str(s.file)[:80]!r} has fields of the wrong type")
    except (KeyError, TypeError, ValueError) as e:
        raise StorageError(f"{path}: unreadable manifest ({e.__class__.__name__}: {e})") from None
    return manifest


def write_manifest(directory: str | os.PathLike, manifest: Manifest, *, fsync: bool = False) -> None:
    """Replace `directory`/manifest.json atomically."""
    write_atomic(Path(directory) / MANIFEST, manifest.to_json(), fsync=fsync)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
