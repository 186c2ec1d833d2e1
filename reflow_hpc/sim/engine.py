"""The discrete-event engine: simulated workers carry out the coordinator's commands and their
completions go back to the same :class:`~reflow_hpc.core.coordinator.Coordinator` as events — the
loop of ``runtime/training.py`` and ``runtime/worker.py`` with simulated time in place of MPI.

Workers (as ``runtime/worker.py``)
    Every worker is hybrid (an engine and a trainer); its role is what ``Setup`` and ``Switch`` say.
    It takes its commands in order. ``Dispatch``, ``Resume``, ``SetCap``, ``Drop`` and ``Cancel`` take
    no time; ``Train``, ``SyncWeights``, ``Switch``, ``FlushTrajectories`` and ``WriteCheckpoint`` block the worker
    until they end, and its engine makes no progress meanwhile. ``Train`` and a split-pool ``SyncWeights``
    are collectives: they start when every member has reached them (the replicas' gradient
    all-reduce; the weight broadcast) and end together. A command reaches its worker, and a report
    (a finished sample, a step, a sync, a switch, ready) the coordinator, ``sim.message_latency_s``
    after it was sent: the runtime's control messages wait for the receiver's next poll. At 0 they
    arrive at once and cost no event.
Engines (processor sharing: no event per token)
    A worker's engine runs at most its concurrency cap of requests (``SetCap``; at first the
    coordinator's ``cap_max``) and as many as its KV cache holds (:meth:`~reflow_hpc.sim.costs.Costs.kv_capacity`
    × engines, admitting a request only while ``sim.kv_watermark`` of it stays free); the others wait
    in arrival order. Between two events every running request gets one
    token per decode step, whose time depends on the running count n and the sum S of their contexts
    (:mod:`reflow_hpc.sim.costs`). S grows by n per step, so the time to the next event is a closed
    form, recomputed whenever the running set changes; the engine state advances lazily. An engine's
    events: the next request ends a turn (its sample ends, or a tool call starts), or the KV cache is
    full — then the newest request is preempted (vLLM's recompute preemption) and re-prefills its
    context when admitted again. Admitting requests stalls decoding for their prefill time.
Tool calls (as ``rollout/episodes.py``)
    A request whose turn ends in a tool call leaves its engine (it holds no slot of the concurrency
    cap) while the call runs on its worker's executor: at most ``task.tool_concurrency`` calls run at
    once, the others wait in arrival order; a call occupies its slot until it returns, even when its
    sample was handed over or cancelled meanwhile. The engine decodes the others all along. When the
    call returns, the request queues again with the observation's tokens to prefill. A request handed
    over while its call runs or waits has the call run again, from the start, by the worker that
    resumes it. Rewards take no simulated time.
Versions and partial rollouts
    An engine generates with the version of the last sync it completed. At a split-pool ``SyncWeights`` the
    in-flight requests are held (their tokens so far belong to the old version), the weights load, and
    the requests resume under the new version after re-prefilling their contexts (with
    ``rollout.sync_kv = "keep"`` they keep their KV and decode on: the load is the only stall). A worker that leaves
    rollout at a ``Switch`` hands its in-flight requests over; the ``Resume`` that follows moves them,
    tokens and versions intact, to another worker, where they re-prefill. Each sample keeps its tokens
    as ``(version, count)`` segments, which the trainer checks against the mode's guarantee token by
    token, as ``runtime/worker.py`` does.
Idle time (as the runtime measures it)
    Rollout idle: a worker in the rollout role with no request in flight that carries out no command.
    Trainer idle: from the end of the worker's last step, sync or switch to the start of its next ``Train``.
Payload fetches
    A trainer replica fetches its share before the step: ``sim.fetch_s_per_sample`` per sample
    (≈ 12 bytes per token: negligible on a GPU cluster, a per-message cost on the CPU one).
Zero-cost steps (documented simplifications)
    ``Drop``, ``Snapshot``, heartbeats and the coordinator's own work take no simulated time. A
    cancelled request leaves its engine at once.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Final

from ..core import events as ev
from ..core.commands import (Cancel, Dispatch, Drop, FlushTrajectories, Resume, SetCap, Setup, Snapshot, Switch,
                             SyncWeights, Train, WriteCheckpoint)
from ..core.coordinator import Coordinator, Settings
from ..core.modes import ModeRules
from ..core.phase import Phase
from ..core.scheduling import EngineLoad
from ..core.shaping import OverlongShaping
from .costs import Costs, decode_steps, decode_time
from .lengths import LengthModel, SampleShape
from .workload import Placement

# Event kinds of the queue. (Final: the compiled engine inlines them instead of looking up globals.)
_ENGINE: Final = 0
_DONE: Final = 1
_READY: Final = 2
_TOOL: Final = 3
_TICK: Final = 4
_MESSAGE: Final = 5
# Steps within this of a request's end count as the end (float arithmetic of the closed forms).
_EPS_STEPS: Final = 1e-6
# Net allocations between the collector's young collections while a run is simulated (CPython's
# default is 700); only speed depends on it.
GC_YOUNG_THRESHOLD = 100_000
# The coordinator's last phase, a module constant: the loop compares with it on every event, and an enum
# member looked up on its class costs a few times a global.
_FINISHED: Final = Phase.FINISHED
# Request states.
QUEUED: Final = "queued"
RUNNING: Final = "running"
TOOL: Final = "tool"
HELD: Final = "held"
DONE: Final = "done"


class Request:
    """One sample on its engine."""
    __slots__ = ("sid", "group_id", "prompt_id", "prompt", "turns", "turn", "turn_end", "generated", "obs",
                 "start", "off", "finish_at", "segments", "reprefill", "prompt_cached", "state", "reward", "epoch",
                 "tool_at", "oldest", "newest", "total")

    def __init__(self, sid: int, group_id: int, prompt_id: int, shape: SampleShape, prompt_cached: bool):
        self.sid, self.group_id, self.prompt_id = sid, group_id, prompt_id
        self.prompt = shape.prompt_tokens
        self.turns = shape.turns
        self.turn = 0
        self.turn_end = shape.turns[0]          # generated tokens at the end of the current turn
        self.generated = 0                      # whole generated tokens flushed so far
        self.obs = 0                            # tool-observation tokens in the context
        self.start = 0.0                        # engine step counter matching `generated` while running
        self.off = 0.0                          # context - start (constant while running)
        self.finish_at = 0.0
        self.segments: list[list[int]] = []     # [version, tokens] in generation order
        self.reprefill = False                  # its context must be prefilled again
        self.prompt_cached = prompt_cached      # another sample of its group brought the prompt
        self.state = QUEUED
        self.reward = shape.reward
        self.epoch = 0
        self.tool_at = 0.0                      # when its tool call returns (state TOOL)
        # Set when it finishes (its tokens no longer change): versions of its oldest and newest tokens
        # (sys.maxsize and -1 when it has none), and its context.
        self.oldest, self.newest, self.total = sys.maxsize, -1, 0

    def context(self) -> int:
        return self.prompt + self.generated + self.obs


@dataclass
class Activity:
    """One interval of a worker's timeline (the role timeline plot)."""
    worker: int
    start: float
    end: float
    kind: str                                   # generate, train, sync, switch, checkpoint, idle-rollout, idle-trainer


@dataclass
class Collective:
    members: frozenset                              # who must arrive (a sync's group)
    size: int                                       # how many must arrive
    arrived: dict = field(default_factory=dict)     # worker -> (command, arrival time, trainer idle)


class SimWorker:
    """A simulated worker: its command inbox, its engine and its clocks."""

    def __init__(self, wid: int, sim: "Simulation", *, trainer: bool, rollout: bool):
        self.wid, self.sim = wid, sim
        place = sim.place
        self.gpus, self.engines, self.tp = place.worker_gpus, place.engines, place.tp
        self.is_trainer, self.is_rollout = trainer, rollout
        self.inbox: deque = deque()
        self.busy: str | None = None            # kind of the blocking command in progress
        self.version = 0                        # weights the engine generates with
        # Engine (module docstring). S(x) = s_off + n·x at step counter x.
        self.steps = 0.0
        self.t_ref = 0.0
        self.n = 0
        self.s_off = 0.0
        self.resume_at = 0.0                    # decoding stalls (prefill) until then
        self.stall_left = 0.0                   # stall remaining when a blocking command paused it
        # (finish_at, tie, epoch, request) of running requests; typed, as the other containers, so that
        # the compiled engine (tools/compile_sim.py) reads their fields directly.
        self.heap: list[tuple[float, int, int, Request]] = []
        self.tie = 0
        self.queue: deque[Request] = deque()
        self.admitted: dict[int, Request] = {}  # running requests in admission order (preemption victim last)
        self.live: dict[int, Request] = {}      # every request in flight here (queued, running, tool)
        self.holdings: dict[int, Request] = {}  # handed over at a switch, until another worker resumes them
        self.epoch = 0                          # engine event generation (stale queue entries are skipped)
        self.target = 0.0                       # step count of the scheduled engine event
        self.target_is_kv = False               # that event is a full KV cache, not a turn end
        self.kv_capacity = place.engines * sim.costs.kv_capacity(place.tp)
        self.kv_admit_limit = self.kv_capacity * (1.0 - sim.cfg.sim.kv_watermark)   # admission stops above it
        # Costs.decode_terms, its constants folded once (it is needed at every event).
        self._a0, self._a1, self._c0, self._c1 = sim.costs.decode_coefficients(place.tp, place.engines)
        self.cap = sim.settings.cap_max
        self.preemptions = 0
        # The worker's tool executor: calls running (their slots) and calls waiting for a slot.
        self.tool_slots = sim.cfg.task.tool_concurrency
        self.tool_busy = 0
        self.tool_wait: deque[Request] = deque()
        # Clocks and counters.
        self.idle_s = 0.0
        self.idle_since: float | None = None
        self.generated_tokens = 0.0
        # Prefill stalls by cause: first prefills (prompts, tool observations), re-prefills after a
        # preemption or a hand-over, and re-prefills of the requests a weight sync held.
        self.prefill_s = 0.0
        self.reprefill_s = 0.0
        self.sync_reprefill_s = 0.0
        self.trainer_idle_since = 0.0
        self.activity_kind: str | None = None
        self.activity_since = 0.0
        self.load_reported_at = -math.inf

    # ------------------------------------------------------------------------------------------
    # Engine state
    # ------------------------------------------------------------------------------------------

    def kv_used(self) -> float:
        return self.s_off + self.n * self.steps

    def terms(self) -> tuple[float, float, float]:
        n, a1 = self.n, self._a1
        return self._a0 + a1 * (self.s_off + n * self.steps), a1 * n, self._c0 + self._c1 * n

    def advance(self, now: float) -> None:
        """Bring the engine's step counter to ``now``."""
        if self.busy is None and self.n:
            start = self.t_ref if self.t_ref > self.resume_at else self.resume_at
            if now > start:
                a, b, c = self.terms()
                k = decode_steps(a, b, c, now - start)
                self.steps += k
                self.generated_tokens += k * self.n
        if now > self.t_ref:
            self.t_ref = now

    def flush(self, r: Request, tokens: int | None = None) -> None:
        """Move the whole tokens ``r`` generated since its last flush into its segments (the engine's
        current version); a fraction of a token stays for the next flush."""
        if tokens is None:
            tokens = int(self.steps - r.start + 1e-9)
        if tokens > 0:
            seg = r.segments[-1] if r.segments else None
            if seg is not None and seg[0] == self.version:
                seg[1] += tokens
            else:
                r.segments.append([self.version, tokens])
            r.generated += tokens
            r.start += tokens                    # context and start move together: r.off is unchanged

    def schedule(self, now: float) -> None:
        """Queue this engine's next event (the next turn end or a full KV cache)."""
        self.epoch += 1
        if self.busy is not None or self.n == 0:
            return
        heap = self.heap
        while heap and (heap[0][3].state != RUNNING or heap[0][2] != heap[0][3].epoch):
            heapq.heappop(heap)
        k = max(0.0, heap[0][0] - self.steps) if heap else float("inf")
        self.target_is_kv = False
        if self.n > 1:
            k_kv = (self.kv_capacity - self.kv_used()) / self.n
            if k_kv < k:
                k = max(0.0, k_kv)
                self.target_is_kv = True
        self.target = self.steps + k
        a, b, c = self.terms()
        start = max(self.t_ref, self.resume_at, now)
        self.sim.push(start + decode_time(a, b, c, k), _ENGINE, self.wid, self.epoch)

    def start_running(self, r: Request) -> None:
        r.state = RUNNING
        r.start = self.steps
        r.off = r.context() - self.steps
        r.finish_at = self.steps + (r.turn_end - r.generated)
        r.epoch += 1
        self.n += 1
        self.s_off += r.off
        self.admitted[r.sid] = r
        self.tie += 1
        heapq.heappush(self.heap, (r.finish_at, self.tie, r.epoch, r))

    def stop_running(self, r: Request, tokens: int | None = None) -> None:
        """Take ``r`` out of the running set (its tokens flushed first)."""
        self.flush(r, tokens)
        self.n -= 1
        self.s_off -= r.off
        r.state = HELD
        r.epoch += 1
        del self.admitted[r.sid]

    def admit(self, now: float) -> None:
        """Admit queued requests in arrival order while a slot and their KV cache are free; their
        prefill stalls decoding."""
        if self.busy is not None or not self.queue:
            return
        costs = self.sim.costs
        flops = 0.0
        re_flops = 0.0
        s_now = self.kv_used()
        limit = self.kv_admit_limit
        while self.queue and self.n < self.cap:
            r = self.queue[0]
            ctx = r.context()
            if self.n > 0 and s_now + ctx > limit:
                break
            self.queue.popleft()
            if r.reprefill:
                f = costs.prefill_flops_of(ctx)
                flops += f
                re_flops += f
                r.reprefill = False
            elif r.generated == 0 and r.obs == 0:
                if not r.prompt_cached:
                    flops += costs.prefill_flops_of(r.prompt)
            else:                                 # back from a tool call: the observation, after the cached context
                obs = costs.tool_observation_tokens
                flops += costs.prefill_flops_of(obs, ctx - obs)
            self.start_running(r)
            s_now += ctx
        if flops > 0.0:
            t = costs.prefill_time(self.gpus, flops)
            self.resume_at = max(self.resume_at, now) + t
            re_t = t * re_flops / flops
            self.reprefill_s += re_t
            self.prefill_s += t - re_t

    def enqueue(self, r: Request, now: float) -> None:
        """``r`` arrives at this engine (dispatch, resume, a returning tool call)."""
        self.live[r.sid] = r
        if r.state == TOOL:                       # handed over while its tool call ran: run it again here
            self.start_tool(r, now)
            return
        r.state = QUEUED
        self.queue.append(r)

    # ------------------------------------------------------------------------------------------
    # Engine events
    # ------------------------------------------------------------------------------------------

    def on_engine_event(self, now: float) -> None:
        """The scheduled event of this engine: it reached ``self.target`` steps (had anything changed
        since it was scheduled, the event would have been voided)."""
        self.advance(now)
        if self.target > self.steps:                  # the closed forms are exact; only rounding is left
            self.generated_tokens += (self.target - self.steps) * self.n
            self.steps = self.target
        heap, sim = self.heap, self.sim
        ended = []
        while heap:
            fin, _, epoch, r = heap[0]
            if r.state != RUNNING or epoch != r.epoch:
                heapq.heappop(heap)
                continue
            if fin > self.steps + _EPS_STEPS:
                break
            heapq.heappop(heap)
            ended.append(r)
        done = []
        for r in ended:
            self.stop_running(r, r.turn_end - r.generated)    # exactly the turn's remaining tokens
            if r.turn + 1 < len(r.turns):             # a tool call: leave the engine until it returns
                r.state = TOOL
                r.turn += 1
                r.turn_end += r.turns[r.turn]
                self.start_tool(r, now)
            else:
                r.state = DONE
                del self.live[r.sid]
                done.append(r)
        if not ended and self.target_is_kv and self.n > 1:
            victim = next(reversed(self.admitted.values()))   # the newest: vLLM's recompute preemption
            self.stop_running(victim)
            victim.state = QUEUED
            victim.reprefill = True
            self.queue.appendleft(victim)
            self.preemptions += 1
        self.admit(now)
        self.schedule(now)
        self.update_idle(now)
        if done:                                      # reported once the engine is consistent again
            sim.finished(self, done, now)

    def start_tool(self, r: Request, now: float) -> None:
        """Run ``r``'s tool call on this worker's executor, or queue it behind the calls running."""
        if self.tool_busy < self.tool_slots:
            self.tool_busy += 1
            r.tool_at = now + self.sim.costs.tool_latency(self.sim.rng)
            self.sim.push(r.tool_at, _TOOL, self.wid, r)
        else:
            r.tool_at = math.inf
            self.tool_wait.append(r)

    def on_tool_return(self, r: Request, now: float) -> None:
        self.tool_busy -= 1                           # a call started here ended: its slot is free
        while self.tool_wait and self.tool_busy < self.tool_slots:
            q = self.tool_wait.popleft()
            if q.state == TOOL and self.live.get(q.sid) is q:
                self.start_tool(q, now)
        if r.state != TOOL or self.live.get(r.sid) is not r or r.tool_at != now:
            return                                    # cancelled or handed over meanwhile (a stale call)
        self.advance(now)
        r.obs += self.sim.costs.tool_observation_tokens
        r.state = QUEUED
        self.queue.append(r)
        if self.busy is None:
            self.admit(now)
            self.schedule(now)

    def hand_off(self, now: float) -> list[int]:
        """Leaving rollout: everything in flight is held for whoever resumes it (``runtime`` ``hand_off``)."""
        for r in list(self.admitted.values()):
            self.stop_running(r)
        self.queue.clear()
        self.tool_wait.clear()                    # calls not started go with their samples (run again there)
        ids = []
        for sid, r in self.live.items():
            if r.state != TOOL:
                r.state = HELD
                r.reprefill = r.generated > 0 or r.obs > 0
            self.holdings[sid] = r
            ids.append(sid)
        self.live.clear()
        self.heap.clear()
        return ids

    # ------------------------------------------------------------------------------------------
    # Idle and activity
    # ------------------------------------------------------------------------------------------

    def update_idle(self, now: float) -> None:
        idle = self.is_rollout and self.busy is None and not self.live
        if idle and self.idle_since is None:
            self.idle_since = now
        elif not idle and self.idle_since is not None:
            self.idle_s += now - self.idle_since
            self.idle_since = None
        timeline = self.sim.timeline
        if timeline is not None:
            if self.busy is not None:
                kind = self.busy
            elif self.live:
                kind = "generate"
            else:
                kind = "idle-rollout" if self.is_rollout else "idle-trainer"
            if kind != self.activity_kind:
                if self.activity_kind is not None and now > self.activity_since:
                    timeline.append(Activity(self.wid, self.activity_since, now, self.activity_kind))
                self.activity_kind, self.activity_since = kind, now

    def idle_now(self, now: float) -> float:
        return self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)

    def load(self) -> EngineLoad:
        waiting = sum(1 for r in self.live.values() if r.state == TOOL)      # as the runtime reports them
        return EngineLoad(int(self.kv_used()), int(self.kv_capacity), self.preemptions, self.n, len(self.queue),
                          waiting)

    # ------------------------------------------------------------------------------------------
    # Blocking commands
    # ------------------------------------------------------------------------------------------

    def block(self, kind: str, now: float) -> None:
        """Start a blocking command: the engine stops where it is."""
        self.advance(now)
        for r in self.admitted.values():
            self.flush(r)
        self.stall_left = max(0.0, self.resume_at - now)
        self.busy = kind
        self.epoch += 1                               # the engine's pending event is void
        self.update_idle(now)

    def unblock(self, now: float, extra_stall: float = 0.0) -> None:
        self.busy = None
        self.t_ref = now
        self.resume_at = now + self.stall_left + extra_stall
        self.stall_left = 0.0
        self.admit(now)
        self.schedule(now)
        self.update_idle(now)


class Simulation:
    """One simulated run of one mode (module docstring); :meth:`run` drives the coordinator to the end.

    ``lengths`` (a :class:`~reflow_hpc.sim.lengths.LengthModel` or any object with its ``group``
    method) and ``costs`` default to the config's. ``on_command(cmd, now)`` sees every command the
    coordinator emits, ``on_train(cmd, segments, now)`` every replica's share of a batch with the
    ``(version, tokens)`` segments of each of its samples, and ``on_finished(worker, requests, now)``
    the samples a worker finishes. ``timeline`` records each worker's activity. ``settings`` are the
    ones ``coordinator`` was built with; the simulator reads nothing of the coordinator but what
    :meth:`~reflow_hpc.core.coordinator.Coordinator.handle` returns and its summary.
    """

    def __init__(self, cfg, coordinator: Coordinator, settings: Settings, place: Placement, *, lengths: Any = None,
                 costs: Costs | None = None, on_command: Callable | None = None, on_train: Callable | None = None,
                 on_finished: Callable | None = None, timeline: bool = False):
        self.cfg, self.coordinator, self.settings, self.place = cfg, coordinator, settings, place
        self.rules: ModeRules = settings.rules
        self.phase = Phase.NEW                         # the coordinator's, after the last event it handled
        self.costs = costs or Costs.from_config(cfg)
        self.lengths = lengths or LengthModel.from_config(cfg)
        self.shaping = OverlongShaping.of(cfg)          # DAPO's overlong reward shaping, None when off
        self.rng = random.Random(cfg.run.seed * 7 + 1)
        self.on_command, self.on_train, self.on_finished = on_command, on_train, on_finished
        self.timeline: list[Activity] | None = [] if timeline else None
        self.queue: list[tuple[float, int, int, Any, Any]] = []      # (time, sequence, kind, a, b)
        self.seq = 0
        self.now = 0.0
        longest = self.costs.kv_capacity(place.tp)
        if longest < cfg.rollout.max_new_tokens:
            raise ValueError(f"sim: an engine of {place.tp} GPU(s) holds {longest:.0f} KV tokens, fewer than one "
                             f"response of rollout.max_new_tokens = {cfg.rollout.max_new_tokens}")
        trainers, rollouts = set(place.trainers), set(place.rollouts)
        self.workers: dict[int, SimWorker] = {
            w: SimWorker(w, self, trainer=w in trainers, rollout=w in rollouts) for w in range(place.world)}
        self.samples: dict[int, Request] = {}          # finished samples whose payload is held
        self.collectives: dict[tuple, Collective] = {}
        self.collectives_done: set[tuple] = set()        # syncs whose broadcast ended
        self.records: list = []                         # StepRecords, in order
        self.checkpoints: list[tuple[str, int, str]] = []    # (tag, step, path) of every checkpoint written
        self.log: list[dict] = []                       # the event log (with the coordinator's event_log on)
        self.train_seconds: list[float] = []            # slowest replica's compute time per step
        self.sync_seconds: list[float] = []
        self.switch_seconds: list[float] = []
        self.handed_off: list[tuple[int, int]] = []     # (sample, worker that handed it over) at switches
        self.trained_tokens = 0
        self.events = 0
        self.latency = cfg.sim.message_latency_s
        self.max_new_tokens = cfg.rollout.max_new_tokens
        # Engine loads feed only the adaptive controller, which acts at most once per control interval
        # and worker (core/scheduling.py): a report within the interval changes nothing, so none is made.
        sch = settings.scheduling
        self.load_interval = sch.control_interval_s if sch.adaptive and not place.colocated else math.inf

    @property
    def preemptions(self) -> int:
        return sum(w.preemptions for w in self.workers.values())

    def prefill_seconds(self) -> dict[str, float]:
        """Prefill stalls summed over the workers, by cause (:class:`SimWorker`)."""
        ws = self.workers.values()
        return {"first": sum(w.prefill_s for w in ws), "reprefill": sum(w.reprefill_s for w in ws),
                "sync": sum(w.sync_reprefill_s for w in ws)}

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------

    def push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, kind, a, b))

    def run(self) -> "Simulation":
        # A run allocates millions of short-lived records and makes few cycles: young collections are
        # made rarer while it runs (1,024 GPUs × 40 steps: 9.7–9.9 → 7.5–8.0 s; the same results).
        saved = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *saved[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*saved)

    def _run(self) -> "Simulation":
        self.deliver(self.handle(ev.Start(0.0)))
        self.push(self.cfg.sim.tick_s, _TICK, None)
        workers, queue = self.workers, self.queue
        # The runtime ticks after every message (runtime/pump.py) as well as periodically; a tick
        # matters only for a time budget here (simulated workers are never silent), so only then is it
        # worth its cost after every event.
        tick_always = self.cfg.trainer.time_budget_s > 0 or self.settings.time_budget_s > 0
        while queue and self.phase is not _FINISHED:
            t, _, kind, a, b = heapq.heappop(queue)
            self.now = t
            self.events += 1
            if kind == _ENGINE:
                w = workers[a]
                if b != w.epoch:
                    continue
                w.on_engine_event(t)
            elif kind == _DONE:
                self.done(workers[a], b, t)
            elif kind == _TOOL:
                workers[a].on_tool_return(b, t)
            elif kind == _MESSAGE:
                a(t)
            elif kind == _READY:
                workers[a].trainer_idle_since = t
                workers[a].update_idle(t)
                self.send(functools.partial(self._ready, a))
            elif kind == _TICK:
                self.tick(t)
            if tick_always and kind != _TICK and self.phase is not _FINISHED:
                self.deliver(self.handle(ev.Tick(t)))
        if self.phase is not _FINISHED:
            s = self.coordinator.summary()
            raise RuntimeError(f"sim: the event queue ran dry at t = {self.now:.3f} s before the run ended "
                               f"(step {s['steps']} of {s['steps_target']}): a command was never answered")
        for w in workers.values():
            w.update_idle(self.now)
            if self.timeline is not None and w.activity_kind is not None and self.now > w.activity_since:
                self.timeline.append(Activity(w.wid, w.activity_since, self.now, w.activity_kind))
        return self

    def send(self, arrive: Callable[[float], None]) -> None:
        """A control message: ``arrive(now)`` runs when it reaches its receiver (module docstring)."""
        if self.latency > 0.0:
            self.push(self.now + self.latency, _MESSAGE, arrive)
        else:
            arrive(self.now)

    def handle(self, event: Any) -> list:
        """The coordinator handles ``event``: the commands it gives (the step records are kept)."""
        out = self.coordinator.handle(event)
        self.phase = out.phase
        if out.steps or out.log or out.checkpoints:       # (rare: tested together)
            self.records += out.steps
            self.log += out.log
            self.checkpoints += out.checkpoints
        return out.commands

    def _ready(self, wid: int, now: float) -> None:
        self.deliver(self.handle(ev.Ready(wid, now)))

    def tick(self, now: float) -> None:
        """The coordinator's timer, after every worker's heartbeat (``runtime/service.py``)."""
        out: list = []
        for w in self.workers.values():
            # The progress figures as they stood before the load report brings the engine up to date.
            idle, generated = w.idle_now(now), int(w.generated_tokens)
            load = self.load_report(w, now) if w.is_rollout and self.phase.started else None
            out += self.handle(ev.Heartbeat(w.wid, now, idle, generated, load))
        self.deliver(out)
        self.deliver(self.handle(ev.Tick(now)))
        if self.phase is not _FINISHED:
            self.push(now + self.cfg.sim.tick_s, _TICK, None)

    # ------------------------------------------------------------------------------------------
    # Commands
    # ------------------------------------------------------------------------------------------

    def deliver(self, commands: list) -> None:
        """Send the coordinator's commands to their workers."""
        if not commands:
            return
        on_command = self.on_command
        if on_command is not None:
            for cmd in commands:
                on_command(cmd, self.now)
        self.send(lambda now: self._arrive(commands))

    def _arrive(self, commands: list) -> None:
        touched = []
        for cmd in commands:
            w = self.workers[cmd.worker]
            w.inbox.append(cmd)
            touched.append(w)
        for w in touched:
            if w.busy is None and w.inbox:
                self.pump(w)

    def pump(self, w: SimWorker) -> None:
        """Carry out ``w``'s commands in order until one blocks."""
        now = self.now
        changed = False
        while w.busy is None and w.inbox:
            cmd = w.inbox.popleft()
            t = type(cmd)
            if t is Dispatch or t is Resume or t is Cancel or t is SetCap:
                if not changed:
                    w.advance(now)
                    changed = True
                if t is Dispatch:
                    self.dispatch(w, cmd)
                elif t is Resume:
                    self.resume(w, cmd)
                elif t is Cancel:
                    self.cancel(w, cmd)
                else:
                    w.cap = cmd.cap
            elif t is Drop:
                for sid in cmd.sample_ids:
                    self.samples.pop(sid, None)
            elif t is Train:
                self.train(w, cmd)
            elif t is SyncWeights:
                self.sync_weights(w, cmd)
            elif t is Switch:
                self.switch(w, cmd)
            elif t is FlushTrajectories:
                w.block("checkpoint", now)
                self.push(now + self.cfg.sim.checkpoint_flush_s, _DONE, w.wid, cmd)
            elif t is WriteCheckpoint:
                w.block("checkpoint", now)
                self.push(now + self.cfg.sim.checkpoint_write_s, _DONE, w.wid, cmd)
            elif t is Setup:
                self.push(now + self.cfg.sim.setup_s, _READY, w.wid)
            elif t is Snapshot:
                pass
            else:
                raise RuntimeError(f"sim: worker {w.wid}: unexpected command {t.__name__}")
        if changed and w.busy is None:
            w.admit(now)
            w.schedule(now)
            w.update_idle(now)

    def dispatch(self, w: SimWorker, cmd: Dispatch) -> None:
        groups: dict[int, list] = {}
        for s in cmd.samples:
            groups.setdefault(s.group_id, []).append(s)
        now = self.now
        for samples in groups.values():
            shapes = self.lengths.group(samples[0].prompt_id, len(samples), w.version)
            for i, (s, shape) in enumerate(zip(samples, shapes)):
                w.enqueue(Request(s.sample_id, s.group_id, s.prompt_id, shape, prompt_cached=i > 0), now)

    def resume(self, w: SimWorker, cmd: Resume) -> None:
        """Continue samples another worker handed over: fetched with their tokens and versions."""
        source = self.workers[cmd.source]
        for s in cmd.samples:
            r = source.holdings.pop(s.sample_id)
            r.reprefill = r.generated > 0 or r.obs > 0
            w.enqueue(r, self.now)

    def cancel(self, w: SimWorker, cmd: Cancel) -> None:
        for sid in cmd.sample_ids:
            w.holdings.pop(sid, None)
            r = w.live.pop(sid, None)
            if r is None:
                continue
            if r.state == RUNNING:
                w.stop_running(r)
            elif r.state == QUEUED:
                w.queue.remove(r)
            r.state = DONE

    def finished(self, w: SimWorker, done: list[Request], now: float) -> None:
        """Samples ended on ``w``: report them as ``runtime/worker.py`` does (one message)."""
        cap = self.max_new_tokens
        shaping = self.shaping
        if self.on_finished is not None:
            self.on_finished(w.wid, done, now)
        samples = []
        for r in done:
            lo, hi = sys.maxsize, -1              # its oldest and newest token versions, one pass over its segments
            for v, n in r.segments:
                if n > 0:
                    if v < lo:
                        lo = v
                    if v > hi:
                        hi = v
            if hi >= 0:
                r.oldest, r.newest = lo, hi
            else:
                lo = hi = w.version
            r.total = r.context()
            self.samples[r.sid] = r
            # A plain tuple of ev.FinishedSample's fields (core/events.py): cheaper to make than the named tuple.
            reward = r.reward if shaping is None else r.reward + shaping(r.generated)
            samples.append((r.sid, reward, lo, hi, r.generated, "length" if r.generated >= cap else "stop", None,
                            r.total))
        wid, idle, generated = w.wid, w.idle_now(now), int(w.generated_tokens)
        load = self.load_report(w, now) if w.is_rollout else None

        def arrive(t: float) -> None:
            self.deliver(self.handle(tuple.__new__(ev.SamplesFinished, (wid, t, samples, idle, generated, load))))
        self.send(arrive)

    def load_report(self, w: SimWorker, now: float) -> EngineLoad | None:
        """``w``'s engine load for the generation scheduler, when it can act on it (else None)."""
        if now - w.load_reported_at < self.load_interval:
            return None
        w.load_reported_at = now
        w.advance(now)
        return w.load()

    # ------------------------------------------------------------------------------------------
    # Collectives and other blocking commands
    # ------------------------------------------------------------------------------------------

    def train(self, w: SimWorker, cmd: Train) -> None:
        now = self.now
        idle = now - w.trainer_idle_since
        w.block("train", now)
        key = ("train", cmd.step)
        col = self.collectives.get(key)
        if col is None:
            col = self.collectives[key] = Collective(frozenset(), cmd.replicas)     # every trainer rank
        col.arrived[w.wid] = (cmd, now, idle)
        if len(col.arrived) < col.size:
            return
        del self.collectives[key]
        mode = self.rules.mode
        longest = compute = 0.0
        total = samples = 0
        parts = {}
        per_sample = self.cfg.sim.fetch_s_per_sample
        for wid, (c_, _, _) in col.arrived.items():
            lengths = [self.samples[s.sample_id].total for s in c_.samples]
            total += sum(lengths)
            samples += len(lengths)
            fb, update = self.costs.train_parts(self.workers[wid].gpus, lengths, mode)
            parts[wid] = (per_sample * len(lengths), fb, update)          # fetch, forward-backward, update
            compute = max(compute, fb + update)
            # The gradient all-reduce waits for the slowest replica, fetch included.
            longest = max(longest, sum(parts[wid]))
        self.train_seconds.append(compute)
        self.trained_tokens += total
        for wid, (c_, _, idle_) in col.arrived.items():
            lo, hi = self.check_staleness(c_)
            fetch, fb, update = parts[wid]
            # As the trainer reports a step (train/trainer.py), with the batch's tokens and samples.
            stats = {"tokens": float(total), "samples": float(samples), "seconds": compute,
                     "forward_backward_seconds": fb, "optimizer_seconds": update, "allreduce_seconds": 0.0,
                     "token_staleness_min": lo, "token_staleness_max": hi}
            self.push(now + longest, _DONE, wid, ("train", c_, stats, idle_, fetch))

    def check_staleness(self, cmd: Train) -> tuple[int, int]:
        """(min, max) staleness of every token of this share, which must keep the mode's guarantee
        (``runtime/worker.py`` ``_check_staleness``). Each mode allows an interval of staleness
        (:meth:`~reflow_hpc.core.modes.ModeRules.staleness_ok`), so every token keeps it when the least
        and the greatest staleness do (a sample's oldest and newest token versions are taken from its
        segments when it finishes); only then is the sample at fault looked for."""
        rules, delta = self.rules, self.cfg.reflow.delta
        share = [self.samples[s.sample_id] for s in cmd.samples]
        newest = max([r.newest for r in share], default=-1)
        lo, hi = (cmd.version - newest, cmd.version - min([r.oldest for r in share])) if newest >= 0 else (cmd.version, 0)
        if not (rules.staleness_ok(lo, delta, cmd.step) and rules.staleness_ok(hi, delta, cmd.step)):
            for r in share:
                for v, n in r.segments:
                    st = cmd.version - v
                    if n > 0 and not rules.staleness_ok(st, delta, cmd.step):
                        raise RuntimeError(f"sim: step {cmd.step}: sample {r.sid} has {n} token(s) {st} "
                                           f"step(s) behind version {cmd.version}, which mode {rules.mode} does not "
                                           f"allow (δ = {delta})")
        if self.on_train is not None:
            self.on_train(cmd, [[tuple(seg) for seg in r.segments] for r in share], self.now)
        return lo, hi

    def sync_weights(self, w: SimWorker, cmd: SyncWeights) -> None:
        now = self.now
        w.block("sync", now)
        if cmd.src is None:                           # colocated: load our own trainer's weights
            self.push(now + self.costs.colocated_sync_time(), _DONE, w.wid, ("sync", cmd, self.costs.colocated_sync_time()))
            return
        key = ("sync", cmd.version)
        if w.wid not in cmd.group and key in self.collectives_done and key not in self.collectives:
            # one of the source's shard group, arriving after the broadcast ended
            self.push(now, _DONE, w.wid, ("sync", cmd, 0.0))
            return
        col = self.collectives.get(key)
        if col is None:
            col = self.collectives[key] = Collective(frozenset(cmd.group), len(cmd.group))
        # A worker outside the broadcast group is one of the source's shard group, gathering the weights
        # with it: it ends with the broadcast and does not count towards it.
        col.arrived[w.wid] = (cmd, now, 0.0)
        if not col.members <= set(col.arrived):
            return
        del self.collectives[key]
        self.collectives_done.add(key)
        gpus = sum(self.workers[m].gpus for m in col.members)
        duration = self.costs.sync_time(gpus)
        self.sync_seconds.append(duration)
        for wid, (c_, _, _) in col.arrived.items():
            self.push(now + duration, _DONE, wid, ("sync", c_, duration))

    def switch(self, w: SimWorker, cmd: Switch) -> None:
        """The pools change (``runtime/worker.py`` ``_switch``): hand over, park or wake, transfer state."""
        now = self.now
        w.block("switch", now)
        was_rollout, was_trainer = w.is_rollout, w.is_trainer
        w.is_trainer, w.is_rollout = w.wid in cmd.trainers, w.wid in cmd.rollouts
        if w.is_rollout and not was_rollout:
            w.load_reported_at = -math.inf            # the scheduler starts afresh with a new rollout worker
        handed = w.hand_off(now) if was_rollout and not w.is_rollout else []
        self.handed_off += [(sid, w.wid) for sid in handed]
        costs = self.costs
        seconds = 0.0
        if w.is_trainer and not was_trainer:
            seconds = costs.role_switch_time("to_trainer", trainer_gpus=w.gpus, tp=w.tp)
        elif was_trainer and not w.is_trainer:
            seconds = costs.role_switch_time("to_rollout", trainer_gpus=w.gpus, tp=w.tp)
        if any(src == w.wid for src, _ in cmd.transfers):
            seconds = max(seconds, costs.shard_transfer_time(w.gpus))
        self.switch_seconds.append(seconds)
        self.push(now + seconds, _DONE, w.wid, ("switch", cmd, seconds, handed))

    def done(self, w: SimWorker, payload: Any, now: float) -> None:
        """A blocking command of ``w`` ended: report it, then carry on with its inbox."""
        wid = w.wid
        report: Callable[[float], Any]
        if isinstance(payload, FlushTrajectories):
            saved: list[int] = []
            if payload.partials and w.is_rollout:     # the run stops early: what is in flight is saved
                saved = w.hand_off(now)
                w.holdings.clear()
            w.unblock(now)
            report = lambda t: ev.TrajectoriesFlushed(wid, t, payload.tag, {"rank": wid}, saved)  # noqa: E731
        elif isinstance(payload, WriteCheckpoint):
            w.unblock(now)
            report = lambda t: ev.CheckpointWritten(wid, t, payload.tag, f"sim://{payload.tag}")  # noqa: E731
        elif payload[0] == "train":
            _, cmd, stats, idle, fetch = payload
            w.trainer_idle_since = now
            w.unblock(now)
            report = lambda t: ev.StepDone(wid, t, cmd.step, stats, idle, fetch)  # noqa: E731
        elif payload[0] == "sync":
            _, cmd, seconds = payload
            resumed = 0
            stall = 0.0
            if w.is_rollout:
                w.version = cmd.version
                if cmd.src is not None:
                    resumed = len(w.live)
                    if w.admitted and self.cfg.rollout.sync_kv == "recompute":   # held requests re-prefill
                        flops = sum(self.costs.prefill_flops_of(r.context()) for r in w.admitted.values())
                        stall = self.costs.prefill_time(w.gpus, flops)
                        w.sync_reprefill_s += stall
            w.trainer_idle_since = now
            w.unblock(now, stall)
            report = lambda t: ev.WeightsLoaded(wid, t, cmd.version, seconds, resumed)  # noqa: E731
        else:
            _, cmd, seconds, handed = payload
            w.trainer_idle_since = now
            w.unblock(now)
            report = lambda t: ev.Switched(wid, t, handed, seconds)  # noqa: E731

        def arrive(t: float) -> None:
            self.deliver(self.handle(report(t)))
        self.send(arrive)
        if w.busy is None and w.inbox:
            self.pump(w)
