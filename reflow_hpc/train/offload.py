"""Colocated mode: a trainer's optimizer state out of device memory while its worker generates.

:meth:`Offload.offload` frees the gradients and, on a GPU, copies the optimizer state to CPU memory
(pinned on CUDA) and frees it on the device; :meth:`Offload.onload` brings it back. A plain tensor
is replaced in the state by its CPU copy; a sharded one (a DTensor, which carries the mesh and the
placement) stays in the state and only the storage of its local shard is emptied, then refilled.
On CPU both are cheap no-ops, but the trainer still refuses a step between them, so a loop that
forgets :meth:`Offload.onload` is caught on a laptop too.
"""

from __future__ import annotations

from typing import Any

import torch

from .sharding import is_sharded, local


class Offload:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.active = False
        self._moved: list[tuple[dict, str, Any]] = []     # (state, key, None | (CPU copy, storage bytes))

    def offload(self) -> None:
        if self.active:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type != "cpu":
            pin = self.device.type == "cuda"
            freed = []
            for st in self.optimizer.state.values():
                for key, value in st.items():
                    if not torch.is_tensor(value) or value.device.type == "cpu":
                        continue
                    mine = local(value)
                    cpu = torch.empty(mine.shape, dtype=mine.dtype, pin_memory=pin)
                    cpu.copy_(mine, non_blocking=True)
                    if is_sharded(value):
                        storage = mine.untyped_storage()
                        self._moved.append((st, key, (cpu, storage.nbytes())))
                        freed.append(storage)
                    else:
                        st[key] = cpu
                        self._moved.append((st, key, None))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for storage in freed:
                storage.resize_(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.active = True

    def onload(self) -> None:
        if not self.active:
            return
        for st, key, kept in self._moved:
            if kept is None:
                st[key] = st[key].to(self.device, non_blocking=True)
            else:
                cpu, nbytes = kept
                mine = local(st[key])
                mine.untyped_storage().resize_(nbytes)
                mine.copy_(cpu, non_blocking=True)
        self._moved.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.active = False

    def reloaded(self) -> None:
        """The optimizer's state was just loaded (next to the parameters): offload it again if it was."""
        if self.active:
            self._moved.clear()
            self.active = False
            self.offload()
