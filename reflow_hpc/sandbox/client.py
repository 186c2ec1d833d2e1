"""The trainer's side of the sandbox: a pool of fork servers, one per concurrent run.

``Sandbox(cfg).run(code, stdin, timeout_s) -> RunResult`` is safe from any thread: a call takes an idle
fork server (waiting while all ``sandbox.concurrency`` are busy), sends the code and waits for the reply
at most the run's wall limit plus a grace; a server that does not answer in time is killed and
restarted. Each server is its own sandbox (in the bwrap tier its own namespaces and tmpfs), so two
runs at once share nothing. What a run returns is data for a judge outside (``judge.py``): nothing a
run prints or exits with decides a reward by itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import secrets
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, SandboxConfig
from ..private import private_dir, private_scratch
from . import tiers
from .helper import HelperError, HelperProcess

REPLY_GRACE_S = 5.0              # beyond the run's own limit: kill and wipe time, a busy host
START_TIMEOUT_S = 30.0
SERVER_SOURCE = (Path(__file__).resolve().parent / "server.py").read_text()


class SandboxUnavailable(RuntimeError):
    """No tier the config accepts is usable here (one line: what to install or set)."""


@dataclass
class RunResult:
    """What one run produced. ``exit_code`` is None when the run produced no result (``error`` says
    why); a negative one is the signal that ended it."""
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    truncated: bool = False
    wall_s: float = 0.0
    tier: str = ""
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def require_tier(cfg) -> str:
    """The tier a code tool will use under ``cfg`` (a Config or a SandboxConfig); ConfigError (one line, naming
    the key and what to install or set) when none is usable. Call it when the config is loaded."""
    sc = cfg if isinstance(cfg, SandboxConfig) else cfg.sandbox
    tier, why = tiers.choose(sc.tier, sc.allow_weak)
    if tier is None:
        if sc.tier != "auto" and not (sc.tier == "rlimits" and not sc.allow_weak):
            raise ConfigError("sandbox.tier", sc.tier, why)
        raise ConfigError("sandbox.allow_weak", sc.allow_weak, why)
    return tier


def _remove_orphans(root: Path) -> None:
    """Scratch directories of trainers that ended without closing their sandbox (killed): named
    ``<pid>-…`` after a process that no longer runs."""
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)


class _Slot:
    """One fork server and the host directory it may write (landlock and rlimits tiers)."""

    def __init__(self, helper: HelperProcess, scratch: Path | None):
        self.helper, self.scratch = helper, scratch


class Sandbox:
    """A pool of ``concurrency`` fork servers of one tier; see the module docstring."""

    def __init__(self, cfg: SandboxConfig | None = None, *, quiet: bool = False, python: str = ""):
        self.cfg = cfg = cfg or SandboxConfig()
        tier, why = tiers.choose(cfg.tier, cfg.allow_weak, python)
        if tier is None:
            raise SandboxUnavailable(f"sandbox: {why}")
        self.tier = tier
        self.launch = tiers.launch_for(tier, python)
        self.notice = f"reflow_hpc: sandbox tier {tier}: {why}"
        if tier == "rlimits":
            self.notice += " — WEAK: model-written code can read and write what this user can, and reach the network"
        if not quiet:
            print(self.notice, file=sys.stderr, flush=True)
        self.reply_grace_s = REPLY_GRACE_S
        self._scratch_root: Path | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._slots = [self._make_slot(i) for i in range(cfg.concurrency)]
        for slot in self._slots:
            self._idle.put(slot)

    @classmethod
    def from_config(cls, cfg, **kw) -> "Sandbox":
        """The sandbox of a whole Config (its ``[sandbox]`` section)."""
        return cls(cfg.sandbox, **kw)

    # ---- servers ----------------------------------------------------------------------------------
    def _settings(self, scratch: Path | None) -> dict:
        c, launch = self.cfg, self.launch
        common = {"wall_s": c.wall_time_s, "cpu_s": c.cpu_time_s, "memory_bytes": c.memory_mib << 20,
                  "output_bytes": c.output_bytes, "scratch_bytes": c.scratch_mib << 20, "seccomp": launch.seccomp}
        if self.tier == "bwrap":
            landlock = None
            if launch.landlock_abi:
                landlock = {"read": ["/"], "write": ["/tmp", "/dev/shm", "/dev/null"], "abi": launch.landlock_abi}
            # RLIMIT_NPROC counts the sandbox's init and the server too
            nproc = c.processes + 2 if launch.seccomp != "nofork" else 0
            return {**common, "cwd": "/tmp", "scratch": ["/tmp", "/dev/shm"], "pid_namespace": True,
                    "env": {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"},
                    "nproc": nproc, "drop_caps": False, "landlock": landlock, "foreign_pids": [1],
                    "watch_scratch": False, "parent": None}
        assert scratch is not None
        landlock = None
        if self.tier == "landlock":
            read = [*launch.prefix, "/usr", "/bin", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/dev/null",
                    "/dev/zero", "/dev/urandom"]
            landlock = {"read": read, "write": [str(scratch), "/dev/null"], "abi": launch.landlock_abi}
        return {**common, "cwd": str(scratch), "scratch": [str(scratch)], "pid_namespace": False,
                "env": {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8"},
                "nproc": 0, "drop_caps": os.geteuid() == 0, "landlock": landlock, "foreign_pids": [],
                "watch_scratch": True, "parent": os.getpid()}

    def _make_slot(self, index: int) -> _Slot:
        scratch = None
        if self.tier == "bwrap":
            argv = tiers.bwrap_argv(self.launch, scratch_bytes=self.cfg.scratch_mib << 20)
        else:
            if self._scratch_root is None:
                self._scratch_root = private_scratch(tempfile.gettempdir(), "reflow-sandbox")
                _remove_orphans(self._scratch_root)
            scratch = private_dir(self._scratch_root / f"{os.getpid()}-{index}-{secrets.token_hex(6)}",
                                  what="sandbox scratch")
            argv = [self.launch.python, "-I", "-B", "-c", tiers.BOOTSTRAP]
        first = json.dumps([SERVER_SOURCE, self._settings(scratch)]).encode()
        helper = HelperProcess(argv, name=f"sandbox server {index} ({self.tier})", first_line=first,
                               start_timeout_s=START_TIMEOUT_S, recycle_every=self.cfg.recycle_every,
                               respawn="eager", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        return _Slot(helper, scratch)

    def start(self) -> list[dict]:
        """Start every fork server now (otherwise each starts at its first run); their ready lines."""
        for slot in self._slots:          # all spawn first, so that they start side by side
            slot.helper.spawn()
        return [slot.helper.start() for slot in self._slots]

    # ---- runs -------------------------------------------------------------------------------------
    def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> RunResult:
        """Run ``code`` as a Python program in the sandbox; its outputs, never a verdict."""
        if self._closed:
            raise RuntimeError("sandbox: run after close()")
        limit = self.cfg.wall_time_s if timeout_s is None else min(float(timeout_s), self.cfg.wall_time_s)
        slot = self._idle.get()
        try:
            try:
                reply = slot.helper.call({"code": code, "stdin": stdin, "timeout_s": limit}, limit + self.reply_grace_s)
            except HelperError as e:
                return RunResult(tier=self.tier, error=str(e))
        finally:
            self._idle.put(slot)
        if reply is None:
            timed_out = "no reply" in slot.helper.last_failure
            return RunResult(tier=self.tier, timed_out=timed_out, wall_s=limit if timed_out else 0.0,
                             error=slot.helper.last_failure)
        if "exit_code" not in reply:
            return RunResult(tier=self.tier, error=f"sandbox server: {reply.get('error', 'a malformed reply')}")
        fields = {f.name for f in dataclasses.fields(RunResult)} - {"tier"}
        return RunResult(**{k: v for k, v in reply.items() if k in fields}, tier=self.tier)

    def server_pids(self) -> list[int]:
        """Host pids of the processes that hold the servers (bwrap or the interpreter), for tests."""
        return [s.helper.pid for s in self._slots if s.helper.pid is not None]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for slot in self._slots:
            slot.helper.close()
            if slot.scratch is not None:
                shutil.rmtree(slot.scratch, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


_shared: dict[str, Sandbox] = {}
_shared_lock = threading.Lock()


def shared_sandbox(cfg) -> Sandbox:
    """The process's sandbox for ``cfg.sandbox`` (a Config), started at the first call and shared by every
    user in the process (the ``python`` tool, a coding task's reward), so that a rollout worker holds
    ``sandbox.concurrency`` fork servers, not one pool per user. SandboxUnavailable (one line) when no
    tier the config accepts is usable here."""
    key = repr(cfg.sandbox)
    with _shared_lock:
        box = _shared.get(key)
        if box is None:
            box = _shared[key] = Sandbox.from_config(cfg)
        return box

