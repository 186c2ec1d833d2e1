"""The coordinator's logic during a training run: plumbing between control messages and the pure
:class:`~reflow_hpc.core.pipeline.Pipeline` (which owns the replay index and all decisions).

It also owns what only rank 0 can see whole: the per-step metrics (trainer stats of every replica,
rollout idle time of every worker, batch composition, buffer gauges), liveness of every rank
(a rank silent for ``run.timeout_s`` ends the job with its name), resume from the newest
checkpoint (the index is restored, then reconciled with what the workers find in their shards),
and the two-phase checkpoint: every worker flushes its shards first, then the first trainer writes
the checkpoint with the coordinator's state and every shard manifest inside it.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

from ..config import Config, to_dict
from ..core.commands import Checkpoint
from ..core.index import RecoveredSample, build_index
from ..core.pipeline import Pipeline
from ..core.sample import FINISHED, READY, REPLAY
from ..metrics import MetricsSink
from .messages import (CheckpointDone, Heartbeat, Ready, SamplesFailed, SamplesFinished, SaveCheckpoint, Setup,
                       StepDone, SyncDone)
from .mpi import RankTimeout
from .worker import checkpoint_root

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def pools(cfg: Config) -> tuple[list[int], list[int]]:
    """(trainer ranks, rollout ranks) of the fixed split: trainers first."""
    w = cfg.resources.workers
    if cfg.reflow.mode == "sync":
        return list(range(w)), list(range(w))
    n_t = cfg.resources.trainer_replicas * cfg.resources.trainer_shard_size
    return list(range(n_t)), list(range(n_t, w))


class _ModeSettings:
    """The [reflow] section as the chosen mode runs it: only reflow replays; batch-level modes
    dispatch one batch per step; one-step-off trains one version behind, so it needs δ ≥ 1."""

    def __init__(self, cfg: Config):
        r, mode = cfg.reflow, cfg.reflow.mode
        self.sigma = r.sigma if mode == "reflow" else 0.0
        self.tau = r.tau
        self.delta = max(r.delta, 1) if mode == "one_step_off" else r.delta
        self.b_max = cfg.trainer.batch_size if mode in ("sync", "one_step_off") else cfg.b_max
        self.sampler, self.replay_filter = r.sampler, r.replay_filter
        self.reward_low, self.reward_high = r.reward_low, r.reward_high


class TrainingLogic:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.world = cfg.resources.workers
        self.trainers, self.rollouts = pools(cfg)
        self.index = build_index(_ModeSettings(cfg), group_size=cfg.algorithm.group_size,
                                 batch_size=cfg.trainer.batch_size, seed=cfg.run.seed, adv_eps=cfg.algorithm.adv_eps,
                                 adv_std_norm=cfg.algorithm.adv_std_norm)
        self.resume_from: Path | None = None
        steps_done = first_prompt = 0
        self.history: dict[str, Any] = {"fresh_rewards": []}
        if cfg.checkpoint.resume:
            from ..train.checkpoint import latest_checkpoint
            latest = latest_checkpoint(checkpoint_root(cfg))
            if latest is not None:
                state = json.loads((latest / "extra" / "coordinator.json").read_text())
                self.index.load_state_dict(state["index"], resume=True)
                steps_done, first_prompt = state["steps_done"], state["next_prompt"]
                self.history = state.get("history", self.history)
                self.resume_from = latest
        self.pipeline = Pipeline(mode=cfg.reflow.mode, index=self.index, trainers=self.trainers,
                                 rollouts=self.rollouts, steps=cfg.trainer.steps, sync_every=cfg.reflow.sync_every,
                                 worker_cap=max(cfg.rollout.max_concurrency + cfg.scheduler.queue_samples,
                                                cfg.algorithm.group_size),
                                 checkpoint_every=cfg.checkpoint.every_steps,
                                 first_prompt=first_prompt, steps_done=steps_done)
        self.phase = "setup"
        self.ready: dict[int, Ready] = {}
        self.last_seen: dict[int, float] = {}
        self.next_heartbeat = 0.0
        self.started_at = 0.0
        self.step_stats: dict[int, list[StepDone]] = {}
        self.rollout_idle = {r: 0.0 for r in self.rollouts}
        self.idle_at_last_step = dict(self.rollout_idle)
        self.last_step_end: float | None = None
        self.response_len: dict[int, int] = {}
        self.sync_seconds = math.nan
        self.resumed_partials = 0
        self.save: dict | None = None               # checkpoint in progress
        self.stop_requested = False
        self.finished = False
        self.summary: dict[str, Any] = {}
        self.metrics = MetricsSink(cfg.run_dir, tensorboard=cfg.metrics.tensorboard, append=self.resume_from is not None)

    # ------------------------------------------------------------------------------ plumbing

    def request_stop(self, signum: int = 0, _frame: Any = None) -> None:
        """Signal handler (rank 0 main thread): finish the current step, checkpoint, stop."""
        self.stop_requested = True

    def _emit(self, cmds: list[Any], now: float) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        for c in cmds:
            if isinstance(c, Checkpoint):
                if self.save is None or self.save["tag"] != c.tag:
                    self.save = {"tag": c.tag, "step": c.step, "manifests": {}, "waiting": set(),
                                 "state": self._coordinator_state()}
                if c.save_trainer:
                    continue                     # the first trainer writes last, with everything inside
                self.save["waiting"].add(c.worker)
            out.append((c.worker, c))
        if self.save is not None and not self.save["waiting"] and not self.save.get("sent"):
            out.append(self._save_message())
        return out

    def _save_message(self) -> tuple[int, Any]:
        self.save["sent"] = True
        extra = {"coordinator": self.save["state"], "manifests": self.save["manifests"], "config": to_dict(self.cfg)}
        return self.trainers[0], SaveCheckpoint(self.save["tag"], self.save["step"], extra)

    def _coordinator_state(self) -> dict:
        p = self.pipeline
        return {"index": self.index.state_dict(), "steps_done": p.steps_done, "next_prompt": p.next_prompt,
                "version": self.index.version, "history": self.history}

    # ------------------------------------------------------------------------------ logic hooks

    def on_start(self, hellos: list, handshake_s: float, now: float) -> list[tuple[int, Any]]:
        self.started_at = now
        self.last_seen = {r: now for r in range(self.world)}
        from .selfcheck import write_topology
        roles = {r: ("trainer+rollout" if r in self.trainers and r in self.rollouts else
                     "trainer" if r in self.trainers else "rollout") for r in range(self.world)}
        write_topology(self.cfg, hellos, None, handshake_s, roles)
        resume = str(self.resume_from) if self.resume_from else None
        setup = Setup(self.trainers, self.rollouts, self.cfg.reflow.mode == "sync", self.index.version, resume)
        if resume:
            print(f"coordinator: resuming from {resume} (step {self.pipeline.steps_done}, version "
                  f"{self.index.version})", flush=True)
            from ..train.checkpoint import resume_changes
            _, free = resume_changes(self.resume_from, to_dict(self.cfg))
            if free:
                print("coordinator: config changed since that checkpoint: "
                      + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in free), flush=True)
        return [(r, setup) for r in range(self.world)]

    def on_message(self, source: int, msg: Any, now: float) -> list[tuple[int, Any]]:
        self.last_seen[source] = now
        p = self.pipeline
        if isinstance(msg, Heartbeat):
            if source in self.rollout_idle:
                self.rollout_idle[source] = max(self.rollout_idle[source], msg.idle_s)
            return []
        if isinstance(msg, Ready):
            self.ready[source] = msg
            if len(self.ready) < self.world:
                return []
            self._reconcile()
            self.phase = "running"
            self.last_step_end = now
            return self._emit(p.start(now), now)
        if isinstance(msg, SamplesFinished):
            if source in self.rollout_idle:
                self.rollout_idle[source] = msg.idle_s
            cmds: list[Any] = []
            for s in msg.samples:
                self.response_len[s.sample_id] = s.response_len
                cmds += p.sample_finished(source, s.sample_id, reward=s.reward, min_version=s.min_version,
                                          max_version=s.max_version, loss_tokens=s.loss_tokens, now=now,
                                          location=s.location)
            return self._emit(cmds, now)
        if isinstance(msg, SamplesFailed):
            cmds = []
            for sid in msg.sample_ids:
                cmds += p.sample_failed(source, sid, now=now)
            print(f"coordinator: rank {source}: {len(msg.sample_ids)} sample(s) failed: {msg.error}", flush=True)
            return self._emit(cmds, now)
        if isinstance(msg, StepDone):
            self.step_stats.setdefault(msg.step, []).append(msg)
            out = self._emit(p.step_done(source, msg.step, now=now), now)
            for rec in p.completed:
                self._write_step(rec, now)
            p.completed.clear()
            self._maybe_finish()
            return out
        if isinstance(msg, SyncDone):
            self.resumed_partials += msg.resumed
            self.sync_seconds = msg.seconds if math.isnan(self.sync_seconds) or msg.version != self._sync_version \
                else max(self.sync_seconds, msg.seconds)
            self._sync_version = msg.version
            out = self._emit(p.sync_done(source, msg.version, now=now), now)
            self._maybe_finish()
            return out
        if isinstance(msg, CheckpointDone):
            out = []
            if self.save is not None and source in self.save["waiting"]:       # phase 1: shards flushed
                self.save["manifests"][str(source)] = msg.manifest
                self.save["waiting"].discard(source)
                out += self._emit(p.checkpoint_done(source, msg.tag, now=now), now)
                if not self.save["waiting"] and not self.save.get("sent"):
                    out.append(self._save_message())
            elif self.save is not None and source == self.trainers[0]:           # phase 2: written
                print(f"coordinator: checkpoint {msg.manifest.get('path')} written", flush=True)
                self.save = None
                out += self._emit(p.checkpoint_done(source, msg.tag, now=now), now)
            else:
                raise RuntimeError(f"rank 0: unexpected checkpoint report {msg.tag} from rank {source}")
            self._maybe_finish()
            return out
        raise RuntimeError(f"rank 0: coordinator: unexpected {type(msg).__name__} from rank {source}")

    _sync_version = -1

    def on_tick(self, now: float) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        timeout = self.cfg.run.timeout_s
        if self.phase == "setup":
            # Loading models and joining torch.distributed may take a while: bounded all the same.
            missing = [r for r in range(self.world) if r not in self.ready]
            if now - self.started_at > 2 * timeout and missing:
                raise TimeoutError(f"rank 0: setup: no ready from rank(s) {', '.join(map(str, missing))} "
                                   f"after {2 * timeout:.0f} s")
        else:
            silent = [r for r, t in self.last_seen.items() if now - t > timeout]
            if silent:
                raise RankTimeout(0, f"watching rank {silent[0]} (no message or heartbeat)", timeout, silent[0])
        if now >= self.next_heartbeat:
            out += [(r, Heartbeat(0)) for r in range(self.world)]
            self.next_heartbeat = now + self.cfg.run.heartbeat_s
        if self.stop_requested and self.phase == "running":
            self.stop_requested = False
            print("coordinator: stop requested: finishing the current step and checkpointing", flush=True)
            out += self._emit(self.pipeline.request_stop(now), now)
        self._maybe_finish()
        return out

    def done(self) -> bool:
        return self.finished

    # ------------------------------------------------------------------------------ resume

    def _reconcile(self) -> None:
        """Restored index vs. what the workers found in their shards."""
        if self.resume_from is None:
            return
        recovered: list[RecoveredSample] = []
        present: set[int] = set()
        for rank, ready in self.ready.items():
            for s in ready.inventory:
                sid = s["sample_id"]
                present.add(sid)
                if not self.index.knows(sid):
                    recovered.append(RecoveredSample(sid, s["group_id"], s["prompt_id"], rank, s["reward"],
                                                     s["min_version"], s["max_version"], s["loss_tokens"]))
            for sid in ready.lost:
                if sid in self.index:
                    self.index.lost(sid)
        for sid in list(self.index.live_ids()):
            rec = self.index.sample(sid)
            if rec.state in (FINISHED, READY, REPLAY) and sid not in present:
                self.index.lost(sid)           # its shard is gone (another node, wiped scratch): counted
        if recovered:
            self.index.recover(recovered)
        self.index.check_accounting()
        g = self.index.gauges()
        print(f"coordinator: buffer after resume: {g['buffer/ready']} ready, {g['buffer/replay']} replay, "
              f"{len(recovered)} recovered from shards, {g['buffer/lost']} lost, {g['buffer/aborted']} aborted",
              flush=True)

    # ------------------------------------------------------------------------------ metrics

    def _write_step(self, rec: Any, now: float) -> None:
        batch = rec.batch
        reports = self.step_stats.pop(rec.step, [])
        step_time = max(now - (self.last_step_end if self.last_step_end is not None else self.started_at), 1e-9)
        self.last_step_end = now
        stats0 = reports[0].stats if reports else {}
        tokens = float(stats0.get("tokens", 0.0))
        idle_now = dict(self.rollout_idle)
        rollout_idle = sum(max(0.0, idle_now[r] - self.idle_at_last_step.get(r, 0.0)) for r in self.rollouts)
        self.idle_at_last_step = idle_now
        fresh = [r for r, rep in zip(batch.rewards, batch.is_replay) if not rep]
        replayed = [r for r, rep in zip(batch.rewards, batch.is_replay) if rep]
        lengths = [self.response_len.pop(s, None) if not rep else self.response_len.get(s)
                   for s, rep in zip(batch.sample_ids, batch.is_replay)]
        lengths = [x for x in lengths if x is not None]
        self.history["fresh_rewards"].append(_mean(fresh))
        record: dict[str, Any] = {
            "step": rec.step + 1, "version": rec.version, "mode": self.cfg.reflow.mode,
            "throughput_tokens_per_s": tokens / step_time, "step_seconds": step_time,
            "idle_ratio/trainer": min(1.0, _mean([r.idle_s for r in reports]) / step_time) if reports else math.nan,
            "idle_ratio/rollout": min(1.0, rollout_idle / (len(self.rollouts) * step_time)),
            "replay_fraction": batch.replay_fraction, "alpha": batch.alpha,
            "staleness/mean": _mean(batch.staleness), "staleness/max": max(batch.staleness),
            "reward/mean": _mean(fresh), "reward/replay_mean": _mean(replayed),
            "response_length/mean": _mean(lengths), "sync_seconds": self.sync_seconds,
            "samples/unused": batch.num_unused, "samples/replay": batch.num_replay,
            "tokens": tokens, "fetch_seconds": max((r.fetch_s for r in reports), default=math.nan),
            "partial_rollouts": self.resumed_partials,
        }
        for r in self.rollouts:
            record[f"rollout/concurrency_cap/{r}"] = self.cfg.rollout.max_concurrency
        record.update(rec.gauges)
        record["step"] = rec.step + 1
        keys = sorted({k for rep in reports for k in rep.stats})
        for k in keys:
            vals = [float(rep.stats[k]) for rep in reports if k in rep.stats]
            record[f"trainer/{k}"] = max(vals) if k.endswith("max") or k == "staleness_max" else _mean(vals)
        self.metrics.write(record)
        self.metrics.progress(record)

    def _maybe_finish(self) -> None:
        if self.finished or not self.pipeline.done:
            return
        self.finished = True
        self.index.check_accounting()
        rewards = [r for r in self.history["fresh_rewards"] if not math.isnan(r)]
        k = max(1, min(50, len(rewards) // 10))      # first and last tenth of the run
        self.summary = {
            "steps": self.pipeline.steps_done, "version": self.index.version, "mode": self.cfg.reflow.mode,
            "wall_seconds": time.time() - self.started_at,
            "reward_first_steps": _mean(rewards[:k]), "reward_last_steps": _mean(rewards[-k:]),
            "buffer": self.index.gauges(), "accounting_ok": True,
        }
        self.metrics.close()
        (self.cfg.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan
