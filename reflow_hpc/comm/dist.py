"""torch.distributed for weights and gradients, bootstrapped from MPI.

Rank 0 opens the rendezvous store (a ``TCPStore``) on a port the kernel picks on its own address
(``run.master_addr``, else loopback on one host, else its host name's address) and broadcasts
``host:port`` over MPI (a non-blocking broadcast with a deadline), then every rank joins the default
group through that store: NCCL when the workers run on CUDA, gloo on CPU. The group's timeout is
``run.timeout_s``; :func:`guarded` turns a failing or timed-out collective into an error that names the
rank and the operation.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from typing import Any, Iterator

from .mpi import bcast_obj


def _own_address(single_host: bool, master_addr: str = "") -> str:
    if master_addr:
        return master_addr
    if single_host:
        return "127.0.0.1"
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_process_group(comm: Any, *, device: str, single_host: bool, timeout_s: float, master_addr: str = "") -> float:
    """Join the default process group; returns the seconds it took.

    Rank 0 opens the rendezvous store on a port the kernel picks and only then tells the others where it
    is: a port picked free and bound later can be taken meanwhile (gloo's own sockets, another job)."""
    import torch.distributed as dist
    t0 = time.monotonic()
    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    store, endpoint = None, None
    if rank == 0:
        addr = _own_address(single_host, master_addr)
        with guarded(rank, f"torch.distributed rendezvous store (listening on {addr})"):
            store = dist.TCPStore(addr, 0, size, True, timeout=timeout, wait_for_workers=False)
        endpoint = (addr, store.port)
    addr, port = bcast_obj(comm, endpoint, 0, timeout=timeout_s, op="rendezvous address broadcast")
    kwargs: dict[str, Any] = {}
    if device.startswith("cuda"):
        import torch
        kwargs["device_id"] = torch.device(device)
    with guarded(rank, f"torch.distributed init ({backend_for(device)}, tcp://{addr}:{port})"):
        if store is None:
            store = dist.TCPStore(addr, port, size, False, timeout=timeout)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout,
                                **kwargs)
    return time.monotonic() - t0


class CollectiveError(RuntimeError):
    pass


@contextlib.contextmanager
def guarded(rank: int, op: str) -> Iterator[None]:
    """Re-raise any failure inside a collective as one line naming the rank and the operation."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise CollectiveError(f"rank {rank}: {op}: {first}") from e


def destroy() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
