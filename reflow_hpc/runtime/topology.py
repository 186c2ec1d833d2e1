"""Who is where: ranks, nodes, devices and node-local scratch directories.

Node identity comes from Slurm (``SLURMD_NODENAME``) when present and from the host name
otherwise, so emulated Slurm nodes on one host count as separate nodes, as they do for Slurm.
Node ids and local ranks are assigned by the coordinator from every worker's hello, in rank order,
so no collective is needed before the handshake (a collective has no deadline).
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..private import private_dir, private_scratch


class LaunchError(RuntimeError):
    """The processes were started in a way that cannot work; the message says how to fix it."""


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def slurm_tasks() -> int | None:
    """Tasks Slurm started for this step (None outside a Slurm step)."""
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if var in os.environ and "SLURM_STEP_ID" in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                return None
    return None


def check_world_size(mpi_size: int, mpi_rank: int) -> None:
    """Fail at once when srun started every task as its own one-rank MPI world (``--mpi=none``)."""
    tasks = slurm_tasks()
    if tasks is not None and tasks != mpi_size:
        raise LaunchError(
            f"rank {os.environ.get('SLURM_PROCID', mpi_rank)}: MPI world size {mpi_size} differs from "
            f"SLURM_NTASKS={tasks}: srun started the tasks without an MPI bootstrap, so every rank runs "
            f"alone (srun --mpi=none, or MpiDefault=none in slurm.conf). Launch with `srun --mpi=pmi2` "
            f"(or the plugin matching your MPI, see `srun --mpi=list`; config key slurm.mpi).")


def visible_devices() -> list[str]:
    try:
        import torch
        if torch.cuda.is_available():
            return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    except Exception:  # torch missing or a broken driver: report no GPU rather than fail the hello
        pass
    return []


def scratch_root(configured: str) -> Path:
    """Node-local scratch: the config key, else $SLURM_TMPDIR, else $TMPDIR, else /tmp."""
    for candidate in (configured, os.environ.get("SLURM_TMPDIR", ""), os.environ.get("TMPDIR", "")):
        if candidate:
            return Path(candidate)
    return Path("/tmp")


def scratch_dir(configured: str, run_name: str, rank: int) -> Path:
    """Per-rank scratch directory of this job, created private (0700) or checked as ours; stable across a
    requeue (same Slurm job id), so a rank requeued on the same node finds its shards.

    The name is predictable (``<root>/reflow-<run>-<job>-<user>/rank<r>``) rather than random, for that
    requeue; when someone else holds it, ``private_scratch`` uses a private directory of its own beside
    it (and says so in one line), never theirs."""
    job = os.environ.get("SLURM_JOB_ID")
    base = private_scratch(scratch_root(configured), f"reflow-{run_name}-{job}" if job else f"reflow-{run_name}")
    return private_dir(base / f"rank{rank:05d}", what=f"rank {rank}: scratch directory")


@dataclass
class Placement:
    """What the coordinator derives from all hellos."""
    nodes: list[str]                 # distinct node names in order of first rank
    node_of_rank: list[int]
    local_rank: list[int]
    local_size: list[int]


def place(node_by_rank: list[str]) -> Placement:
    nodes: list[str] = []
    for n in node_by_rank:
        if n not in nodes:
            nodes.append(n)
    node_of_rank = [nodes.index(n) for n in node_by_rank]
    counts = {i: 0 for i in range(len(nodes))}
    local_rank = []
    for nid in node_of_rank:
        local_rank.append(counts[nid])
        counts[nid] += 1
    return Placement(nodes, node_of_rank, local_rank, [counts[n] for n in node_of_rank])


@dataclass
class Topology:
    rank: int
    world_size: int
    node: str
    node_id: int
    local_rank: int
    local_size: int
    nodes: list[str]
    hostname: str
    pid: int
    device: str
    scratch: str
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)
