"""A tensor-parallel rollout instance inside a job: ``s_R = resources.rollout_tp_size`` consecutive ranks
hold one vLLM instance (``VllmEngine`` with ``tp = s_R``, vLLM's external-launcher executor), and every
rank of it must make the same engine calls in the same order.

The instances are fixed blocks of ``s_R`` ranks from rank 0 (``comm/dims.py``, engine blocks), over
which vLLM lays its groups when every rank builds its engine at set-up. A block's first rank, the
*leader*, drives the block's engines for the whole run, in every mode and every split; the others,
*followers*, only repeat its engine calls. A split decides only whether the block generates (its
leader is a rollout worker the coordinator knows) or trains (its engines sleep).

- :class:`LeaderEngine` wraps the leader's engine: every call that changes the engine (``add``,
  ``step``, ``abort_all``, ``abort``, ``load_weights``, ``load_own_weights``, ``sleep``, ``wake``,
  ``set_concurrency_cap``) is sent to the followers before the leader makes it; reads (``stats``,
  ``has_unfinished``, ``version``) stay local, since every rank's engine holds the same state.
- :class:`FollowerLink` is a follower's end: :meth:`FollowerLink.apply` makes the leader's next call on
  its own engine and returns its name. The calls travel over MPI (pickled, in order: MPI does not
  overtake between two ranks on one communicator and tag). A weight load the leader *received*
  (split pools: the trainer's weight sync) reaches the followers over torch.distributed, one broadcast
  per tensor on the instance's group (NCCL on GPU, gloo on CPU), so a follower gets the full weights
  and vLLM keeps its shard of each. Colocated, every rank holds its own trainer's weights (each
  replica the same; a sharded one gathers them over its own shard group): ``load_own_weights`` has
  every rank of the instance load its own at the same point of the call order, so no weights travel
  over the instance's group and a sharded replica's gathers never interleave with a broadcast.
- :meth:`LeaderEngine.mark` puts a named point into the call stream (no engine call). A follower that
  must not go on before its leader has reached a point (its ``sleep`` before a step, say) applies the
  calls up to that mark, whether it meets the mark in its loop or while it waits for it
  (:meth:`FollowerLink.reached`); names are unique, so a mark passed early is not waited for again.
- A follower's completions are discarded: the leader reports the instance's samples.

What a follower does, mode by mode (``runtime/worker.py`` applies its leader's calls between its own
commands, in one loop):

- **split pools, its block generating**: it repeats the leader's calls; the coordinator sends it only
  ``Setup``, ``Switch`` and ``Stop``.
- **split pools, its block training** (a static split's trainer ranks, or where the elastic pool put
  it): it trains like any trainer; the only calls that reach it are the leader's ``sleep`` and ``wake``.
- **colocated** (mode ``sync``): every rank trains, the leader generates for the block. Before a
  follower trains it applies the leader's calls up to the leader's ``sleep`` (which the leader makes
  before it trains), so that neither waits in a trainer collective for the other while that one
  waits in an engine call (the leader marks the point ``train step N``); the leader's ``wake`` after
  the step and ``load_own_weights`` at the weight sync are applied in the follower's loop, where it
  waits for nothing else.
- **at a switch** (the elastic pool moves whole blocks): a block that leaves rollout hands its samples
  over and sleeps through its leader; each follower applies the calls up to that ``sleep`` (the mark
  ``switch N``) before it touches its trainer. A block that joins rollout wakes through its leader; the next weight sync
  reaches the followers through the leader's ``load_weights``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

OPS_TAG = 41            # MPI tag of an instance's engine calls (apart from the control channel's)

Weights = Iterable[tuple[str, Any]]


class LeaderEngine:
    """The leader's engine of a tensor-parallel instance (module docstring)."""

    def __init__(self, engine: Any, comm: Any, group: Any, followers: list[int]):
        """``comm``: a duplicate of the job's MPI world, so its ranks are the global ranks torch.distributed
        uses (``followers``: the instance's other ranks); ``group``: the instance's torch.distributed group
        (None for a block that never generates: it loads no weights it received)."""
        self.engine, self.comm, self.group, self.followers = engine, comm, group, followers
        self.src = comm.Get_rank()                  # the source of the weight broadcasts

    def _send(self, op: tuple) -> None:
        for f in self.followers:
            self.comm.send(op, dest=f, tag=OPS_TAG)

    def __getattr__(self, name: str) -> Any:          # reads: every rank's engine holds the same state
        return getattr(self.engine, name)

    def add(self, request: Any) -> None:
        self._send(("add", request))
        self.engine.add(request)

    def step(self) -> list:
        self._send(("step",))
        return self.engine.step()

    def abort_all(self) -> list:
        self._send(("abort_all",))
        return self.engine.abort_all()

    def abort(self, request_ids) -> None:
        ids = list(request_ids)
        self._send(("abort", ids))
        self.engine.abort(ids)

    def sleep(self) -> None:
        self._send(("sleep",))
        self.engine.sleep()

    def wake(self) -> None:
        self._send(("wake",))
        self.engine.wake()

    def set_concurrency_cap(self, cap: int) -> None:
        self._send(("set_concurrency_cap", cap))
        self.engine.set_concurrency_cap(cap)

    def load_weights(self, state: Mapping[str, Any] | Weights, version: int) -> None:
        """Weights the leader received: passed on to the followers, one broadcast per tensor."""
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError(f"tensor-parallel rank {self.src}: a weight load for an instance with no group "
                               f"(its block generates in no split)")
        self._send(("load_weights", version))
        items = state.items() if isinstance(state, Mapping) else state

        def shared():
            for name, tensor in items:
                tensor = tensor.detach().contiguous()
                self._send(("tensor", name, tuple(tensor.shape), tensor.dtype))
                dist.broadcast(tensor, src=self.src, group=self.group)
                yield name, tensor
            self._send(("end",))

        self.engine.load_weights(shared(), version)

    def load_own_weights(self, state: Mapping[str, Any] | Weights, version: int) -> None:
        """Colocated: every rank of the instance loads its own trainer's weights (``state`` are the leader's),
        at this point of the call order."""
        self._send(("load_own_weights", version))
        self.engine.load_weights(state, version)

    def mark(self, name: str) -> None:
        """A named point in the call stream, for followers that wait until their leader reached it."""
        self._send(("mark", name))

    def stop(self) -> None:
        """The run ends: the followers leave their loops."""
        self._send(("stop",))


class FollowerLink:
    """A follower's end of its instance (module docstring)."""

    def __init__(self, engine: Any, comm: Any, group: Any, leader: int, device: str,
                 own_weights: Callable[[], Weights] | None = None):
        """``comm`` and ``group`` as for :class:`LeaderEngine`; ``leader``: the leader's rank (the same on both,
        and the source of the weight broadcasts); ``own_weights``: this rank's trainer's weights, for the
        leader's ``load_own_weights`` (colocated)."""
        self.engine, self.comm, self.group, self.leader, self.device = engine, comm, group, leader, device
        self.own_weights = own_weights
        self.calls = 0
        self.loads = 0
        self.stopped = False
        self._marks: set[str] = set()               # reached and not yet asked for

    def pending(self) -> bool:
        return bool(self.comm.iprobe(source=self.leader, tag=OPS_TAG))

    def reached(self, mark: str) -> bool:
        """Whether the leader's mark ``mark`` was applied (once: it is forgotten when asked for)."""
        if mark in self._marks:
            self._marks.discard(mark)
            return True
        return False

    def _next(self) -> tuple:
        return self.comm.recv(source=self.leader, tag=OPS_TAG)

    def apply(self) -> str:
        """Make the leader's next call (one is pending) on this rank's engine; returns the call's name."""
        op = self._next()
        self.calls += 1
        kind = op[0]
        if kind == "step":
            self.engine.step()                      # the leader reports the completions
        elif kind == "add":
            self.engine.add(op[1])
        elif kind == "abort_all":
            self.engine.abort_all()
        elif kind == "abort":
            self.engine.abort(op[1])
        elif kind in ("sleep", "wake"):
            getattr(self.engine, kind)()
        elif kind == "set_concurrency_cap":
            self.engine.set_concurrency_cap(op[1])
        elif kind == "load_weights":
            self.engine.load_weights(self._tensors(), op[1])
            self.loads += 1
        elif kind == "load_own_weights":
            if self.own_weights is None:
                raise RuntimeError(f"tensor-parallel follower of rank {self.leader}: asked to load its own "
                                   f"weights, but it holds no trainer")
            self.engine.load_weights(self.own_weights(), op[1])
            self.loads += 1
        elif kind == "mark":
            self._marks.add(op[1])
        elif kind == "stop":
            self.stopped = True
        else:
            raise RuntimeError(f"tensor-parallel follower: unexpected call {kind!r} from rank {self.leader}")
        return kind

    def _tensors(self):
        import torch
        import torch.distributed as dist

        while True:
            op = self._next()
            if op[0] == "end":
                return
            if op[0] != "tensor":
                raise RuntimeError(f"tensor-parallel follower: {op[0]!r} from rank {self.leader} inside a weight load")
            _, name, shape, dtype = op
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(tensor, src=self.leader, group=self.group)
            yield name, tensor
