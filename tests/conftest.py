"""Shared fixtures for every tier: the repository root, subprocess helpers and the local Slurm cluster.

Tiers: ``tests/unit`` (pure and fast: what a contributor runs while editing), ``tests/integration``
(real MPI ranks, HDF5 files, engines, models), ``tests/cluster`` (Slurm, the vLLM venv). The MPI
programs and the shared modules that tests of several tiers import live in ``tests/helpers``, which
is put on ``sys.path`` here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path.insert(0, str(HELPERS))


def sandbox_or_skip(cfg) -> str:
    """The sandbox tier ``cfg`` (a Config) gets here; the test is skipped, with the reason, where none is usable
    (CI installs bubblewrap, and its attack corpus fails instead of skipping: REFLOW_REQUIRE_BWRAP)."""
    from reflow_hpc.config import ConfigError
    from reflow_hpc.sandbox import require_tier
    try:
        return require_tier(cfg)
    except ConfigError as e:
        pytest.skip(f"no usable sandbox tier: {e}")


def run_cmd(args: list[str], *, timeout: float = 180, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, capture text output; a hang fails the test instead of blocking the suite."""
    full_env = dict(os.environ)
    full_env.pop("REFLOW_FAILPOINTS", None)
    full_env.update(env or {})
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def python_m(module: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, "-m", module, *args], **kw)


def run_mpi(program: str, *args: str, ranks: int = 4, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``mpiexec -n ranks python tests/helpers/<program> args`` in its own process group, stdout and
    stderr together; on a timeout the whole group is killed (ranks included, not only mpiexec) and the
    test fails with the end of the output."""
    proc = subprocess.Popen([shutil.which("mpiexec") or "mpiexec", "-n", str(ranks), sys.executable,
                             str(HELPERS / program), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{program} did not finish within {timeout} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as a CPU worker runs (``resources.cpu_threads``): tiny ops on 2 shared cores
    are many times slower when two threads have to meet for each of them."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def offline(monkeypatch):
    """No Hugging Face hub: nothing may be downloaded at run time."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def ended_every_sample(summary: dict) -> bool:
    """A finished run's coordinator summary: every sample created ended with one terminal reason."""
    from reflow_hpc.core.sample import LIVE_STATES, TERMINAL_REASONS
    buffer = summary["buffer"]
    ended = sum(buffer[f"buffer/{r}"] for r in TERMINAL_REASONS)
    return buffer["buffer/created"] == ended and not any(buffer[f"buffer/{s}"] for s in LIVE_STATES)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    """The warm-started tiny policy of the main job's config: the repository's when present, else the same
    warm start (the config's, ~70 s on 2 cores) made once for the session. A shorter one would earn no
    reward, so RL steps would leave the weights as they were and every check that tells versions apart
    by their weights would pass vacuously."""
    from reflow_hpc.config import load
    if os.environ.get("REFLOW_TEST_POLICY"):             # the outer session's, for the tests run in .venv-vllm
        return os.environ["REFLOW_TEST_POLICY"]
    cfg_path = str(ROOT / "configs" / "cpu_tiny.toml")
    cfg = load(cfg_path)
    if (ROOT / cfg.model.path / "config.json").is_file():
        return str((ROOT / cfg.model.path).absolute())
    out = tmp_path_factory.mktemp("policy") / "tiny"
    r = python_m("reflow_hpc.warmstart", cfg_path, "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    return str(out)


def leftover_processes(marker: str, within_s: float = 30.0) -> list[str]:
    """Command lines of live processes that mention `marker` (a unique run name), once they had up
    to `within_s` to go (killed ranks of an aborted job may take a moment to be reaped)."""
    deadline = time.monotonic() + within_s
    while True:
        out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
        left = [ln for ln in out.splitlines() if "pgrep" not in ln]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_conf() -> str:
    """SLURM_CONF of a running local cluster with 2 emulated nodes.

    Uses the cluster named by $SLURM_CONF when it answers; otherwise starts one with
    tools/local_slurm.sh, which installs Debian's Slurm and munge when they are missing, and stops
    it, by PID file, at the end of the session. Where that is impossible (no root, no apt) the
    tests are skipped, unless REFLOW_REQUIRE_SLURM=1 (CI), where they fail.
    """
    conf = os.environ.get("SLURM_CONF")
    if conf and shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0:
        yield conf
        return
    script = str(ROOT / "tools" / "local_slurm.sh")
    status = subprocess.run([script, "status"], capture_output=True, text=True)
    started = status.returncode != 0
    up = subprocess.run([script, "up", "--nodes", "2"], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        why = f"local Slurm cluster could not start: {up.stderr.strip()[-500:]}"
        if os.environ.get("REFLOW_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    conf = up.stdout.strip().split("=", 1)[1]
    os.environ["SLURM_CONF"] = conf
    yield conf
    if started:
        subprocess.run([script, "down"], capture_output=True, text=True, timeout=60)
