"""The fork server that runs model-written code: started inside the sandbox, never run in the trainer.

The client (``client.py``) starts a fresh interpreter with a one-line bootstrap and sends this file's
source as its first line, so nothing of the package has to be visible inside the sandbox. The server
then answers JSON lines: one ``{"ready": …}`` line, then one reply per request ``{"code", "stdin",
"timeout_s"}``. For each request it forks a child that confines itself (session, rlimits, Landlock,
seccomp, dropped capabilities, as the settings say) and executes the code with ``exec``; the server
collects the child's stdout and stderr up to the output cap, kills it and everything it started at
the deadline or when it exits, wipes the scratch directory and replies. The child never holds the
reply pipe, so only the server can answer.

The server protects itself from its children: not dumpable (a child cannot open its ``/proc/<pid>/mem``
or read its environment), a child subreaper (a daemonised grandchild is reparented to it and killed),
and it dies with its parent. Standard library only; the host imports this module for
:func:`landlock_abi` and :data:`SECCOMP_ARCHES`.
"""

import ctypes
import json
import os
import platform
import resource
import select
import signal
import stat
import struct
import sys
import time
import traceback

# --------------------------------------------------------------------------------------------
# prctl, capabilities
# --------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
# noroot, no_setuid_fixup, keep_caps, no_cap_ambient_raise: each set and locked
SECURE_ALL = 0b11101111

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option, arg=0):
    if _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _syscall(nr, *args):
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ret = _libc.syscall(ctypes.c_long(nr), *conv)
    if ret < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return ret


def drop_capabilities():
    """Every capability gone for good, also across execve as uid 0 (root without privileges)."""
    try:
        _prctl(PR_SET_SECUREBITS, SECURE_ALL)
    except OSError:
        pass                        # no CAP_SETPCAP: nothing to drop below either
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            break                   # past the last capability the kernel knows
    try:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    header = struct.pack("Ii", 0x20080522, 0)                # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)                   # two empty {effective, permitted, inheritable}
    if _libc.capset(ctypes.create_string_buffer(header, 8), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


# --------------------------------------------------------------------------------------------
# Landlock
# --------------------------------------------------------------------------------------------

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV
LL_READ = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR


def landlock_abi():
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    try:
        return _syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)    # LANDLOCK_CREATE_RULESET_VERSION
    except OSError:
        return 0


def _fs_rights(abi):
    rights = (1 << 13) - 1                     # ABI 1: execute … make_sym
    if abi >= 2:
        rights |= 1 << 13                      # refer
    if abi >= 3:
        rights |= LL_TRUNCATE
    if abi >= 5:
        rights |= LL_IOCTL_DEV
    return rights


def landlock_ruleset(read, write, abi):
    """A ruleset fd: read ``read``, write ``write``, nothing else; no TCP (ABI ≥ 4); no signals to, nor
    abstract sockets of, processes outside the domain (ABI ≥ 6). Ptrace of a process outside the domain
    is refused by every ABI. Made once by the server; each child restricts itself with it."""
    fs = _fs_rights(abi)
    attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.create_string_buffer(attr[:size], size), size, 0)
    try:
        for paths, rights in ((read, LL_READ & fs), (write, fs)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue            # a path this host does not have
                try:
                    allowed = rights if stat.S_ISDIR(os.fstat(fd).st_mode) else rights & LL_FILE_RIGHTS
                    rule = struct.pack("=Qi", allowed, fd)
                    _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.create_string_buffer(rule, 12), 0)
                finally:
                    os.close(fd)
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def landlock_restrict(ruleset):
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0)


# --------------------------------------------------------------------------------------------
# seccomp
# --------------------------------------------------------------------------------------------

# Syscall numbers by audit architecture: x86_64 and aarch64. On any other machine the seccomp layer,
# and with it the Landlock tier, is unavailable.
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, dict(
        ptrace=101, process_vm_readv=310, process_vm_writev=311, pidfd_getfd=438, pidfd_send_signal=424,
        kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, socket=41, clone=56,
        clone3=435, fork=57, vfork=58, execve=59, execveat=322, unshare=272, setns=308, mount=165, bpf=321,
        userfaultfd=323, perf_event_open=298, keyctl=250, add_key=248, request_key=249, io_uring_setup=425,
        personality=135)),
    "aarch64": (0xC00000B7, dict(
        ptrace=117, process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438, pidfd_send_signal=424,
        kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, socket=198, clone=220,
        clone3=435, execve=221, execveat=281, unshare=97, setns=268, mount=40, bpf=280, userfaultfd=282,
        perf_event_open=241, keyctl=219, add_key=217, request_key=218, io_uring_setup=425, personality=92)),
}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL = 0x7FFF0000, 0x80000000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
CLONE_THREAD = 0x00010000
_SIGNALLERS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")


def _errno(e):
    return 0x00050000 | e


def seccomp_filter(mode, own_pid, foreign_pids):
    """The BPF program of one child. ``mode`` ``"nofork"``: no new processes (threads are fine), no
    execve, signals to itself only. ``mode`` ``"fork"``: processes allowed, but no signal to
    ``foreign_pids`` (the server, pid 1) nor to every process at once. Both: no ptrace or
    process_vm_*, no sockets but AF_UNIX, no namespaces, mounts, BPF, keyrings, userfaultfd,
    perf events or io_uring."""
    arch, nr = SECCOMP_ARCHES[platform.machine()]
    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL), (_LD, 0, 0, 0)]
    if platform.machine() == "x86_64":
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _errno(_ENOSYS))]       # the x32 ABI
    denied = ["ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "pidfd_send_signal", "unshare",
              "setns", "mount", "bpf", "userfaultfd", "perf_event_open", "keyctl", "add_key", "request_key",
              "io_uring_setup", "personality"]
    if mode == "nofork":
        denied += ["fork", "vfork", "execve", "execveat"]
    for name in denied:
        if name in nr:
            prog += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, _errno(_EPERM))]
    blocks = []
    # socket(family, …): AF_UNIX only (socketpair, multiprocessing); the net namespace or Landlock
    # stop TCP as well, this stops UDP and raw sockets where they cannot.
    blocks.append((nr["socket"], [(_LD, 0, 0, 16), (_JEQ, 0, 1, 1), (_RET, 0, 0, _ALLOW),
                                  (_RET, 0, 0, _errno(_EAFNOSUPPORT))]))
    if mode == "nofork":
        # clone: threads only; clone3 hides its flags in memory, so it is "missing" and glibc falls
        # back to clone for its threads.
        blocks.append((nr["clone"], [(_LD, 0, 0, 16), (_JSET, 1, 0, CLONE_THREAD), (_RET, 0, 0, _errno(_EPERM)),
                                     (_RET, 0, 0, _ALLOW)]))
        blocks.append((nr["clone3"], [(_RET, 0, 0, _errno(_ENOSYS))]))
        for name in _SIGNALLERS:     # the first argument is a pid (a tgid for tgkill)
            blocks.append((nr[name], [(_LD, 0, 0, 16), (_JEQ, 0, 1, own_pid), (_RET, 0, 0, _ALLOW),
                                      (_RET, 0, 0, _errno(_EPERM))]))
    else:
        bad = sorted({p & 0xFFFFFFFF for pid in foreign_pids for p in (pid, -pid)} | {0xFFFFFFFF})
        for name in _SIGNALLERS:
            body = [(_LD, 0, 0, 16)]
            for v in bad:
                body += [(_JEQ, 0, 1, v), (_RET, 0, 0, _errno(_EPERM))]
            blocks.append((nr[name], body + [(_RET, 0, 0, _ALLOW)]))
    for number, body in blocks:
        prog += [(_LD, 0, 0, 0), (_JEQ, 0, len(body), number)] + body
    prog.append((_RET, 0, 0, _ALLOW))
    return prog


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


OWN_PID = 0x7EADBEEF            # stands for the child's pid in a program packed before the fork


def seccomp_pack(prog):
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def seccomp_apply(raw, own_pid):
    raw = raw.replace(struct.pack("I", OWN_PID), struct.pack("I", own_pid))
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(raw) // 8, ctypes.addressof(buf))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                   ctypes.c_void_p(ctypes.addressof(fprog)), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

def _reply(obj):
    data = (json.dumps(obj) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def wipe(path):
    """Empty a directory the children wrote, whatever modes they left on it."""
    try:
        os.chmod(path, 0o700)
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                wipe(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _children_of(ppid):
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with os.fdopen(os.open(f"/proc/{name}/stat", os.O_RDONLY), "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == ppid:
                out.append(int(name))
    return out


class Server:
    def __init__(self, s):
        self.s = s
        self.me = os.getpid()
        # Built once: each child only applies them (a fork server's point is a short path per run).
        self.ruleset = None
        if s["landlock"]:
            ll = s["landlock"]
            self.ruleset = landlock_ruleset(ll["read"], ll["write"], ll["abi"])
        self.seccomp = None
        if s["seccomp"]:
            self.seccomp = seccomp_pack(seccomp_filter(s["seccomp"], OWN_PID, s["foreign_pids"] + [self.me]))

    # ---- after each run: nothing of it may survive -------------------------------------------
    def kill_all(self, child):
        """Kill the child and everything it started, reap them all; the child's wait status.

        Called while the child is unreaped (a zombie at most), so its pid and process group cannot
        have been reused by an unrelated process. Orphans are reparented to this subreaper and found
        on the next round."""
        status = None
        while True:
            if self.s["pid_namespace"]:
                # Alone in a pid namespace with its init: -1 is every process but the two of them.
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                targets = [] if self.s["seccomp"] == "nofork" else _children_of(self.me)
                if status is None:
                    for kill in (os.killpg, os.kill):
                        try:
                            kill(child, signal.SIGKILL)
                        except OSError:
                            pass
                for pid in targets:
                    try:
                        os.kill(pid, signal.SIGKILL)     # our own unreaped child: a valid pid
                    except OSError:
                        pass
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                return status
            if pid == child:
                status = st

    # ---- one request ---------------------------------------------------------------------------
    def run(self, req):
        s = self.s
        timeout = min(float(req.get("timeout_s") or s["wall_s"]), s["wall_s"])
        code = str(req.get("code", ""))
        stdin = str(req.get("stdin", "")).encode()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            status = 127
            try:
                os.close(in_w)
                os.close(out_r)
                os.close(err_r)
                status = self.child(code, in_r, out_w, err_w)
            finally:
                os._exit(status)
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        result = self.collect(pid, timeout, start, stdin, in_w, out_r, err_r)
        for d in s["scratch"]:
            wipe(d)
        return result

    def collect(self, pid, timeout, start, stdin, in_w, out_r, err_r):
        cap = self.s["output_bytes"]
        bufs = {out_r: bytearray(), err_r: bytearray()}
        open_fds = {out_r, err_r}
        timed_out = truncated = over_scratch = False
        status = None
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        pending = memoryview(stdin)
        poll = select.poll()
        for fd in open_fds:
            poll.register(fd, select.POLLIN)
        if pidfd is not None:
            poll.register(pidfd, select.POLLIN)
        if pending:
            os.set_blocking(in_w, False)
            poll.register(in_w, select.POLLOUT)
        else:
            os.close(in_w)
            in_w = None
        deadline = start + timeout
        next_check = start + 0.05
        watch = self.s["watch_scratch"]
        while open_fds or status is None:
            now = time.monotonic()
            if now >= deadline:
                timed_out = status is None
                break
            wait = deadline - now
            if status is None and (pidfd is None or watch):
                wait = min(wait, 0.01 if pidfd is None else max(0.0, next_check - now))
            for fd, _ in poll.poll(int(wait * 1000) + 1):
                if fd == pidfd:
                    continue
                if fd == in_w:
                    try:
                        pending = pending[os.write(in_w, pending[:65536]):]
                    except OSError:             # the child closed its stdin
                        pending = memoryview(b"")
                    if not pending:
                        poll.unregister(in_w)
                        os.close(in_w)
                        in_w = None
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    poll.unregister(fd)
                    open_fds.discard(fd)
                    continue
                room = cap - len(bufs[out_r]) - len(bufs[err_r])
                bufs[fd] += chunk[:max(0, room)]
                if len(chunk) > room:
                    truncated = True
            if truncated:
                break
            if status is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                # The child is done: what it started goes now, so that its pipes close.
                status = self.kill_all(pid)
                if pidfd is not None:
                    poll.unregister(pidfd)
            if watch and status is None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.05
                if any(_usage(d) > self.s["scratch_bytes"] for d in self.s["scratch"]):
                    over_scratch = True
                    break
        wall = time.monotonic() - start
        if status is None:
            status = self.kill_all(pid)
        for fd in list(open_fds) + [fd for fd in (in_w, pidfd) if fd is not None]:
            os.close(fd)
        return {"stdout": bufs[out_r].decode("utf-8", "backslashreplace"),
                "stderr": bufs[err_r].decode("utf-8", "backslashreplace"),
                "exit_code": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "truncated": truncated,
                "wall_s": round(wall, 6), "error": "scratch limit exceeded" if over_scratch else None}

    # ---- the child: confine, then run the code ----------------------------------------------------
    def child(self, code, in_r, out_w, err_w):
        s = self.s
        os.setsid()
        for src, dst in ((in_r, 0), (out_w, 1), (err_w, 2)):
            os.dup2(src, dst)
        if self.ruleset is None:
            os.closerange(3, 1 << 20)
        else:
            os.closerange(3, self.ruleset)
            os.closerange(self.ruleset + 1, 1 << 20)
        os.chdir(s["cwd"])
        os.umask(0o077)
        limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, s["cpu_s"]),
                  (resource.RLIMIT_AS, s["memory_bytes"]), (resource.RLIMIT_FSIZE, s["scratch_bytes"]),
                  (resource.RLIMIT_NOFILE, 256)]
        if s["nproc"]:
            limits.append((resource.RLIMIT_NPROC, s["nproc"]))
        for which, value in limits:
            # CPU: SIGXCPU at the limit, SIGKILL a second later even when SIGXCPU is ignored
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
        os.environ.clear()
        os.environ.update(s["env"])
        try:
            if s["drop_caps"]:
                drop_capabilities()
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            if self.ruleset is not None:
                landlock_restrict(self.ruleset)
                os.close(self.ruleset)
            if self.seccomp is not None:
                seccomp_apply(self.seccomp, os.getpid())
        except BaseException as e:     # never run the code less confined than promised
            os.write(2, f"sandbox: confinement failed: {e}\n".encode())
            return 125
        return _execute(code)


def _usage(path):
    total, count = 0, 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            count += 1
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
        if count > 100000:
            return 1 << 62
    return total


def _execute(code):
    """Run the code as ``__main__``; its exit status. Runs in the confined child only."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        setattr(sys, name, os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False))
    sys.stdin = os.fdopen(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.argv = ["<snippet>"]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    status = 0
    try:
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)    # from the snippet's frame on
        status = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    return status & 0xFF


def serve(settings):
    """The server's main loop (called by the bootstrap with the client's settings)."""
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = settings.get("parent")
    if parent and os.getppid() != parent:      # the parent was gone before PDEATHSIG was armed
        os._exit(1)
    server = Server(settings)
    for d in settings["scratch"]:
        wipe(d)
    _reply({"ready": True, "pid": os.getpid(), "uid": os.getuid(), "python": platform.python_version(),
            "landlock": landlock_abi()})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        try:
            req = json.loads(line)
        except ValueError:
            _reply({"error": "malformed request"})
            continue
        _reply(server.run(req))
