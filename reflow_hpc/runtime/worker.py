"""The main thread of a worker during a training run (DESIGN §3, §6, §7, §8).

A worker is hybrid: its role — rollout, trainer, or both in colocated ``sync`` mode — is what the
coordinator's :class:`~reflow_hpc.core.commands.Setup` and later :class:`~reflow_hpc.core.commands.Switch`
commands say. At set-up every worker builds both sides (pre-warm): the rollout engine with its
episode runner and sample store (whose fetch server the service thread polls), the trainer with its
fetch client. Its process groups are made once, for every split the elastic pool may take, from
one description of the job (:class:`~reflow_hpc.comm.dims.ParallelDims`) and asked for by name
(:class:`~reflow_hpc.comm.groups.ProcessGroups`: its replica's shard group — ``resources.trainer_shard_size``
> 1: the trainer is FSDP2-sharded over it —, per split its counterparts, the weight-sync group and
its rollout instance's tensor-parallel group; docs/architecture.md, "Process groups"). The side its
role does not use sleeps (on a GPU: offloaded). Then it carries out
the coordinator's commands in the order they arrive (``handlers``: one method per command type)
and, whenever it has requests in flight, steps the engine between them:

- ``Dispatch`` → requests into the engine; finished samples go to the store (memory + shard) and
  their metadata to the coordinator.
- ``Train`` → fetch payloads from their owners, one optimizer step, ``StepDone``.
- ``SyncWeights`` → source: broadcast the weights in buckets; the other workers of its sharded replica:
  gather them with it; rollout: hold in-flight requests, load the weights, resume them (partial
  rollout); colocated: load the worker's own trainer weights (gathered over its shard group).
- ``Switch`` → the pools change: leaving rollout, hand the samples in flight over (served to whoever
  resumes them) and put the engine to sleep; joining the trainers, receive parameters and optimizer
  state (sharded: this rank's shards) from the worker named in the transfers; leaving training,
  wake the engine (the next sync brings the weights). ``Resume`` → fetch partial samples from the
  worker that handed them over and continue them. ``SetCap`` → the engine's concurrency cap.
- ``Drop`` / ``Cancel`` → free payloads / stop samples that ended; ``FlushTrajectories`` / ``WriteCheckpoint``
  → flush shards / write the checkpoint; ``Snapshot`` → save the trainer's weights for evaluation
  after the run (a sharded replica gathers both to its first worker, which writes); ``Stop`` →
  close the store, copy the shards into the run directory, shut down.

Tensor-parallel vLLM instances (``resources.rollout_tp_size = s_R > 1``, every mode) are the fixed
blocks of ``s_R`` consecutive ranks from rank 0 (:meth:`~reflow_hpc.comm.dims.ParallelDims.engine_block`).
Every rank builds its engine for its block at set-up; the block's first rank (its *leader*) drives the
block's engines through :class:`~reflow_hpc.rollout.tensor_parallel.LeaderEngine` for the whole run,
and the others (*followers*) hold a :class:`~reflow_hpc.rollout.tensor_parallel.FollowerLink`. A
follower runs the same loop as every worker: between its own commands it applies its leader's
pending engine calls, one at a time, so it can follow and, at the same time (colocated) or later
(after a switch), train. What it does in each mode:

- split pools, its block generating: it applies its leader's calls and gets only ``Setup``,
  ``Switch`` and ``Stop`` (the coordinator knows the leader as the rollout worker);
- split pools, its block training: a trainer like the others; its engine sleeps through its leader;
- colocated (``sync``): it trains every step, and before it does it applies its leader's calls up to
  the leader's ``sleep`` (which the leader makes before it trains), so that neither ever waits in a
  trainer collective for the other while that one waits in an engine call; the leader's ``wake``
  after the step and its weight load (every rank of the instance loads its own trainer's weights,
  ``load_own_weights``) come in the loop, where the follower waits for nothing else;
- at a switch: a block leaving rollout hands over through its leader, whose ``sleep`` each follower
  applies before it touches its trainer; a block joining rollout wakes through its leader, and the
  next weight sync reaches the followers through the leader's load;
- at the stop: it applies its leader's last calls, up to the leader's ``stop``.

Every wait is bounded by ``run.timeout_s``: the coordinator's heartbeat must arrive within it, and a
follower's wait for its leader's call ends in an error naming both ranks and the operation.
"""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..comm.mpi import RankTimeout, wait_until
from ..config import fresh_filter, to_dict
from ..core.commands import (Cancel, Dispatch, Drop, FlushTrajectories, Resume, SetCap, Setup, Snapshot, Switch,
                             SyncWeights, Train, WriteCheckpoint)
from ..core.modes import rules
from ..private import copy_tree
from .context import Runtime
from .messages import (CheckpointWritten, EngineReport, FinishedSample, Heartbeat, Ready, SamplesFailed,
                       SamplesFinished, TrajectoriesFlushed, StepDone, Stop, Switched, WeightsLoaded)
from .rankstats import RankAccount

# A worker with nothing to generate blocks on its inbox this long at a time. A command wakes it at
# once, so the value only bounds how often it checks that the coordinator is still heard from.
IDLE_WAIT_S = 0.05


class Holdings:
    """What a worker's fetch server serves: its sample store, and the partial samples it handed over when
    it left rollout (kept until its next switch; by then whoever resumes them has fetched them)."""

    def __init__(self, store: Any):
        self.store = store
        self.partials: dict[int, Any] = {}

    def get(self, ids: list[int]) -> list[Any]:
        if all(i in self.partials for i in ids):
            return [self.partials[i] for i in ids]
        return self.store.get(ids)

    def holds(self, sample_id: int) -> bool:
        return sample_id in self.partials or self.store.holds(sample_id)


class Worker:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self.cfg = rt.cfg
        self.rank = rt.rank
        self.device = rt.topology.device if rt.topology else "cpu"
        self.engine: Any = None
        self.runner: Any = None
        self.store: Any = None
        self.fetcher: Any = None
        self.trainer: Any = None
        self.tokenizer: Any = None
        self.colocated = False
        self.rules = rules(self.cfg.reflow.mode, refills=fresh_filter(self.cfg) != "accept_all")
        self.trainers: tuple[int, ...] = ()
        self.rollouts: tuple[int, ...] = ()
        self.replica_size = self.cfg.resources.trainer_shard_size   # s_T: workers per trainer replica
        self.tp = self.cfg.resources.rollout_tp_size         # s_R: workers per rollout instance
        self.leader = self.rank               # first rank of this rank's engine block (s_R > 1: fixed for the run)
        self.follower: Any = None             # FollowerLink: on an engine block's other ranks
        self.dims: Any = None                                 # ParallelDims: the groups of every split, as data
        self.groups: Any = None                               # ProcessGroups: this rank's, by name
        self.wsyncs: dict[int, Any] = {}                    # trainer replicas -> weight-sync endpoint
        self.holdings: Holdings | None = None
        self.resume_from: str | None = None
        self._saved_partials: dict[int, Any] | None = None      # the checkpoint's, read once
        self.idle_s = 0.0              # rollout idle: nothing in flight while in the rollout role
        self.trainer_idle_since = time.monotonic()
        self.stop_reason = ""              # once a Stop came, its reason: messages.DONE, or why the run was cut short
        self.switches = 0                   # Switch commands so far
        # The rank's account for the benchmarks (rankstats.py): busy generation and training time.
        self.generate_s, self.train_s, self.train_steps = 0.0, 0.0, 0
        self.generate_cpu_s = 0.0          # the main thread's CPU over generate_s: the share generation got
        self.account = RankAccount()
        self.handlers: dict[type, Callable[[Any], None]] = {
            Dispatch: self._dispatch, Train: self._train, SyncWeights: self._sync_weights, Drop: self._drop,
            Cancel: self._cancel, FlushTrajectories: self._flush_trajectories, WriteCheckpoint: self._write_checkpoint,
            Snapshot: self._snapshot,
            Switch: self._switch, Resume: self._resume, SetCap: self._set_cap, Stop: self._stop,
        }

    # ------------------------------------------------------------------------------ set-up

    def setup(self, msg: Setup) -> None:
        from ..comm.dims import ParallelDims
        from ..comm.dist import init_process_group
        from ..comm.groups import ProcessGroups

        cfg, rank = self.cfg, self.rank
        self.colocated = msg.colocated
        self.resume_from = msg.resume_from
        self.trainers, self.rollouts = tuple(msg.trainers), tuple(msg.rollouts)
        init_process_group(self.rt.world, device=self.device, single_host=self.rt.single_host,
                           timeout_s=cfg.run.timeout_s, master_addr=cfg.run.master_addr)
        # Every rank creates every group of every split the pool may take, in the same order
        # (torch.distributed requires it), so that a switch needs no collective.
        n_t = len(msg.trainers) // self.replica_size
        self.dims = ParallelDims(world=self.rt.size, shard=self.replica_size, tp=self.tp,
                                 replicas=(n_t,) if msg.colocated else (n_t, *msg.placements),
                                 colocated=msg.colocated)
        split = self.dims.split(n_t)
        if (split.trainers, split.rollouts) != (self.trainers, self.rollouts):
            raise RuntimeError(f"rank {rank}: setup: trainers {list(self.trainers)} and rollout workers "
                               f"{list(self.rollouts)} are not the split of {n_t} trainer replicas "
                               f"({list(split.trainers)}, {list(split.rollouts)})")
        self.groups = ProcessGroups.create(self.dims, rank, cfg.run.timeout_s)
        self.instance_comm = self.rt.world.Dup() if self.tp > 1 else None
        self.leader = self.dims.engine_block(rank)[0]

        from ..policy import load_policy
        model, self.tokenizer = load_policy(cfg.model.path, cfg.model.dtype, self.device)
        if msg.resume_from:
            from ..train.checkpoint import load_model_weights
            load_model_weights(model, Path(msg.resume_from) / "model")
        # Pre-warm: every worker holds a trainer and an engine (split modes: each on its own copy).
        from ..train.trainer import Trainer
        ref = None
        if cfg.algorithm.kl_coef > 0:
            ref, _ = load_policy(cfg.model.path, cfg.model.dtype, self.device)
        self.trainer = Trainer(copy.deepcopy(model), cfg, self.device, group=self.groups.replica(self._n_t()),
                               ref_model=ref, shard_group=self.groups.shard)
        if msg.resume_from:
            from ..train.checkpoint import load_checkpoint
            load_checkpoint(msg.resume_from, trainer=self.trainer, restore_rng=False, map_location=self.device)
        inventory, lost = self._build_rollout(model, msg)
        if not self._generates(self.rollouts) and self.follower is None:
            self.engine.sleep()                       # a block that trains: its leader puts the block to sleep
        if rank not in self.trainers:
            self.trainer.offload()
        from ..storage.fetch import FetchClient
        self.fetcher = FetchClient(self.rt.data_comm, cfg.run.timeout_s, store=self.store,
                                   poll_min_s=cfg.run.poll_min_s, poll_max_s=cfg.run.poll_max_s)
        self.rt.send(Ready(rank, inventory, lost, self.groups.created, self.groups.seconds))

    def _generates(self, rollouts: tuple[int, ...]) -> bool:
        """Whether this rank's engine block generates when ``rollouts`` are the rollout workers (its leader is one)."""
        return self.leader in rollouts

    def _leads(self) -> bool:
        """The first rank of a tensor-parallel engine block: its engine is a LeaderEngine."""
        return self.tp > 1 and self.follower is None

    def _n_t(self) -> int:
        """Trainer replicas in force: the split whose groups apply."""
        return len(self.trainers) // self.replica_size

    def _weight_sync(self) -> Any:
        """The weight-sync endpoint of the split in force (built on first use: it verifies the specs)."""
        from ..train.weight_sync import WeightSync
        n_t = self._n_t()
        if n_t not in self.wsyncs:
            src, group = self.trainers[0], self.groups.sync(n_t)
            if group is None:          # WeightSync would take None for the default group
                raise RuntimeError(f"rank {self.rank}: weight sync with {n_t} trainer replicas: this rank is not "
                                   f"in the split's sync group {list(self.dims.split(n_t).sync)}")
            model = self.trainer.model if self.rank == src else self.engine_model
            self.wsyncs[n_t] = WeightSync.for_model(model, src=src, bucket_mb=self.cfg.trainer.sync_bucket_mb,
                                                    device=self.device, group=group, timeout_s=self.cfg.run.timeout_s)
        return self.wsyncs[n_t]

    def _build_rollout(self, model: Any, msg: Setup) -> tuple[list[dict], list[int]]:
        from ..envs import make_task
        from ..core.shaping import OverlongShaping
        from ..rollout.episodes import EpisodeRunner
        from ..rollout.factory import build_engine, sampling_params
        from ..storage.fetch import FetchServer
        from ..storage.store import SampleStore

        cfg = self.cfg
        self.engine_model = model
        self.engine = build_engine(model, cfg.rollout, device=self.device, seed=cfg.run.seed, version=msg.version,
                                   tp=self.tp)
        if self.tp > 1:
            # Roles of the block, for the run: vLLM's groups are these blocks whichever split is in force.
            from ..rollout.tensor_parallel import FollowerLink, LeaderEngine
            block, group = self.dims.engine_block(self.rank), self.groups.tp_block
            if block[0] == self.rank:
                self.engine = LeaderEngine(self.engine, self.instance_comm, group, list(block[1:]))
            else:
                self.follower = FollowerLink(self.engine, self.instance_comm, group, block[0], device=self.device,
                                             own_weights=lambda: self.trainer.named_weights())
        task = make_task(cfg)
        self.runner = EpisodeRunner(self.engine, task, self.tokenizer, sampling_params(cfg.rollout), owner=self.rank,
                                    chat_template=cfg.task.chat_template, shaping=OverlongShaping.of(cfg))
        trajectory_dir = Path(self.rt.topology.scratch) / "shards"
        existing = trajectory_dir.is_dir() and any(trajectory_dir.iterdir())
        collected = cfg.run_dir / "shards" / f"rank{self.rank:05d}"
        if msg.resume_from and not existing and collected.is_dir():
            # Resumed on another node (node-local scratch is empty): start from the copy the previous
            # process set left in the run directory when it stopped (storage.collect).
            copy_tree(collected, trajectory_dir)
            existing = True
        if existing and not msg.resume_from:
            # A fresh run must not mix with an old run's rows: keep them, aside, for analysis.
            aside = trajectory_dir.with_name(f"shards.old-{int(time.time())}")
            trajectory_dir.rename(aside)
            existing = False
        self.store = SampleStore(trajectory_dir, self.rank, cfg.storage, resume=existing)
        self.holdings = Holdings(self.store)
        server = FetchServer(self.rt.data_comm, self.holdings, send_timeout_s=cfg.run.timeout_s)
        self.rt.service.add_poller(server.poll)
        inventory = []
        lost: list[int] = []
        if existing:
            for sid in self.store.held_ids():
                t = self.store.get([sid])[0]
                lo, hi = t.version_span()
                inventory.append({"sample_id": t.sample_id, "group_id": t.group_id, "prompt_id": t.prompt_id,
                                  "reward": t.reward, "min_version": lo, "max_version": hi,
                                  "loss_tokens": t.num_loss_tokens, "location": self._location(sid)})
            lost = list(self.store.lost_ids())
            self.store.release(self.store.held_ids())
        return inventory, lost

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> int:
        svc = self.rt.service
        from .telemetry import GpuTelemetry
        gpu = GpuTelemetry.open(self.device, self.rank)
        svc.heartbeat = lambda: self.rt.send(Heartbeat(self.rank, self.idle_s, self._generated_tokens(), self._load(),
                                                       gpu.read() if gpu is not None else None, self._tool_stats()))
        svc.heartbeat_s = self.cfg.run.heartbeat_s
        setup = self._wait(lambda m: isinstance(m, Setup), "waiting for setup")
        self.setup(setup)
        link, backoff = self.follower, self.rt.control.backoff()
        while not self.stop_reason:
            # A follower applies one of its leader's calls per turn, so its own commands are never starved.
            followed = link is not None and link.pending()
            if followed:
                link.apply()
            busy = link is None and self.runner is not None and self.runner.has_work()
            t0 = time.monotonic()
            # A follower never blocks on its inbox: its leader's next call may come first.
            cmd = svc.poll_command(0.0 if busy or link is not None else IDLE_WAIT_S)
            if not busy and self.rank in self.rollouts:
                self.idle_s += time.monotonic() - t0        # nothing to generate: rollout idle
            if cmd is not None:
                handler = self.handlers.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"rank {self.rank}: unexpected command {type(cmd).__name__}")
                handler(cmd)
                backoff.progress()
                continue
            if busy:
                t_gen, c_gen = time.monotonic(), time.thread_time()
                self._generate()
                self.generate_s += time.monotonic() - t_gen
                self.generate_cpu_s += time.thread_time() - c_gen
            elif followed:
                backoff.progress()
            else:
                if svc.silent_for() > self.cfg.run.timeout_s:
                    raise RankTimeout(self.rank, "waiting for work", self.cfg.run.timeout_s, peer="0 (coordinator)")
                if link is not None:
                    backoff.idle()
        return 0

    def _follow_through(self, mark: str, op: str) -> None:
        """A follower: apply its leader's calls up to the leader's ``mark`` (the point the leader reaches before
        it can wait for this rank in ``op``), within ``run.timeout_s``. ``"stop"``: up to the leader's stop."""
        link, backoff = self.follower, self.rt.control.backoff()
        done = (lambda: link.stopped) if mark == "stop" else (lambda: link.reached(mark))

        def through() -> bool:
            while link.pending():
                backoff.progress()
                link.apply()
                if done():
                    return True
            return False

        if not done():
            wait_until(through, timeout=self.cfg.run.timeout_s, rank=self.rank, backoff=backoff, peer=link.leader,
                       op=f"{op}: waiting for tensor-parallel rank {link.leader} to reach {mark!r}")

    def _mark(self, name: str) -> None:
        """A leader: tell its followers it has reached ``name`` (see _follow_through)."""
        if self._leads():
            self.engine.mark(name)

    def _wait(self, want: Any, op: str) -> Any:
        while True:
            msg = self.rt.next_command(op)
            if want(msg):
                return msg
            if isinstance(msg, Stop):
                raise RuntimeError(f"rank {self.rank}: {op}: the coordinator stopped the run")

    def _generate(self) -> None:
        finished = self.runner.step()
        if self.runner.failed:
            failed, self.runner.failed = self.runner.failed, []
            self.rt.send(SamplesFailed(self.rank, [sid for sid, _ in failed], failed[0][1]))
        if not finished:
            return
        self.store.put(finished)
        self.store.maybe_flush()
        metas = [FinishedSample(t.sample_id, t.reward, *t.version_span(), t.num_loss_tokens, t.finish_reason,
                                self._location(t.sample_id), len(t.tokens)) for t in finished]
        self.rt.send(SamplesFinished(self.rank, metas, self.idle_s, self._generated_tokens(), self._load()))

    def _generated_tokens(self) -> int:
        """Tokens this rank's engine generated (a follower's are its leader's, which reports them)."""
        return self.engine.stats().generated_tokens if self.engine is not None and self.follower is None else 0

    def _load(self) -> EngineReport | None:
        """The engine's load while in the rollout role (the generation scheduler's input)."""
        if self.engine is None or self.rank not in self.rollouts:
            return None
        st = self.engine.stats()
        waiting = self.runner.waiting() if self.runner is not None else 0
        return EngineReport(st.kv_tokens_used, st.kv_tokens_budget, st.preemptions, st.running, st.queued, waiting)

    def _tool_stats(self) -> dict | None:
        """The executor's counts for the heartbeat (read on the service thread: plain numbers, copied)."""
        st = self.runner.tool_stats if self.runner is not None and self.follower is None else None
        return None if st is None or not (st.samples or st.calls) else st.snapshot()

    def _location(self, sample_id: int) -> list[int] | None:
        where = self.store.location(sample_id)
        return None if where is None else [where[1].segment, where[1].row]

    # ------------------------------------------------------------------------------ commands

    def _dispatch(self, cmd: Dispatch) -> None:
        for s in cmd.samples:
            self.runner.add(s.sample_id, s.group_id, s.prompt_id)

    def _drop(self, cmd: Drop) -> None:
        self.store.release(cmd.sample_ids)

    def _cancel(self, cmd: Cancel) -> None:
        self.runner.cancel(cmd.sample_ids)

    def _train(self, cmd: Train) -> None:
        from ..train.trainer import WeightedSample
        idle = time.monotonic() - self.trainer_idle_since
        t0 = time.monotonic()
        wanted: dict[int, list[int]] = {}
        for s in cmd.samples:
            wanted.setdefault(s.owner, []).append(s.sample_id)
        payload = self.fetcher.fetch(wanted)
        fetch_s = time.monotonic() - t0
        samples = [WeightedSample(payload[s.sample_id], s.advantage, s.weight, s.is_replay) for s in cmd.samples]
        lo, hi = self._check_staleness(cmd, samples)
        if self.colocated:
            # The engine sleeps before the trainer onloads; a follower's sleeps through its leader, whose
            # sleep it applies before it trains (tensor_parallel.py: the lockstep order).
            if self.follower is not None:
                self._follow_through(f"train step {cmd.step}", f"train step {cmd.step}")
            else:
                self.engine.sleep()
                self._mark(f"train step {cmd.step}")
            self.trainer.onload()
        stats = self.trainer.train_step(samples, cmd.batch_loss_tokens)
        if self.colocated:
            self.trainer.offload()
            if self.follower is None:
                self.engine.wake()                       # a follower's wakes in its loop, when its leader's does
        stats.update({"token_staleness_min": lo, "token_staleness_max": hi})
        self.rt.send(StepDone(self.rank, cmd.step, stats, idle, fetch_s))
        self.trainer_idle_since = time.monotonic()
        self.train_s, self.train_steps = self.train_s + self.trainer_idle_since - t0, self.train_steps + 1

    def _check_staleness(self, cmd: Train, samples: list) -> tuple[int, int]:
        """(min, max) staleness of every token trained in this step, which must keep the mode's guarantee
        (core/modes.py); a token that breaks it is a bug, and ends the run naming the sample."""
        lo, hi = cmd.version, 0
        for s in samples:
            versions = s.trajectory.versions
            generated = versions[versions >= 0]
            if not len(generated):
                continue
            s_lo, s_hi = cmd.version - int(generated.max()), cmd.version - int(generated.min())
            lo, hi = min(lo, s_lo), max(hi, s_hi)
            for staleness in (s_lo, s_hi):
                if not self.rules.staleness_ok(staleness, self.cfg.reflow.delta, cmd.step):
                    raise RuntimeError(f"rank {self.rank}: step {cmd.step}: sample {s.trajectory.sample_id} has a "
                                       f"token {staleness} step(s) behind version {cmd.version}, which mode "
                                       f"{self.rules.mode} does not allow (δ = {self.cfg.reflow.delta})")
        return lo, hi

    def _sync_weights(self, cmd: SyncWeights) -> None:
        t0 = time.monotonic()
        nbytes, resumed = 0, 0
        if cmd.src is None:                                  # colocated: our own trainer's weights
            if self._leads():                                # and every rank of the instance its own
                self.engine.load_own_weights(self.trainer.named_weights(), cmd.version)
            else:
                self.engine.load_weights(self.trainer.named_weights(), cmd.version)
        elif self.rank == cmd.src:
            stats = self._weight_sync().send(self.trainer.named_weights())
            nbytes = stats.bytes
        elif self.rank not in cmd.group:                     # the source's shard group: gather with it
            self.trainer.join_weight_gather()
        else:
            wsync = self._weight_sync()
            if self.cfg.rollout.sync_kv == "keep":           # in-flight update: requests keep their KV
                st = self.engine.stats()
                resumed = st.running + st.queued
                self.engine.load_weights(wsync.receive(), cmd.version)
            else:
                resumed = self.runner.interrupt()
                self.engine.load_weights(wsync.receive(), cmd.version)
                self.runner.resume()
            nbytes = wsync.bytes
        self.rt.send(WeightsLoaded(self.rank, cmd.version, time.monotonic() - t0, nbytes, resumed))
        self.trainer_idle_since = time.monotonic()        # broadcasting is work, not waiting

    def _switch(self, cmd: Switch) -> None:
        t0 = time.monotonic()
        rank = self.rank
        self.switches += 1                          # every worker gets every Switch: a name both ends agree on
        was_trainer, now_trainer = rank in self.trainers, rank in cmd.trainers
        # Whole engine blocks move: a follower's block generates when its leader does.
        was_generating, now_generating = self._generates(self.rollouts), self._generates(cmd.rollouts)
        self.holdings.partials.clear()              # the previous switch's: fetched long since
        handed: list[int] = []
        if was_generating and not now_generating and self.follower is not None:
            self._follow_through(f"switch {self.switches}", "switch to training")   # its leader hands over, sleeps
        elif was_generating and not now_generating:   # to trainer: what is in flight goes to the others
            partials = self.runner.hand_off()
            self.holdings.partials.update((t.sample_id, t) for t in partials)
            handed = [t.sample_id for t in partials]
            self.engine.sleep()
            self._mark(f"switch {self.switches}")
        if now_trainer and not was_trainer:
            self.trainer.onload()
        self.trainers, self.rollouts = tuple(cmd.trainers), tuple(cmd.rollouts)
        self.trainer.set_group(self.groups.replica(self._n_t()))        # None unless it trains now
        for src, dst in cmd.transfers:               # a new replica: state from its counterpart, point to point
            if rank == src:
                self.trainer.send_state(dst)
            elif rank == dst:
                self.trainer.recv_state(src)
        if was_trainer and not now_trainer:         # to rollout: the next sync brings the weights
            self.trainer.offload()
            if self.follower is None:
                self.engine.wake()                  # a follower's wakes when its leader's does
        self.trainer_idle_since = time.monotonic()
        self.rt.send(Switched(rank, handed, time.monotonic() - t0))

    def _resume(self, cmd: Resume) -> None:
        if cmd.source < 0:                           # saved in the checkpoint this run resumed from
            if self._saved_partials is None:
                from ..storage.partials import load_partials
                self._saved_partials = load_partials(Path(self.resume_from) / "partials")
            partials = self._saved_partials
        else:
            partials = self.fetcher.fetch({cmd.source: [s.sample_id for s in cmd.samples]})
        for s in cmd.samples:
            self.runner.resume_partial(partials[s.sample_id])

    def _set_cap(self, cmd: SetCap) -> None:
        self.engine.set_concurrency_cap(cmd.cap)

    def _flush_trajectories(self, cmd: FlushTrajectories) -> None:
        saved: list[int] = []
        if cmd.partials and self.rank in self.rollouts:      # the run stops early: keep what is in flight
            from ..storage.partials import save_partials
            from ..train.checkpoint import staging_dir
            partials = self.runner.hand_off()
            save_partials(staging_dir(self.cfg.checkpoint_dir, cmd.step, "partials") / f"rank{self.rank}.npz",
                          partials)
            saved = [t.sample_id for t in partials]
        self.rt.send(TrajectoriesFlushed(self.rank, cmd.tag, self._flush_manifest(), saved))

    def _flush_manifest(self) -> dict:
        if self.store is None:
            return {}
        self.store.flush()
        stats = self.store.stats()
        return {"directory": str(self.store.directory), **{k: v for k, v in stats.items()
                                                          if isinstance(v, (int, float, str))}}

    def _write_checkpoint(self, cmd: WriteCheckpoint) -> None:
        from ..train.checkpoint import save_checkpoint, staging_dir
        # A sharded replica gathers the model and the optimizer state to its first worker, the writer;
        # the others take part in the gathers and report that they did.
        model, trainer_state = self.trainer.checkpoint_state()
        if model is None:
            self.rt.send(CheckpointWritten(self.rank, cmd.tag, ""))
            return
        manifests = {**cmd.manifests, str(self.rank): self._flush_manifest()}
        extra = {"coordinator": cmd.state, "manifests": manifests, "config": to_dict(self.cfg)}
        staged = staging_dir(self.cfg.checkpoint_dir, cmd.step, "partials")
        include = {"partials": staged} if cmd.state.get("partials") is not None and staged.is_dir() else None
        path = save_checkpoint(self.cfg.checkpoint_dir, cmd.step, model=model, tokenizer=self.tokenizer,
                               trainer_state=trainer_state, extra=extra,
                               keep_last=self.cfg.checkpoint.keep_last, include=include)
        self.rt.send(CheckpointWritten(self.rank, cmd.tag, str(path)))

    def _snapshot(self, cmd: Snapshot) -> None:
        from ..evaluation import save_snapshot
        model = self.trainer.full_model()             # sharded: gathered; None on all but the first worker
        if model is not None:
            save_snapshot(self.cfg.run_dir, model, cmd.step, cmd.version, cmd.elapsed_s)

    def _stop(self, cmd: Stop) -> None:
        self.stop_reason = cmd.reason
        link = self.follower
        if self.runner is not None and link is None:
            self.runner.abandon()
            self.runner.close()
            if self._leads():
                self.engine.stop()                  # its followers leave after its last calls
        if link is not None:
            if not link.stopped:
                self._follow_through("stop", "stopping")
            print(f"rank {self.rank}: followed tensor-parallel rank {link.leader}: {link.calls} engine calls, "
                  f"{link.loads} weight loads", flush=True)
        if self.store is not None:
            self.store.close()
            if self.cfg.storage.collect:
                dest = self.cfg.run_dir / "shards" / f"rank{self.rank:05d}"
                if dest.exists():
                    shutil.rmtree(dest)
                copy_tree(self.store.directory, dest)
