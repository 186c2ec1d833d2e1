"""Each rank's own account of its training: CPU time, threads, and the time it spent generating and
training, so that a benchmark (``tools/bench_modes.py``, ``tools/bench_learning.py``) can tell a
slow rank, or a mode whose ranks ran under other conditions, from a slow algorithm.

The account covers the worker's life, from its start (before set-up) to the coordinator's Stop (the
evaluation after training is not in it). Every rank then writes ``ranks/rank<NNNNN>.json`` in the run
directory (:func:`write_record`), and rank 0 gathers the records into summary.json's ``ranks``, one per
rank in rank order (:func:`gather_records`: it waits up to ``GATHER_WAIT_S`` for a rank whose record
is not there yet, then leaves it out). Writing a record never fails a run: a rank that cannot says so
in one line. The keys of a record:

| key | meaning |
| --- | --- |
| ``rank`` | the rank |
| ``role`` | its role at the stop: ``trainer``, ``rollout``, ``trainer+rollout`` (colocated) or ``idle`` |
| ``wall_s`` | seconds from the worker's start to its stop |
| ``cpu_s`` | CPU seconds of the rank's process over that time: every thread, user + system, and the child processes it waited for (``getrusage``) |
| ``cgroup_cpu_s`` | CPU seconds of the rank's own cgroup over that time (every process in it): ``usage_usec`` of ``cpu.stat`` on cgroup v2, ``cpuacct.usage`` on v1; None when the rank is in no cgroup of its own or its group does not account CPU (cgroup v1 with ``cpuacct`` mounted apart from ``cpu``, where ``resources.cpu_quota``'s group is a ``cpu`` group only: ``cpu_s`` is then the figure) |
| ``cpu_group`` | that CPU cgroup's directory (None without one: no ``resources.cpu_quota``, or not applied) |
| ``periods``, ``throttled_periods``, ``throttled_s`` | of the group's ``cpu.stat`` over that time: CFS periods, those in which the quota held the rank back, and how long it was held back |
| ``threads`` | the process's threads at the stop (``/proc/self/status``) |
| ``torch_threads``, ``torch_interop_threads`` | torch's intra-op and inter-op thread pools |
| ``generate_s`` | wall seconds the worker spent stepping its engine with requests in flight |
| ``generate_cpu_s`` | CPU seconds its main thread used over those wall seconds (``generate_cpu_s`` ÷ ``generate_s``: the share of a core generation got while it had work; below the cap when other threads of the rank, or its children, took the rest) |
| ``prefilled_tokens``, ``decode_steps`` | the engine's prefilled tokens (re-prefills after a weight sync's abort or a preemption included) and its decode forwards (``generated_tokens`` ÷ ``decode_steps``: the mean running requests per decode); None where the engine does not count them (vLLM) |
| ``generation_tokens_per_cpu_s`` | ``generated_tokens`` ÷ ``generate_cpu_s``: the engine's cost per token, whatever share of the CPU it got (None without generation) |
| ``thread_cpu_s`` | CPU seconds of each Python thread over the account's time, by thread name: those alive at the stop (``MainThread``, the coordinator's thread on rank 0) and the service thread (``service-<rank>``), which ends at the Stop |
| ``other_threads_cpu_s`` | CPU seconds of the process's other threads (torch's and the MPI library's pools, threads that ended): the process's own CPU time less ``thread_cpu_s`` |
| ``children_cpu_s`` | CPU seconds of the child processes the rank waited for (a code sandbox's servers, a reward scorer) |
| ``generated_tokens`` | tokens its engine generated (a tensor-parallel follower's count as its leader's: 0) |
| ``busy_generation_tokens_per_s`` | ``generated_tokens`` ÷ ``generate_s`` (None without generation) |
| ``train_s``, ``train_steps`` | wall seconds spent in training steps (fetch included) and their number |
| ``stopped_at`` | Unix time of the stop (rank 0 keeps only records of this process set) |
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..private import private_dir, write_atomic

CGROUP_ROOT = Path("/sys/fs/cgroup")
GATHER_WAIT_S = 10.0            # rank 0's wait for the other ranks' records (they stop within moments)


def _ints(path: Path) -> dict[str, int]:
    """``key value`` lines of a cgroup stat file as numbers ({} when unreadable)."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def _one_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cgroup_cpu(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> dict[str, Any]:
    """The CPU figures of this process's own cgroup (cumulative since the group was made): ``cpu_group``,
    ``cgroup_cpu_s``, ``periods``, ``throttled_periods``, ``throttled_s``, each None where not found.
    ``proc_cgroup``: the text of /proc/self/cgroup (read when None). A process in its hierarchy's root
    group ("/") has no group of its own: the root's figures are the machine's, not the rank's."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    out: dict[str, Any] = {"cpu_group": None, "cgroup_cpu_s": None, "periods": None, "throttled_periods": None,
                           "throttled_s": None}

    def own(controller: str) -> str | None:
        p = paths.get(controller)
        return p.strip("/") if p is not None and p.strip("/") else None

    if own("cpu"):                                                       # cgroup v1
        for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            d = root / mount / own("cpu")
            if (d / "cpu.stat").is_file():
                stat = _ints(d / "cpu.stat")
                out.update(cpu_group=str(d), periods=stat.get("nr_periods"), throttled_periods=stat.get("nr_throttled"),
                           throttled_s=stat["throttled_time"] / 1e9 if "throttled_time" in stat else None)
                usage = _one_int(d / "cpuacct.usage")
                out["cgroup_cpu_s"] = usage / 1e9 if usage is not None else None
                break
        if out["cgroup_cpu_s"] is None and own("cpuacct"):
            for mount in ("cpuacct", "cpu,cpuacct", "cpuacct,cpu"):
                usage = _one_int(root / mount / own("cpuacct") / "cpuacct.usage")
                if usage is not None:
                    out["cgroup_cpu_s"] = usage / 1e9
                    break
    elif own(""):                                                        # cgroup v2
        for base in (root, root / "unified"):
            d = base / own("")
            stat = _ints(d / "cpu.stat")
            if "usage_usec" in stat:
                out.update(cpu_group=str(d), cgroup_cpu_s=stat["usage_usec"] / 1e6, periods=stat.get("nr_periods"),
                           throttled_periods=stat.get("nr_throttled"),
                           throttled_s=stat["throttled_usec"] / 1e6 if "throttled_usec" in stat else None)
                break
    return out


def _rusage_s(who: int) -> float:
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def python_threads_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds of every live Python thread so far, by thread ident: (name, seconds). A thread whose
    clock cannot be read (it ended meanwhile, or the platform has no per-thread clocks) is left out."""
    out: dict[int, tuple[str, float]] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            out[t.ident] = (t.name, time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
        except (OSError, AttributeError, OverflowError):
            pass
    return out


def thread_count() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class RankAccount:
    """Started with the worker; :meth:`record` closes it at the stop."""

    def __init__(self) -> None:
        self.t0, self.group0 = time.monotonic(), cgroup_cpu()
        self.self0, self.children0 = _rusage_s(resource.RUSAGE_SELF), _rusage_s(resource.RUSAGE_CHILDREN)
        self.threads0 = python_threads_cpu_s()
        self.started = time.time()

    def record(self, rank: int, role: str, generate_s: float, generated_tokens: int | None, train_s: float,
               train_steps: int, generate_cpu_s: float | None = None,
               ended: tuple[tuple[int, str, float], ...] = (),
               engine_counts: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
        """``ended``: (ident, name, CPU seconds) of threads that ended before the stop (the service thread)."""
        group = cgroup_cpu()
        own, children = _rusage_s(resource.RUSAGE_SELF) - self.self0, _rusage_s(resource.RUSAGE_CHILDREN) - self.children0
        rec: dict[str, Any] = {"rank": rank, "role": role, "wall_s": time.monotonic() - self.t0,
                               "cpu_s": own + children, "cpu_group": group["cpu_group"]}
        # Where the rank's CPU went, thread by thread: a thread born after the account started counts whole.
        threads: dict[str, float] = {}
        live = python_threads_cpu_s()
        for ident, name, s in ended:
            live.setdefault(ident, (name, s))
        for ident, (name, s) in live.items():
            before = self.threads0.get(ident)
            threads[name] = threads.get(name, 0.0) + s - (before[1] if before and before[0] == name else 0.0)
        rec["thread_cpu_s"] = threads
        rec["other_threads_cpu_s"] = max(0.0, own - sum(threads.values()))
        rec["children_cpu_s"] = children
        for key in ("cgroup_cpu_s", "periods", "throttled_periods", "throttled_s"):
            now, then = group[key], self.group0[key]
            rec[key] = now - then if now is not None and then is not None and group["cpu_group"] == \
                self.group0["cpu_group"] else None
        try:
            import torch
            rec["torch_threads"], rec["torch_interop_threads"] = (torch.get_num_threads(),
                                                                  torch.get_num_interop_threads())
        except Exception:  # noqa: BLE001 - no torch: the OS threads alone
            rec["torch_threads"] = rec["torch_interop_threads"] = None
        rec.update({"threads": thread_count(), "generate_s": generate_s, "generated_tokens": generated_tokens,
                    "busy_generation_tokens_per_s": (generated_tokens / generate_s
                                                     if generate_s > 0 and generated_tokens is not None else None),
                    "generate_cpu_s": generate_cpu_s,
                    "prefilled_tokens": engine_counts[0], "decode_steps": engine_counts[1],
                    "generation_tokens_per_cpu_s": (generated_tokens / generate_cpu_s
                                                    if generate_cpu_s and generated_tokens is not None else None),
                    "train_s": train_s, "train_steps": train_steps, "stopped_at": time.time()})
        return rec


def worker_record(worker: Any) -> dict[str, Any]:
    """The record of a :class:`~reflow_hpc.runtime.worker.Worker` that has stopped."""
    rank = worker.rank
    generating = rank in worker.rollouts or (worker.follower is not None and worker.leader in worker.rollouts)
    role = "+".join([r for r, on in (("trainer", rank in worker.trainers), ("rollout", generating)) if on]) or "idle"
    try:
        tokens = worker._generated_tokens()
    except Exception:  # noqa: BLE001 - an engine that no longer answers after its stop: the time alone
        tokens = None
    service = worker.rt.service
    ended = ((service.ident, service.name, service.cpu_s),) if service.cpu_s is not None else ()
    try:
        st = worker.engine.stats() if worker.engine is not None and worker.follower is None else None
        counts = (st.prefilled_tokens or None, st.decode_steps or None) if st is not None else (None, None)
    except Exception:  # noqa: BLE001 - as above
        counts = (None, None)
    return worker.account.record(rank, role, worker.generate_s, tokens, worker.train_s, worker.train_steps,
                                 worker.generate_cpu_s, ended, counts)


def record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank:05d}.json"


def write_record(run_dir: Path, worker: Any) -> None:
    """The stopped worker's record as ``ranks/rank<NNNNN>.json`` in the run directory; a failure is one
    line on stderr, not an error."""
    try:
        record = worker_record(worker)
        private_dir(Path(run_dir) / "ranks", what="rank records directory")
        write_atomic(record_path(run_dir, record["rank"]), json.dumps(record) + "\n")
    except Exception as e:  # noqa: BLE001 - an account for benchmarks: never worth a failed run
        print(f"reflow_hpc: rank {getattr(worker, 'rank', '?')}: rank record not written: {e}", file=sys.stderr,
              flush=True)


def gather_records(run_dir: Path, size: int, since: float = 0.0, wait_s: float = GATHER_WAIT_S) -> list[dict]:
    """The ranks' records that stopped after ``since`` (Unix time), in rank order, waiting up to ``wait_s``
    for missing ones."""
    deadline = time.monotonic() + wait_s
    found: dict[int, dict] = {}
    while True:
        for rank in range(size):
            if rank in found:
                continue
            try:
                rec = json.loads(record_path(run_dir, rank).read_text())
            except (OSError, ValueError):
                continue
            if rec.get("stopped_at", 0.0) >= since:
                found[rank] = rec
        if len(found) == size or time.monotonic() >= deadline:
            return [found[r] for r in sorted(found)]
        time.sleep(0.05)
