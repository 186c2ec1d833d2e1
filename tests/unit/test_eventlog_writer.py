"""The event log's writer never hangs the coordinator and never fails silently: a write error comes back
as one line naming the file and the cause; flush, close and a full queue wait at most ``timeout_s``."""

from __future__ import annotations

import errno
import json
import threading
import time

import pytest

from reflow_hpc.runtime.eventlog import EventLogError, EventWriter


def _events(n: int, start: int = 0) -> list[dict]:
    return [{"t": 1.0, "e": "end", "v": 0, "id": start + i, "reason": "trained", "w": 1} for i in range(n)]


class _Full:
    """A file whose writes fail as on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Stuck(_Full):
    """A file whose writes block (a file system that stopped answering) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.release.wait()
        self.written.append(text)
        return len(text)


def _writer(tmp_path, file=None, **kw) -> EventWriter:
    w = EventWriter(tmp_path / "events.jsonl", append=False, flush_s=0.01, **kw)
    if file is not None:
        w._file.close()
        w._file = file
    return w


def test_events_are_written_in_order_and_flush_puts_them_on_disk(tmp_path):
    w = _writer(tmp_path, timeout_s=10.0)
    for k in range(50):
        w.put(_events(20, 20 * k))
    w.flush()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == list(range(1000))
    w.close()
    assert w.events == 1000


def test_a_write_error_is_one_line_naming_the_file_and_the_cause_at_the_next_put(tmp_path):
    w = _writer(tmp_path, _Full(), timeout_s=10.0)
    w.put(_events(3))
    w.join(5.0)
    assert not w.is_alive(), "the writer should stop at its first failed write"
    with pytest.raises(EventLogError) as err:
        w.put(_events(1))
    text = str(err.value)
    assert "\n" not in text and str(tmp_path / "events.jsonl") in text and "No space left on device" in text
    assert len(w._queue) == 0            # nothing more piles up behind a dead writer
    with pytest.raises(EventLogError, match="No space left"):
        w.flush()
    with pytest.raises(EventLogError, match="No space left"):
        w.close()


def test_flush_of_a_dead_writer_fails_at_once(tmp_path):
    w = _writer(tmp_path, _Full(), timeout_s=60.0)
    w.put(_events(3))
    t0 = time.monotonic()
    with pytest.raises(EventLogError, match="write failed"):
        w.flush()
    assert time.monotonic() - t0 < 5.0


def test_flush_and_close_of_a_stuck_writer_end_at_the_deadline_naming_the_operation(tmp_path):
    stuck = _Stuck()
    w = _writer(tmp_path, stuck, timeout_s=0.5)
    w.put(_events(5))
    t0 = time.monotonic()
    with pytest.raises(EventLogError) as err:
        w.flush()
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert "flush" in str(err.value) and str(tmp_path / "events.jsonl") in str(err.value)
    with pytest.raises(EventLogError, match="close"):
        w.close()
    stuck.release.set()
    w.join(5.0)


def test_a_full_queue_holds_put_back_until_the_writer_catches_up(tmp_path):
    stuck = _Stuck()
    w = _writer(tmp_path, stuck, timeout_s=10.0, max_pending=100)
    w.put(_events(60))
    threading.Timer(0.3, stuck.release.set).start()
    t0 = time.monotonic()
    w.put(_events(60, 60))              # over the bound: waits for the writer
    assert time.monotonic() - t0 >= 0.25
    assert w._put - w.events <= 50      # it waited until half of the bound was left
    w.flush()
    w.close()
    assert [json.loads(x)["id"] for x in "".join(stuck.written).splitlines()] == list(range(120))


def test_a_full_queue_with_a_stuck_writer_fails_at_the_deadline(tmp_path):
    stuck = _Stuck()
    w = _writer(tmp_path, stuck, timeout_s=0.5, max_pending=100)
    for k in range(10):
        w.put(_events(10, 10 * k))
    t0 = time.monotonic()
    with pytest.raises(EventLogError, match="queue full"):
        w.put(_events(10, 100))
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert len(w._queue) <= 11          # bounded: nothing was added past the bound but the batch that hit it
    stuck.release.set()


def test_a_resume_cuts_the_unfinished_line_a_failed_write_left(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = "".join(json.dumps(e) + "\n" for e in _events(3))
    path.write_text(whole + '{"t":1.0,"e":"en')
    w = EventWriter(path, append=True, flush_s=0.01, timeout_s=10.0)
    assert w.cut == len('{"t":1.0,"e":"en')
    w.put(_events(2, 3))
    w.close()
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    again = EventWriter(path, append=True, timeout_s=10.0)
    again.close()
    assert again.cut == 0 and len(path.read_text().splitlines()) == 5   # a whole file is left as it is
    path.write_text('{"t":1.0,"e":"en')                                   # no whole line at all
    last = EventWriter(path, append=True, timeout_s=10.0)
    last.close()
    assert last.cut == len('{"t":1.0,"e":"en') and path.read_text() == ""
