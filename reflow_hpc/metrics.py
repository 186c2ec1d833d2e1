"""Metric sinks (DESIGN §10): JSONL in the run directory (always), one progress line per step, and
TensorBoard event files when ``metrics.tensorboard`` is on. Metric names are API: dashboards and
the benchmarks read them.

Per-step names written by the coordinator (docs/api.md is the reference; every record also carries
``time``, the Unix time the sink wrote it):

| name | meaning |
| --- | --- |
| ``step``, ``version`` | optimizer steps done; policy version the batch was composed under |
| ``mode`` | the run's ``reflow.mode`` |
| ``throughput_tokens_per_s`` | tokens processed by the trainer in the step ÷ step wall time (paper §7.2) |
| ``step_seconds`` | wall time since the previous step ended |
| ``tokens`` | tokens the trainer processed in the step |
| ``idle_ratio/trainer`` | fraction of the step the trainer replicas waited for their batch |
| ``idle_ratio/rollout`` | fraction of the step the rollout workers had nothing in flight |
| ``replay_fraction``, ``alpha`` | λ = replayed samples ÷ b, and α = τλ/(1−λ+τλ) |
| ``staleness/mean``, ``staleness/max`` | current version − oldest token version, over the batch |
| ``reward/mean`` | mean reward of the batch's unused (fresh) samples |
| ``reward/replay_mean`` | mean reward of its replayed samples |
| ``reward/task_mean`` | mean task reward of the batch's unused samples: ``reward/mean`` without the overlong shaping (``algorithm.overlong_buffer``; equal to it when off) |
| ``dynamic_sampling/dropped_fraction`` | of the groups completed during the step, the fraction the fresh filter dropped (dynamic sampling: all rewards equal) |
| ``dynamic_sampling/over_cap`` | groups completed during the step that the fresh filter declined but that went through, the step's generation being over ``algorithm.max_gen_batches`` |
| ``response_length/mean`` | mean generated response tokens of the batch's samples (tool observations excluded) |
| ``sync_seconds`` | duration of the most recent weight sync (its slowest member) |
| ``partial_rollouts`` | in-flight samples held at a sync and resumed under the new weights (with ``rollout.sync_kv = "keep"``: that decoded on under them), so far |
| ``rollout/generated_tokens_per_s`` | tokens the rollout workers generated in the step ÷ step wall time |
| ``finish_reason/<reason>`` | finished samples so far by how generation ended (stop, length, turns, abort) |
| ``samples/unused``, ``samples/replay`` | composition of the batch |
| ``samples/unused_no_signal``, ``samples/replay_no_signal`` | of the batch's unused and of its replayed samples, the share whose advantage is 0 (a group whose rewards were all alike): they add no policy gradient but count in the loss normaliser (NaN when there are none; 1 under ppo, whose trainer computes the advantages) |
| ``fetch_seconds`` | the slowest replica's time to fetch its samples from their owners |
| ``buffer/*`` | replay-buffer gauges after the step (``core.GAUGE_NAMES``): ready, replay, training, pending (queued or generating), finished, one count per terminal reason, ``evicted_unused`` (evicted stale before any training: generation spent for nothing), ``created``, ``trained_samples`` (distinct samples trained on) and ``replayed_uses`` (training uses beyond each sample's first) |
| ``dispatch/budget`` | samples the ``b_max`` window still allows to dispatch in this step |
| ``trainer/*`` | loss, pg_loss, kl, entropy, clip_fraction, grad_norm, lr, ... (replica mean; ``*max`` the largest, ``*_min`` the smallest) |
| ``trainer/token_staleness_min``, ``trainer/token_staleness_max`` | over every token trained in the step: trainer version − the version that generated it (checked against the mode's guarantee by the trainer) |
| ``rollout/tool_calls``, ``rollout/tool_errors``, ``rollout/tool_timeouts`` | tool calls the rollout workers ran so far, those that failed (the observation is an error), and those stopped at ``task.turn_timeout_s`` |
| ``rollout/tool_seconds_p50``, ``rollout/tool_seconds_p99`` | latency of a tool call on the executor (start to result), over each worker's last 256 calls |
| ``rollout/tool_wait_fraction`` | of the time samples were in flight on a rollout worker, the fraction they waited for a tool's observation, so far |
| ``rollout/turns_per_sample`` | model turns per finished sample, so far |
| ``rollout/concurrency_cap/<rank>`` | the concurrency cap in force on each rollout worker (the adaptive scheduler's) |
| ``role/<rank>``, ``pool/trainers``, ``pool/rollouts`` | every rank's role during the step, and the pool sizes |
| ``role_switch_seconds/to_trainer``, ``role_switch_seconds/to_rollout`` | the slowest worker's switch, each direction, in the step a switch completed |
| ``role_switch/handed_off`` | samples a worker leaving rollout handed over to the others, in a step with a switch |
| ``placement/mismatch`` | the placement planner's abs(log(fresh coverage / (1−σ)·b)) for the split in force |
| ``placement/coverage_predicted``, ``placement/coverage_observed`` | usable fresh samples of the step: the planner's prediction from the windows before it (its rates and usable fraction at the step's busy rollout time and step time), and what happened (fresh samples finished × (1 − the share of fresh fates that were evictions as too stale)) |
| ``placement/step_predicted_s`` | the step time the planner predicted for the split in force before the step |
| ``gpu/util/<rank>``, ``gpu/mem_gib/<rank>``, ``gpu/power_w/<rank>`` | on CUDA with ``nvidia-ml-py``: each rank's device utilisation (%), memory in use (GiB) and power draw (W) |

Evaluation records (``"kind": "eval"``; step records carry no kind), one per policy scored after the run
(``reflow_hpc.evaluation``; ``run.eval_every_steps``):

| name | meaning |
| --- | --- |
| ``kind`` | ``eval`` |
| ``step``, ``version`` | the step after which the weights were taken (0: the starting policy) |
| ``eval/elapsed_s`` | training time of the run when that step ended |
| ``eval/task/reward``, ``eval/task/greedy`` | mean reward of ``run.eval_samples`` samples per task prompt never drawn in training, and greedy exact match |
| ``eval/held_out/reward``, ``eval/held_out/greedy`` | the same on distinct held-out texts |
| ``eval/<set>/prompts`` | prompts scored in each set (``task``, ``held_out``) |
| ``eval/seconds`` | time the scoring took (after training, not on its clock) |

The start and the final policy are scored on both sets, the snapshots between them on the set of
``run.eval_curve`` (``task`` by default).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from .private import open_append, open_new, private_dir

if TYPE_CHECKING:
    from .core.outputs import StepRecord


class StepMetrics:
    """The per-step metrics of the table above, from the coordinator's step records."""

    def __init__(self, mode: str, overlong: Callable[[int], float] | None = None):
        self.mode = mode
        self.overlong = overlong        # R_length of a response of n tokens, when rewards are shaped
        self._groups = (0, 0, 0)        # the index's group counters at the previous step

    def __call__(self, rec: "StepRecord") -> dict[str, Any]:
        batch, reports = rec.batch, rec.replicas
        step_time = max(rec.done_at - rec.started_at, 1e-9)
        stats0 = reports[0].stats if reports else {}
        tokens = float(stats0.get("tokens", 0.0))
        fresh = [r for r, rep in zip(batch.rewards, batch.is_replay) if not rep]
        replayed = [r for r, rep in zip(batch.rewards, batch.is_replay) if rep]
        record: dict[str, Any] = {
            "step": rec.step + 1, "version": rec.version, "mode": self.mode,
            "throughput_tokens_per_s": tokens / step_time, "step_seconds": step_time,
            "idle_ratio/trainer": min(1.0, _mean([r.idle_s for r in reports]) / step_time) if reports else math.nan,
            "idle_ratio/rollout": min(1.0, rec.rollout_idle_s / (rec.rollout_workers * step_time)),
            "replay_fraction": batch.replay_fraction, "alpha": batch.alpha,
            "staleness/mean": _mean(batch.staleness), "staleness/max": max(batch.staleness),
            "reward/mean": _mean(fresh), "reward/replay_mean": _mean(replayed),
            "response_length/mean": _mean(batch.loss_tokens),
            "sync_seconds": math.nan if rec.sync_seconds is None else rec.sync_seconds,
            "samples/unused": batch.num_unused, "samples/replay": batch.num_replay,
            "samples/unused_no_signal": _zero_share(batch, replay=False),
            "samples/replay_no_signal": _zero_share(batch, replay=True),
            "tokens": tokens, "fetch_seconds": max((r.fetch_s for r in reports), default=math.nan),
            "partial_rollouts": rec.partial_rollouts,
            "rollout/generated_tokens_per_s": rec.generated_tokens / step_time,
        }
        record.update(self._fresh(rec, fresh))
        for w, cap in sorted(rec.concurrency_caps.items()):
            record[f"rollout/concurrency_cap/{w}"] = cap
        for reason, n in sorted(rec.finish_reasons.items()):
            record[f"finish_reason/{reason}"] = n
        for w, role in sorted(rec.roles.items()):
            record[f"role/{w}"] = role
        record["pool/trainers"] = sum(1 for r in rec.roles.values() if r.startswith("trainer"))
        record["pool/rollouts"] = sum(1 for r in rec.roles.values() if r.endswith("rollout"))
        record["placement/mismatch"] = rec.placement_mismatch
        record["placement/coverage_predicted"], record["placement/coverage_observed"] = rec.placement_coverage
        record["placement/step_predicted_s"] = rec.placement_step_s
        for sw in rec.switches:
            record["role_switch/handed_off"] = sw["handed_off"]
            for direction in ("to_trainer", "to_rollout"):
                if f"{direction}_s" in sw:
                    record[f"role_switch_seconds/{direction}"] = sw[f"{direction}_s"]
        record.update(rec.gauges)
        record.update(step=rec.step + 1, version=rec.version)     # the gauges' own are the index's, after the step
        for k in sorted({k for rep in reports for k in rep.stats}):
            vals = [float(rep.stats[k]) for rep in reports if k in rep.stats]
            record[f"trainer/{k}"] = max(vals) if k.endswith("max") else min(vals) if k.endswith("_min") else _mean(vals)
        return record

    def _fresh(self, rec: "StepRecord", fresh: list[float]) -> dict[str, Any]:
        """The task reward of the fresh samples and the fresh filter's share of the step's groups."""
        batch, pen = rec.batch, self.overlong
        task = fresh if pen is None else [r - pen(n) for r, n, rep in zip(batch.rewards, batch.loss_tokens,
                                                                        batch.is_replay) if not rep]
        g = rec.gauges
        now = (g.get("buffer/groups_completed", 0), g.get("buffer/groups_dropped", 0),
               g.get("buffer/groups_over_cap", 0))
        completed, dropped, over = (a - b for a, b in zip(now, self._groups))
        self._groups = now
        return {"reward/task_mean": _mean(task),
                "dynamic_sampling/dropped_fraction": dropped / completed if completed > 0 else 0.0,
                "dynamic_sampling/over_cap": over}


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _zero_share(batch: Any, *, replay: bool) -> float:
    """Share of the batch's replayed (or unused) samples whose advantage is 0."""
    return _mean([a == 0.0 for a, rep in zip(batch.advantages, batch.is_replay) if rep == replay])


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = False, stream: TextIO | None = None,
                 append: bool = False):
        private_dir(run_dir, what="run directory")
        self.path = run_dir / "metrics.jsonl"
        if append:
            self._file = open_append(self.path, buffering=1)
        else:               # a fresh file: an old one goes (unlink never follows a symlink), then O_EXCL
            self.path.unlink(missing_ok=True)
            self._file = open_new(self.path, buffering=1)
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
    if "throughput_tokens_per_s" not in r and ("eval/task/reward" in r or "eval/held_out/reward" in r):
        sets = [(name, label) for name, label in (("task", "task"), ("held_out", "held-out texts"))
                if f"eval/{name}/reward" in r]                                  # a snapshot's evaluation
        scores = "  ".join(f"{label} reward {_fmt(r.get(f'eval/{name}/reward'), '.3f')} greedy "
                           f"{_fmt(r.get(f'eval/{name}/greedy'), '.3f')}" for name, label in sets)
        return (f"eval {r.get('step', 0):>4} v{r.get('version', 0):<3} after {_fmt(r.get('eval/elapsed_s'), '5.0f')} s "
                f"of training: {scores}")
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


def read_jsonl(path: Path, kind: str | None = "step") -> list[dict]:
    """The records of a metrics.jsonl: one ``kind`` (``step``: a training step; ``eval``: a scored
    snapshot), or every record with ``kind=None``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind", "step") == kind]
