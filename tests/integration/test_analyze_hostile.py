"""Run directories and shard directories that someone else may have written: ``python -m
reflow_hpc.analyze`` and a worker resuming its shards read them as data. Nothing in them is
imported or run, no declared size makes a reader allocate it, no nesting or line length makes a
JSON reader raise, an output never writes through a planted symlink; every bad file is reported
by name (and rows or lines), the rest analysed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from conftest import ROOT, run_cmd

sys.path.insert(0, str(ROOT / "tools"))
from bench_analyze import synthesise  # noqa: E402

from reflow_hpc.analyze import analyze_run  # noqa: E402
from reflow_hpc.storage.reader import scan_directory  # noqa: E402
from reflow_hpc.storage.schema import BATCH_DTYPE, ROW_DTYPE  # noqa: E402

LIE_ROWS = 64 << 20
SMALL = ["trainer.batch_size=32", "checkpoint.every_steps=10"]
ENV = {"PYTHONPATH": str(ROOT)}       # the checkout under test, whatever the working directory


def lying_segment(path, rows: int = LIE_ROWS) -> None:
    """A valid HDF5 segment of a few KB whose datasets declare ``rows`` rows (chunks never written,
    so they read as zeros), and one batch record that claims all of them."""
    with h5py.File(path, "w") as f:
        f.attrs.update(format="reflow_hpc.shard", format_version=2, owner=0, segment=0, closed=True)
        for name, dtype in (("tokens", "<i4"), ("logprobs", "<f4"), ("versions", "<i4"), ("offsets", "<i8"),
                            ("rows", ROW_DTYPE), ("meta", h5py.string_dtype("utf-8"))):
            f.create_dataset(name, shape=(rows + (name == "offsets"),), maxshape=(None,), chunks=(1024,), dtype=dtype)
        batch = np.zeros(1, BATCH_DTYPE)
        batch["row_end"], batch["token_end"] = rows, rows
        f.create_dataset("batches", data=batch)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile") / "run"
    synthesise(d, 400, 0, SMALL)
    return d


def _copy(run_dir, dest):
    subprocess.run(["cp", "-a", str(run_dir), str(dest)], check=True)
    return dest


def _plant_plugin(run_dir, marker, sampler: str | None = None) -> str:
    """A module beside the run's files, importable from the analyst's working directory, named in
    ``run.plugins`` of its topology.json; importing it creates ``marker``."""
    module = "planted_plugin_" + run_dir.parent.name.replace("-", "_")
    (run_dir / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    topo = json.loads((run_dir / "topology.json").read_text())
    topo["config"]["run"]["plugins"] = [module]
    if sampler is not None:
        topo["config"]["reflow"]["sampler"] = sampler
    (run_dir / "topology.json").write_text(json.dumps(topo))
    return module


def _analyze(run_dir, *args, cwd=None, timeout=120):
    return run_cmd([sys.executable, "-m", "reflow_hpc.analyze", str(run_dir), "--json", *args],
                   cwd=cwd or ROOT, env=ENV, timeout=timeout)


# ----------------------------------------------------------------------------------------- plugins

def test_a_planted_plugin_is_not_imported(run_dir, tmp_path):
    """The analyst runs analyze from inside the run directory (its files importable): the module the
    recorded run.plugins names is reported, never imported, and the what-if still reproduces the run."""
    run = _copy(run_dir, tmp_path / "run")
    marker = tmp_path / "marker"
    module = _plant_plugin(run, marker)
    r = _analyze(".", "--no-plots", "--what-if", cwd=run)
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), "the planted plugin was imported"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["plugins_not_imported"] == [module] and res["reproduces_run"] is True
    assert sum(f"run.plugins names {module}: not imported" in line for line in r.stdout.splitlines()) == 1
    # Named on the command line, it is the user's choice: imported.
    r = _analyze(".", "--no-plots", "--what-if", "--plugin", module, cwd=run)
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "imported"
    assert json.loads(r.stdout.strip().splitlines()[-1])["plugins_not_imported"] == []


def test_a_what_if_that_needs_an_unnamed_plugin_is_skipped(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path / "run")
    marker = tmp_path / "marker"
    module = _plant_plugin(run, marker, sampler="planted_sampler")
    r = _analyze(run, "--no-plots", "--what-if", "reflow.sigma=0.25")
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "reflow.sampler" in res["what_if"]["skipped"] and module in res["what_if"]["skipped"]
    assert res["samples"] > 0 and res["reproduces_run"] is None
    assert "what-if: skipped:" in r.stdout


# ------------------------------------------------------------------------------------ lying HDF5

RSS_PROBE = textwrap.dedent("""
    import json, resource, sys
    def vm(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
    import h5py, numpy
    from reflow_hpc.config import StorageConfig
    from reflow_hpc.storage import SampleStore
    from reflow_hpc.storage.reader import scan_directory
    # Bounded address space, so that a reader that believes the file fails fast instead of swapping the host.
    resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize:") + (3 << 30), resource.RLIM_INFINITY))
    before = vm("VmHWM:")
    out = {}
    try:
        if sys.argv[1] == "scan":
            rep = scan_directory(sys.argv[2])
            out["lost"] = [[lr.file, list(lr.rows) if lr.rows else None, lr.reason] for lr in rep.lost]
        else:
            store = SampleStore(sys.argv[2], 0, StorageConfig(), resume=True)
            out["held"] = sorted(store.held_ids())
            out["lost"] = [[lr.file, list(lr.rows) if lr.rows else None, lr.reason] for lr in store.restored.lost]
            store.close()
    except BaseException as e:
        out["error"] = f"{e.__class__.__name__}: {e}"
    out["growth_mib"] = (vm("VmHWM:") - before) / 2 ** 20
    print(json.dumps(out))
""")


def _probe(kind, directory):
    r = run_cmd([sys.executable, "-c", RSS_PROBE, kind, str(directory)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_small_file_declaring_64m_rows_is_damaged_within_bounded_memory(tmp_path):
    d = tmp_path / "rank00000"
    d.mkdir()
    lying_segment(d / "seg-r00000-000000.h5")
    assert (d / "seg-r00000-000000.h5").stat().st_size < 16 << 10
    out = _probe("scan", d)
    assert out.get("error") is None, out
    assert out["growth_mib"] < 64, out
    [(file, rows, reason)] = out["lost"]
    assert file == "seg-r00000-000000.h5" and rows == [0, LIE_ROWS], out
    assert f"declares {LIE_ROWS} entries in rows" in reason, reason


def test_a_resuming_worker_loses_only_the_lying_file(tmp_path):
    """The worker's store restores its directory: the good segment's samples are served again, the
    lying one is reported lost, within bounded memory, and the store opens."""
    from reflow_hpc.config import StorageConfig
    from reflow_hpc.storage import SampleStore
    from reflow_hpc.trajectory import Trajectory
    d = tmp_path / "rank00000"
    store = SampleStore(d, 0, StorageConfig(flush_rows=4))
    store.put([Trajectory(sample_id=i, group_id=i // 4, prompt_id=i // 4, tokens=np.arange(10, dtype=np.int32),
                          logprobs=np.zeros(10, np.float32), versions=np.full(10, 1, np.int32), prompt_len=3,
                          reward=1.0, finish_reason="stop") for i in range(12)])
    store.close()
    lying_segment(d / "seg-r00000-000001.h5")
    out = _probe("store", d)
    assert out.get("error") is None, out
    assert out["held"] == list(range(12)) and out["growth_mib"] < 64, out
    assert [(f, rows) for f, rows, _ in out["lost"]] == [("seg-r00000-000001.h5", [0, LIE_ROWS])], out


# ------------------------------------------------------------------------------------ hostile JSON

def test_nested_and_oversized_json_is_damage_not_an_exception(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path / "run")
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    deep = b'{"e": "dispatch", "x": ' + nested(200_000) + b"}\n"
    long = b'{"e": "dispatch", "pad": "' + b"x" * (1 << 21) + b'"}\n'
    (run / "events.jsonl").write_bytes(b"".join(lines[:5] + [deep, long] + lines[5:]))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(nested(200_000) + b"\n")
    rank = sorted((run / "shards").glob("rank*"))[0]
    (rank / "manifest.json").write_bytes(b'{"owner": 0, "segments": ' + nested(200_000) + b"}")
    res, text = analyze_run(run, tmp_path / "a", plots=False)
    bad = res["unreadable"]
    assert {"file": "events.jsonl", "reason": "nested deeper than 64 levels", "lines": [6, 6]} in bad
    assert {"file": "events.jsonl", "reason": "line longer than 1 MiB", "lines": [7, 7]} in bad
    assert any(u["file"] == "metrics.jsonl" and "nested deeper" in u["reason"] for u in bad), bad
    assert any(u["file"].endswith(f"{rank.name}/manifest.json") and "nested deeper" in u["reason"] for u in bad), bad
    assert res["events"] == len(lines) and res["samples"] > 0    # the rest was analysed, the manifest's shards too
    # The worker that resumes from that directory gets one error naming its manifest, not a RecursionError.
    rep = scan_directory(rank)
    assert rep.manifest is None and "manifest.json" in rep.manifest_error and "nested deeper" in rep.manifest_error


# ----------------------------------------------------------------------------- a directory of them

def test_analyze_on_a_directory_of_hostile_files(run_dir, tmp_path):
    """Garbage, truncated, lying and empty segments, hostile JSON Lines, symlink loops, empty JSON
    files, a FIFO and a topology.json with a planted plugin, in one run directory: analyze exits 0,
    imports nothing, and names every one of them."""
    run = _copy(run_dir, tmp_path / "run")
    marker = tmp_path / "marker"
    _plant_plugin(run, marker)
    ranks = sorted((run / "shards").glob("rank*"))
    seg = next(ranks[0].glob("seg-*.h5"))
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size // 3)                                   # truncated
    r1 = ranks[1]
    (r1 / "seg-r00099-000007.h5").write_bytes(os.urandom(8192))      # garbage
    (r1 / "seg-r00099-000008.h5").write_bytes(b"")                   # empty
    lying_segment(r1 / "seg-r00099-000009.h5")                       # lying
    os.symlink("seg-r00099-000011.h5", r1 / "seg-r00099-000010.h5")  # a symlink loop
    os.symlink("seg-r00099-000010.h5", r1 / "seg-r00099-000011.h5")
    os.mkfifo(r1 / "seg-r00099-000012.h5")                           # would block an open
    os.symlink("rank99999", run / "shards" / "rank99999")            # a directory that loops
    (ranks[2] / "manifest.json").write_bytes(b"")                    # empty manifest
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    hostile = [nested(200_000) + b"\n", b'{"e": "x", "p": "' + b"y" * (1 << 21) + b'"}\n', b"\xff\xfe\x00garbage\n",
               b'{"e": "dispatch", "ids": [1000000000000], "t": 1}\n',          # ids that would size arrays
               b'{"e": "finish", "id": 1, "w": 0, "v": 10000000000}\n']
    (run / "events.jsonl").write_bytes(b"".join(lines[:3] + hostile + lines[3:]))
    (run / "metrics.jsonl").unlink()
    os.symlink("metrics.jsonl", run / "metrics.jsonl")               # loops onto itself
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    r = _analyze(run, "--no-plots", "--what-if", timeout=90)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not marker.exists()
    res = json.loads(r.stdout.strip().splitlines()[-1])
    named = {u["file"].rsplit("/", 1)[-1] for u in res["unreadable"]}
    expected = {seg.name, "seg-r00099-000007.h5", "seg-r00099-000008.h5", "seg-r00099-000009.h5",
                "seg-r00099-000010.h5", "seg-r00099-000011.h5", "seg-r00099-000012.h5", "manifest.json",
                "rank99999", "events.jsonl", "metrics.jsonl", "summary.json"}
    assert expected <= named, expected - named
    assert res["samples"] > 0 and res["plugins_not_imported"]
    lie = [u for u in res["unreadable"] if u["file"].endswith("seg-r00099-000009.h5")]
    assert lie and lie[0]["rows"] == [0, LIE_ROWS]


def test_outputs_replace_a_planted_symlink(run_dir, tmp_path):
    """summary.txt and analysis.json planted as symlinks to a file of the analyst's: the file is left
    alone, the outputs are regular files."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("summary.txt", "analysis.json"):
        os.symlink(victim, out / name)
    res, text = analyze_run(run_dir, out, plots=False)
    assert victim.read_text() == "precious"
    assert not (out / "summary.txt").is_symlink() and (out / "summary.txt").read_text().strip() == text
    assert not (out / "analysis.json").is_symlink()
