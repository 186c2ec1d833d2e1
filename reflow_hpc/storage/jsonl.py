"""Bounded JSON reading for files a run left behind (event log, metrics, manifests, topology).

Those files may be damaged or planted, so nothing here trusts their sizes or shapes:

- a JSON Lines line is read at most :data:`MAX_LINE_BYTES` at a time; a longer line is passed over
  (read on in pieces up to its end) and reported, never held whole;
- a whole JSON file is read only up to :data:`MAX_FILE_BYTES`;
- nesting deeper than :data:`MAX_DEPTH` is refused before ``json.loads`` sees the text (the C parser
  recurses once per level and raises RecursionError, not ValueError, on deep input);
- only regular files are opened, without blocking: a FIFO or a device named like a run file would
  otherwise hang a reader or feed it without end.

Every refusal is a :class:`JSONLimitError`, a ValueError, so that callers that already treat a
``json`` ValueError as damage treat these alike.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import chain
from typing import IO, Any, Iterator

MAX_LINE_BYTES = 1 << 20        # one event or metrics record is a few KiB; a compose of a huge batch ~100 KiB
MAX_DEPTH = 64                  # the deepest honest record nests 3 levels
MAX_FILE_BYTES = 64 << 20       # a manifest listing ~8 M sample ids; topology and summaries are far smaller

# Strings (whose brackets do not count) and brackets, for the exact depth scan. Possessive, and an
# unterminated string runs to the end: every match attempt is linear and none is retried.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_DECODER = json.JSONDecoder()


class JSONLimitError(ValueError):
    """Text refused by a bound of this module (too long, too deep, not a regular file)."""


def depth_ok(raw: bytes, max_depth: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests at most ``max_depth`` arrays/objects.

    The count of opening brackets bounds the depth from above, so almost every line is settled by
    two C-speed counts; only text with more brackets than ``max_depth`` is scanned exactly,
    skipping brackets inside strings, and the scan stops at the first level too deep.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return True
    depth = 0
    for m in _TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return False
        elif c in (b"]", b"}"):
            depth -= 1
    return True


def loads(raw: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` of UTF-8 bytes after the depth check; raises ValueError on bad or refused text."""
    if not depth_ok(raw, max_depth):
        raise JSONLimitError(f"nested deeper than {max_depth} levels")
    return _DECODER.decode(raw.decode("utf-8"))     # on str: json.loads(bytes) first guesses the encoding


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened for binary reading; OSError, or JSONLimitError when it is not a regular file.

    Opened non-blocking (a FIFO opens at once instead of waiting for a writer), then checked on the
    descriptor itself, so the check and the read see the same file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JSONLimitError("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def iter_lines(f: IO[bytes], max_line: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of every line of ``f``, 1-based, without its newline; None in place of a
    line longer than ``max_line`` bytes, which is read past, never kept whole. Lines come from
    1 MiB blocks split at newlines, and are numbered by C iterators: no Python frame per line."""
    return enumerate(chain.from_iterable(_blocks(f, max_line)), 1)


def _blocks(f: IO[bytes], max_line: int) -> Iterator[list[bytes | None]]:
    """The lines of ``f`` (iter_lines), one list per block read."""
    rest = b""                  # the start of a line whose end is in a later block
    skipping = False            # inside a line already reported as too long
    while True:
        data = f.read(1 << 20)
        if not data:
            break
        if skipping:
            cut = data.find(b"\n")
            if cut < 0:
                continue
            data, skipping = data[cut + 1:], False
        data = rest + data if rest else data
        lines: list[bytes | None] = data.split(b"\n")
        rest = lines.pop()
        if lines and max(map(len, lines)) > max_line:
            lines = [raw if len(raw) <= max_line else None for raw in lines]
        if len(rest) > max_line:
            lines.append(None)
            rest, skipping = b"", True
        yield lines
    if rest:
        yield [rest if len(rest) <= max_line else None]


def load_file(path: str | os.PathLike, *, max_bytes: int = MAX_FILE_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """A whole JSON file, bounded; OSError when it cannot be opened, ValueError when it is refused
    or is not JSON (the message says which, without the path: callers name the file)."""
    with open_regular(path) as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise JSONLimitError(f"larger than {max_bytes >> 20} MiB")
    return loads(raw, max_depth=max_depth)
