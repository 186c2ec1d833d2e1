"""Hold every rank to a fixed CPU share, so that a CPU rank behaves like a dedicated device.

On a GPU cluster each rank owns its device: time a rank spends waiting is lost. On a laptop or a
small VM several ranks share the cores, and a waiting rank hands its core to the others, so idle
time costs almost nothing and a comparison between modes or placements favours whichever one
oversubscribes most. With ``resources.cpu_quota = q`` the launcher (``python -m reflow_hpc.run``
started without MPI) starts every rank through this wrapper::

    mpiexec -n W python -m reflow_hpc.runtime.cpuquota q GROUP -- python -m reflow_hpc.run ...

Each rank creates the cgroup ``GROUP-rank<r>`` under the cgroup-v1 ``cpu`` controller, sets its
quota to ``q`` of one core per period (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), moves itself
into it and execs the real command; children stay in the group. The launcher removes the groups
once the ranks have exited. It needs write access to the controller (root, or a delegated
hierarchy); without it the launcher says so in one line and runs without the quota.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONTROLLER = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000          # the kernel's default CFS period: the quota is a share of it


def available(controller: Path | None = None) -> str | None:
    """None when quotas can be set here, else why not (one line)."""
    controller = controller or CONTROLLER
    if not (controller / "cpu.cfs_quota_us").is_file():
        return f"no cgroup-v1 cpu controller at {controller}"
    if not os.access(controller, os.W_OK):
        return f"no write access to {controller} (run as root or delegate a cgroup)"
    return None


def group_dir(prefix: str, rank: int | str, controller: Path | None = None) -> Path:
    return (controller or CONTROLLER) / f"{prefix}-rank{rank}"


def join(fraction: float, prefix: str, rank: int | str, controller: Path | None = None) -> Path:
    """Create the rank's group with its quota and move this process into it."""
    group = group_dir(prefix, rank, controller)
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
    (group / "cpu.cfs_quota_us").write_text(f"{max(1000, round(fraction * PERIOD_US))}\n")
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return group


def remove(prefix: str, ranks: int, controller: Path | None = None) -> None:
    """Remove the groups of a finished launch (they are empty once their ranks have exited)."""
    for rank in range(ranks):
        try:
            group_dir(prefix, rank, controller).rmdir()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m reflow_hpc.runtime.cpuquota FRACTION GROUP -- COMMAND ...", file=sys.stderr)
        return 2
    fraction, prefix, cmd = float(argv[0]), argv[1], argv[3:]
    rank = os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "0"))
    try:
        join(fraction, prefix, rank)
    except OSError as e:
        print(f"reflow_hpc: rank {rank}: CPU quota not applied ({e.strerror}: {e.filename}); running without it",
              file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 1     # not reached


if __name__ == "__main__":
    sys.exit(main())
