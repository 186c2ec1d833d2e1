"""What the job tests with tensor-parallel vLLM instances share (tests/cluster/test_vllm_tensor_parallel.py).

vLLM-CPU's tensor-parallel groups keep shared-memory segments in /dev/shm under names made of the
group's ranks alone (vLLM 0.32, ``cpu_communicator.py``), the same for every job. A job that was
killed leaves its segments behind, and the next instance over the same ranks on this host cannot
create them (``create shm in SHMManager failed. errno: 17``): one failed test would fail every
later one. :func:`clear_stale_shm` removes the segments that no live process maps.
"""

from __future__ import annotations

from pathlib import Path

SHM = Path("/dev/shm")


def _mapped() -> set[str]:
    """Paths under /dev/shm that some process maps now."""
    out: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:                      # the process ended, or is not ours to read
            continue
        out.update(line.split(None, 5)[5].removesuffix(" (deleted)") for line in text.splitlines()
                   if "/dev/shm/" in line and len(line.split(None, 5)) == 6)
    return out


def clear_stale_shm() -> list[str]:
    """Remove vLLM-CPU's tensor-parallel segments that no process maps; returns their names."""
    if not SHM.is_dir():
        return []
    live = _mapped()
    removed = []
    for seg in SHM.glob("*cpushm*"):
        if str(seg) not in live:
            seg.unlink(missing_ok=True)
            removed.append(seg.name)
    return removed
