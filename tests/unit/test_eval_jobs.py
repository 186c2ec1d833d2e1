"""Which policies a run scores after training, on which prompt sets (run.eval_curve)."""

from __future__ import annotations

import json

import pytest

from reflow_hpc import config as C
from reflow_hpc.evaluation import META, eval_jobs, snapshot_root


def snapshots(cfg, steps, complete=True):
    for s in steps:
        d = snapshot_root(cfg.run_dir) / f"step_{s:06d}"
        d.mkdir(parents=True)
        if complete:
            (d / META).write_text(json.dumps({"step": s, "version": s - 1, "elapsed_s": 2.0 * s}))


@pytest.mark.parametrize("curve", ["task", "held_out"])
def test_snapshots_are_scored_on_the_curve_set_and_the_ends_on_both(tmp_path, curve):
    cfg = C.load(None, [f"run.output_dir={tmp_path}", f"run.eval_curve={curve}"], check_files=False)
    snapshots(cfg, (10, 20, 30))
    snapshots(cfg, (40,), complete=False)                 # no snapshot.json: still being written, not scored
    jobs = eval_jobs(cfg)
    assert [(j.name, j.sets) for j in jobs] == [("start", ("task", "held_out")), ("step_000010", (curve,)),
                                                ("step_000020", (curve,)), ("step_000030", ("task", "held_out"))]
    assert jobs[2].elapsed_s == 40.0 and jobs[2].version == 19


def test_an_unknown_curve_set_is_refused_by_name():
    with pytest.raises(C.ConfigError, match="run.eval_curve"):
        C.load(None, ["run.eval_curve=train"], check_files=False)
