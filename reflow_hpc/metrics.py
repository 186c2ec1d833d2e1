"""Metric sinks (DESIGN §10): JSONL in the run directory (always), one progress line per step, and
TensorBoard event files when ``metrics.tensorboard`` is on. Metric names are API: dashboards and
the benchmarks read them.

Per-step names written by the coordinator:

| name | meaning |
| --- | --- |
| ``step``, ``version`` | optimizer steps done; policy version the batch was composed under |
| ``throughput_tokens_per_s`` | tokens processed by the trainer in the step ÷ step wall time (paper §7.2) |
| ``step_seconds`` | wall time since the previous step ended |
| ``idle_ratio/trainer`` | fraction of the step the trainer replicas waited for their batch |
| ``idle_ratio/rollout`` | fraction of the step the rollout workers had nothing in flight |
| ``replay_fraction``, ``alpha`` | λ = replayed samples ÷ b, and α = τλ/(1−λ+τλ) |
| ``staleness/mean``, ``staleness/max`` | current version − oldest token version, over the batch |
| ``reward/mean`` | mean reward of the batch's unused (fresh) samples |
| ``reward/replay_mean`` | mean reward of its replayed samples |
| ``response_length/mean`` | mean response tokens of the batch |
| ``sync_seconds`` | duration of the most recent weight sync |
| ``buffer/*`` | replay-buffer gauges: ready, replay, training, pending, running, finished, one count per terminal reason, and ``evicted_unused`` (evicted stale before any training: generation spent for nothing) |
| ``trainer/*`` | loss, pg_loss, kl, entropy, clip_fraction, grad_norm, lr, ... (replica mean) |
| ``rollout/concurrency_cap/<rank>`` | per-worker concurrency cap |
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = False, stream: TextIO | None = None,
                 append: bool = False):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w", buffering=1)
        self._stream = stream if stream is not None else sys.stdout
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record, default=_plain) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)

    def progress(self, r: dict[str, Any]) -> None:
        self._stream.write(progress_line(r) + "\n")
        self._stream.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


def progress_line(r: dict[str, Any]) -> str:
    return (f"step {r.get('step', 0):>4} v{r.get('version', 0):<3} "
            f"reward {_fmt(r.get('reward/mean'), '.3f')}  "
            f"tok/s {_fmt(r.get('throughput_tokens_per_s'), '7.0f')}  "
            f"idle T {_fmt(r.get('idle_ratio/trainer'), '4.0%')} R {_fmt(r.get('idle_ratio/rollout'), '4.0%')}  "
            f"replay {_fmt(r.get('replay_fraction'), '.2f')}  "
            f"stale {_fmt(r.get('staleness/mean'), '.2f')}/{_fmt(r.get('staleness/max'), 'd')}  "
            f"loss {_fmt(r.get('trainer/loss'), '+.4f')}  {_fmt(r.get('step_seconds'), '.2f')}s")


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
