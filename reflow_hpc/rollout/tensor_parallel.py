"""A tensor-parallel rollout instance inside a job: ``s_R = resources.rollout_tp_size`` consecutive ranks
hold one vLLM instance (``VllmEngine`` with ``tp = s_R``, vLLM's external-launcher executor), and every
rank of it must make the same engine calls in the same order. The first rank, the *leader*, is the
rollout worker the coordinator knows; the others, *followers*, only repeat its engine calls.

- :class:`LeaderEngine` wraps the leader's engine: every call that changes the engine (``add``,
  ``step``, ``abort_all``, ``load_weights``, ``sleep``, ``wake``, ``set_concurrency_cap``) is sent to
  the followers before the leader makes it; reads (``stats``, ``has_unfinished``, ``version``) stay
  local, since every rank's engine holds the same state.
- :class:`FollowerLink` is a follower's end: :meth:`FollowerLink.apply` makes the next call on its own
  engine. The calls travel over MPI (pickled, in order: MPI does not overtake between two ranks on
  one communicator and tag); the tensors of a weight load over torch.distributed, one broadcast per
  tensor on the instance's group (NCCL on GPU, gloo on CPU), so a follower gets the full weights the
  leader received and vLLM keeps its shard of each.
- A follower's completions are discarded: the leader reports the instance's samples.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

OPS_TAG = 41            # MPI tag of an instance's engine calls (apart from the control channel's)


class LeaderEngine:
    """The leader's engine of a tensor-parallel instance (module docstring)."""

    def __init__(self, engine: Any, comm: Any, group: Any, followers: list[int]):
        """``comm``: a duplicate of the job's MPI world, so its ranks are the global ranks torch.distributed
        uses (``followers``: the instance's other ranks); ``group``: the instance's torch.distributed group."""
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

    def sleep(self) -> None:
        self._send(("sleep",))
        self.engine.sleep()

    def wake(self) -> None:
        self._send(("wake",))
        self.engine.wake()

    def set_concurrency_cap(self, cap: int) -> None:
        self._send(("set_concurrency_cap", cap))
        self.engine.set_concurrency_cap(cap)

    def load_weights(self, state: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        import torch.distributed as dist

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

    def stop(self) -> None:
        """The run ends: the followers leave their loops."""
        self._send(("stop",))


class FollowerLink:
    """A follower's end of its instance (module docstring)."""

    def __init__(self, engine: Any, comm: Any, group: Any, leader: int, device: str):
        """``comm`` and ``group`` as for :class:`LeaderEngine`; ``leader``: the leader's rank (the same on both,
        and the source of the weight broadcasts)."""
        self.engine, self.comm, self.group, self.leader, self.device = engine, comm, group, leader, device
        self.calls = 0
        self.loads = 0
        self.stopped = False

    def pending(self) -> bool:
        return bool(self.comm.iprobe(source=self.leader, tag=OPS_TAG))

    def _next(self) -> tuple:
        return self.comm.recv(source=self.leader, tag=OPS_TAG)

    def apply(self) -> None:
        """Make the leader's next call (one is pending) on this rank's engine."""
        op = self._next()
        self.calls += 1
        kind = op[0]
        if kind == "step":
            self.engine.step()                      # the leader reports the completions
        elif kind == "add":
            self.engine.add(op[1])
        elif kind == "abort_all":
            self.engine.abort_all()
        elif kind in ("sleep", "wake"):
            getattr(self.engine, kind)()
        elif kind == "set_concurrency_cap":
            self.engine.set_concurrency_cap(op[1])
        elif kind == "load_weights":
            self.engine.load_weights(self._tensors(), op[1])
            self.loads += 1
        elif kind == "stop":
            self.stopped = True
        else:
            raise RuntimeError(f"tensor-parallel follower: unexpected call {kind!r} from rank {self.leader}")

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
