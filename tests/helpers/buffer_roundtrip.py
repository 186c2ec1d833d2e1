"""MPI program for tests/integration/test_buffer_mpi.py: the replay buffer end to end over real ranks.

    mpiexec -n 4 python tests/helpers/buffer_roundtrip.py DIR [--steps N] [--seed S] [--timeout T]

Rank 0 is the coordinator and the trainer. It holds the replay index (σ = 0.5, τ = 0.5, δ = 1),
dispatches groups to the producers within the b_max budget, composes a batch as soon as the σ rule
allows, fetches the batch's payloads from their owners over MPI (while the owners keep producing),
checks every array bit for bit against the regenerated samples, "trains" by sleeping briefly, ends
the step and publishes the next version. Ranks 1.. are producers of different speeds (a sleep per
generated token): they generate their dispatched samples chunk by chunk, tag each chunk with the
version they last heard of (a version change between chunks is a partial rollout: one sample, two
versions; a long sample on a slow producer arrives staler than δ and is evicted), put finished
samples in their SampleStore (a memory cache of a few samples in front of small HDF5 segments in
DIR/rankNN) and report the metadata to rank 0. A service thread on each producer answers fetches.

A sample's tokens, log-probs, lengths and reward are a pure function of (seed, sample id); its
versions follow from those and the per-chunk versions the producer reports over the control
channel, so the trainer regenerates every array and compares what came over the data plane.

The rules are checked per event (`IndexDriver.on_finished`, `releases`), per batch
(`IndexDriver.train`), on the shards after shutdown (`check_shards`) and over the run
(`IndexDriver.finish`); a broken one prints a `FAIL` line with the numbers. Rank 0's last line is `SUMMARY {json}`; the exit code is 0 only when nothing failed.
An error that stops a rank (a timeout names the rank and the operation) aborts the whole job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections import Counter, deque
from pathlib import Path

import numpy as np

from reflow_hpc.comm import mpi as rmpi

MPI = rmpi.init()

from reflow_hpc.config import ReflowConfig, StorageConfig  # noqa: E402
from reflow_hpc.core.index import build_index  # noqa: E402
from reflow_hpc.core.sample import EVICTED_STALE, READY, TERMINAL_REASONS  # noqa: E402
from reflow_hpc.comm.channel import ControlChannel  # noqa: E402
from reflow_hpc.runtime.service import ServiceThread  # noqa: E402
from reflow_hpc.storage.fetch import FetchClient, FetchServer  # noqa: E402
from reflow_hpc.storage.reader import ShardReader  # noqa: E402
from reflow_hpc.storage.store import SampleStore  # noqa: E402
from reflow_hpc.trajectory import NOT_GENERATED, Trajectory  # noqa: E402
from storage_samples import difference  # noqa: E402

# Control channel (its own Dup of COMM_WORLD, apart from the data plane of the fetches).
TAG_COMMAND = 21        # rank 0 → producer: dispatch, version, release, stop
TAG_REPORT = 22         # producer → rank 0: finished, bye

GROUP_SIZE = 4
BATCH_SIZE = 8
SIGMA, TAU, DELTA = 0.5, 0.5, 1
B_MAX = 12              # three groups in flight: every producer has work
CHUNK = 16              # tokens generated between two looks at the control channel
ADV_EPS = 1e-6
VOCAB = 151_936


# ---------------------------------------------------------------------------------- the samples

def _lengths(rng: np.random.Generator, sample_id: int) -> tuple[int, int]:
    prompt_len = int(rng.integers(1, 24))
    if sample_id % 8 == 5:
        return prompt_len, 0                              # empty response: no loss tokens
    if sample_id % 8 == 2:
        return prompt_len, int(rng.integers(200, 320))    # long: spans versions on a slow producer
    return prompt_len, int(rng.integers(1, 120))


def response_length(seed: int, sample_id: int) -> int:
    return _lengths(np.random.default_rng([seed, sample_id]), sample_id)[1]


def num_chunks(response_len: int) -> int:
    return -(-response_len // CHUNK)


def make_sample(seed: int, sample_id: int, group_id: int, prompt_id: int, chunk_versions: list[int],
                owner: int) -> Trajectory:
    """The sample as its producer generated it: all but the versions follow from (seed, sample id)."""
    rng = np.random.default_rng([seed, sample_id])
    prompt_len, response_len = _lengths(rng, sample_id)
    if len(chunk_versions) != num_chunks(response_len):
        raise ValueError(f"sample {sample_id}: {len(chunk_versions)} chunk versions for a response of "
                         f"{response_len} tokens ({num_chunks(response_len)} chunks)")
    n = prompt_len + response_len
    tokens = rng.integers(0, VOCAB, n, dtype=np.int32)
    logprobs = np.zeros(n, np.float32)
    versions = np.full(n, NOT_GENERATED, np.int32)
    if response_len:
        logprobs[prompt_len:] = -rng.exponential(1.0, response_len).astype(np.float32)
        logprobs[prompt_len] = -0.0                 # bit patterns must survive, not only values
        for c, v in enumerate(chunk_versions):
            versions[prompt_len + c * CHUNK:prompt_len + (c + 1) * CHUNK] = v
    reward = float(rng.random())                    # varied: advantages differ inside a group
    return Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=prompt_id, tokens=tokens,
                      logprobs=logprobs, versions=versions, prompt_len=prompt_len, reward=reward,
                      finish_reason="length" if response_len >= 200 else "stop", owner=owner,
                      meta={"producer": owner, "chunks": len(chunk_versions)})


class CountingStore(SampleStore):
    """The real store, counting where each `get` found a sample: memory (the cached object itself,
    still cached or pending in the writer) or the HDF5 shard (a new object read from a segment)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._put: dict[int, Trajectory] = {}
        self.from_memory = 0
        self.from_shard = 0

    def put(self, trajs, now=None) -> None:
        trajs = list(trajs)
        super().put(trajs, now)
        with self._lock:
            self._put.update((t.sample_id, t) for t in trajs)

    def get(self, ids):
        ids = list(ids)
        got = super().get(ids)
        with self._lock:
            for sid, t in zip(ids, got):
                if t is self._put.get(sid):
                    self.from_memory += 1
                else:
                    self.from_shard += 1
        return got


# ---------------------------------------------------------------------------------- messages

class Channel:
    """Pickled control messages on their own communicator; sends are completed under a deadline."""

    def __init__(self, comm, timeout: float):
        self.comm, self.rank, self.timeout = comm, comm.Get_rank(), timeout
        self._sends: list = []

    def send(self, dest: int, tag: int, msg: dict) -> None:
        self._sends.append(self.comm.isend(msg, dest=dest, tag=tag))
        if len(self._sends) > 64:
            self._sends = [r for r in self._sends if not r.Test()]

    def recv(self, source: int, tag: int) -> tuple[int, dict] | None:
        """One message if one is there (matched probe: safe with other threads using MPI)."""
        status = MPI.Status()
        msg = self.comm.improbe(source=source, tag=tag, status=status)
        return None if msg is None else (status.Get_source(), msg.recv())

    def flush(self, op: str) -> None:
        rmpi.wait_until(lambda: all(r.Test() for r in self._sends), timeout=self.timeout, rank=self.rank, op=op)
        self._sends.clear()


# ---------------------------------------------------------------------------------- producer

def producer(args, data, ctrl: Channel, service_comm) -> int:
    rank = ctrl.rank
    token_s = args.token_us[(rank - 1) % len(args.token_us)] * 1e-6
    cfg = StorageConfig(flush_rows=4, flush_s=0.02, segment_mib=args.segment_mib, memory_mib=args.memory_mib,
                        chunk_tokens=1024, chunk_rows=64)
    directory = Path(args.dir) / f"rank{rank:02d}"
    store = CountingStore(directory, rank, cfg)
    server = FetchServer(data, store, send_timeout_s=args.timeout, poll_min_s=1e-4, poll_max_s=2e-3)
    service = ServiceThread(ControlChannel(service_comm, poll_min_s=1e-4, poll_max_s=2e-3),
                            pollers=[server.poll, store.maybe_flush])
    service.start()

    queue: deque[tuple[int, int, int]] = deque()      # (sample id, group id, prompt id)
    heard = {"version": 0, "stop": False, "last": time.monotonic()}
    counts = Counter()

    def listen() -> None:
        while (got := ctrl.recv(0, TAG_COMMAND)) is not None:
            _, msg = got
            heard["last"] = time.monotonic()
            kind = msg["kind"]
            if kind == "dispatch":
                queue.extend((sid, msg["group_id"], msg["prompt_id"]) for sid in msg["sample_ids"])
            elif kind == "version":
                heard["version"] = max(heard["version"], msg["version"])
            elif kind == "release":
                store.release(msg["sample_ids"])
                counts["released"] += len(msg["sample_ids"])
            elif kind == "stop":
                heard["stop"] = True
            else:
                raise ValueError(f"rank {rank}: unknown control message {kind!r}")

    backoff = rmpi.Backoff(1e-4, 2e-3)
    while True:
        listen()
        if heard["stop"]:
            break
        if not queue:
            if time.monotonic() - heard["last"] > args.timeout:
                raise rmpi.RankTimeout(rank, "waiting for dispatched samples", args.timeout, peer=0)
            backoff.idle()
            continue
        backoff.progress()
        sid, gid, prompt_id = queue.popleft()
        chunk_versions: list[int] = []
        start_version = heard["version"]
        time.sleep(2e-4)                                # prefill of the prompt
        for _ in range(num_chunks(response_length(args.seed, sid))):
            listen()                                    # a version change here: a partial rollout
            if heard["stop"]:
                break
            chunk_versions.append(heard["version"])
            time.sleep(CHUNK * token_s)
        if heard["stop"]:
            counts["abandoned"] += 1                    # in flight at shutdown: rank 0 aborts it
            break
        traj = make_sample(args.seed, sid, gid, prompt_id, chunk_versions, rank)
        store.put([traj])
        store.maybe_flush()
        counts["produced"] += 1
        counts["multi_version"] += len(set(chunk_versions)) > 1
        versions = chunk_versions or [start_version]    # an empty response was generated under one version
        ctrl.send(0, TAG_REPORT, {"kind": "finished", "sample_id": sid, "reward": traj.reward,
                                  "min_version": min(versions), "max_version": max(versions),
                                  "loss_tokens": traj.num_loss_tokens, "chunk_versions": chunk_versions,
                                  "location": store.location(sid)})

    counts["abandoned"] += len(queue)
    # Rank 0 fetched its last batch before it sent stop: nothing more to serve.
    service.stop()
    service.join(timeout=args.timeout)
    if service.is_alive():
        raise rmpi.RankTimeout(rank, "stopping the service thread", args.timeout)
    left = server.close(timeout_s=args.timeout)
    if left:
        raise RuntimeError(f"rank {rank}: {left} fetch replies never completed")
    store.close()                                       # flush, seal the open segment, write the manifest
    ctrl.send(0, TAG_REPORT, {"kind": "bye", "rank": rank, "counts": dict(counts),
                              "from_memory": store.from_memory, "from_shard": store.from_shard,
                              "served_samples": server.served_samples, "fetch_errors": server.errors,
                              "segments": sorted(p.name for p in directory.glob("seg-*"))})
    ctrl.flush(f"rank {rank}: sending the final report")
    return 0


# ---------------------------------------------------------------------------------- the index driver

class IndexDriver:
    """Rank 0: the index, dispatch, batches, fetch and the checks."""

    def __init__(self, args, data, ctrl: Channel):
        self.args, self.ctrl = args, ctrl
        self.producers = list(range(1, ctrl.comm.Get_size()))
        self.index = build_index(ReflowConfig(sigma=SIGMA, tau=TAU, delta=DELTA, b_max=B_MAX),
                                 group_size=GROUP_SIZE, batch_size=BATCH_SIZE, seed=args.seed, adv_eps=ADV_EPS)
        self.client = FetchClient(data, args.timeout, poll_min_s=1e-4, poll_max_s=2e-3)
        self.t0 = time.monotonic()
        self.failures: list[str] = []
        self.groups: dict[int, tuple[int, ...]] = {}     # group id -> sample ids
        self.meta: dict[int, dict] = {}                  # sample id -> {group, prompt, worker}
        self.reports: dict[int, dict] = {}               # sample id -> its finished report
        self.expected_adv: dict[int, float] = {}         # sample id -> advantage at group completion
        self.ended: dict[int, tuple[str, str]] = {}      # sample id -> (reason, where)
        self.trained: Counter = Counter()                # sample id -> steps that trained on it
        self.outstanding = dict.fromkeys(self.producers, 0)
        self.last_dispatch = dict.fromkeys(self.producers, -1)
        self.dispatches = 0
        self.byes: dict[int, dict] = {}
        self.stats = Counter()
        self.staleness = Counter()
        self.replay_fractions: list[float] = []
        self.groups_distinct_adv = 0
        self.busy_s = 0.0                                # time in steps (fetch, checks, train)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, what: str) -> None:
        self.failures.append(what)
        if len(self.failures) <= 30:
            print(f"FAIL {what}", flush=True)

    # ------------------------------------------------------------------------------ events

    def releases(self, out, where: str) -> None:
        """Record each ended sample (exactly once) and tell owners to drop payloads."""
        drop: dict[int, list[int]] = {}
        for rel in out:
            sid = rel.sample_id
            if sid in self.ended:
                self.fail(f"sample {sid} ended twice: {self.ended[sid]} then ({rel.reason}, {where})")
            self.ended[sid] = (rel.reason, where)
            self.stats[f"{rel.reason}/{where}"] += 1
            if rel.has_payload:
                owner = self.reports[sid]["owner"] if sid in self.reports else None
                if rel.rank != owner:
                    self.fail(f"release of sample {sid} names rank {rel.rank}, its owner is rank {owner}")
                drop.setdefault(rel.rank, []).append(sid)
            elif rel.rank != self.meta[sid]["worker"]:
                self.fail(f"release of sample {sid} names rank {rel.rank}, it was dispatched to "
                          f"rank {self.meta[sid]['worker']}")
            if rel.reason == EVICTED_STALE and sid in self.reports:
                stale = self.index.version - self.reports[sid]["min_version"]
                if stale <= DELTA:
                    self.fail(f"sample {sid} evicted as stale at version {self.index.version} with "
                              f"staleness {stale} ≤ δ = {DELTA} ({where})")
        if where != "shutdown":       # after stop the producers no longer listen
            for rank, ids in drop.items():
                self.ctrl.send(rank, TAG_COMMAND, {"kind": "release", "sample_ids": ids})

    def on_finished(self, rank: int, msg: dict) -> None:
        sid = msg["sample_id"]
        msg["owner"] = rank
        if self.meta.get(sid, {}).get("worker") != rank:
            self.fail(f"rank {rank} reported sample {sid}, which was not dispatched to it")
        self.reports[sid] = msg
        self.outstanding[rank] -= 1
        stale = self.index.version - msg["min_version"]
        out = self.index.finished(sid, owner=rank, reward=msg["reward"], min_version=msg["min_version"],
                                  max_version=msg["max_version"], loss_tokens=msg["loss_tokens"],
                                  now=self.now(), location=msg["location"])
        if bool(out) != (stale > DELTA):
            self.fail(f"sample {sid} finished with staleness {stale} (δ = {DELTA}) at version "
                      f"{self.index.version}: index returned {len(out)} releases")
        self.releases(out, "arrival")
        gid = self.meta[sid]["group"]
        members = self.groups[gid]
        if all(m in self.reports or m in self.ended for m in members):
            self.group_complete(gid, members)

    def group_complete(self, gid: int, members: tuple[int, ...]) -> None:
        """GRPO advantages over the members that became ready, recomputed from regenerated rewards."""
        states = {m: self.index.sample(m).state for m in members if m in self.index}
        ready = [m for m, state in states.items() if state == READY]
        if len(ready) != len(states):
            self.fail(f"group {gid} is complete but its live members are not all ready: {states}")
        rewards = [make_sample(self.args.seed, m, gid, self.meta[m]["prompt"],
                               self.reports[m]["chunk_versions"], self.reports[m]["owner"]).reward for m in ready]
        if rewards:
            mean = math.fsum(rewards) / len(rewards)
            std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
            for m, r in zip(ready, rewards):
                self.expected_adv[m] = (r - mean) / (std + ADV_EPS)
            if len({round(self.expected_adv[m], 12) for m in ready}) > 1:
                self.groups_distinct_adv += 1

    def listen(self) -> bool:
        any_msg = False
        while (got := self.ctrl.recv(MPI.ANY_SOURCE, TAG_REPORT)) is not None:
            rank, msg = got
            any_msg = True
            if msg["kind"] == "finished":
                self.on_finished(rank, msg)
            elif msg["kind"] == "bye":
                self.byes[rank] = msg
            else:
                raise ValueError(f"rank 0: unknown report {msg['kind']!r} from rank {rank}")
        return any_msg

    def dispatch(self) -> bool:
        """Whole groups while the b_max budget allows, each to the producer with the least work."""
        sent = False
        while self.index.can_dispatch_group():
            rank = min(self.producers, key=lambda r: (self.outstanding[r], self.last_dispatch[r]))
            group = self.index.new_group(self.dispatches, now=self.now(), worker=rank)
            self.groups[group.group_id] = group.sample_ids
            for sid in group.sample_ids:
                self.meta[sid] = {"group": group.group_id, "prompt": group.prompt_id, "worker": rank}
            self.ctrl.send(rank, TAG_COMMAND, {"kind": "dispatch", "group_id": group.group_id,
                                               "prompt_id": group.prompt_id, "sample_ids": list(group.sample_ids)})
            self.outstanding[rank] += GROUP_SIZE
            self.last_dispatch[rank] = self.dispatches
            self.dispatches += 1
            sent = True
        if self.index.outstanding > B_MAX:
            self.fail(f"{self.index.outstanding} samples outstanding > b_max = {B_MAX}")
        return sent

    # ------------------------------------------------------------------------------ steps

    def run(self) -> None:
        backoff = rmpi.Backoff(1e-4, 2e-3)
        last_progress = time.monotonic()
        while self.index.step < self.args.steps:
            progressed = self.listen() | self.dispatch()
            batch = self.index.compose_batch(now=self.now())
            if batch is None:
                if progressed:
                    last_progress = time.monotonic()
                    backoff.progress()
                elif time.monotonic() - last_progress > self.args.timeout:
                    raise rmpi.RankTimeout(0, f"waiting for samples to compose step {self.index.step} "
                                              f"(buffer {self.index.gauges()})", self.args.timeout,
                                           peer="1..3 (producers)")
                else:
                    backoff.idle()
                continue
            self.dispatch()                 # the step opened a new dispatch window
            t = time.monotonic()
            self.train(batch)
            self.busy_s += time.monotonic() - t
            self.releases(self.index.step_done(batch), "after step")
            self.releases(self.index.bump_version(), "version bump")
            for rank in self.producers:
                self.ctrl.send(rank, TAG_COMMAND, {"kind": "version", "version": self.index.version})
            try:
                self.index.check_invariants()
            except AssertionError as e:
                self.fail(f"index invariant after step {batch.step}: {e}")
            last_progress = time.monotonic()

    def train(self, batch) -> None:
        step, b = batch.step, len(batch)
        ids = batch.sample_ids
        if b != BATCH_SIZE:
            self.fail(f"step {step}: batch of {b} samples, expected b = {BATCH_SIZE}")
        if len(set(ids)) != b:
            dup = sorted(s for s, c in Counter(ids).items() if c > 1)
            self.fail(f"step {step}: duplicate samples in the batch: {dup}")
        # σ: replay fraction, and which samples are replay, judged by this rank's own count.
        replay = sum(batch.is_replay)
        self.replay_fractions.append(replay / b)
        if replay > math.floor(SIGMA * b) or batch.replay_fraction > SIGMA:
            self.fail(f"step {step}: replay fraction {replay}/{b} = {replay / b:.3f} > σ = {SIGMA}")
        if abs(batch.replay_fraction - replay / b) > 1e-12:
            self.fail(f"step {step}: batch says λ = {batch.replay_fraction}, it holds {replay} replay of {b}")
        lam = replay / b
        alpha = TAU * lam / (1 - lam + TAU * lam)
        if abs(batch.alpha - alpha) > 1e-12 or batch.alpha > TAU * SIGMA / (1 - SIGMA + TAU * SIGMA) + 1e-12:
            self.fail(f"step {step}: α = {batch.alpha}, expected {alpha} ≤ 1/3")
        for i, sid in enumerate(ids):
            if batch.is_replay[i] != (self.trained[sid] > 0) or batch.times_used[i] != self.trained[sid]:
                self.fail(f"step {step}: sample {sid} is_replay={batch.is_replay[i]} times_used="
                          f"{batch.times_used[i]}, but it was trained {self.trained[sid]} times before")
            if sid in self.ended:
                self.fail(f"step {step}: sample {sid} is in a batch after it ended as {self.ended[sid]}")
        # δ: staleness of every trained sample, from this rank's own reports.
        for i, sid in enumerate(ids):
            stale = batch.version - self.reports[sid]["min_version"]
            self.staleness[stale] += 1
            if stale > DELTA or stale != batch.staleness[i] or stale < 0:
                self.fail(f"step {step}: sample {sid} staleness {stale} (batch says {batch.staleness[i]}) "
                          f"at version {batch.version}, δ = {DELTA}")
        # τ: the token-weighted mean loss weight is 1, replay weighs τ times an unused sample.
        n = batch.loss_tokens
        if list(n) != [self.reports[s]["loss_tokens"] for s in ids]:
            self.fail(f"step {step}: loss tokens {list(n)} differ from the reported ones")
        if sum(n) > 0:
            mean_w = math.fsum(w * k for w, k in zip(batch.loss_weights, n)) / sum(n)
            if abs(mean_w - 1.0) > 1e-9:
                self.fail(f"step {step}: Σ w̃_i n_i / Σ n_i = {mean_w!r}, expected 1 "
                          f"(weights {batch.loss_weights}, tokens {n})")
        w_unused = {w for w, r in zip(batch.loss_weights, batch.is_replay) if not r}
        w_replay = {w for w, r in zip(batch.loss_weights, batch.is_replay) if r}
        if len(w_unused) > 1 or len(w_replay) > 1 or (
                w_unused and w_replay and abs(next(iter(w_replay)) / next(iter(w_unused)) - TAU) > 1e-12):
            self.fail(f"step {step}: loss weights unused {sorted(w_unused)}, replay {sorted(w_replay)}: "
                      f"the ratio must be τ = {TAU}")
        # Rewards and GRPO advantages, against the regenerated rewards.
        for i, sid in enumerate(ids):
            want = self.expected_adv.get(sid)
            if want is None or abs(batch.advantages[i] - want) > 1e-9:
                self.fail(f"step {step}: sample {sid} advantage {batch.advantages[i]!r}, expected {want!r}")
            if batch.rewards[i] != self.reports[sid]["reward"]:
                self.fail(f"step {step}: sample {sid} reward {batch.rewards[i]!r}, reported "
                          f"{self.reports[sid]['reward']!r}")
        # The payloads, from their owners over MPI, bit for bit.
        wanted: dict[int, list[int]] = {}
        for sid, owner in zip(ids, batch.owners):
            if owner != self.reports[sid]["owner"]:
                self.fail(f"step {step}: sample {sid} owner {owner} in the batch, reported by rank "
                          f"{self.reports[sid]['owner']}")
            wanted.setdefault(owner, []).append(sid)
        got = self.client.fetch(wanted)
        for i, sid in enumerate(ids):
            rep, meta = self.reports[sid], self.meta[sid]
            held = self.index.sample(sid).location           # the sample is live (training) during its step
            if held != rep["location"]:
                self.fail(f"step {step}: sample {sid} location {held} in the index != reported {rep['location']}")
            if sid not in got:
                self.fail(f"step {step}: sample {sid} missing from the fetch from rank {rep['owner']}")
                continue
            t = got[sid]
            want = make_sample(self.args.seed, sid, meta["group"], meta["prompt"], rep["chunk_versions"],
                               rep["owner"])
            diff = difference(want, t)
            if diff:
                self.fail(f"step {step}: sample {sid} fetched from rank {rep['owner']}: {diff}")
                continue
            if t.num_loss_tokens != n[i]:
                self.fail(f"step {step}: sample {sid} holds {t.num_loss_tokens} loss tokens, index says {n[i]}")
            if n[i] and t.version_span() != (rep["min_version"], rep["max_version"]):
                self.fail(f"step {step}: sample {sid} token versions {t.version_span()}, "
                          f"reported {rep['min_version']}..{rep['max_version']}")
            self.stats["verified"] += 1
            self.stats["verified_tokens"] += len(t.tokens)
            self.stats["trained_multi_version"] += len(set(t.version_span())) > 1
            self.stats["trained_empty_response"] += t.response_len == 0
        self.stats["replay_samples_trained"] += replay
        time.sleep(self.args.train_s)       # the "optimizer step"
        for sid in ids:
            self.trained[sid] += 1

    # ------------------------------------------------------------------------------ the end

    def shutdown(self) -> None:
        for rank in self.producers:
            self.ctrl.send(rank, TAG_COMMAND, {"kind": "stop"})
        rmpi.wait_until(lambda: (self.listen() or True) and len(self.byes) == len(self.producers),
                      timeout=self.args.timeout, rank=0, op="waiting for the producers' final reports",
                      peer=", ".join(str(r) for r in self.producers if r not in self.byes) or None,
                      backoff=rmpi.Backoff(1e-4, 2e-3))
        self.ctrl.flush("rank 0: completing control sends")
        self.releases(self.index.shutdown(), "shutdown")

    def check_shards(self) -> None:
        """Offline, after the producers closed their stores: each shard directory holds exactly the
        samples its producer reported, all closed, none lost, every row bit for bit."""
        for rank in self.producers:
            directory = Path(self.args.dir) / f"rank{rank:02d}"
            left_open = sorted(p.name for p in directory.glob("*.open"))
            if left_open:
                self.fail(f"rank {rank}: segments left open after close: {left_open}")
            with ShardReader(directory) as reader:
                report = reader.report
                if report.lost or report.unreadable or report.manifest is None:
                    self.fail(f"rank {rank}: shard scan: {report.summary()}; manifest "
                              f"{'missing' if report.manifest is None else 'present'} {report.manifest_error or ''}")
                ids = reader.ids()
                mine = sorted(s for s, rep in self.reports.items() if rep["owner"] == rank)
                if sorted(ids) != mine:
                    extra, missing = sorted(set(ids) - set(mine)), sorted(set(mine) - set(ids))
                    self.fail(f"rank {rank}: shards hold {len(ids)} samples, it reported {len(mine)}; "
                              f"unreported {extra[:10]}, missing {missing[:10]}")
                for k in range(0, len(ids), 64):
                    part = [s for s in ids[k:k + 64] if s in self.reports]
                    for sid, t in zip(part, reader.get(part)):
                        rep, meta = self.reports[sid], self.meta[sid]
                        want = make_sample(self.args.seed, sid, meta["group"], meta["prompt"], rep["chunk_versions"],
                                           rank)
                        diff = difference(want, t)
                        if diff:
                            self.fail(f"rank {rank}: shard row of sample {sid}: {diff}")
                        else:
                            self.stats["shard_rows_verified"] += 1

    def finish(self) -> dict:
        """The run-wide rules; returns the summary."""
        idx = self.index
        try:
            idx.check_accounting()
            idx.check_invariants()
        except AssertionError as e:
            self.fail(f"index at shutdown: {e}")
        created = set(self.meta)
        terminal = idx.terminal_counts()
        own = Counter(reason for reason, _ in self.ended.values())
        if len(idx) != 0:
            self.fail(f"{len(idx)} samples still live after shutdown")
        if idx.created != len(created) or set(self.ended) != created:
            self.fail(f"accounting: index created {idx.created}, dispatched {len(created)}, ended "
                      f"{len(self.ended)}; never ended: {sorted(created - set(self.ended))[:10]}, "
                      f"ended but never created: {sorted(set(self.ended) - created)[:10]}")
        if {r: own.get(r, 0) for r in TERMINAL_REASONS} != terminal:
            self.fail(f"terminal counts: index {terminal}, counted from releases {dict(own)}")
        if idx.step != self.args.steps:
            self.fail(f"{idx.step} steps composed, expected {self.args.steps}")
        replay_batches = sum(f > 0 for f in self.replay_fractions)
        if replay_batches == 0:
            self.fail(f"no batch held replay samples in {len(self.replay_fractions)} steps "
                      f"(replay fractions {self.replay_fractions})")
        if self.replay_fractions and max(self.replay_fractions) > SIGMA:
            self.fail(f"max replay fraction {max(self.replay_fractions)} > σ = {SIGMA}")
        stale_arrival = self.stats[f"{EVICTED_STALE}/arrival"]
        if terminal[EVICTED_STALE] == 0 or stale_arrival == 0:
            self.fail(f"evicted as stale: {terminal[EVICTED_STALE]} in all, {stale_arrival} on arrival; "
                      f"expected some of both (long samples on the slow producer)")
        if self.stats["verified"] != self.args.steps * BATCH_SIZE:
            self.fail(f"verified {self.stats['verified']} samples, trained {self.args.steps * BATCH_SIZE}")
        byes = [self.byes[r] for r in self.producers]
        from_memory = sum(b["from_memory"] for b in byes)
        from_shard = sum(b["from_shard"] for b in byes)
        served = sum(b["served_samples"] for b in byes)
        if from_memory == 0 or from_shard == 0:
            self.fail(f"fetched samples came {from_memory} times from memory and {from_shard} times from the "
                      f"HDF5 shard; expected both")
        if served != self.args.steps * BATCH_SIZE or from_memory + from_shard != served:
            self.fail(f"owners served {served} samples ({from_memory} memory + {from_shard} shard), "
                      f"the trainer fetched {self.args.steps * BATCH_SIZE}")
        errors = sum(b["fetch_errors"] for b in byes)
        if errors:
            self.fail(f"owners answered {errors} fetch requests with an error")
        produced = {r: self.byes[r]["counts"].get("produced", 0) for r in self.producers}
        if sum(produced.values()) != len(self.reports):
            self.fail(f"producers made {produced} samples, rank 0 received {len(self.reports)} reports")
        multi_made = sum(b["counts"].get("multi_version", 0) for b in byes)
        if self.stats["trained_multi_version"] == 0:
            self.fail(f"no trained sample spanned two versions (partial rollout); producers made {multi_made}")
        if self.stats["trained_empty_response"] == 0:
            self.fail("no sample with an empty response was trained")
        if self.stats["shard_rows_verified"] != len(self.reports):
            self.fail(f"{self.stats['shard_rows_verified']} shard rows verified offline, {len(self.reports)} "
                      f"samples produced")
        if self.groups_distinct_adv == 0:
            self.fail("no group had differing advantages")
        return {
            "ok": not self.failures, "failures": len(self.failures), "steps": idx.step, "version": idx.version,
            "batch_size": BATCH_SIZE, "sigma": SIGMA, "tau": TAU, "delta": DELTA, "b_max": B_MAX,
            "created": idx.created, "ended": len(self.ended), "terminal": terminal,
            "ended_where": {k: v for k, v in sorted(self.stats.items()) if "/" in k},
            "evicted_stale_on_arrival": stale_arrival,
            "replay_batches": replay_batches, "max_replay_fraction": max(self.replay_fractions, default=0.0),
            "replay_samples_trained": self.stats["replay_samples_trained"],
            "max_staleness": max(self.staleness, default=0), "staleness": dict(sorted(self.staleness.items())),
            "verified": self.stats["verified"], "verified_tokens": self.stats["verified_tokens"],
            "trained_multi_version": self.stats["trained_multi_version"],
            "trained_empty_response": self.stats["trained_empty_response"],
            "groups_with_distinct_advantages": self.groups_distinct_adv,
            "fetched_from_memory": from_memory, "fetched_from_shard": from_shard,
            "produced": produced, "multi_version_made": multi_made,
            "segments": {r: len(self.byes[r]["segments"]) for r in self.producers},
            "shard_rows_verified": self.stats["shard_rows_verified"],
            "released_on_owners": sum(b["counts"].get("released", 0) for b in byes),
            "trainer_busy_s": round(self.busy_s, 2), "wall_s": round(self.now(), 2),
        }


# ---------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="scratch directory; each producer keeps its shard in DIR/rankNN")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--timeout", type=float, default=30.0, help="bound of every wait on another rank")
    ap.add_argument("--train-s", type=float, default=0.002, help="seconds one optimizer step sleeps")
    ap.add_argument("--token-us", type=lambda s: [float(x) for x in s.split(",")], default=[100.0, 300.0, 1000.0],
                    help="microseconds per generated token of producers 1, 2, 3")
    ap.add_argument("--memory-mib", type=float, default=0.004, help="storage.memory_mib of each producer")
    ap.add_argument("--segment-mib", type=float, default=0.03, help="storage.segment_mib of each producer")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    print(f"PID {rank} {os.getpid()}", flush=True)
    if world.Get_size() < 2:
        print("FAIL run with at least 2 ranks (mpiexec -n 4)", flush=True)
        return 2
    data = world.Dup()                      # fetches (FetchServer / FetchClient)
    ctrl = Channel(world.Dup(), args.timeout)
    service_comm = world.Dup()              # producers' service threads, as in the runtime
    code = 0
    try:
        if rank == 0:
            coord = IndexDriver(args, data, ctrl)
            try:
                coord.run()
            finally:
                coord.shutdown()
            rmpi.barrier(world, timeout=args.timeout, op="final barrier")
            coord.check_shards()            # every producer has closed its store by now
            summary = coord.finish()
            code = 0 if summary["ok"] else 1
        else:
            code = producer(args, data, ctrl, service_comm)
            rmpi.barrier(world, timeout=args.timeout, op="final barrier")
    except BaseException:
        print(f"FAIL rank {rank} stopped:\n{traceback.format_exc()}", flush=True)
        world.Abort(3)
    if rank == 0:
        print("SUMMARY " + json.dumps(summary, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
