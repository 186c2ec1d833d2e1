"""The end-of-run report: every terminal reason is listed, so its counts add up to the samples created."""

from __future__ import annotations

import re

from reflow_hpc import config as C
from reflow_hpc.core.sample import TERMINAL_REASONS
from reflow_hpc.run import report


def test_the_samples_line_lists_every_terminal_reason():
    counts = {reason: 10 * (i + 1) for i, reason in enumerate(TERMINAL_REASONS)}
    buffer = {f"buffer/{k}": v for k, v in counts.items()}
    buffer.update({"buffer/created": sum(counts.values()), "buffer/evicted_unused": 3,
                   "buffer/trained_samples": 50, "buffer/replayed_uses": 7})
    text = report({"steps": 4, "wall_seconds": 2.0, "mode": "reflow", "buffer": buffer},
                  C.load(None, ["model.warmstart=true"], check_files=False))
    line = next(x for x in text.splitlines() if x.startswith("samples:"))
    listed = dict(re.findall(r"(\w+) (\d+)", line.split("ended: ", 1)[1].split(" (", 1)[0]))
    assert set(listed) == set(TERMINAL_REASONS) and "uninformative" in listed
    assert sum(map(int, listed.values())) == buffer["buffer/created"]
    assert "note:" not in text


def test_a_run_that_replayed_nothing_says_so_and_why():
    buffer = {"buffer/created": 100, "buffer/trained_samples": 90, "buffer/replayed_uses": 0}
    summary = {"steps": 4, "wall_seconds": 2.0, "mode": "reflow", "buffer": buffer}
    note = report(summary, C.load(None, ["model.warmstart=true", "reflow.sampler=medium_reward"], check_files=False))
    assert "note: reflow.sigma = 0.5 but no sample was replayed" in note and "strictly between" in note
    other = report(summary, C.load(None, ["model.warmstart=true"], check_files=False))
    assert "note:" in other and "strictly" not in other
    fresh_only = report(summary, C.load(None, ["model.warmstart=true", "reflow.sigma=0"], check_files=False))
    assert "note:" not in fresh_only
