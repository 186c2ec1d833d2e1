"""Fetch throughput across MPI ranks against raw Send/Recv of the same bytes, side by side in one run.

    python tools/bench_fetch.py                      # relaunches itself under `mpiexec -n 4`
    mpiexec -n 4 python tools/bench_fetch.py --json  # one JSON object on the last line

Every rank holds ``--samples`` samples in its SampleStore (memory cache large enough for all of
them, so the MPI path is measured, not the disk) and runs a service thread polling its FetchServer.
In a *fetch* round every rank fetches ``--batch`` random samples from every other rank with one
``FetchClient.fetch`` call (all owners at once). In a *raw* round every rank moves exactly the same
bytes with upper-case ``Isend``/``Irecv`` from preallocated buffers — one message per pair of
ranks, the bytes of the samples that pair exchanges — and ``Waitall``. Phases of ``--rounds`` rounds
alternate raw/fetch ``--repeats`` times; each phase is timed between barriers (slowest rank) and
the best phase of each side counts (the least disturbed by other processes; medians are printed
too). MB/s = payload bytes (12 per token) moved by all ranks / time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks when relaunching under mpiexec")
    ap.add_argument("--mpiexec", default="mpiexec")
    ap.add_argument("--samples", type=int, default=256, help="samples held per rank")
    ap.add_argument("--mean-len", type=int, default=2048, help="mean tokens per sample")
    ap.add_argument("--batch", type=int, default=32, help="samples fetched from each owner per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="fetch timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    return ap.parse_args(argv)


def make_samples(rank: int, n: int, mean_len: int, seed: int) -> list:
    from reflow_hpc.trajectory import Trajectory
    rng = np.random.default_rng([seed, rank])
    out = []
    for i in range(n):
        length = int(rng.integers(mean_len // 4, mean_len * 7 // 4 + 1))
        prompt = min(length, 128)
        versions = np.full(length, -1, np.int32)
        versions[prompt:] = 1
        out.append(Trajectory(sample_id=rank * 1_000_000 + i, group_id=i // 8, prompt_id=i // 8,
                              tokens=rng.integers(0, 151_000, length, dtype=np.int32),
                              logprobs=rng.standard_normal(length).astype(np.float32), versions=versions,
                              prompt_len=prompt, reward=1.0, finish_reason="stop", meta={"i": i}))
    return out


def lengths_of(rank: int, n: int, mean_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    out = np.empty(n, np.int64)
    for i in range(n):   # same draws as make_samples, so every rank knows every rank's lengths
        out[i] = int(rng.integers(mean_len // 4, mean_len * 7 // 4 + 1))
        rng.integers(0, 151_000, out[i], dtype=np.int32)
        rng.standard_normal(out[i])
    return out


def plan(rounds: int, size: int, n: int, batch: int, seed: int) -> list[dict]:
    """For each round: {(requester, owner): sample indices}, the same on every rank."""
    rng = np.random.default_rng([seed, 99])
    return [{(r, o): rng.choice(n, batch, replace=False).tolist() for r in range(size) for o in range(size) if r != o}
            for _ in range(rounds)]


def run(args: argparse.Namespace) -> int:
    import mpi4py
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    from reflow_hpc.config import StorageConfig
    from reflow_hpc.storage import SampleStore
    from reflow_hpc.comm.channel import ControlChannel
    from reflow_hpc.runtime.service import ServiceThread
    from reflow_hpc.storage.fetch import FetchClient, FetchServer

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        print("bench_fetch needs at least 2 ranks", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix=f"bench_fetch-r{rank}-"))
    trajs = make_samples(rank, args.samples, args.mean_len, args.seed)
    all_lengths = [lengths_of(r, args.samples, args.mean_len, args.seed) for r in range(size)]
    rounds = plan(args.rounds, size, args.samples, args.batch, args.seed)
    payload = 12 * sum(int(all_lengths[o][ix].sum()) for rnd in rounds for (_, o), ix in rnd.items())
    samples_moved = args.rounds * size * (size - 1) * args.batch

    store = SampleStore(scratch / "shard", rank, StorageConfig(memory_mib=1 << 20))
    store.put(trajs)
    store.flush()
    server = FetchServer(comm, store)
    service = ServiceThread(ControlChannel(MPI.COMM_WORLD.Dup(), poll_min_s=1e-4, poll_max_s=1e-3),
                            pollers=[server.poll])
    service.start()
    client = FetchClient(comm, args.timeout, store=store, poll_min_s=1e-5, poll_max_s=1e-3)

    # Raw side: one preallocated byte buffer per peer, as large as the largest message of the run.
    biggest = max(12 * int(all_lengths[o][ix].sum()) for rnd in rounds for (_, o), ix in rnd.items())
    send_buf = {p: np.ones(biggest, np.uint8) for p in range(size) if p != rank}
    recv_buf = {p: np.empty(biggest, np.uint8) for p in range(size) if p != rank}

    def raw_phase() -> None:
        for rnd in rounds:
            reqs = []
            for p in range(size):
                if p == rank:
                    continue
                n_in = 12 * int(all_lengths[p][rnd[(rank, p)]].sum())     # what I fetch from p
                n_out = 12 * int(all_lengths[rank][rnd[(p, rank)]].sum())  # what p fetches from me
                reqs.append(comm.Irecv(recv_buf[p][:n_in], source=p, tag=7))
                reqs.append(comm.Isend(send_buf[p][:n_out], dest=p, tag=7))
            MPI.Request.Waitall(reqs)

    received = [0]

    def fetch_phase() -> None:
        for rnd in rounds:
            want = {p: [p * 1_000_000 + i for i in rnd[(rank, p)]] for p in range(size) if p != rank}
            got = client.fetch(want)
            received[0] += sum(t.tokens.nbytes + t.logprobs.nbytes + t.versions.nbytes for t in got.values())

    def timed(phase) -> float:
        comm.Barrier()
        t0 = MPI.Wtime()
        phase()
        comm.Barrier()
        return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)

    timed(raw_phase)      # warm-up of both paths (connections, allocations)
    timed(fetch_phase)
    received[0] = 0
    raw_s, fetch_s = [], []
    for _ in range(args.repeats):
        raw_s.append(timed(raw_phase))
        fetch_s.append(timed(fetch_phase))
    total_received = comm.allreduce(received[0], op=MPI.SUM)
    service.stop()
    service.join()
    store.close()
    shutil.rmtree(scratch, ignore_errors=True)
    if total_received != payload * args.repeats:
        print(f"rank {rank}: fetched {total_received} bytes, expected {payload * args.repeats}", file=sys.stderr)
        return 1
    if rank == 0:
        mb = payload / 1e6
        raw_t, fetch_t = min(raw_s), min(fetch_s)
        median_ratio = statistics.median(raw_s) / statistics.median(fetch_s)
        result = {"ranks": size, "samples_per_rank": args.samples, "mean_len": args.mean_len, "batch": args.batch,
                  "rounds": args.rounds, "repeats": args.repeats, "payload_mb_per_phase": round(mb, 1),
                  "raw_mb_s": round(mb / raw_t, 1), "fetch_mb_s": round(mb / fetch_t, 1),
                  "fetch_samples_s": round(samples_moved / fetch_t, 1),
                  "raw_samples_s": round(samples_moved / raw_t, 1),
                  "ratio": round(raw_t / fetch_t, 3), "ratio_of_medians": round(median_ratio, 3),
                  "raw_phases_s": [round(x, 4) for x in raw_s], "fetch_phases_s": [round(x, 4) for x in fetch_s]}
        print(f"fetch vs raw Send/Recv: {size} ranks, each fetching {args.batch} samples from every other rank "
              f"per round, {args.rounds} rounds = {samples_moved} samples, {mb:.1f} MB per phase, "
              f"best of {args.repeats}")
        print(f"{'side':<8}{'MB/s':>10}{'samples/s':>12}  phases (s)")
        print(f"{'raw':<8}{mb / raw_t:>10.1f}{samples_moved / raw_t:>12.1f}  " + " ".join(f"{x:.3f}" for x in raw_s))
        print(f"{'fetch':<8}{mb / fetch_t:>10.1f}{samples_moved / fetch_t:>12.1f}  "
              + " ".join(f"{x:.3f}" for x in fetch_s))
        print(f"ratio fetch/raw: {raw_t / fetch_t:.3f} (ratio of medians {median_ratio:.3f})")
        if args.json:
            print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not any(k in os.environ for k in _MPI_ENV):
        # Started without MPI: relaunch under mpiexec before MPI is initialised in this process.
        cmd = [args.mpiexec, "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), *argv]
        try:
            return subprocess.run(cmd, timeout=args.timeout * (args.repeats + 2) + 120).returncode
        except subprocess.TimeoutExpired:
            print(f"bench_fetch: {' '.join(cmd)} timed out", file=sys.stderr)
            return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
