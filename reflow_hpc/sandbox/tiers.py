"""Which isolation this machine offers, best first, and how a fork server is started in each.

- ``bwrap``: user namespaces and bubblewrap. Everything unshared (user, pid, net, ipc, uts, cgroup,
  mount), no capabilities, no further user namespaces, only ``/usr`` (and the interpreter's prefix)
  read-only, size-capped tmpfs for ``/tmp`` and ``/dev/shm``. As root the server is started as uid
  65534 (``setpriv``), so that ``RLIMIT_NPROC`` counts and nothing runs as host root; the interpreter
  must then be reachable by that uid (``sys.executable`` when its directories allow it, else
  ``/usr/bin/python3``). Each child adds Landlock (no signal or ptrace to the server) and seccomp.
- ``landlock``: no user namespaces, but Landlock and seccomp (x86_64, aarch64): each child reads only the
  interpreter and system libraries, writes only its scratch, has no network, cannot start a process,
  signal or trace anyone else; as root it drops every capability.
- ``rlimits``: resource limits, a session and a scratch directory (plus seccomp where it exists);
  refused unless ``sandbox.allow_weak``.

Probing runs each candidate once (a real sandboxed ``python -c``) and is cached per process.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import server as _server

TIERS = ("bwrap", "landlock", "rlimits")
NOBODY = 65534                   # the uid a root trainer's sandboxes run as
SYSTEM_PYTHON = "/usr/bin/python3"
PROBE_TIMEOUT_S = 20.0
# The bootstrap every fork server starts with: its source arrives as the first line on stdin, so
# nothing of the package needs to be visible in the sandbox.
BOOTSTRAP = ("import sys,json;s,c=json.loads(sys.stdin.buffer.readline());g={'__name__':'reflow_sandbox'};"
             "exec(compile(s,'reflow_hpc/sandbox/server.py','exec'),g);g['serve'](c)")


@dataclass(frozen=True)
class Probe:
    tier: str
    usable: bool
    why: str                      # one line: what was found, or what is missing and how to get it


@dataclass(frozen=True)
class Launch:
    """How to start one fork server of a tier (the parts that do not depend on the limits)."""
    tier: str
    python: str
    prefix: tuple[str, ...] = ()                  # directories the interpreter needs, bound read-only
    run_as: int | None = None                     # host uid of the sandbox (root trainers), None = ours
    seccomp: str | None = None                    # "fork", "nofork" or None (no seccomp here)
    landlock_abi: int = 0
    notes: tuple[str, ...] = field(default=())


def seccomp_supported() -> bool:
    return platform.machine() in _server.SECCOMP_ARCHES


def _others_reach(path: str, *, read: bool) -> bool:
    """Whether a process of another uid can reach ``path`` (every parent searchable; the path readable
    and executable, or a searchable directory)."""
    p = Path(os.path.realpath(path))
    for parent in reversed(p.parents):
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return False
    need = stat.S_IXOTH | (stat.S_IROTH if read else 0)
    return mode & need == need


def _prefixes(python: str) -> tuple[str, ...]:
    """Directories the interpreter reads outside /usr: its own install (and a venv's base)."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:
        dirs = {str(Path(os.path.realpath(python)).parent.parent)}
    out = set()
    for d in dirs:
        real = os.path.realpath(d)
        if real != "/usr" and not real.startswith("/usr/"):
            out.add(real)
    return tuple(sorted(out))


def _bwrap_launch(python_override: str) -> Launch:
    abi = _server.landlock_abi()
    if os.geteuid() != 0:
        py = python_override or sys.executable
        return Launch("bwrap", py, _prefixes(py), None, "fork" if seccomp_supported() else None, abi)
    setpriv = shutil.which("setpriv")
    candidates = [python_override] if python_override else [sys.executable, SYSTEM_PYTHON]
    for py in candidates:
        prefix = _prefixes(py)
        if setpriv and os.path.exists(py) and _others_reach(py, read=False) and \
                all(_others_reach(os.path.join(d, "lib"), read=True) for d in prefix if os.path.isdir(d + "/lib")):
            return Launch("bwrap", py, prefix, NOBODY, "fork" if seccomp_supported() else None, abi)
    # Root, and no interpreter another uid can reach (or no setpriv): the sandbox runs as root without
    # capabilities, where RLIMIT_NPROC does not count, so seccomp forbids new processes instead.
    py = python_override or sys.executable
    why = "no setpriv" if not setpriv else f"no interpreter uid {NOBODY} can reach"
    return Launch("bwrap", py, _prefixes(py), None, "nofork" if seccomp_supported() else None, abi,
                  notes=(f"as root without a uid change ({why}): no new processes in a run",))


def launch_for(tier: str, python_override: str = "") -> Launch:
    if tier == "bwrap":
        return _bwrap_launch(python_override)
    py = python_override or sys.executable
    if tier == "landlock":
        return Launch("landlock", py, _prefixes(py), None, "nofork", _server.landlock_abi())
    return Launch("rlimits", py, _prefixes(py), None, "nofork" if seccomp_supported() else None, 0)


def bwrap_argv(launch: Launch, *, scratch_bytes: int) -> list[str]:
    """The command that starts one fork server in the bwrap tier."""
    argv: list[str] = []
    if launch.run_as is not None:
        argv += [shutil.which("setpriv") or "setpriv", "--reuid", str(launch.run_as), "--regid", str(launch.run_as),
                 "--clear-groups", "--"]
    argv += [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent",
             "--new-session", "--cap-drop", "ALL", "--disable-userns", "--clearenv",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
             "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for d in launch.prefix:
        argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(scratch_bytes), "--tmpfs", "/tmp",
             "--size", str(scratch_bytes), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--remount-ro", "/",
             "--chdir", "/tmp", "--", launch.python, "-I", "-B", "-c", BOOTSTRAP]
    return argv


def _probe_bwrap(python_override: str) -> Probe:
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return Probe("bwrap", False, "bubblewrap is not installed (Debian: apt-get install bubblewrap)")
    launch = _bwrap_launch(python_override)
    argv = bwrap_argv(launch, scratch_bytes=1 << 20)
    argv[-4:] = ["-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, close_fds=True,
                           timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Probe("bwrap", False, f"bwrap could not run: {e}")
    if r.returncode != 0 or not r.stdout.strip():
        err = (r.stderr.strip().splitlines() or ["no output"])[-1]
        hint = " (user namespaces disabled? sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces)"
        return Probe("bwrap", False, f"bwrap failed: {err}{hint if 'namespace' in err.lower() else ''}")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip() or "bwrap"
    who = f"uid {launch.run_as}" if launch.run_as is not None else f"uid {os.geteuid()}"
    extra = f", Landlock ABI {launch.landlock_abi}" if launch.landlock_abi else ""
    extra += " + seccomp" if launch.seccomp else ""
    notes = "".join(f"; {n}" for n in launch.notes)
    return Probe("bwrap", True, f"{version}, {who}, python {launch.python} {r.stdout.strip()}{extra}{notes}")


def _probe_landlock() -> Probe:
    abi = _server.landlock_abi()
    if not seccomp_supported():
        return Probe("landlock", False, f"no seccomp syscall table for {platform.machine()} (x86_64, aarch64)")
    if abi < 1:
        return Probe("landlock", False, "the kernel has no Landlock (Linux ≥ 5.13 with lsm=…,landlock)")
    net = "" if abi >= 4 else " (no TCP rules below ABI 4: seccomp stops sockets)"
    return Probe("landlock", True, f"Landlock ABI {abi} + seccomp{net}")


@functools.lru_cache(maxsize=None)
def probe(python_override: str = "") -> tuple[Probe, ...]:
    """Every tier, best first, with whether it is usable here and why (cached)."""
    return (_probe_bwrap(python_override), _probe_landlock(),
            Probe("rlimits", True, "rlimits, a session and a scratch directory" +
                  (" + seccomp" if seccomp_supported() else "") + "; no file or network isolation"))


def choose(tier: str = "auto", allow_weak: bool = False, python_override: str = "") -> tuple[str | None, str]:
    """(the tier to use or None, one line saying why)."""
    probes = {p.tier: p for p in probe(python_override)}
    if tier != "auto":
        p = probes[tier]
        if not p.usable:
            return None, f"tier {tier} is not usable here: {p.why}"
        if tier == "rlimits" and not allow_weak:
            return None, "tier rlimits isolates nothing but resources: set sandbox.allow_weak = true to accept it"
        return tier, p.why
    for name in ("bwrap", "landlock"):
        if probes[name].usable:
            return name, probes[name].why
    missing = "; ".join(f"{n}: {probes[n].why}" for n in ("bwrap", "landlock"))
    if allow_weak:
        return "rlimits", f"{probes['rlimits'].why} (sandbox.allow_weak = true; {missing})"
    return None, (f"no usable sandbox tier ({missing}): install bubblewrap (apt-get install bubblewrap) with user "
                  f"namespaces enabled, or set sandbox.allow_weak = true to run model-written code under rlimits only")
