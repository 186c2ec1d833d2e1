"""Metric sinks: JSONL always, one progress line per step, TensorBoard event files when enabled."""

from __future__ import annotations

import io
import json

from reflow_hpc.metrics import MetricsSink, progress_line, read_jsonl


def test_jsonl_progress_and_tensorboard(tmp_path):
    out = io.StringIO()
    sink = MetricsSink(tmp_path, tensorboard=True, stream=out)
    for step in (1, 2):
        rec = {"step": step, "version": step - 1, "reward/mean": 0.25 * step, "throughput_tokens_per_s": 1000.0,
               "idle_ratio/trainer": 0.1, "idle_ratio/rollout": 0.02, "replay_fraction": 0.5,
               "staleness/mean": 0.5, "staleness/max": 1, "trainer/loss": -0.01, "step_seconds": 0.3}
        sink.write(rec)
        sink.progress(rec)
    sink.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.5 and "time" in rows[0]
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("step    2 v1") and "replay 0.50" in lines[1]
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25, 0.5]


def test_resume_appends_and_nan_prints_a_dash(tmp_path):
    MetricsSink(tmp_path, stream=io.StringIO()).write({"step": 1})
    sink = MetricsSink(tmp_path, append=True, stream=io.StringIO())
    sink.write({"step": 2})
    sink.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert "reward -" in progress_line({"step": 3, "reward/mean": float("nan")})
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


def test_no_signal_shares_count_zero_advantages_in_each_part_of_the_batch():
    import math

    from reflow_hpc.core.composition import Batch
    from reflow_hpc.metrics import _zero_share
    n = 5
    b = Batch(step=0, version=0, sample_ids=tuple(range(n)), owners=(0,) * n,
              is_replay=(False, False, False, True, True), advantages=(0.0, 1.2, -0.4, 0.0, 0.0),
              loss_weights=(0.2,) * n, loss_tokens=(4,) * n, staleness=(0,) * n, rewards=(1.0,) * n,
              times_used=(0, 0, 0, 1, 1), queue_s=(0.0,) * n, production_s=(1.0,) * n, replay_fraction=0.4, alpha=0.25)
    assert _zero_share(b, replay=False) == 1 / 3 and _zero_share(b, replay=True) == 1.0
    fresh_only = Batch(**{**b.__dict__, "is_replay": (False,) * n})
    assert _zero_share(fresh_only, replay=False) == 3 / 5 and math.isnan(_zero_share(fresh_only, replay=True))
