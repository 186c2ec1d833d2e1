"""Streaming readers of a run directory that report bad data instead of raising.

- JSON Lines (``events.jsonl``, ``metrics.jsonl``): read one line at a time; a line that is not a
  JSON object (a crash cut it, a byte flipped), is longer than 1 MiB or nests deeper than 64 levels
  is skipped and reported with its line number, runs of consecutive bad lines as one range. Whole
  JSON files (``topology.json``, ``summary.json``, manifests) are read up to 64 MiB, as deep.
  Only regular files are read (:mod:`reflow_hpc.storage.jsonl`).
- Shards (``shards/rank*/``, copied there at the end of a run): every segment is verified by
  :func:`reflow_hpc.storage.reader.scan_segment`, the project's one rule for what a readable row is
  (its batch's extents agree with the datasets and both XXH3-64 checksums match). The ``rows``
  records of the verified rows are then read back in chunks of ``chunk_rows``, so memory holds one
  segment's verification map and one chunk, never a whole shard. Token data is read only by the
  verification, one flushed batch at a time.
- Whatever cannot be read (a missing or truncated file, a damaged batch, a segment of another format
  version, an unreadable manifest) becomes an :class:`Unreadable` naming the file, the rows or lines,
  and why. The rest is analysed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from reflow_hpc.storage import jsonl, schema
from reflow_hpc.storage.manifest import SegmentEntry, read_manifest
from reflow_hpc.storage.reader import BUDGET_MIB, open_segment, scan_segment
from reflow_hpc.storage.schema import StorageError, parse_segment_name

_DECODER = json.JSONDecoder()

# Largest values of a verified row's fields that the analysis sums by: its sums are arrays indexed
# by version, rank and length, so a row's fields must not size them beyond these.
MAX_VERSION = 1 << 20        # optimizer steps
MAX_RANK = 1 << 16
MAX_TOKENS = 1 << 22         # tokens of one sample


@dataclass(frozen=True)
class Unreadable:
    """Data an analysis could not read: a file, or rows of a segment, or lines of a JSONL file."""
    file: str                               # relative to the run directory
    reason: str
    rows: tuple[int, int] | None = None     # [start, end) rows of a segment
    lines: tuple[int, int] | None = None    # first and last line (1-based, inclusive) of a JSONL file
    samples: int | None = None              # samples in those rows, when the file or its manifest says

    def describe(self) -> str:
        where = ""
        if self.rows is not None:
            where = f" rows {self.rows[0]}–{self.rows[1] - 1}" if self.rows[1] > self.rows[0] else " (no rows)"
        elif self.lines is not None:
            a, b = self.lines
            where = f" line {a}" if a == b else f" lines {a}–{b}"
        n = f" ({self.samples} samples)" if self.samples is not None else ""
        return f"{self.file}{where}{n}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "reason": self.reason}
        if self.rows is not None:
            out["rows"] = list(self.rows)
        if self.lines is not None:
            out["lines"] = list(self.lines)
        if self.samples is not None:
            out["samples"] = self.samples
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Unreadable":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


# ----------------------------------------------------------------------------------------- JSONL

def iter_jsonl(path: Path, name: str, bad: list[Unreadable], *, skip: tuple[bytes, ...] = (),
               skip_within: int = 64) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every JSON-object line of ``path``; bad lines are appended to ``bad``.

    Lines are bounded (:mod:`reflow_hpc.storage.jsonl`): one longer than 1 MiB or nested deeper
    than 64 levels is damage like a line that is not JSON, reported with its line number; runs of
    consecutive bad lines with the same reason are one range. ``skip``: lines containing one of
    these strings within their first ``skip_within`` characters are passed over without parsing (a
    reader that needs no ``end`` events saves a third of the parse). A missing file, or one that is
    not a regular file, is one :class:`Unreadable`.
    """
    try:
        f = jsonl.open_regular(path)
    except OSError as e:
        bad.append(Unreadable(name, f"cannot open: {e.strerror or e}"))
        return
    except ValueError as e:
        bad.append(Unreadable(name, f"cannot open: {e}"))
        return
    run: list = [0, 0, ""]                          # first and last line of the current bad run, its reason
    decode, depth_ok, max_depth = _DECODER.decode, jsonl.depth_ok, jsonl.MAX_DEPTH
    with f:
        for lineno, raw in jsonl.iter_lines(f):
            if raw is None:
                reason = f"line longer than {jsonl.MAX_LINE_BYTES >> 20} MiB"
            else:
                if skip:
                    head = raw[:skip_within]
                    if any(s in head for s in skip):
                        continue
                # The bracket count bounds the depth: only a line with many brackets is scanned.
                if raw.count(b"[") + raw.count(b"{") > max_depth and not depth_ok(raw):
                    reason = f"nested deeper than {max_depth} levels"
                else:
                    try:
                        obj = decode(raw.decode("utf-8"))   # on str: json.loads(bytes) first guesses the encoding
                        if type(obj) is dict:
                            yield lineno, obj
                            continue
                        reason = "not a JSON object"
                    except ValueError:            # UnicodeDecodeError and JSONDecodeError are ValueErrors
                        if not raw.strip():
                            continue               # a blank line is not data
                        reason = "not a JSON object"
            if run[0] and lineno == run[1] + 1 and reason == run[2]:
                run[1] = lineno
                continue
            if run[0]:
                bad.append(Unreadable(name, run[2], lines=(run[0], run[1])))
            run[:] = [lineno, lineno, reason]
    if run[0]:
        bad.append(Unreadable(name, run[2], lines=(run[0], run[1])))


def skip_patterns(*events: str) -> tuple[bytes, ...]:
    """The ``skip`` argument of :func:`iter_jsonl` for events of these names (``"e":"<name>"``, as
    both the event log's fast path and ``json.dumps`` with compact separators write them)."""
    return tuple(f'"e":"{e}"'.encode() for e in events)


def read_json(path: Path, name: str, bad: list[Unreadable]) -> Any:
    """A whole small JSON file (summary.json, topology.json), or None and an :class:`Unreadable`.
    Bounded like the JSONL lines: at most 64 MiB, nested at most 64 levels."""
    try:
        return jsonl.load_file(path)
    except FileNotFoundError:
        bad.append(Unreadable(name, "missing"))
    except jsonl.JSONLimitError as e:
        bad.append(Unreadable(name, f"unreadable: {e}"))
    except (OSError, ValueError) as e:
        bad.append(Unreadable(name, f"unreadable: {e.__class__.__name__}: {e}"))
    return None


# ---------------------------------------------------------------------------------------- shards

@dataclass
class SegmentRows:
    """Verified rows of one segment, one chunk at a time (``rows`` holds ROW_DTYPE records)."""
    file: str                     # relative to the run directory
    owner: int
    rows: np.ndarray


@dataclass(frozen=True)
class Flush:
    """One verified batch of a segment: when its owner flushed it and how many tokens it holds."""
    owner: int
    unix_time: float
    rows: int
    tokens: int


class ShardWalk:
    """Every verified row under ``<run dir>/shards/rank*/``, segment by segment, in chunks.

    A run copies its shards there when it ends; a run that crashed left them in each rank's
    node-local scratch (``scratch_dirs``: ``topology.json``'s ``ranks[].scratch`` + ``/shards``),
    which are read instead when the run directory has none and they exist on this host.

    Iterate it for :class:`SegmentRows`; afterwards ``segments`` counts the segment files seen,
    ``flushes`` lists the verified batches, ``source`` says where the shards were found, and ``bad``
    (shared with the caller) holds what could not be read.
    """

    def __init__(self, run_dir: Path, bad: list[Unreadable], *, chunk_rows: int, verify: bool = True,
                 scratch_dirs: list[Path] = (), budget_mib: float = BUDGET_MIB):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows = {chunk_rows}: must be ≥ 1")
        self.run_dir, self.bad, self.chunk_rows, self.verify = run_dir, bad, chunk_rows, verify
        self.budget_mib = budget_mib
        self.scratch_dirs = list(scratch_dirs)
        self.segments = 0
        self.flushes: list[Flush] = []
        self.source = "shards"

    def rank_dirs(self) -> list[Path]:
        root = self.run_dir / "shards"
        if root.is_dir():
            try:
                found = sorted(p for p in root.iterdir() if p.name.startswith("rank"))
            except OSError as e:
                self.bad.append(Unreadable("shards", f"cannot list: {e.strerror or e}"))
                return []
            for p in found:
                if not p.is_dir():          # is_dir is False for a symlink loop too
                    self.bad.append(Unreadable(self._rel(p), "not a directory (or a symlink that leads to none)"))
            return [p for p in found if p.is_dir()]
        found = [d for d in self.scratch_dirs if d.is_dir()]
        if found:
            self.source = "node-local scratch (" + ", ".join(map(str, found)) + ")"
            return found
        self.bad.append(Unreadable("shards", "missing (no shard directory in the run directory, and no rank's "
                                             "node-local scratch on this host)"))
        return []

    def __iter__(self) -> Iterator[SegmentRows]:
        for d in self.rank_dirs():
            yield from self._rank(d)

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir)) if path.is_relative_to(self.run_dir) else str(path)

    def _rank(self, d: Path) -> Iterator[SegmentRows]:
        entries: dict[str, SegmentEntry] = {}
        try:
            manifest = read_manifest(d)
            entries = {s.file: s for s in manifest.segments} if manifest else {}
        except StorageError as e:
            self.bad.append(Unreadable(self._rel(d / schema.MANIFEST), str(e).split(": ", 1)[-1]))
        files: dict[str, Path] = {}
        try:
            names = [p.name for p in d.iterdir()]
        except OSError as e:
            self.bad.append(Unreadable(self._rel(d), f"cannot list: {e.strerror or e}"))
            names = []
        for n in names:
            parsed = parse_segment_name(n)
            if parsed is not None:
                files[n[:-len(schema.OPEN_SUFFIX)] if parsed[2] else n] = d / n
        for name in sorted(set(files) | set(entries)):
            self.segments += 1
            entry = entries.get(name)
            if name not in files:
                n = entry.rows if entry is not None else None
                self.bad.append(Unreadable(self._rel(d / name), "file missing (listed in the manifest)",
                                           rows=(0, n) if n is not None else None, samples=n))
                continue
            yield from self._segment(files[name], entry)

    def _segment(self, path: Path, entry: SegmentEntry | None) -> Iterator[SegmentRows]:
        rel = self._rel(path)
        scan = scan_segment(path, entry=entry, verify=self.verify, budget_mib=self.budget_mib)
        for lr in scan.lost:
            self.bad.append(Unreadable(rel, lr.reason, rows=lr.rows, samples=lr.count()))
        if not scan.locations:
            return
        verified = np.sort(np.fromiter((loc.row for loc in scan.locations.values()), np.int64,
                                       len(scan.locations)))
        owner = scan.owner
        self.flushes += [Flush(owner, t, rows, tokens) for rows, tokens, t in scan.flushes]
        del scan                                   # the per-row map is this segment's only large object
        try:
            f, _ = open_segment(path)
        except OSError as e:                       # it opened a moment ago: the file changed under us
            self.bad.append(Unreadable(rel, f"unreadable on second open: {e}", rows=(0, int(verified[-1]) + 1)))
            return
        with f:
            try:
                yield from self._rows(f, rel, owner, verified)
            except (OSError, ValueError, KeyError) as e:
                self.bad.append(Unreadable(rel, f"read error after verification: {e.__class__.__name__}: {e}"))

    def _rows(self, f, rel: str, owner: int, verified: np.ndarray) -> Iterator[SegmentRows]:
        ds = f["rows"]
        lo, hi = int(verified[0]), int(verified[-1]) + 1
        for a in range(lo, hi, self.chunk_rows):
            b = min(a + self.chunk_rows, hi)
            i, j = np.searchsorted(verified, [a, b])
            if i == j:
                continue
            chunk = ds[a:b]
            take = verified[i:j] - a
            chunk = chunk if len(take) == b - a else chunk[take]
            odd = ((chunk["min_version"] > MAX_VERSION) | (chunk["max_version"] > MAX_VERSION)
                   | (chunk["owner"] > MAX_RANK) | (chunk["num_tokens"] > MAX_TOKENS))
            if odd.any():
                self.bad.append(Unreadable(rel, f"rows with a version over {MAX_VERSION}, an owner over {MAX_RANK} "
                                                f"or over {MAX_TOKENS} tokens", samples=int(odd.sum())))
                chunk = chunk[~odd]
            yield SegmentRows(rel, owner, chunk)
