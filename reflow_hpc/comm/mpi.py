"""MPI start-up and the polling primitives every thread uses.

- MPI is initialised with ``MPI_THREAD_MULTIPLE``: the coordinator thread (rank 0), the service
  thread and the main thread of a worker all talk MPI at once.
- Nobody blocks inside MPI without a deadline. Receives are matched probes (``improbe``: the probe
  and the receive cannot be split by another thread) and requests are tested in a loop that sleeps
  with exponential back-off between ``run.poll_min_s`` and ``run.poll_max_s``, so an idle thread
  costs almost no CPU and a silent peer ends in :class:`RankTimeout` naming the rank and operation.
- Object collectives (broadcast of a rendezvous address) are done with non-blocking buffer
  collectives under the same deadline.
- Under Slurm's ``mpi/pmi2`` plugin an MPICH that has both modules starts on OFI, not UCX
  (:func:`netmod_override` says why); a user's own choice of module is kept.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

_MPI = None


def under_launcher() -> bool:
    """True when this process was started by an MPI launcher or as a Slurm step task."""
    markers = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
               "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "SLURM_STEP_ID")
    return any(m in os.environ for m in markers)


# Environment variables through which a user chooses MPICH's network module himself.
NETMOD_VARS = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")


def netmod_override(library: str, env: Mapping[str, str]) -> str | None:
    """The MPICH network module to select before ``MPI_Init``, or None to leave the library's choice.

    MPICH's UCX module publishes a 4 KiB business card per rank through PMI, padded past the real
    UCX address with whatever lies next to it on the heap, and cut into PMI-1 ``put`` lines of up to
    ~1080 bytes. Slurm's ``mpi/pmi2`` plugin reads a PMI-1 request with a single 1024-byte ``read``:
    whenever the heap bytes do not compress (MPICH hex-encodes with run-length), a line is split, the
    step daemon rejects both halves ("value not properly terminated in client request") and
    MPI_Init fails. Whether it does depends on what the process allocated before MPI_Init, so jobs
    failed at random, most often when restarted after a requeue. The OFI module publishes its fixed-size
    socket address instead, a short line. Hydra's own PMI server reads whole lines and is not affected.
    """
    lines = library.splitlines()
    device = next((ln for ln in lines if ln.startswith("MPICH Device:")), "")
    if not lines or not lines[0].startswith("MPICH") or "ucx" not in device or "ofi" not in device:
        return None
    if "PMI_JOBID" not in env or "PMI_FD" not in env or "HYDI_CONTROL_FD" in env:
        return None                 # not Slurm's mpi/pmi2 plugin serving PMI-1 on a socket
    if any(v in env for v in NETMOD_VARS):
        return None
    return "ofi"


def launcher_rank() -> str:
    """This process's rank as the launcher announced it (before MPI can say), or '?'."""
    for var in ("PMI_RANK", "SLURM_PROCID", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return os.environ[var]
    return "?"


def init(timeout_s: float | None = None) -> Any:
    """Initialise MPI once (thread level multiple) and return the ``MPI`` module.

    ``timeout_s`` bounds ``MPI_Init`` itself: it waits on every other rank and on the launcher's PMI
    exchange, and would wait forever for a rank that never starts or a PMI request the server lost.
    Past it the rank writes one line naming itself and exits 1 (the launcher then ends the others).
    """
    global _MPI
    if _MPI is None:
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
        mpi4py.rc.initialize = False        # initialised below, once the network module is chosen
        mpi4py.rc.finalize = True
        from mpi4py import MPI
        if not MPI.Is_initialized():
            netmod = netmod_override(MPI.Get_library_version(), os.environ)
            if netmod is not None:
                os.environ[NETMOD_VARS[0]] = netmod
            _init_thread(MPI, timeout_s)
            if netmod is not None and MPI.COMM_WORLD.Get_rank() == 0:
                print(f"reflow_hpc: MPICH under Slurm's pmi2 plugin: network module {netmod!r} instead of UCX, whose "
                      f"start-up messages overflow the plugin's 1024-byte PMI-1 reads (set {NETMOD_VARS[0]} to "
                      f"choose)", file=sys.stderr, flush=True)
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: the MPI library provides thread level "
                               f"{MPI.Query_thread()}, reflow_hpc needs MPI_THREAD_MULTIPLE "
                               f"({MPI.Get_library_version().splitlines()[0]})")
        _MPI = MPI
    return _MPI


def _init_thread(MPI: Any, timeout_s: float | None) -> None:
    if timeout_s is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    import ctypes
    import threading

    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            os.write(2, f"reflow_hpc: rank {launcher_rank()}: MPI_Init: the launcher's start-up exchange did not "
                        f"complete after {timeout_s:.1f} s (run.timeout_s); a rank that never started, or the "
                        f"PMI server lost a request (the launcher's or slurmd's log names it)\n".encode())
            os._exit(1)

    if launcher_rank().isdigit():
        from .failure import failpoint
        failpoint("mpi_init", int(launcher_rank()))         # (tests: a rank that never reaches MPI_Init)
    threading.Thread(target=watchdog, name="mpi-init-watchdog", daemon=True).start()
    # mpi4py keeps the GIL during MPI_Init_thread, so the watchdog could never run; a ctypes call into
    # the same library (the one mpi4py's extension links) releases it.
    provided = ctypes.c_int(0)
    try:
        code = ctypes.CDLL(MPI.__file__).MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE),
                                                         ctypes.byref(provided))
    finally:
        done.set()
    if code != 0:
        raise RuntimeError(f"rank {launcher_rank()}: MPI_Init_thread failed with error code {code}")
    # What mpi4py does after an MPI_Init_thread of its own (mpi4py.rc.errors = "exception"): an MPI
    # error raises MPI.Exception instead of aborting the job.
    for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
        comm.Set_errhandler(MPI.ERRORS_RETURN)


class RankTimeout(TimeoutError):
    """A wait on another rank ran out of time; the message names both ranks and the operation."""

    def __init__(self, rank: int, op: str, seconds: float, peer: int | str | None = None):
        self.rank, self.op, self.seconds, self.peer = rank, op, seconds, peer
        who = f" from rank {peer}" if peer is not None else ""
        super().__init__(f"rank {rank}: {op}: no answer{who} after {seconds:.1f} s")


@dataclass
class Backoff:
    """Exponential back-off for polling loops: reset on progress, double while idle."""
    min_s: float = 1e-4
    max_s: float = 1e-2

    def __post_init__(self) -> None:
        self.current = self.min_s

    def progress(self) -> None:
        self.current = self.min_s

    def idle(self, remaining_s: float | None = None) -> None:
        """Sleep the current back-off (never past ``remaining_s``, the time left to a deadline)."""
        time.sleep(self.current if remaining_s is None else max(0.0, min(self.current, remaining_s)))
        self.current = min(self.current * 2, self.max_s)


def wait_until(pred: Callable[[], Any], *, timeout: float, rank: int, op: str, peer: int | str | None = None,
               backoff: Backoff | None = None, alive: Callable[[], bool] | None = None,
               clock: Callable[[], float] = time.monotonic, raise_on_timeout: bool = True) -> Any:
    """Poll ``pred()`` until it returns something other than None/False and return that; the one
    polling loop of the package.

    Between polls it sleeps ``backoff`` (never past the deadline); ``pred`` may call
    ``backoff.progress()`` to keep polling at the fast rate (a transfer moves only while this rank
    calls MPI). After ``timeout`` seconds it raises :class:`RankTimeout` naming ``rank``, ``op`` and
    ``peer`` (or returns False with ``raise_on_timeout=False``). ``alive`` lets a caller abandon the
    wait early (e.g. shutdown was requested); then None is returned.
    """
    backoff = backoff or Backoff()
    deadline = clock() + timeout
    while True:
        result = pred()
        if result is not None and result is not False:
            return result
        if alive is not None and not alive():
            return None
        now = clock()
        if now >= deadline:
            if raise_on_timeout:
                raise RankTimeout(rank, op, timeout, peer)
            return False
        backoff.idle(deadline - now)


def wait_request(req: Any, *, timeout: float, rank: int, op: str, peer: int | str | None = None,
                 backoff: Backoff | None = None) -> None:
    """Complete a non-blocking MPI request under a deadline (cancel it on timeout)."""
    try:
        wait_until(req.Test, timeout=timeout, rank=rank, op=op, peer=peer, backoff=backoff)
    except RankTimeout:
        try:
            req.Cancel()
        except Exception:  # some requests (collectives) cannot be cancelled; the job ends anyway
            pass
        raise


def bcast_obj(comm: Any, obj: Any, root: int, *, timeout: float, op: str, backoff: Backoff | None = None) -> Any:
    """Broadcast a small picklable object with non-blocking collectives under a deadline."""
    MPI = init()
    rank = comm.Get_rank()
    payload = pickle.dumps(obj) if rank == root else b""
    size = np.array([len(payload)], dtype=np.int64)
    wait_request(comm.Ibcast([size, MPI.INT64_T], root=root), timeout=timeout, rank=rank,
                 op=f"{op} (size)", peer=root if rank != root else None, backoff=backoff)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if rank == root else np.empty(int(size[0]), np.uint8)
    wait_request(comm.Ibcast([buf, MPI.BYTE], root=root), timeout=timeout, rank=rank, op=op,
                 peer=root if rank != root else None, backoff=backoff)
    return obj if rank == root else pickle.loads(buf.tobytes())


def barrier(comm: Any, *, timeout: float, op: str, backoff: Backoff | None = None) -> None:
    wait_request(comm.Ibarrier(), timeout=timeout, rank=comm.Get_rank(), op=op, backoff=backoff)


def library_version() -> str:
    MPI = init()
    return MPI.Get_library_version().strip().splitlines()[0].strip()
