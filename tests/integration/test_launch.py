"""The launch path on real MPI ranks: self-check, self-relaunch, failing ranks."""

from __future__ import annotations

import json
import re
import sys
import time
import uuid

import pytest

from conftest import ROOT, leftover_processes, run_cmd

pytestmark = pytest.mark.mpi
CFG = str(ROOT / "configs" / "cpu_tiny.toml")


def _run(tmp_path, *extra, mpiexec=True, env=None, timeout=180, mpiexec_args=()):
    name = f"t{uuid.uuid4().hex[:10]}"
    args = ["python", "-m", "reflow_hpc.run", CFG, "--check", "--set", f"run.output_dir={tmp_path}",
            "--set", f"run.name={name}", *extra]
    if mpiexec:
        args = ["mpiexec", *mpiexec_args, "-n", "4", *args]
    t0 = time.monotonic()
    r = run_cmd(args, env=env, timeout=timeout)
    return r, time.monotonic() - t0, tmp_path / name, name


def _assert_topology(run_dir, ranks=4, nodes=None):
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["world_size"] == ranks and len(topo["ranks"]) == ranks
    assert [r["rank"] for r in topo["ranks"]] == list(range(ranks))
    assert topo["verified"] is True
    ar = topo["torch_distributed"]["allreduce"]
    assert ar["ok"] and ar["value"] == ar["expected"] == ranks * (ranks + 1) / 2
    assert topo["torch_distributed"]["backend"] == "gloo"
    assert "MPICH" in topo["mpi"]["library"] or "Open MPI" in topo["mpi"]["library"]
    assert len({r["pid"] for r in topo["ranks"]}) == ranks
    assert all(r["scratch"].endswith(f"rank{r['rank']:05d}") for r in topo["ranks"])
    if nodes is not None:
        assert topo["num_nodes"] == nodes
    return topo


def test_check_under_mpiexec(tmp_path):
    r, _, run_dir, _ = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "self-check: 4 ranks" in r.stdout
    _assert_topology(run_dir, nodes=1)


def test_check_relaunches_itself_without_mpiexec(tmp_path):
    r, _, run_dir, _ = _run(tmp_path, mpiexec=False)
    assert r.returncode == 0, r.stderr
    _assert_topology(run_dir)


def test_rank_count_must_match_config(tmp_path):
    r = run_cmd(["mpiexec", "-n", "2", "python", "-m", "reflow_hpc.run", CFG, "--check",
                 "--set", f"run.output_dir={tmp_path}"], timeout=120)
    assert r.returncode == 2
    assert "config error: resources.workers = 4: the launcher started 2 ranks" in r.stderr


def test_every_rank_ends_its_pmi_session(tmp_path):
    # MPICH sends PMI "finalize" from a C exit handler. A rank leaving with os._exit skipped it, and
    # hydra's proxy took the unannounced close of its PMI socket for a crash: it SIGKILLed the ranks
    # still running (about 1 run in 30 failed). Hydra's verbose log shows each rank's finalize.
    if "HYDRA" not in run_cmd(["mpiexec", "--version"], timeout=30).stdout:
        pytest.skip("mpiexec is not MPICH's hydra")
    r, _, run_dir, _ = _run(tmp_path, mpiexec_args=["-verbose"])
    assert r.returncode == 0, r.stderr
    finalized = set(re.findall(r"got pmi command from downstream 0-(\d+):\s+cmd=finalize\b", r.stdout))
    assert finalized == {"0", "1", "2", "3"}, r.stdout[-3000:]
    _assert_topology(run_dir, nodes=1)


def test_rank_hanging_after_finalize_ends_within_the_teardown_bound(tmp_path):
    # The same bound covers the self-check's handshake and collectives, which start only after each
    # rank has imported torch (seconds apart on 2 loaded cores): a few seconds would time them out.
    timeout_s = 20.0
    r, elapsed, run_dir, name = _run(tmp_path, "--set", f"run.timeout_s={timeout_s}",
                                     env={"REFLOW_FAILPOINTS": "exit@1=hang"})
    assert r.returncode != 0
    assert "signal 14" in r.stdout + r.stderr or "Alarm clock" in r.stdout + r.stderr, r.stdout + r.stderr
    _assert_topology(run_dir, nodes=1)    # the work was done; only the exit hung
    assert elapsed < timeout_s + 60
    assert leftover_processes(name) == []


@pytest.mark.parametrize("action", ["hang", "raise", "kill"])
def test_rank_dying_in_handshake_ends_job_naming_it(tmp_path, action):
    # Long enough for every healthy rank to import torch and say hello, however loaded the machine.
    timeout_s = 20.0
    r, elapsed, run_dir, name = _run(tmp_path, "--set", f"run.timeout_s={timeout_s}",
                                     env={"REFLOW_FAILPOINTS": f"handshake@2={action}"})
    assert r.returncode != 0
    assert not (run_dir / "topology.json").exists()
    # Start-up (imports) on 2 shared cores takes several seconds; the wait itself is bounded by timeout_s.
    assert elapsed < timeout_s + 60
    if action == "hang":
        assert "rank 0: handshake: no hello from rank 2 after 20.0 s (3 of 4 ranks answered)" in r.stderr
    elif action == "raise":
        assert "rank 2 (" in r.stderr and "start-up failed: injected fault at handshake" in r.stderr
    else:  # SIGKILL: the launcher notices at once and ends every rank
        assert "signal 9" in r.stdout + r.stderr or "Killed" in r.stdout + r.stderr
    assert leftover_processes(name) == []


def test_a_rank_that_never_reaches_mpi_init_ends_the_job_named_by_a_waiting_rank(tmp_path):
    """MPI_Init waits on every rank through the launcher; it is bounded by run.timeout_s like any wait.
    The first waiting rank to give up ends the job (hydra then stops the others, often before they write)."""
    r, elapsed, run_dir, name = _run(tmp_path, "--set", "run.timeout_s=8",
                                     env={"REFLOW_FAILPOINTS": "mpi_init@2=hang"})
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "MPI_Init: the launcher's start-up exchange did not complete" in ln]
    assert lines and all("after 8.0 s (run.timeout_s)" in ln for ln in lines), r.stderr
    assert {re.search(r"rank (\d+):", ln).group(1) for ln in lines} <= {"0", "1", "3"}
    assert elapsed < 8 + 60
    assert leftover_processes(name) == []


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_mpi_errors_raise_after_either_way_of_starting_mpi(timeout_s):
    """With a deadline MPI_Init is called through ctypes (mpi4py would hold the GIL); MPI errors must
    still raise MPI.Exception as after mpi4py's own start, not abort the rank."""
    code = ("from reflow_hpc.comm.mpi import init\n"
            f"MPI = init(timeout_s={timeout_s})\n"
            "try:\n"
            "    MPI.COMM_WORLD.send(1, dest=5)\n"
            "except MPI.Exception as e:\n"
            "    print('raised', e.Get_error_class() == MPI.ERR_RANK)\n")
    r = run_cmd(["mpiexec", "-n", "1", sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0 and "raised True" in r.stdout, r.stdout + r.stderr


MPICH_BOTH = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\nMPICH configure:    --with-device=ch4:ucx,ofi\n"
SLURM_PMI = {"PMI_FD": "11", "PMI_JOBID": "23.0", "PMI_RANK": "0", "PMI_SIZE": "4", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("library, env, expected", [
    (MPICH_BOTH, SLURM_PMI, "ofi"),                                            # srun --mpi=pmi2
    (MPICH_BOTH, {**SLURM_PMI, "MPIR_CVAR_CH4_NETMOD": "ucx"}, None),          # the user chose
    (MPICH_BOTH, {**SLURM_PMI, "MPICH_CH4_NETMOD": "ucx"}, None),
    (MPICH_BOTH, {"PMI_FD": "9", "PMI_RANK": "0", "HYDI_CONTROL_FD": "7"}, None),  # hydra's mpiexec
    (MPICH_BOTH, {"PMIX_RANK": "0", "SLURM_STEP_ID": "0"}, None),              # srun --mpi=pmix
    ("MPICH Version: 4.2.0\nMPICH Device: ch4:ucx\n", SLURM_PMI, None),        # nothing to switch to
    ("Open MPI v5.0.3, package: Open MPI\n", SLURM_PMI, None),
])
def test_netmod_override_only_where_slurms_pmi1_reads_would_split(library, env, expected):
    from reflow_hpc.comm.mpi import netmod_override
    assert netmod_override(library, env) == expected
