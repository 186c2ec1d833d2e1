"""Fetching samples by id from the rank that owns them, over MPI (the data plane of DESIGN §3).

Sample payloads stay on the worker that produced them. A trainer asks each owner rank for a list of
sample ids; the owner's *service thread* answers from its :class:`SampleStore` while the owner's main
thread keeps generating or training.

Protocol, on a communicator dedicated to the data plane (the runtime passes a ``Dup()`` of
COMM_WORLD, so these tags cannot collide with control messages):

| tag                               | direction         | message                                    |
| --------------------------------- | ----------------- | ------------------------------------------ |
| ``REQUEST_TAG`` (1)               | requester → owner | pickled ``{"ids": [...], "reply_tag": t}`` |
| ``t`` (``REPLY_TAG_FIRST`` (2) …) | owner → requester | pickled header, then one raw payload       |

- The header holds the per-sample scalars (ids, lengths, prompt lengths, rewards, finish reasons,
  group/prompt ids, meta) and the token total T; it is followed by one message of 12·T bytes: the
  ``tokens`` (int32) of all samples, then their ``logprobs`` (float32), then their ``versions``
  (int32), sent with an upper-case ``Isend`` (no pickling of arrays). The owner describes the
  samples' own arrays with an MPI derived datatype (``hindexed`` over their addresses), so MPI
  gathers them without an extra copy into a staging buffer; the requester receives into one buffer
  and its samples are views into it. An error header (``{"error": "..."}``) has no payload.
- MPI keeps messages of one (source, tag) in order, so the 2 messages of a reply arrive in order.
  Reply tags come from one counter per process (``next_reply_tag``), so concurrent fetches — from
  several threads, to several owners — never receive each other's replies.
- The owner's ``poll`` handles at most one request and never blocks: it finds a request with a
  matched probe (``improbe`` + ``Message.recv``), which is safe while other threads use MPI too
  (``iprobe`` + ``recv`` is not: another thread may receive the probed message first). Its sends are
  non-blocking; their completion is checked on later polls.
- The requester sends every request first and then receives, so owners work in parallel. It waits
  by polling (``improbe`` for the header, ``Irecv`` + ``Test`` for the buffers) with exponential
  back-off between ``poll_min_s`` and ``poll_max_s``, never spinning a core, until ``timeout_s``;
  then it raises :class:`FetchTimeout` naming the owner ranks and how many samples each owed.
- Ids owned by the requester's own rank are read from its local store, without MPI.

MPI must be initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default; ``mpi4py.rc.thread_level =
"multiple"`` before importing ``mpi4py.MPI``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from reflow_hpc.comm.mpi import Backoff, RankTimeout, wait_until
from reflow_hpc.config import RunConfig
from reflow_hpc.storage.schema import StorageError
from reflow_hpc.storage.store import SampleStore
from reflow_hpc.trajectory import Trajectory

log = logging.getLogger(__name__)

REQUEST_TAG = 1
REPLY_TAG_FIRST = 2

_tag_lock = threading.Lock()
_tag_next = REPLY_TAG_FIRST


class FetchError(StorageError):
    """An owner answered a fetch with an error (unknown or lost ids, unreadable shard)."""

    def __init__(self, message: str, ranks: list[int], partial: dict[int, Trajectory] | None = None):
        super().__init__(message)
        self.ranks = ranks
        self.partial = partial or {}     # samples that did arrive, from the other owners


class FetchTimeout(FetchError, TimeoutError):
    """An owner did not answer within the timeout (its service thread stopped, or the rank hangs)."""


def next_reply_tag(comm: MPI.Comm) -> int:
    """A reply tag not used by any other fetch in flight from this process."""
    global _tag_next
    upper = comm.Get_attr(MPI.TAG_UB)
    with _tag_lock:
        tag = _tag_next
        _tag_next = tag + 1 if tag < upper else REPLY_TAG_FIRST
    return tag


def _require_thread_multiple() -> None:
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise StorageError("fetch needs MPI initialised with MPI_THREAD_MULTIPLE (set "
                           "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)")


# ------------------------------------------------------------------------------------------- owner

@dataclass
class _Reply:
    dest: int
    tag: int
    requests: list
    buffers: tuple                      # header and payload, kept alive until the sends complete
    started: float


class FetchServer:
    """Answers fetch requests for the samples in `store`; call ``poll`` from the service thread.

    `send_timeout_s` (the runtime passes ``run.timeout_s``): a reply whose requester has not taken
    it after this long (it timed out and gave up) is counted in ``abandoned`` and no longer tested;
    its buffers stay referenced, since MPI may still read them.
    """

    def __init__(self, comm: MPI.Comm, store: SampleStore, *, send_timeout_s: float = RunConfig.timeout_s,
                 poll_min_s: float = RunConfig.poll_min_s, poll_max_s: float = RunConfig.poll_max_s,
                 clock: Callable[[], float] = time.monotonic):
        _require_thread_multiple()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.store = store
        self.send_timeout_s = send_timeout_s
        self.poll_min_s, self.poll_max_s = poll_min_s, poll_max_s
        self.clock = clock
        self._replies: list[_Reply] = []
        self._abandoned: list[_Reply] = []
        self.served_requests = 0
        self.served_samples = 0
        self.served_bytes = 0
        self.errors = 0

    @property
    def abandoned(self) -> int:
        return len(self._abandoned)

    @property
    def replies_in_flight(self) -> int:
        return len(self._replies)

    def poll(self) -> bool:
        """Handle at most one pending request without blocking. Returns whether the caller should poll
        again at once: there was a request, or a reply is still in flight (a large reply moves only
        while this rank calls MPI, so the service thread must not back off then)."""
        self._progress_sends()
        status = MPI.Status()
        msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST_TAG, status=status)
        if msg is None:
            return bool(self._replies)
        src = status.Get_source()
        try:
            req = msg.recv()
            ids, tag = [int(i) for i in req["ids"]], int(req["reply_tag"])
        except Exception as e:      # a malformed request has no reply tag to answer on
            log.error("rank %d: dropped a malformed fetch request from rank %d: %s", self.rank, src, e)
            self.errors += 1
            return True
        try:
            trajs = self.store.get(ids)
        except Exception as e:
            self.errors += 1
            missing = [i for i in ids if not self.store.holds(i)]
            why = f"{e.__class__.__name__}: {e}"
            if len(missing) > 1:
                why += f" ({len(missing)} of {len(ids)} requested ids not held, e.g. {missing[:8]})"
            self._send(src, tag, {"error": why}, None)
            return True
        lengths = [len(t.tokens) for t in trajs]
        header = {
            "ids": ids, "lengths": lengths, "total": sum(lengths),
            "group_id": [t.group_id for t in trajs], "prompt_id": [t.prompt_id for t in trajs],
            "prompt_len": [t.prompt_len for t in trajs], "reward": [t.reward for t in trajs],
            "finish_reason": [t.finish_reason for t in trajs], "meta": [t.meta for t in trajs],
        }
        arrays = [t.tokens for t in trajs] + [t.logprobs for t in trajs] + [t.versions for t in trajs]
        self._send(src, tag, header, arrays)
        self.served_requests += 1
        self.served_samples += len(ids)
        self.served_bytes += 12 * header["total"]
        return True

    def close(self, timeout_s: float = 0.0) -> int:
        """Wait up to `timeout_s` for replies still in flight; returns how many never completed."""
        def sent() -> bool:
            self._progress_sends()
            return not self._replies
        wait_until(sent, timeout=timeout_s, rank=self.rank, op="fetch replies in flight",
                   backoff=Backoff(self.poll_min_s, self.poll_max_s), clock=self.clock, raise_on_timeout=False)
        return len(self._replies) + len(self._abandoned)

    def _send(self, dest: int, tag: int, header: dict, arrays: list[np.ndarray] | None) -> None:
        """Header, then (unless it is an error) the arrays back to back as one message."""
        reqs = [self.comm.isend(header, dest=dest, tag=tag)]
        if arrays is not None:
            payload = np.concatenate([a.view(np.uint8) for a in arrays]) if arrays else np.empty(0, np.uint8)
            reqs.append(self.comm.Isend(payload, dest=dest, tag=tag))
            arrays = payload
        self._replies.append(_Reply(dest, tag, reqs, (header, arrays), self.clock()))

    def _progress_sends(self) -> None:
        if not self._replies:
            return
        now, keep = self.clock(), []
        for r in self._replies:
            if MPI.Request.Testall(r.requests):
                continue
            if now - r.started > self.send_timeout_s:
                log.warning("rank %d: reply to rank %d (tag %d) not taken after %.1f s; abandoned",
                            self.rank, r.dest, r.tag, now - r.started)
                self._abandoned.append(r)
            else:
                keep.append(r)
        self._replies = keep


# --------------------------------------------------------------------------------------- requester

@dataclass
class _Pending:
    owner: int
    ids: list[int]
    tag: int
    send: object                            # the request's isend
    header: dict | None = None
    recvs: list = field(default_factory=list)
    arrays: tuple = ()
    done: bool = False
    error: str | None = None


class FetchClient:
    """Fetches samples from their owners: ``fetch({owner_rank: [ids]}) -> {id: Trajectory}``.

    Thread-safe: several threads may fetch at once. `store` serves ids owned by this rank.
    """

    def __init__(self, comm: MPI.Comm, timeout_s: float, *, store: SampleStore | None = None,
                 poll_min_s: float = RunConfig.poll_min_s, poll_max_s: float = RunConfig.poll_max_s,
                 clock: Callable[[], float] = time.monotonic):
        _require_thread_multiple()
        if timeout_s <= 0:
            raise ValueError(f"fetch timeout_s must be > 0, got {timeout_s}")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.timeout_s = timeout_s
        self.store = store
        self.poll_min_s, self.poll_max_s = poll_min_s, poll_max_s
        self.clock = clock
        self._abandoned: list = []          # cancelled receives and their buffers, kept alive for MPI

    def fetch(self, wanted: Mapping[int, Sequence[int]], *, timeout_s: float | None = None) -> dict[int, Trajectory]:
        """All samples of `wanted` ({owner rank: ids}); raises FetchTimeout / FetchError naming ranks."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = self.clock() + timeout_s
        out: dict[int, Trajectory] = {}
        pending: list[_Pending] = []
        size = self.comm.Get_size()
        wanted = {owner: [int(i) for i in ids] for owner, ids in wanted.items() if len(ids)}
        for owner, ids in wanted.items():
            if not 0 <= owner < size:
                raise ValueError(f"fetch: owner rank {owner} outside the communicator (size {size}); "
                                 f"ids {ids[:8]}")
        local = wanted.pop(self.rank, [])
        if local and self.store is None:
            raise StorageError(f"rank {self.rank}: fetch of {len(local)} own samples but no local store")
        for owner, ids in wanted.items():
            tag = next_reply_tag(self.comm)
            send = self.comm.isend({"ids": ids, "reply_tag": tag}, dest=owner, tag=REQUEST_TAG)
            pending.append(_Pending(owner, ids, tag, send))
        # Local ids while the owners work on theirs.
        local_error = None
        if local:
            try:
                out.update(zip(local, self.store.get(local)))
            except StorageError as e:
                local_error = str(e)
        self._wait(pending, deadline, timeout_s, out)
        failed = [p for p in pending if p.error is not None]
        if local_error is not None or failed:
            parts = [f"fetch from rank {p.owner} failed ({_ids_text(p.ids)}): {p.error}" for p in failed]
            if local_error is not None:
                parts.insert(0, f"fetch from rank {self.rank} (local) failed: {local_error}")
            raise FetchError("; ".join(parts), [p.owner for p in failed] + ([self.rank] if local_error else []),
                             out)
        return out

    def _wait(self, pending: list[_Pending], deadline: float, timeout_s: float,
              out: dict[int, Trajectory]) -> None:
        backoff = Backoff(self.poll_min_s, self.poll_max_s)
        open_ = list(pending)

        def arrived() -> bool:
            nonlocal open_
            progressed = False
            for p in open_:
                progressed |= self._step(p, out)
            open_ = [p for p in open_ if not p.done]
            if progressed or any(p.recvs for p in open_):
                backoff.progress()     # a payload in transit moves only while this rank calls MPI
            return not open_

        try:
            wait_until(arrived, timeout=deadline - self.clock(), rank=self.rank, op="fetch", backoff=backoff,
                       clock=self.clock)
        except RankTimeout:
            self._give_up(open_)
            ranks = [p.owner for p in open_]
            counts = ", ".join(str(len(p.ids)) for p in open_)
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            raise FetchTimeout(f"fetch from {who} timed out after {timeout_s:.1f} s ({counts} samples)",
                               ranks, out) from None

    def _step(self, p: _Pending, out: dict[int, Trajectory]) -> bool:
        """Advance one request; returns whether anything arrived."""
        arrived = False
        if p.header is None:
            msg = self.comm.improbe(source=p.owner, tag=p.tag)
            if msg is None:
                return False
            p.header, arrived = msg.recv(), True
            if "error" in p.header:
                MPI.Request.Waitall([p.send])   # the owner answered, so it took the request
                p.error, p.done = p.header["error"], True
                return True
            total = int(p.header["total"])
            payload = np.empty(12 * total, np.uint8)
            p.arrays = (payload[:4 * total].view(np.int32), payload[4 * total:8 * total].view(np.float32),
                        payload[8 * total:].view(np.int32))
            p.recvs = [self.comm.Irecv(payload, source=p.owner, tag=p.tag)]
        if not MPI.Request.Testall(p.recvs):
            return arrived
        MPI.Request.Waitall([p.send])
        h, (tokens, logprobs, versions) = p.header, p.arrays
        start = 0
        for k, sid in enumerate(h["ids"]):
            end = start + h["lengths"][k]
            # Views into the reply's buffers: no copy per sample.
            out[sid] = Trajectory(
                sample_id=sid, group_id=h["group_id"][k], prompt_id=h["prompt_id"][k],
                tokens=tokens[start:end], logprobs=logprobs[start:end], versions=versions[start:end],
                prompt_len=h["prompt_len"][k], reward=h["reward"][k], finish_reason=h["finish_reason"][k],
                owner=p.owner, meta=h["meta"][k])
            start = end
        p.done = True
        return True

    def _give_up(self, open_: list[_Pending]) -> None:
        for p in open_:
            for r in p.recvs:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
            # Buffers of cancelled (or late-matching) receives must outlive them.
            self._abandoned.append((p.send, p.recvs, p.arrays))


def _ids_text(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:8])) + (", …" if len(ids) > 8 else "")
    return f"{len(ids)} samples: ids {shown}"
