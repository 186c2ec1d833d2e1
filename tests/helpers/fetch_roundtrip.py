"""MPI program for tests/integration/test_fetch_mpi.py: every rank stores samples, serves them from a service
thread, and fetches every other rank's samples from two threads at once, checking them bit for bit.

    mpiexec -n 4 python tests/helpers/fetch_roundtrip.py DIR [--seed S] [--samples N] [--timeout T]
"""

from __future__ import annotations

import argparse
import sys
import threading
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
from reflow_hpc.storage.fetch import FetchClient, FetchError, FetchServer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    control = MPI.COMM_WORLD.Dup()          # the service thread's own communicator, as in the runtime
    rank, size = comm.Get_rank(), comm.Get_size()
    # A small memory cache and small segments: most fetched samples come back from closed shard
    # segments, some from the open one, some from memory.
    cfg = StorageConfig(flush_rows=8, segment_mib=0.02, memory_mib=0.01)
    store = SampleStore(Path(args.dir) / f"rank{rank}", rank, cfg)
    n = args.samples
    store.put(make_sample(args.seed, rank, i) for i in range(n - 3))
    store.put([make_sample(args.seed, rank, i) for i in range(n - 3, n)])   # still pending in the writer
    server = FetchServer(comm, store)
    service = ServiceThread(ControlChannel(control, poll_min_s=1e-4, poll_max_s=5e-3),
                            pollers=[server.poll, store.maybe_flush])
    service.start()
    client = FetchClient(comm, args.timeout, store=store, poll_min_s=1e-4, poll_max_s=5e-3)
    failures: list[str] = []
    checked = [0]

    def check(got: dict, wanted: dict) -> None:
        for owner, ids in wanted.items():
            for i in ids:
                sid = sample_id(owner, i)
                if sid not in got:
                    failures.append(f"rank {rank}: sample {sid} of rank {owner} missing")
                    continue
                diff = difference(make_sample(args.seed, owner, i), got[sid])
                if diff:
                    failures.append(f"rank {rank}: sample {sid}: {diff}")
                checked[0] += 1

    def fetch_all() -> None:
        # Everything from everyone (own rank included), in one call: owners answer in parallel.
        wanted = {o: list(range(n)) for o in range(size)}
        check(client.fetch({o: [sample_id(o, i) for i in ids] for o, ids in wanted.items()}), wanted)

    def fetch_subsets() -> None:
        rng = __import__("random").Random(rank)
        for _ in range(10):
            wanted = {o: rng.sample(range(n), 7) for o in range(size) if o != rank}
            check(client.fetch({o: [sample_id(o, i) for i in ids] for o, ids in wanted.items()}), wanted)

    try:
        other = threading.Thread(target=lambda: _guard(fetch_subsets, failures), name="fetcher")
        other.start()
        _guard(fetch_all, failures)
        other.join()
        # An unknown id comes back as an error naming the owner and the id.
        peer = (rank + 1) % size
        try:
            client.fetch({peer: [sample_id(peer, 0), sample_id(peer, n + 5)]})
            failures.append(f"rank {rank}: fetch of an unknown id did not fail")
        except FetchError as e:
            if f"rank {peer}" not in str(e) or str(sample_id(peer, n + 5)) not in str(e) or e.ranks != [peer]:
                failures.append(f"rank {rank}: unclear error for an unknown id: {e}")
            print(f"rank {rank}: unknown id error: {e}", flush=True)
    finally:
        # Keep serving until every rank has finished fetching.
        barrier = comm.Ibarrier()
        deadline = time.monotonic() + args.timeout
        while not barrier.Test():
            if time.monotonic() > deadline:
                print(f"rank {rank}: final barrier timed out after {args.timeout} s", flush=True)
                comm.Abort(3)
            time.sleep(1e-3)
        service.stop()
        service.join()
        store.close()
    for f in failures[:20]:
        print("FAIL", f, flush=True)
    if not failures:
        print(f"OK rank {rank}: {checked[0]} samples verified bit for bit, served {server.served_requests} "
              f"requests ({server.served_samples} samples)", flush=True)
    return 1 if failures else 0


def _guard(fn, failures: list[str]) -> None:
    try:
        fn()
    except Exception as e:
        failures.append(f"{fn.__name__}: {e.__class__.__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
