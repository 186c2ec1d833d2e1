"""MPI program for tests/integration/test_fetch_mpi.py: owners that stop answering make a fetch fail in time.

    mpiexec -n 4 python tests/helpers/fetch_unresponsive.py DIR [--timeout T]

rank 0 fetches; rank 1 serves normally; rank 2 is alive but its service thread was stopped; rank 3
hangs outside MPI. Rank 0 must get FetchTimeout errors naming ranks 2 and 3 (and the samples of rank 1
in the error's `partial`), print them, and then end the job with MPI_Abort — what the runtime does on
a fatal error — so that no rank is left running. Every rank prints its pid for the test to check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mpi4py

mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage_samples import difference, make_sample, sample_id  # noqa: E402

from reflow_hpc.config import StorageConfig  # noqa: E402
from reflow_hpc.storage import SampleStore  # noqa: E402
from reflow_hpc.comm.channel import ControlChannel  # noqa: E402
from reflow_hpc.runtime.service import ServiceThread  # noqa: E402
from reflow_hpc.storage.fetch import FetchClient, FetchServer, FetchTimeout  # noqa: E402

HANG_S = 300.0   # far beyond the test's patience: only MPI_Abort ends rank 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == 4, "run with mpiexec -n 4"
    print(f"PID {rank} {os.getpid()}", flush=True)
    store = SampleStore(Path(args.dir) / f"rank{rank}", rank, StorageConfig(flush_rows=4))
    store.put(make_sample(1, rank, i) for i in range(10))
    control = MPI.COMM_WORLD.Dup()          # the service thread's own communicator, as in the runtime
    if rank in (0, 1):
        server = FetchServer(comm, store)
        ServiceThread(ControlChannel(control, poll_min_s=1e-4, poll_max_s=5e-3), pollers=[server.poll]).start()
    # Every owner holds its samples (and ranks 0-1 serve) before anyone fetches or stops answering:
    # otherwise a slow start of rank 1 would look like an unresponsive owner.
    comm.Barrier()
    if rank == 3:
        time.sleep(HANG_S)          # hangs: no MPI call, no service thread
    if rank != 0:
        while True:                 # rank 1 keeps serving, rank 2 keeps living without serving
            time.sleep(0.05)
    client = FetchClient(comm, args.timeout, store=store, poll_min_s=1e-4, poll_max_s=5e-3)
    ids = {o: [sample_id(o, i) for i in range(o, o + 5)] for o in (1, 2, 3)}
    t0 = time.monotonic()
    try:
        client.fetch(ids)
        print("FAIL fetch from unresponsive ranks returned", flush=True)
    except FetchTimeout as e:
        bad = [d for i in ids[1] for d in [difference(make_sample(1, 1, i - sample_id(1, 0)), e.partial[i])] if d]
        print(f"TIMEOUT1 after {time.monotonic() - t0:.2f} s ranks={e.ranks} partial={len(e.partial)} "
              f"partial_ok={not bad}: {e}", flush=True)
    t0 = time.monotonic()
    try:
        client.fetch({2: ids[2]})
        print("FAIL fetch from a stopped service thread returned", flush=True)
    except FetchTimeout as e:
        print(f"TIMEOUT2 after {time.monotonic() - t0:.2f} s ranks={e.ranks}: {e}", flush=True)
    sys.stdout.flush()
    comm.Abort(7)   # a fetch that timed out is fatal for the job: end every rank
    return 0


if __name__ == "__main__":
    sys.exit(main())
