"""``python -m reflow_hpc.run CONFIG --check``: the start-up self-check.

Every rank handshakes with the coordinator, joins torch.distributed (gloo on CPU, NCCL on CUDA),
verifies an all-reduce (sum of rank+1 over the world, and a 1 Mi-element tensor) and an MPI
all-reduce, and reports to the coordinator, which writes ``topology.json`` into the run directory:
ranks, nodes, devices, scratch directories, MPI library and version, handshake and collective
timings.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..comm.dist import backend_for, guarded, init_process_group
from ..comm.mpi import NETMOD_VARS, library_version, wait_request
from ..config import Config, to_dict
from ..private import private_dir, write_atomic
from .context import Runtime
from .pump import Outgoing
from .messages import DONE, CheckReport, Hello


class CheckSide:
    """Coordinator side: collect one report per rank within the timeout, then write topology.json."""

    def __init__(self, cfg: Config, world: int):
        self.cfg = cfg
        self.world = world
        self.reports: dict[int, CheckReport] = {}
        self.hellos: list[Hello] = []
        self.started = 0.0
        self.written: Path | None = None
        self.handshake_s = 0.0

    def on_start(self, hellos: list[Hello], handshake_s: float, now: float) -> Outgoing:
        self.hellos = hellos
        self.handshake_s = handshake_s
        self.started = now
        return ()

    def on_message(self, source: int, msg: Any, now: float) -> Outgoing:
        if not isinstance(msg, CheckReport):
            raise RuntimeError(f"rank 0: self-check: unexpected {type(msg).__name__} from rank {source}")
        self.reports[source] = msg
        if len(self.reports) == self.world:
            self.written = write_topology(self.cfg, self.hellos, self.reports, self.handshake_s)
        return ()

    def on_tick(self, now: float) -> Outgoing:
        if self.written is None and now - self.started > self.cfg.run.timeout_s:
            missing = sorted(set(range(self.world)) - set(self.reports))
            raise TimeoutError(f"rank 0: self-check: no report from rank(s) {', '.join(map(str, missing))} "
                               f"after {self.cfg.run.timeout_s:.1f} s")
        return ()

    def done(self) -> bool:
        return self.written is not None

    def stop_reason(self) -> str:
        return DONE


def write_topology(cfg: Config, hellos: list[Hello], reports: dict[int, CheckReport] | None, handshake_s: float,
                   roles: dict[int, str] | None = None, timeline: list[dict] | None = None) -> Path:
    """``topology.json`` in the run directory: written by the self-check (with the collectives it
    verified), at the start of every training run (with each rank's role) and after every role
    switch (the roles then, and the timeline of placements: after which step how many trainers)."""
    from .topology import place
    placement = place([h.node for h in hellos])
    ranks = []
    for h in hellos:
        entry = {"rank": h.rank, "node": h.node, "node_id": placement.node_of_rank[h.rank],
                 "local_rank": placement.local_rank[h.rank], "hostname": h.hostname, "pid": h.pid,
                 "visible_devices": h.devices, "nvml_gpus": h.gpus, "scratch": h.scratch}
        if roles is not None:
            entry["role"] = roles[h.rank]
        if reports is not None:
            rep = reports[h.rank]
            entry.update({"device": rep.device, "handshake_rtt_s": round(rep.handshake_rtt_s, 6),
                          "dist_init_s": round(rep.dist_init_s, 4), "allreduce_s": round(rep.allreduce_s, 6)})
        ranks.append(entry)
    doc: dict = {
        "world_size": len(hellos),
        "num_nodes": len(placement.nodes),
        "nodes": placement.nodes,
        "ranks": ranks,
        "mpi": {"library": library_version(), "thread_level": "multiple",
                "netmod": next((f"{v}={os.environ[v]}" for v in NETMOD_VARS if v in os.environ),
                               "the library's default")},
        "handshake_s": round(handshake_s, 6),
        "slurm": {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS")
                  if k in os.environ},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": to_dict(cfg),
    }
    if timeline is not None:
        doc["role_timeline"] = timeline
    if reports is not None:
        first = reports[0]
        doc["torch_distributed"] = {
            "backend": first.backend,
            "allreduce": {"ok": all(r.allreduce_ok for r in reports.values()),
                          "value": first.allreduce_value, "expected": first.allreduce_expected},
            "mpi_allreduce_ok": all(r.mpi_allreduce_ok for r in reports.values())}
        doc["verified"] = all(r.allreduce_ok and r.mpi_allreduce_ok for r in reports.values())
    out = private_dir(cfg.run_dir, what="run directory") / "topology.json"
    write_atomic(out, json.dumps(doc, indent=2) + "\n")
    return out


def gpus_by_node(hellos: list[Hello]) -> dict[str, list[str]]:
    """What NVML sees on each node, from the first hello of that node."""
    out: dict[str, list[str]] = {}
    for h in hellos:
        out.setdefault(h.node, h.gpus)
    return out


def run_check(rt: Runtime) -> CheckReport:
    """Worker side of the self-check; returns this rank's report (already sent)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    cfg, topo = rt.cfg, rt.topology
    assert topo is not None
    init_s = init_process_group(rt.world, device=topo.device, single_host=rt.single_host,
                                timeout_s=cfg.run.timeout_s, master_addr=cfg.run.master_addr)
    world = rt.size
    expected = world * (world + 1) / 2
    t0 = time.monotonic()
    with guarded(rt.rank, "all-reduce self-check"):
        x = torch.tensor([float(rt.rank + 1)], device=topo.device)
        dist.all_reduce(x)
        big = torch.full((1 << 20,), float(rt.rank + 1), device=topo.device)
        dist.all_reduce(big)
        if topo.device.startswith("cuda"):
            torch.cuda.synchronize()
    allreduce_s = time.monotonic() - t0
    value = float(x.item())
    ok = value == expected and bool(torch.all(big == expected).item())

    send = np.array([rt.rank + 1], dtype=np.int64)
    recv = np.zeros(1, dtype=np.int64)
    wait_request(rt.world.Iallreduce(send, recv), timeout=cfg.run.timeout_s, rank=rt.rank, op="MPI all-reduce self-check")
    report = CheckReport(rt.rank, topo.device, backend_for(topo.device), rt.handshake_rtt_s, init_s, ok, value,
                         expected, allreduce_s, int(recv[0]) == int(expected))
    rt.send(report)
    return report
