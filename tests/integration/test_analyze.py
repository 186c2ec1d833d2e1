"""``python -m reflow_hpc.analyze`` on a real run (4 MPI ranks, the tiny policy), and on corrupted
copies of it: bad data is named by file and rows, counted, skipped; the rest is analysed."""

from __future__ import annotations

import json
import shutil

import h5py
import pytest

from conftest import python_m
from loop_common import CFG, run
from reflow_hpc.analyze import analyze_run
from reflow_hpc.config import load
from reflow_hpc.storage.manifest import read_manifest
from reflow_hpc.storage.reader import scan_directory

pytestmark = [pytest.mark.mpi]

PLOTS = {"terminal_reasons.png", "staleness.png", "replay_count.png", "reward_by_version.png",
         "response_length.png", "tokens_per_worker.png", "idle_by_rank.png", "roles.png"}


@pytest.fixture(scope="session")
def real_run(tmp_path_factory, policy_dir):
    """One short reflow run: checkpoint rounds mid-run (blocks the replay must honour), small flush
    batches and segments (row ranges and several segments per rank to corrupt)."""
    tmp = tmp_path_factory.mktemp("analyze")
    run_dir, metrics, summary, _ = run(tmp, policy_dir, "trainer.steps=16", "run.eval_prompts=0",
                                       "checkpoint.every_steps=6", "storage.flush_rows=16", "storage.segment_mib=0.02")
    return run_dir, metrics, summary


def _clean_copy(run_dir, dest):
    """The run without its checkpoints' weights (the analysis reads only their config)."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("*.pt", "*.safetensors", "analysis"))
    return dest


def test_the_report_of_a_real_run(real_run, tmp_path):
    run_dir, metrics, summary = real_run
    res, text = analyze_run(run_dir, tmp_path / "out")
    shards = [scan_directory(d) for d in sorted((run_dir / "shards").glob("rank*"))]
    buf = summary["buffer"]
    assert res["samples"] == sum(len(s.locations()) for s in shards) > 0
    assert res["segments"] > 2 and res["unreadable"] == [] and res["unreadable_samples"] == 0
    assert res["created"] == buf["buffer/created"] and res["evicted_unused"] == buf["buffer/evicted_unused"]
    assert res["by_reason"] == {k: buf[f"buffer/{k}"] for k in res["by_reason"]}
    causes = res["evicted_unused_by_cause"]         # every dispatch names its group: no cause is unknown
    assert sum(causes.values()) == res["evicted_unused"] and "unknown" not in causes, causes
    assert sum(res["by_reason"].values()) == buf["buffer/created"]
    assert res["steps"] == len(metrics) == 16
    assert res["staleness"]["trained"] == sum(m["samples/unused"] + m["samples/replay"] for m in metrics)
    assert sum(res["staleness"]["hist_replay"]) == sum(m["samples/replay"] for m in metrics)
    assert res["staleness"]["max"] <= load(CFG).reflow.delta
    assert sum(res["replay_count"]["hist"]) == res["finished"]
    assert sum(i * c for i, c in enumerate(res["replay_count"]["hist"])) == res["staleness"]["trained"]
    assert sum(res["reward_by_version"]["n"]) == res["samples"]
    assert set(res["idle"]["by_rank"]) == {"0", "1", "2", "3"}
    assert {r for d in res["roles"]["steps_by_rank"].values() for r in d} <= {"trainer", "rollout"}
    predicted = [m["placement/coverage_predicted"] for m in metrics]   # the elastic pool's planner, per step
    pl = res["placement"]
    assert pl["steps"] == sum(1 for v in predicted if v == v) > 0
    by_step = {m["step"]: m for m in metrics}
    for x in pl["series"]:
        m = by_step[x["step"]]
        assert x["coverage"] == [m["placement/coverage_predicted"], m["placement/coverage_observed"]]
        assert x["step_s"] == [m["placement/step_predicted_s"], m["step_seconds"]] and x["coverage"][1] >= 0
    assert {p.rsplit("/", 1)[-1] for p in res["plots"]} == PLOTS
    for p in res["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == text
    for section in ("terminal reasons", "staleness of trained samples", "times trained", "reward by policy version",
                    "response length", "tokens per worker", "idle over", "roles", "placement planner"):
        assert section in text


def test_the_command_line_with_what_if_reproduces_the_run(real_run, tmp_path):
    run_dir, metrics, _ = real_run
    r = python_m("reflow_hpc.analyze", str(run_dir), "--out", str(tmp_path), "--json", "--no-plots", "--what-if")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"samples", "by_reason", "unreadable", "plots", "reproduces_run"} <= set(res)
    base = res["what_if"]["outcomes"][1]
    assert res["reproduces_run"] is True, base
    assert base["matched_steps"] == len(metrics)
    assert "reproduces its 16 batches: yes" in r.stdout


def test_bad_data_is_reported_by_file_and_rows_and_the_rest_analysed(real_run, tmp_path):
    """A truncated segment, flipped bytes in token data, a missing file, a segment of another format
    version, an unreadable manifest, and damaged lines in both JSONL files, in one copy."""
    run_dir = _clean_copy(real_run[0], tmp_path / "run")
    clean, _ = analyze_run(run_dir, tmp_path / "clean", plots=False)
    rank = max((run_dir / "shards").glob("rank*"), key=lambda d: len(list(d.glob("seg-*.h5"))))
    manifest = read_manifest(rank)
    segs = [s for s in manifest.segments if s.rows >= 16]
    assert len(segs) >= 4, [s.rows for s in manifest.segments]
    truncated, flipped, missing, old = (rank / s.file for s in segs[:4])
    expected = {}
    # Truncated to 60 %: the batches before the cut are recovered, the rows after it are lost.
    size = truncated.stat().st_size
    with open(truncated, "r+b") as f:
        f.truncate(int(size * 0.6))
    # Flipped bytes inside the first chunk of token data: the batch holding them is lost.
    with h5py.File(flipped, "r") as f:
        offset = f["tokens"].id.get_chunk_info(0).byte_offset + 40
    with open(flipped, "r+b") as f:
        f.seek(offset)
        b = f.read(4)
        f.seek(offset)
        f.write(bytes(x ^ 0xFF for x in b))
    missing.unlink()
    expected[missing.name] = segs[2].rows
    with h5py.File(old, "r+") as f:
        f.attrs["format_version"] = 1
    expected[old.name] = segs[3].rows
    # Another rank's manifest is damaged: its segments are still found and read by a directory scan.
    other = next(d for d in (run_dir / "shards").glob("rank*") if d != rank and (d / "manifest.json").exists())
    (other / "manifest.json").write_text('{"format": "reflow_hpc.shard-manifest", "owner": ')
    ev = (run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    (run_dir / "events.jsonl").write_bytes(b"".join(ev[:10] + [b"{{not json\n", b"\n", b"[1, 2]\n"] + ev[10:]))
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 17, "idle_ratio/trai')                          # a line cut by a crash

    r = python_m("reflow_hpc.analyze", str(run_dir), "--out", str(tmp_path / "a"), "--json", "--no-plots")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    bad = res["unreadable"]
    by_file = {}
    for u in bad:
        by_file.setdefault(u["file"].rsplit("/", 1)[-1], []).append(u)
    prefix = f"shards/{rank.name}/"
    assert all(u["file"].startswith(prefix) for name in (truncated.name, flipped.name, missing.name, old.name)
               for u in by_file[name])
    assert any("truncated" in u["reason"] and u["rows"][1] == segs[0].rows for u in by_file[truncated.name])
    assert [u["reason"] for u in by_file[flipped.name]] == ["token checksum mismatch"]
    assert by_file[flipped.name][0]["rows"][0] == 0 and by_file[flipped.name][0]["samples"] > 0
    assert by_file[missing.name] == [{"file": prefix + missing.name, "reason": "file missing (listed in the manifest)",
                                      "rows": [0, segs[2].rows], "samples": segs[2].rows}]
    assert "format_version 1" in by_file[old.name][0]["reason"] and by_file[old.name][0]["samples"] == segs[3].rows
    assert any("unreadable manifest" in u["reason"] for u in by_file["manifest.json"])
    assert {"file": "events.jsonl", "reason": "not a JSON object", "lines": [11, 11]} in bad
    assert {"file": "events.jsonl", "reason": "not a JSON object", "lines": [13, 13]} in bad
    assert any(u["file"] == "metrics.jsonl" and u["lines"][0] == len(real_run[1]) + 1 for u in bad)
    # Nothing else was lost: every sample is either analysed or in a reported row range.
    lost = sum(u.get("samples", 0) for u in bad if u["file"].startswith("shards/") and "rows" in u)
    assert res["samples"] + lost == clean["samples"] and res["unreadable_samples"] == lost
    assert res["by_reason"] == clean["by_reason"] and res["steps"] == clean["steps"]
    assert "unreadable: " in r.stdout and "token checksum mismatch" in r.stdout


def test_shards_never_collected_are_read_from_the_ranks_scratch(real_run, tmp_path):
    """A run that crashed never copied its shards into the run directory: they are read where the
    ranks left them (topology.json names each rank's scratch)."""
    run_dir = tmp_path / "run"
    shutil.copytree(real_run[0], run_dir, ignore=shutil.ignore_patterns("shards", "*.pt", "*.safetensors", "analysis"))
    res, text = analyze_run(run_dir, tmp_path / "a", plots=False)
    collected = sum(len(scan_directory(d).locations()) for d in (real_run[0] / "shards").glob("rank*"))
    assert res["samples"] == collected and res["unreadable"] == []
    assert res["shards_from"].startswith("node-local scratch") and "node-local scratch" in text
