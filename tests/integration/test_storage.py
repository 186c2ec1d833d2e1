"""Shard segments, manifest, sample store: round trips, bounds, corruption and crash recovery."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from storage_samples import difference, make_sample, sample_id  # noqa: E402

from reflow_hpc.config import StorageConfig
from reflow_hpc.storage import (LostSampleError, SampleStore, ShardReader, StorageError, UnknownSampleError,
                                scan_directory, segment_name)
from reflow_hpc.storage.manifest import read_manifest
from reflow_hpc.trajectory import Trajectory
from conftest import ROOT, HELPERS

OWNER = 3


def samples(n: int, seed: int = 0, start: int = 0, **kw) -> list[Trajectory]:
    return [make_sample(seed, OWNER, i, **kw) for i in range(start, start + n)]


def assert_same(expected: list[Trajectory], got: list[Trajectory]) -> None:
    assert len(expected) == len(got)
    diffs = [f"sample {a.sample_id}: {d}" for a, b in zip(expected, got) if (d := difference(a, b))]
    assert not diffs, diffs[:5]


def on_disk(path: Path, tmp_path: Path) -> h5py.File:
    """What a segment holds on disk right now: a copy, opened read-only (the writer keeps the original)."""
    copy = tmp_path / ("copy-" + path.name)
    shutil.copyfile(path, copy)
    return h5py.File(copy, "r")


# ------------------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("memory_mib", [0.0, 64.0], ids=["from-shard", "from-memory"])
def test_round_trip_bit_for_bit(tmp_path, memory_mib):
    # flush_s far away: the pending rows this test looks for must not be flushed by a stalled clock.
    cfg = StorageConfig(flush_rows=5, flush_s=3600.0, segment_mib=0.05, memory_mib=memory_mib, chunk_tokens=512,
                        chunk_rows=8)
    trajs = samples(40)
    assert any(len(t.tokens) == 0 for t in trajs) and any(t.response_len == 0 < len(t.tokens) for t in trajs)
    assert max(len(t.tokens) for t in trajs) > 512          # a row spanning several chunks
    with SampleStore(tmp_path, OWNER, cfg) as store:
        store.put(trajs[:17])
        for t in trajs[17:]:
            store.put([t])
        assert store.stats()["pending_samples"] > 0          # some still pending, served from there
        order = list(range(40))[::-1] + [5, 5]
        assert_same([trajs[i] for i in order], store.get([trajs[i].sample_id for i in order]))
    with ShardReader(tmp_path) as reader:
        assert reader.ids() == [t.sample_id for t in trajs]
        assert not reader.report.lost and not reader.report.unreadable
        assert_same(trajs, reader.get(reader.ids()))


def test_reads_of_the_open_segment_between_batches(tmp_path):
    # Batches fill the partial last chunk of each per-token dataset behind HDF5's back (pwritev);
    # reads through the writer's own file handle in between must see every batch (no stale chunk
    # cache), and the file must not grow per batch.
    cfg = StorageConfig(flush_rows=1, memory_mib=0.0, chunk_tokens=300)
    trajs = samples(60, max_len=50)
    with SampleStore(tmp_path, OWNER, cfg) as store:
        for k, t in enumerate(trajs):
            store.put([t])
            assert_same([t, trajs[k // 2]], store.get([t.sample_id, trajs[k // 2].sample_id]))
        f = store.writer.file
        tokens = f["tokens"]
        assert tokens.id.get_num_chunks() == -(-tokens.shape[0] // 300)   # one chunk per 300 tokens, no more
    with ShardReader(tmp_path) as reader:
        assert_same(trajs, reader.get(reader.ids()))


def test_batch_with_more_samples_in_one_chunk_than_one_pwritev_takes(tmp_path):
    # One pwritev takes at most IOV_MAX (1024 on Linux) arrays; 3,000 two-token samples share one chunk.
    cfg = StorageConfig(flush_rows=3000, memory_mib=0.0, chunk_tokens=1 << 14)
    trajs = [Trajectory(sample_id=i, group_id=i, prompt_id=i, tokens=np.array([i, -i], np.int32),
                        logprobs=np.array([0.0, -0.5 - i], np.float32), versions=np.array([-1, i % 5], np.int32),
                        prompt_len=1, reward=float(i), finish_reason="stop") for i in range(3000)]
    with SampleStore(tmp_path, OWNER, cfg) as store:
        store.put(trajs)
        assert store.stats()["pending_samples"] == 0
        assert_same(trajs[::-1], store.get([t.sample_id for t in trajs[::-1]]))
    with ShardReader(tmp_path) as reader:
        assert not reader.report.lost
        assert_same(trajs, reader.get(reader.ids()))


def test_store_memory_bound_release_and_errors(tmp_path):
    trajs = samples(30)
    limit = sum(t.tokens.nbytes * 3 for t in trajs[-5:])
    cfg = StorageConfig(flush_rows=4, memory_mib=limit / (1 << 20))
    with SampleStore(tmp_path, OWNER, cfg) as store:
        store.put(trajs)
        st = store.stats()
        assert st["memory_bytes"] <= limit and 0 < st["memory_samples"] < 30
        cached = set(store._memory)                         # the newest samples stay in memory
        assert cached == {t.sample_id for t in trajs[-len(cached):]}
        store.release([t.sample_id for t in trajs])
        assert store.stats()["memory_samples"] == 0
        assert_same(trajs, store.get([t.sample_id for t in trajs]))   # released rows stay in the shard
        missing = sample_id(OWNER, 999)
        with pytest.raises(UnknownSampleError, match=f"sample {missing} is not held by rank {OWNER}"):
            store.get([trajs[0].sample_id, missing])
        with pytest.raises(StorageError, match=f"sample {trajs[0].sample_id} was already appended"):
            store.put([trajs[0]])
        bad = make_sample(0, OWNER, 500)
        bad.finish_reason = "a-very-long-finish-reason"
        with pytest.raises(StorageError, match="finish_reason"):
            store.put([make_sample(0, OWNER, 501), bad])
        assert not store.holds(sample_id(OWNER, 501))         # a failed put appends nothing
        odd = make_sample(0, OWNER, 502)
        odd.meta = {"x": object()}
        with pytest.raises(StorageError, match="not JSON"):
            store.put([odd])
    with pytest.raises(StorageError, match="already holds"):
        SampleStore(tmp_path, OWNER, cfg)                     # never mix two runs in one directory


# ------------------------------------------------------------------------------ flush and rotation

def test_flush_by_rows(tmp_path):
    cfg = StorageConfig(flush_rows=10, flush_s=3600.0)
    store = SampleStore(tmp_path, OWNER, cfg)
    trajs = samples(25)
    for t in trajs[:9]:
        store.put([t], now=0.0)
    assert not list(tmp_path.glob("*.open"))                  # nothing written before the bound
    store.put([trajs[9]], now=0.0)
    open_file = tmp_path / segment_name(OWNER, 0, open_=True)
    with on_disk(open_file, tmp_path) as f:
        assert f["rows"].shape == (10,) and f["batches"].shape == (1,)
    for t in trajs[10:25]:
        store.put([t], now=0.0)
    with on_disk(open_file, tmp_path) as f:
        assert f["rows"].shape == (20,) and f["batches"].shape == (2,)
        assert f["offsets"][-1] == f["tokens"].shape[0] == sum(len(t.tokens) for t in trajs[:20])
    assert store.stats()["pending_samples"] == 5
    store.close()
    assert ShardReader(tmp_path).ids() == [t.sample_id for t in trajs]


def test_flush_by_time(tmp_path):
    cfg = StorageConfig(flush_rows=1000, flush_s=5.0)
    store = SampleStore(tmp_path, OWNER, cfg)
    trajs = samples(3)
    store.put([trajs[0]], now=100.0)
    store.put([trajs[1]], now=103.0)
    assert not store.maybe_flush(now=104.9)                   # oldest pending waited 4.9 s < 5 s
    assert store.stats()["flushed_samples"] == 0
    assert store.maybe_flush(now=105.0)
    assert store.stats()["flushed_samples"] == 2 and store.stats()["pending_samples"] == 0
    store.put([trajs[2]], now=200.0)
    store.put([], now=205.5)                                  # a put also checks the clock
    assert store.stats()["flushed_samples"] == 3
    with on_disk(tmp_path / segment_name(OWNER, 0, open_=True), tmp_path) as f:
        assert f["batches"].shape == (2,) and f["rows"].shape == (3,)
    store.close()


@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
def test_rotation_and_manifest(tmp_path, fsync):
    cfg = StorageConfig(flush_rows=6, segment_mib=0.03, fsync=fsync)
    trajs = samples(80)
    with SampleStore(tmp_path, OWNER, cfg) as store:
        for t in trajs:
            store.put([t])
        locs = {t.sample_id: store.location(t.sample_id) for t in trajs}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.endswith(".open") or n.endswith(".tmp")]
    manifest = read_manifest(tmp_path)
    assert len(manifest.segments) >= 3 and names == sorted([s.file for s in manifest.segments] + ["manifest.json"])
    assert [s.index for s in manifest.segments] == list(range(len(manifest.segments)))
    assert [i for s in manifest.segments for i in s.sample_ids] == [t.sample_id for t in trajs]
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["owner"] == OWNER and raw["segments"][0]["state"] == "closed"
    for s in manifest.segments[:-1]:                           # every closed segment reached the bound
        assert s.bytes >= 0.03 * (1 << 20) and s.rows == len(s.sample_ids)
    for s in manifest.segments:
        with h5py.File(tmp_path / s.file, "r") as f:
            assert f.attrs["closed"] and f.attrs["segment"] == s.index and f.attrs["owner"] == OWNER
            assert f["rows"]["sample_id"].tolist() == s.sample_ids
            assert f["batches"].shape == (s.batches,)
            for row, sid in enumerate(s.sample_ids):        # the writer's locations match the files
                name, loc = locs[sid]
                assert name == s.file and loc.row == row
                assert (loc.token_start, loc.token_end) == tuple(f["offsets"][row:row + 2])


# ------------------------------------------------------------------------------------ corruption

def _closed_store(tmp_path: Path, n: int = 48) -> list[Trajectory]:
    cfg = StorageConfig(flush_rows=8, segment_mib=1.0, chunk_tokens=256, chunk_rows=8)
    trajs = samples(n)
    with SampleStore(tmp_path, OWNER, cfg) as store:
        for t in trajs:
            store.put([t])
    return trajs


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _check_report(tmp_path: Path, trajs: list[Trajectory], lost_expected: set[int], reason: str) -> None:
    report = scan_directory(tmp_path)
    lost = set(report.lost_ids())
    assert lost == lost_expected, report.summary()
    assert all(re.search(reason, lr.reason) for lr in report.lost), report.summary()
    good = [t for t in trajs if t.sample_id not in lost]
    assert set(report.locations()) == {t.sample_id for t in good}
    with SampleStore(tmp_path, OWNER, StorageConfig(), resume=True) as store:
        assert_same(good, store.get([t.sample_id for t in good]))
        assert store.lost_ids() == sorted(lost)
        sid = min(lost)
        with pytest.raises(LostSampleError, match=f"sample {sid} on rank {OWNER} was lost: .*{reason}"):
            store.get([sid])


def test_flipped_token_byte_loses_one_batch(tmp_path):
    trajs = _closed_store(tmp_path)
    path = tmp_path / segment_name(OWNER, 0)
    with h5py.File(path, "r") as f:
        batch = f["batches"][2]
        t = int(batch["token_start"]) + 1                      # a token inside batch 2
        chunk = f["tokens"].id.get_chunk_info_by_coord((t // 256 * 256,))
        offset = chunk.byte_offset + (t % 256) * 4
        ids = f["rows"]["sample_id"][batch["row_start"]:batch["row_end"]].tolist()
    _flip(path, offset)
    _check_report(tmp_path, trajs, set(ids), "token checksum mismatch")


def test_flipped_metadata_byte_loses_one_batch(tmp_path):
    trajs = _closed_store(tmp_path)
    path = tmp_path / segment_name(OWNER, 0)
    with h5py.File(path, "r") as f:
        chunk = f["rows"].id.get_chunk_info(1)                 # rows 8..15 = batch 1
        ids = f["rows"]["sample_id"][8:16].tolist()
    _flip(path, chunk.byte_offset + 5 * 8 + 1)                 # inside a row's group_id etc.
    _check_report(tmp_path, trajs, set(ids), "row checksum mismatch")


def test_offsets_beyond_data_are_reported(tmp_path):
    trajs = _closed_store(tmp_path)
    path = tmp_path / segment_name(OWNER, 0)
    with h5py.File(path, "r+") as f:
        ids = f["rows"]["sample_id"][16:24].tolist()
        f["offsets"][20] = f["tokens"].shape[0] + 1000
    _check_report(tmp_path, trajs, set(ids), "offsets outside")


def test_truncated_segment_reports_lost_rows(tmp_path):
    trajs = _closed_store(tmp_path)
    path = tmp_path / segment_name(OWNER, 0)
    os.truncate(path, os.path.getsize(path) * 2 // 3)
    report = scan_directory(tmp_path)
    lost, ok = set(report.lost_ids()), set(report.locations())
    assert lost and lost | ok == {t.sample_id for t in trajs} and not lost & ok, report.summary()
    assert ok and report.segments[0].padded                  # batches before the cut are recovered
    assert all("file truncated" in lr.reason for lr in report.lost), report.summary()
    with SampleStore(tmp_path, OWNER, StorageConfig(), resume=True) as store:
        good = [t for t in trajs if t.sample_id in ok]
        assert_same(good, store.get([t.sample_id for t in good]))
        assert set(store.lost_ids()) == lost


def test_unreadable_missing_and_foreign_files(tmp_path):
    trajs = _closed_store(tmp_path, 20)
    path = tmp_path / segment_name(OWNER, 0)
    _flip(path, 0)                                            # HDF5 signature: the file cannot be opened
    (tmp_path / segment_name(OWNER, 7, open_=True)).write_bytes(b"not an hdf5 file")
    report = scan_directory(tmp_path)
    assert set(report.unreadable) == {segment_name(OWNER, 0), segment_name(OWNER, 7)}
    assert report.lost_ids() == sorted(t.sample_id for t in trajs)   # ids known from the manifest
    assert "unknown samples" in report.summary()                    # the stray .open file had no record
    path.unlink()
    report = scan_directory(tmp_path)
    assert "file missing" in report.unreadable[segment_name(OWNER, 0)]
    assert report.lost_ids() == sorted(t.sample_id for t in trajs)
    with SampleStore(tmp_path, OWNER, StorageConfig(), resume=True) as store:
        assert store.held_ids() == [] and len(store.lost_ids()) == 20
        store.put([make_sample(0, OWNER, 100)])              # new samples go to a fresh segment
        assert store.location(sample_id(OWNER, 100))[0] == segment_name(OWNER, 8)
    with pytest.raises(StorageError, match=f"rank {OWNER + 1}: .* holds segments of another rank .seg-r{OWNER:05d}-"):
        SampleStore(tmp_path, OWNER + 1, StorageConfig(), resume=True)


def test_segment_of_another_format_version_is_reported_not_misread(tmp_path):
    trajs = _closed_store(tmp_path, 20)
    with h5py.File(tmp_path / segment_name(OWNER, 0), "r+") as f:
        f.attrs["format_version"] = 1                          # crc32 checksums: not this reader's format
    report = scan_directory(tmp_path)
    assert report.lost_ids() == sorted(t.sample_id for t in trajs) and not report.locations()
    assert "format_version 1; this reader reads version 2" in report.unreadable[segment_name(OWNER, 0)]


# ------------------------------------------------------------------------------- crash recovery

def test_kill_9_writer_recovers_every_flushed_row(tmp_path):
    proc = subprocess.Popen([sys.executable, str(HELPERS / "storage_writer_proc.py"), str(tmp_path),
                             "--seed", "11", "--flush-rows", "16", "--segment-mib", "0.2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        flushed = []
        for line in proc.stdout:
            if line.startswith("FLUSHED"):
                flushed.append(int(line.split()[1]))
            if len(flushed) >= 30:                  # past a rotation or two, mid-stream
                break
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    flushed += [int(x.split()[1]) for x in rest.splitlines() if x.startswith("FLUSHED")]
    last = flushed[-1]
    assert last >= 30 * 16

    report = scan_directory(tmp_path)
    assert not report.unreadable, report.summary()
    recovered = sorted(report.locations())
    n = len(recovered)
    assert n >= last and recovered == [sample_id(0, i) for i in range(n)], report.summary()
    assert all(lr.rows and lr.rows[0] >= 0 for lr in report.lost)    # at most a half-written last batch
    # Usually the kill lands while a segment is open (it must then be recovered up to its last
    # flush); rarely it lands between a rotation and the next batch, when none is.
    open_files = list(tmp_path.glob("*.open"))
    assert len(open_files) <= 1 and len(open_files) == sum(s.was_open for s in report.segments)
    assert len(report.segments) >= 2

    with SampleStore(tmp_path, 0, StorageConfig(), resume=True) as store:
        held = store.held_ids()
        assert sorted(held) == recovered
        expected = [make_sample(11, 0, i, max_len=100) for i in range(n)]
        assert_same(expected, store.get(held))
        assert not store.holds(sample_id(0, n))                      # never flushed: absent
        with pytest.raises(UnknownSampleError, match=f"sample {sample_id(0, n)} is not held by rank 0"):
            store.get([sample_id(0, n)])
        sealed = read_manifest(tmp_path).segments[-1]
        assert sealed.state == "recovered" and not list(tmp_path.glob("*.open"))
        store.put([make_sample(11, 0, n)])                           # the worker continues after restart
        assert store.location(sample_id(0, n))[0] == segment_name(0, sealed.index + 1)
    with SampleStore(tmp_path, 0, StorageConfig(), resume=True) as store:
        assert len(store.held_ids()) == n + 1


# ------------------------------------------------------------------------------------------- docs

def test_docs_example_reads_a_sample_with_plain_h5py(tmp_path):
    trajs = _closed_store(tmp_path, 10)
    text = (ROOT / "docs" / "storage.md").read_text()
    code = re.search(r"<!-- example -->\s*```python\n(.*?)```", text, re.S).group(1)
    scope = {"path": str(tmp_path / segment_name(OWNER, 0)), "i": 6}
    exec(compile(code, "docs/storage.md", "exec"), scope)
    t = trajs[6]
    assert scope["sample_id"] == t.sample_id and scope["meta"] == t.meta
    assert np.array_equal(scope["tokens"], t.tokens) and np.array_equal(scope["logprobs"], t.logprobs)
    assert np.array_equal(scope["versions"], t.versions) and scope["row"]["reward"] == t.reward
    assert scope["batch_ok"]
