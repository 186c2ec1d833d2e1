"""The start of the trainer test programs (train_*.py), in the order they need: MPI first, then torch."""

from __future__ import annotations

from typing import Any

from reflow_hpc.comm import mpi


def start_ranks(timeout_s: float) -> Any:
    """Initialise MPI, then torch.distributed over COMM_WORLD (gloo on one host, its set-up bounded by
    ``timeout_s``) with one intra-op thread per rank, as a CPU worker runs. Returns the ``MPI`` module."""
    MPI = mpi.init()
    import torch

    from reflow_hpc.comm.dist import init_process_group

    torch.set_num_threads(1)
    init_process_group(MPI.COMM_WORLD, device="cpu", single_host=True, timeout_s=timeout_s)
    return MPI
