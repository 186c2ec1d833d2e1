"""Accumulators of one streaming pass over a run: shard rows, the event log and the step metrics.

Each accumulator holds sums indexed by a small integer key (a version, a length, a rank, a step)
or one small integer per sample id, never a list of samples, so memory grows with the number of
versions and sample ids, not with tokens. Everything is added up in one pass over each source and
read once at the end (:mod:`reflow_hpc.analyze.report`).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Role codes of the role timeline (metrics ``role/<rank>``); 0 = no record for the rank that step.
ROLES = ("", "trainer", "rollout", "trainer+rollout", "idle")

# The logs are data: the integers that index the sums below (sample ids, versions, ranks) are
# bounded, so that one line cannot make an array as large as the number it holds. A dispatch may
# name ids at most ID_SLACK beyond the ids dispatched so far (the coordinator numbers them densely).
ID_SLACK = 1 << 16
MAX_VERSION = 1 << 20
# Why a sample ended stale before any step trained on it (EventStats.evicted_unused_by_cause):
EVICTED_UNUSED_CAUSES = {
    "stale_on_arrival": "already staler than δ when it finished",
    "group_incomplete": "its group still waited for a member",
    "ready_after_last_batch": "its group completed after the last batch before the bump",
    "passed_over": "a batch was composed while it was ready and left it out",
    "unknown": "the log lacks its finish or its group",
}
MAX_RANKS = 4096             # ranks of the role timeline; further role/<rank> keys are ignored, counted


def _int(v: Any, lo: int, hi: int) -> int:
    """``v`` as an int in [lo, hi]; ValueError otherwise (a bool is no int here)."""
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{v!r} is not an integer in [{lo}, {hi}]")
    return v


def _time(e: dict) -> float:
    t = e["t"]
    if type(t) not in (int, float):
        raise TypeError(f"time {t!r} is not a number")
    return float(t)


class Tally:
    """Named sums over a non-negative integer key, grown as larger keys appear.

    ``add(keys, name=weights, ...)`` adds ``np.bincount(keys, weights)`` to each named column (a
    column named ``count`` with no weights counts the keys).
    """

    def __init__(self, *names: str):
        self.cols: dict[str, np.ndarray] = {n: np.zeros(0) for n in names}

    def add(self, keys: np.ndarray, **weights: np.ndarray) -> None:
        if len(keys) == 0:
            return
        keys = np.asarray(keys, np.int64)
        if keys.min() < 0:
            raise ValueError("Tally keys must be ≥ 0")
        n = int(keys.max()) + 1
        for name, col in self.cols.items():
            w = weights.get(name)
            add = np.bincount(keys, None if w is None else np.asarray(w, np.float64), minlength=n)
            if len(col) < len(add):
                col = self.cols[name] = np.concatenate([col, np.zeros(len(add) - len(col))])
            col[:len(add)] += add

    def __len__(self) -> int:
        return max((len(c) for c in self.cols.values()), default=0)

    def get(self, name: str) -> np.ndarray:
        """The column, padded to the common length."""
        col = self.cols[name]
        return np.concatenate([col, np.zeros(len(self) - len(col))]) if len(col) < len(self) else col


# ---------------------------------------------------------------------------------------- shards

class ShardStats:
    """Sums over the verified shard rows (``rows`` records: reward, versions, lengths, owner, reason).

    Response length = ``num_tokens - prompt_len`` (generated tokens plus tool observations, read from
    the row table without touching the token data). Per-version figures are keyed by the row's
    ``min_version`` (the version of its oldest generated token, the one staleness counts), stored at
    key ``min_version + 1`` so that a row with no generated token (-1) has a key.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.finish_reasons: Counter[str] = Counter()
        self.by_version = Tally("count", "reward", "reward2", "length", "length2")
        self.lengths = Tally("count")
        self.by_owner = Tally("samples", "tokens", "response")

    def add(self, rows: np.ndarray) -> None:
        self.samples += len(rows)
        reasons, counts = np.unique(rows["finish_reason"], return_counts=True)
        for r, c in zip(reasons, counts):
            self.finish_reasons[bytes(r).decode("utf-8", "replace") or "?"] += int(c)
        length = np.maximum(rows["num_tokens"].astype(np.int64) - rows["prompt_len"], 0)
        reward = rows["reward"].astype(np.float64)
        finite = np.isfinite(reward)
        reward = np.where(finite, reward, 0.0)
        v = rows["min_version"].astype(np.int64) + 1
        ok = v >= 0
        self.by_version.add(v[ok], count=finite[ok].astype(np.float64), reward=reward[ok],
                            reward2=reward[ok] ** 2, length=length[ok], length2=length[ok] ** 2.0)
        self.lengths.add(length)
        owner = rows["owner"].astype(np.int64)
        mine = owner >= 0
        self.by_owner.add(owner[mine], samples=np.ones(int(mine.sum())), tokens=rows["num_tokens"][mine],
                          response=length[mine])


# ----------------------------------------------------------------------------------------- events

@dataclass
class Step:
    """One step as the event log has it: where its batch was composed and where it ended."""
    compose_t: float
    compose_line: int
    version: int
    size: int
    replay: int
    stale_sum: int
    stale_max: int
    train_t: float | None = None
    train_line: int | None = None


@dataclass
class Block:
    """A stretch in which the run's trainer could not start a step although it was free: a checkpoint
    round (from the end of the step before it), a role switch, or a colocated weight load."""
    kind: str
    after_step: int          # the last step that ended before it (-1: none)
    start_t: float
    start_line: int
    end_t: float = float("nan")
    end_line: int = -1


@dataclass
class EventStats:
    """Sums over ``events.jsonl`` (schema: docs/storage.md, "The event log")."""
    events: int = 0
    by_kind: Counter = field(default_factory=Counter)
    created: int = 0
    finished: int = 0
    failed: int = 0
    by_reason: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    evicted_unused: int = 0                  # ended evicted_stale before any step trained on them
    # ... by why no batch took them (EVICTED_UNUSED_CAUSES)
    evicted_unused_by_cause: Counter = field(default_factory=Counter)
    unknown_ids: int = 0                     # ids in events that no dispatch created
    steps: list[Step] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    starts: list[tuple[int, float, Any]] = field(default_factory=list)   # (line, t, resume_from)
    staleness: dict[str, Tally] = field(default_factory=lambda: {"unused": Tally("count"), "replay": Tally("count")})
    tokens_by_worker: dict[int, dict[int, float]] = field(default_factory=dict)  # loss tokens finished, by version
    first_t: float | None = None

    def __post_init__(self) -> None:
        self._times_trained = np.zeros(1024, np.int32)
        self._finished = np.zeros(1024, np.bool_)
        self._group = np.full(1024, -1, np.int64)           # each sample's group
        self._finish_v = np.full(1024, -1, np.int32)        # the version at its finish event
        self._group_left: dict[int, int] = {}               # members of each group not yet finished
        self._group_ready: dict[int, int] = {}              # batches composed when its last member finished
        self._next_id = 0                    # one past the largest dispatched id
        self._open_switch: Block | None = None
        self._open_sync: Block | None = None
        self._handlers = {"dispatch": self._dispatch, "finish": self._finish, "failed": self._failed,
                          "compose": self._compose, "train": self._train, "end": self._end,
                          "checkpoint": self._checkpoint, "switch": self._switch, "switched": self._switched,
                          "sync": self._sync, "synced": self._synced, "start": self._start}

    # -------------------------------------------------------------------------------- feeding

    def feed(self, line: int, e: dict) -> None:
        kind = e.get("e")
        if type(kind) is not str:
            kind = "malformed"
        self.events += 1
        self.by_kind[kind] += 1
        if self.first_t is None:
            t = e.get("t")
            if type(t) in (int, float):
                self.first_t = float(t)
        handler = self._handlers.get(kind)
        if handler is not None:
            try:
                handler(line, e)
            except (KeyError, TypeError, ValueError, IndexError, OverflowError):
                self.by_kind["malformed"] += 1      # a well-formed line with missing or odd fields

    def _dispatched(self, sid: Any) -> bool:
        return type(sid) is int and 0 <= sid < self._next_id

    def _known(self, sid: int) -> bool:
        if self._dispatched(sid):
            return True
        self.unknown_ids += 1
        return False

    def _dispatch(self, line: int, e: dict) -> None:
        ids = e["ids"]
        if not isinstance(ids, list):
            raise TypeError("ids is not a list")
        top = 0
        if ids:             # only the extremes size anything: check those
            _int(min(ids), 0, self.created + len(ids) + ID_SLACK)
            top = _int(max(ids), 0, self.created + len(ids) + ID_SLACK) + 1
        group = e.get("group")
        self.created += len(ids)
        if top > self._next_id:
            self._next_id = top
            if top > len(self._times_trained):
                grow = max(top, 2 * len(self._times_trained)) - len(self._times_trained)
                self._times_trained = np.concatenate([self._times_trained, np.zeros(grow, np.int32)])
                self._finished = np.concatenate([self._finished, np.zeros(grow, np.bool_)])
                self._group = np.concatenate([self._group, np.full(grow, -1, np.int64)])
                self._finish_v = np.concatenate([self._finish_v, np.full(grow, -1, np.int32)])
        if type(group) is int and group >= 0 and ids:
            self._group[ids] = group
            self._group_left[group] = self._group_left.get(group, 0) + len(ids)

    def _finish(self, line: int, e: dict) -> None:
        sid, w, v, reason = e["id"], e["w"], e["v"], e.get("reason", "?")
        if type(w) is not int or type(v) is not int or v > MAX_VERSION or type(reason) is not str:
            raise TypeError("w, v or reason of the wrong type or out of range")
        self.finished += 1
        self.finish_reasons[reason if len(reason) <= 64 else reason[:64]] += 1
        if self._known(sid):
            self._finished[sid] = True
            self._finish_v[sid] = v
            self._leave_group(sid)
        if w >= 0 and v >= 0:
            by_version = self.tokens_by_worker.get(w)
            if by_version is None:
                if len(self.tokens_by_worker) >= MAX_RANKS:
                    raise ValueError(f"more than {MAX_RANKS} workers")
                by_version = self.tokens_by_worker[w] = {}
            by_version[v] = by_version.get(v, 0.0) + e["tokens"]

    def _failed(self, line: int, e: dict) -> None:
        self.failed += 1

    def _compose(self, line: int, e: dict) -> None:
        ids = np.asarray(e["ids"], np.int64)
        replay = np.asarray(e["replay"], np.int64)
        stale = np.asarray(e["stale"], np.int64)
        t, v = _time(e), _int(e["v"], -1, MAX_VERSION)
        if ids.ndim != 1 or replay.shape != ids.shape or stale.shape != ids.shape or (stale > MAX_VERSION).any():
            raise ValueError("ids, replay and stale differ in shape, or a staleness is out of range")
        known = (ids >= 0) & (ids < self._next_id)
        self.unknown_ids += int((~known).sum())
        np.add.at(self._times_trained, ids[known], 1)
        for name, mask in (("unused", replay == 0), ("replay", replay != 0)):
            self.staleness[name].add(np.maximum(stale[mask], 0))
        self.steps.append(Step(t, line, v, len(ids), int(replay.sum()), int(stale.sum()),
                               int(stale.max()) if len(stale) else 0))

    def _train(self, line: int, e: dict) -> None:
        k = int(e["step"])
        if 0 <= k < len(self.steps) and self.steps[k].train_line is None:
            self.steps[k].train_t, self.steps[k].train_line = _time(e), line

    def _end(self, line: int, e: dict) -> None:
        reason = e["reason"]
        if type(reason) is not str:
            raise TypeError("reason is not a string")
        self.by_reason[reason if len(reason) <= 64 else reason[:64]] += 1
        sid = e["id"]
        if self._dispatched(sid) and not self._finished[sid]:     # (uncounted: _known below counts unknown ids)
            self._leave_group(sid)          # ended while generating: its group completes without it
        if reason == "evicted_stale" and self._known(sid) and self._times_trained[sid] == 0:
            self.evicted_unused += 1
            self.evicted_unused_by_cause[self._unused_cause(sid, e["v"])] += 1

    def _leave_group(self, sid: int) -> None:
        """``sid`` finished or ended while generating; its group is complete when none is left."""
        group = int(self._group[sid])
        left = self._group_left.get(group)
        if left:
            self._group_left[group] = left - 1
            if left == 1:
                self._group_ready[group] = len(self.steps)

    def _unused_cause(self, sid: int, v: Any) -> str:
        """Why no batch took ``sid`` before it went stale at version ``v`` (EVICTED_UNUSED_CAUSES)."""
        group, finish_v = int(self._group[sid]), int(self._finish_v[sid])
        if finish_v < 0 or group < 0:
            return "unknown"                 # no finish or no dispatch group in the log (an old or cut log)
        if finish_v == v:
            return "stale_on_arrival"        # evictions at a bump carry the new version: this one came with its finish
        if self._group_left.get(group, 0) > 0:
            return "group_incomplete"
        ready = self._group_ready.get(group)
        return "ready_after_last_batch" if ready is None or ready >= len(self.steps) else "passed_over"

    def _last_train(self) -> tuple[int, float, int] | None:
        for k in range(len(self.steps) - 1, -1, -1):
            s = self.steps[k]
            if s.train_line is not None:
                return k, s.train_t, s.train_line
        return None

    def _checkpoint(self, line: int, e: dict) -> None:
        # The round began when the step before it ended (it needs no batch in training and holds
        # every later one back), so the trainer was blocked from that step's end to this line.
        last = self._last_train()
        if last is not None:
            k, t, ln = last
        elif self.starts:
            k, (ln, t, _) = -1, self.starts[-1]
        else:
            return
        self.blocks.append(Block("checkpoint", k, t, ln, _time(e), line))

    def _switch(self, line: int, e: dict) -> None:
        self._open_switch = self._open(line, e, "switch")

    def _switched(self, line: int, e: dict) -> None:
        self._close(self._open_switch, line, e)
        self._open_switch = None

    def _sync(self, line: int, e: dict) -> None:
        self._open_sync = self._open(line, e, "sync")

    def _synced(self, line: int, e: dict) -> None:
        self._close(self._open_sync, line, e)
        self._open_sync = None

    def _open(self, line: int, e: dict, kind: str) -> Block:
        last = self._last_train()
        return Block(kind, last[0] if last else -1, _time(e), line)

    def _close(self, block: Block | None, line: int, e: dict) -> None:
        if block is not None:
            block.end_t, block.end_line = _time(e), line
            self.blocks.append(block)

    def _start(self, line: int, e: dict) -> None:
        resume = e.get("resume_from")
        self.starts.append((line, _time(e), resume if isinstance(resume, str) or resume is None else str(resume)))

    # -------------------------------------------------------------------------------- results

    def times_trained(self) -> np.ndarray:
        """How many steps trained on each finished sample (0: never)."""
        n = self._next_id
        return self._times_trained[:n][self._finished[:n]]

    @property
    def resumed(self) -> bool:
        return len(self.starts) > 1          # a second start: a new process set resumed the run


# ---------------------------------------------------------------------------------------- metrics

class RankRoles:
    """One rank's role codes (ROLES), only at the steps that record it: memory grows with the records,
    not with ranks × steps (a rank that appears at the first and the last step costs two bytes)."""

    def __init__(self) -> None:
        self.steps = array("q")                                 # indices into MetricStats.step
        self.codes = bytearray()

    def add(self, step: int, code: int) -> None:
        self.steps.append(step)
        self.codes.append(code)

    def dense(self, n: int) -> np.ndarray:
        """Its code at each of the first ``n`` steps (0: no record)."""
        out = np.zeros(n, np.uint8)
        idx = np.frombuffer(self.steps, np.int64)
        keep = idx < n
        out[idx[keep]] = np.frombuffer(self.codes, np.uint8)[keep]
        return out


@dataclass
class MetricStats:
    """The step records of ``metrics.jsonl`` that the report plots: time, idle ratios, roles."""
    step: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    idle_trainer: list[float] = field(default_factory=list)
    idle_rollout: list[float] = field(default_factory=list)
    coverage: list[tuple[float, float]] = field(default_factory=list)   # the planner's (predicted, observed)
    step_predicted: list[float] = field(default_factory=list)            # its predicted step time
    roles: dict[int, RankRoles] = field(default_factory=dict)   # rank -> its role code at the steps it has one
    evals: int = 0
    ignored_ranks: int = 0                                      # role/<rank> keys beyond MAX_RANKS or out of range

    def feed(self, line: int, r: dict) -> None:
        if r.get("kind", "step") != "step":
            self.evals += r.get("kind") == "eval"
            return
        n = len(self.step)
        step = r.get("step", n + 1)
        self.step.append(step if type(step) is int else n + 1)
        self.time.append(_num(r.get("time")))
        self.step_seconds.append(_num(r.get("step_seconds")))
        self.idle_trainer.append(_num(r.get("idle_ratio/trainer")))
        self.idle_rollout.append(_num(r.get("idle_ratio/rollout")))
        self.coverage.append((_num(r.get("placement/coverage_predicted")), _num(r.get("placement/coverage_observed"))))
        self.step_predicted.append(_num(r.get("placement/step_predicted_s")))
        for key, value in r.items():
            if key.startswith("role/"):
                try:
                    rank = int(key[5:])
                except ValueError:
                    continue
                roles = self.roles.get(rank)
                if roles is None:
                    if len(self.roles) >= MAX_RANKS or not 0 <= rank < 1 << 20:
                        self.ignored_ranks += 1
                        continue
                    roles = self.roles[rank] = RankRoles()
                roles.add(n, ROLES.index(value) if value in ROLES else 0)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")
