"""Each rank's account of its training (reflow_hpc/runtime/rankstats.py): the cgroup figures it reads, the
record it writes and rank 0's gathering, on fake cgroup trees and a stand-in worker."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from reflow_hpc.rollout.engine import EngineStats
from reflow_hpc.runtime import rankstats


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v1_cpu_group_gives_its_throttling_and_cpuacct_its_usage(tmp_path):
    write(tmp_path / "cpu" / "reflow-7-rank2" / "cpu.stat", "nr_periods 100\nnr_throttled 30\nthrottled_time 2500000000\n")
    got = rankstats.cgroup_cpu("4:memory:/x\n2:cpuacct:/\n1:cpu:/reflow-7-rank2\n0::/\n", tmp_path)
    assert got == {"cpu_group": str(tmp_path / "cpu" / "reflow-7-rank2"), "cgroup_cpu_s": None, "periods": 100,
                   "throttled_periods": 30, "throttled_s": 2.5}
    # cpu and cpuacct mounted together: the group accounts its CPU time too
    write(tmp_path / "cpu,cpuacct" / "g" / "cpu.stat", "nr_periods 1\nnr_throttled 0\nthrottled_time 0\n")
    write(tmp_path / "cpu,cpuacct" / "g" / "cpuacct.usage", "1500000000\n")
    assert rankstats.cgroup_cpu("3:cpu,cpuacct:/g\n", tmp_path)["cgroup_cpu_s"] == pytest.approx(1.5)
    # or a cpuacct group of its own, mounted apart
    write(tmp_path / "cpuacct" / "h" / "cpuacct.usage", "4000000000\n")
    assert rankstats.cgroup_cpu("2:cpuacct:/h\n1:cpu:/reflow-7-rank2\n", tmp_path)["cgroup_cpu_s"] == pytest.approx(4.0)


def test_cgroup_v2_and_no_group_of_its_own(tmp_path):
    write(tmp_path / "job" / "rank0" / "cpu.stat",
          "usage_usec 3000000\nuser_usec 2000000\nnr_periods 10\nnr_throttled 2\nthrottled_usec 500000\n")
    got = rankstats.cgroup_cpu("0::/job/rank0\n", tmp_path)
    assert got["cgroup_cpu_s"] == pytest.approx(3.0) and got["throttled_s"] == pytest.approx(0.5)
    assert got["periods"] == 10 and got["throttled_periods"] == 2
    # the root group's figures are the machine's: none
    assert rankstats.cgroup_cpu("1:cpu:/\n0::/\n", tmp_path)["cpu_group"] is None
    assert rankstats.cgroup_cpu("", tmp_path)["cgroup_cpu_s"] is None


def worker(rank=1, trainers=(0,), rollouts=(1,), generate_s=4.0, tokens=2000, generate_cpu_s=2.5):
    def generated():
        if tokens is None:
            raise RuntimeError("engine stopped")
        return tokens
    return SimpleNamespace(rank=rank, trainers=trainers, rollouts=rollouts, follower=None, leader=rank,
                           engine=SimpleNamespace(stats=lambda: EngineStats(prefilled_tokens=300, decode_steps=1000)),
                           rt=SimpleNamespace(service=SimpleNamespace(ident=1, name=f"service-{rank}", cpu_s=0.5)),
                           generate_s=generate_s, generate_cpu_s=generate_cpu_s, train_s=0.0, train_steps=0, account=rankstats.RankAccount(),
                           _generated_tokens=generated)


def test_a_stopped_workers_record(tmp_path):
    rec = rankstats.worker_record(worker())
    assert rec["rank"] == 1 and rec["role"] == "rollout" and rec["generated_tokens"] == 2000
    assert rec["busy_generation_tokens_per_s"] == pytest.approx(500.0)
    assert rec["wall_s"] >= 0 and rec["cpu_s"] >= 0 and rec["threads"] >= 1
    assert rec["generation_tokens_per_cpu_s"] == pytest.approx(800.0)
    assert (rec["prefilled_tokens"], rec["decode_steps"]) == (300, 1000)
    assert rec["thread_cpu_s"]["service-1"] == 0.5          # the service thread ended at the Stop: its own figure
    assert rankstats.worker_record(worker(rank=0, trainers=(0,), rollouts=(0,)))["role"] == "trainer+rollout"
    idle = rankstats.worker_record(worker(rank=2, generate_s=0.0, tokens=None))
    assert idle["role"] == "idle" and idle["busy_generation_tokens_per_s"] is None and idle["generated_tokens"] is None


def test_records_are_written_and_gathered_in_rank_order(tmp_path, capsys):
    start = time.time()
    for r in (1, 0):
        rankstats.write_record(tmp_path, worker(rank=r))
    assert (tmp_path / "ranks" / "rank00001.json").is_file()
    got = rankstats.gather_records(tmp_path, 3, since=start, wait_s=0.1)     # rank 2 never writes: left out
    assert [r["rank"] for r in got] == [0, 1]
    # a record of an earlier process set of the same run is not this one's
    old = json.loads((tmp_path / "ranks" / "rank00000.json").read_text())
    (tmp_path / "ranks" / "rank00000.json").write_text(json.dumps({**old, "stopped_at": start - 100}))
    assert [r["rank"] for r in rankstats.gather_records(tmp_path, 2, since=start, wait_s=0.0)] == [1]
    # a record that cannot be made is one line, not an error
    rankstats.write_record(tmp_path, SimpleNamespace(rank=5))
    assert "rank 5: rank record not written" in capsys.readouterr().err


def test_the_account_says_which_thread_used_the_cpu():
    """A thread that spins while the account runs shows under its own name with about the CPU it used,
    and the process's other threads are what is left of its own CPU time."""
    account = rankstats.RankAccount()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="spinner", daemon=True)
    t.start()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.3:                # the main thread's own share
        sum(range(1000))
    time.sleep(0.2)
    rec = account.record(0, "rollout", 1.0, 100, 0.0, 0, generate_cpu_s=None,
                         ended=((-1, "service-0", 0.25),))    # a thread gone before the stop: its own figure
    stop.set()
    t.join()
    threads = rec["thread_cpu_s"]
    assert threads["spinner"] > 0.05 and threads["MainThread"] >= 0.3 and threads["service-0"] == 0.25
    assert rec["other_threads_cpu_s"] >= 0 and rec["children_cpu_s"] >= 0
    assert rec["cpu_s"] >= threads["spinner"] + threads["MainThread"] - 0.05
    assert rec["generate_cpu_s"] is None and rec["generation_tokens_per_cpu_s"] is None
