"""The sandbox against an attack corpus, in every isolating tier this machine has (bwrap, landlock).

Each attack is model-written code submitted as the solution of a tiny task (``add(a, b)``), judged
outside the sandbox by ``reward``: none may earn a reward. Each is also judged by its effect on the host
(files, processes, network, the test process's secrets) and by the sandbox still working afterwards: an
honest solution earns 1.0 after every attack. The bwrap tier skips where bubblewrap or user namespaces
are missing, unless REFLOW_REQUIRE_BWRAP=1 (CI), where it fails.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from reflow_hpc.config import SandboxConfig
from reflow_hpc.sandbox import Sandbox, call_function, probe, reward

INPUTS = [[1, 2], [40, 2], [-5, 5]]
EXPECTED = [3, 42, 0]
HONEST = "def add(a, b):\n    return a + b\n"
WALL_S = 1.5


def tier_or_skip(tier: str) -> None:
    found = {p.tier: p for p in probe()}[tier]
    if not found.usable:
        if tier == "bwrap" and os.environ.get("REFLOW_REQUIRE_BWRAP") == "1":
            pytest.fail(f"REFLOW_REQUIRE_BWRAP=1 but the bwrap tier is unusable: {found.why}")
        pytest.skip(f"tier {tier} unusable here: {found.why}")


def descendants(pid: int) -> list[int]:
    """Host pids below ``pid`` (by parent links in /proc)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = int(Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def gone(pids: list[int], within_s: float = 5.0) -> bool:
    """Whether every process of ``pids`` has ended (zombies count as ended) within ``within_s``."""
    def running(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + within_s
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module", params=["bwrap", "landlock"])
def sb(request):
    tier_or_skip(request.param)
    cfg = SandboxConfig(tier=request.param, concurrency=2, wall_time_s=WALL_S, cpu_time_s=1, memory_mib=256,
                        processes=8, output_bytes=64 << 10, scratch_mib=8, recycle_every=0)
    box = Sandbox(cfg, quiet=True)
    box.start()
    box.baseline = {pid: len(descendants(pid)) for pid in box.server_pids()}
    yield box
    box.close()


@pytest.fixture
def listener():
    """A TCP listener on the host's loopback; yields (port, connections it accepted)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.1)
    accepted: list = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                accepted.append(conn.recv(100))
                conn.close()
            except OSError:
                pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()


def still_works(box: Sandbox) -> None:
    """After an attack: an honest solution earns the reward, and nothing it started is left running."""
    assert reward(call_function(box, HONEST, "add", INPUTS), EXPECTED) == 1.0
    now = {pid: len(descendants(pid)) for pid in box.server_pids()}
    assert now == box.baseline, f"processes left in the sandbox: {now} (at start: {box.baseline})"


def attack(box: Sandbox, body: str, **fmt) -> object:
    """Run ``body`` as the submitted solution (it defines no correct add): its reward must be 0."""
    src = textwrap.dedent(body).format(**fmt) if fmt else body
    run = call_function(box, src, "add", INPUTS)
    assert reward(run, EXPECTED) == 0.0, run
    return run


# ---- resources ----------------------------------------------------------------------------------------

def test_infinite_loop_sigterm_ignored_and_sleep(sb):
    for body in ("while True:\n    pass\n",
                 "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.01)\n",
                 "import time\ntime.sleep(60)\n"):
        t = time.monotonic()
        run = attack(sb, body).run
        assert time.monotonic() - t < WALL_S + 2.0
        assert run.exit_code is not None and run.exit_code < 0          # killed
        still_works(sb)


def test_memory_bomb(sb):
    run = attack(sb, "x = bytearray(8 << 30)\n").run
    assert "MemoryError" in run.stderr
    still_works(sb)


def test_fork_bomb_and_thread_bomb(sb):
    attack(sb, """\
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """)
    still_works(sb)
    attack(sb, """\
        import threading, time
        while True:
            try:
                threading.Thread(target=time.sleep, args=(30,)).start()
            except BaseException:
                pass
        """)
    still_works(sb)


def test_output_flood(sb):
    run = attack(sb, "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(200):\n    sys.stdout.write(chunk)\n").run
    assert run.truncated and len(run.stdout) <= 64 << 10
    still_works(sb)


def test_disk_and_shm_fill(sb):
    shm_name = f"reflow-attack-{secrets.token_hex(4)}"
    before = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    run = attack(sb, """\
        import os
        for d in (".", "/tmp", "/dev/shm"):
            for i in range(100000):
                try:
                    with open(os.path.join(d, "{name}-%d" % i), "wb") as f:
                        f.write(b"x" * (1 << 20) * 16)
                except BaseException:
                    break
        """, name=shm_name).run
    assert not list(Path("/dev/shm").glob(shm_name + "*"))
    after = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    assert before - after < 64 << 20, run        # at most the scratch cap (8 MiB), plus others' noise
    still_works(sb)


# ---- the host's files, processes, secrets, network ----------------------------------------------------

def test_files_outside_scratch(sb, tmp_path):
    target = tmp_path / "existing.txt"
    target.write_text("original")
    new = tmp_path / "created.txt"
    attack(sb, """\
        for path, mode in (({target!r}, "w"), ({new!r}, "w"), ("/etc/reflow-attack", "w"), ("/usr/reflow-attack", "w"),
                           ({target!r}, "a")):
            try:
                with open(path, mode) as f:
                    f.write("pwned")
            except BaseException:
                pass
        """, target=str(target), new=str(new))
    assert target.read_text() == "original" and not new.exists()
    assert not Path("/etc/reflow-attack").exists() and not Path("/usr/reflow-attack").exists()
    still_works(sb)


def test_secrets_shadow_and_environ(sb):
    token = secrets.token_hex(16)
    holder = subprocess.Popen(["sleep", "30"], env={"REFLOW_ATTACK_SECRET": token})
    try:
        run = attack(sb, """\
            import os
            for path in ("/etc/shadow", "/root/.bash_history", "/proc/{me}/environ", "/proc/{holder}/environ",
                         "/proc/1/environ", "/proc/%d/environ" % os.getppid()):
                try:
                    print(open(path, "rb").read()[:4000])
                except BaseException as e:
                    print("denied", path, type(e).__name__)
            """, me=os.getpid(), holder=holder.pid).run
    finally:
        holder.kill()
        holder.wait()
    assert token not in run.stdout and "root:" not in run.stdout, run.stdout
    assert os.environ.get("PATH", "") not in run.stdout or not os.environ.get("PATH")
    still_works(sb)


def test_proc_mem_of_others(sb):
    run = attack(sb, """\
        import os
        for pid in sorted({{1, os.getppid(), {me}}}):
            try:
                with open("/proc/%d/mem" % pid, "rb") as f:
                    print("opened", pid)
            except BaseException as e:
                print("denied", pid, type(e).__name__)
        """, me=os.getpid()).run
    assert "opened" not in run.stdout, run.stdout
    still_works(sb)


def test_tcp_to_a_host_listener(sb, listener):
    port, accepted = listener
    run = attack(sb, """\
        import socket
        for host in ("127.0.0.1", "localhost", "::1"):
            try:
                s = socket.create_connection((host, {port}), timeout=0.5)
                s.sendall(b"pwned")
                print("connected", host)
            except BaseException as e:
                print("refused", host, type(e).__name__)
        """, port=port).run
    time.sleep(0.3)
    assert "connected" not in run.stdout and accepted == [], (run.stdout, accepted)
    still_works(sb)


def test_ctypes_system(sb, tmp_path):
    marker = tmp_path / "system-ran"
    attack(sb, """\
        import ctypes
        ctypes.CDLL(None).system(b"echo pwned > {marker} ; echo pwned > /tmp/../{name}")
        """, marker=str(marker), name=marker.name)
    assert not marker.exists() and not (Path("/") / marker.name).exists()
    still_works(sb)


def test_killing_the_server(sb):
    restarts = [s.helper.restarts for s in sb._slots]
    run = attack(sb, """\
        import os, signal
        for pid in (os.getppid(), 1, -1, 0):
            try:
                os.kill(pid, signal.SIGKILL)
                print("signalled", pid)
            except BaseException as e:
                print("denied", pid, type(e).__name__)
        """).run
    assert "signalled -1" not in run.stdout and "signalled 1" not in run.stdout
    # Whatever got through, the server survived (or was replaced) and the next run works.
    assert [s.helper.restarts for s in sb._slots] == restarts, run
    still_works(sb)


def test_setsid_grandchild_acting_later(sb):
    attack(sb, """\
        import os, time
        try:
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(1.0)
                    open("late-grandchild", "w").write("x")
                    open("/tmp/late-grandchild", "w").write("x")
                os._exit(0)
        except OSError:
            pass
        """)
    time.sleep(1.5)
    for slot in sb._slots:
        if slot.scratch is not None:
            assert list(slot.scratch.iterdir()) == []
    runs = [sb.run("import os\nprint(sorted(os.listdir('.')), sorted(os.listdir('/tmp')) if os.path.isdir('/tmp') "
                   "else None)") for _ in range(4)]
    assert all("late-grandchild" not in r.stdout for r in runs), runs
    still_works(sb)


def test_files_left_for_the_next_run(sb):
    leave = ("import os\nfor d in ('.', '/tmp', '/dev/shm'):\n    try:\n"
             "        open(os.path.join(d, 'left-behind'), 'w').write('x')\n    except OSError:\n        pass\n")
    look = ("import os\nprint([d for d in ('.', '/tmp', '/dev/shm')\n"
            "       if os.path.exists(os.path.join(d, 'left-behind'))])")
    for _ in range(2 * len(sb._slots)):          # enough runs that every server is both writer and reader
        sb.run(leave)
        assert sb.run(look).stdout.strip() == "[]"
    still_works(sb)


def test_concurrent_runs_cannot_reach_each_other(sb):
    """Run A sleeps with a file in its scratch; run B, at the same time, tries to signal, trace or write to
    every process and scratch it can name. A ends normally with its file intact."""
    a_src = ("import os, time\nopen('mine', 'w').write('A')\nprint(os.getpid(), flush=True)\ntime.sleep(0.8)\n"
             "print('A-intact' if open('mine').read() == 'A' else 'A-touched')\n")
    scratches = [str(s.scratch) for s in sb._slots if s.scratch is not None]
    b_src = textwrap.dedent("""\
        import os, signal
        hits = []
        try:
            names = os.listdir("/proc")
        except OSError:                         # Landlock: no /proc at all
            names = []
        for name in names:
            if name.isdigit() and int(name) not in (os.getpid(),):
                for how in ("kill", "mem"):
                    try:
                        if how == "kill":
                            os.kill(int(name), signal.SIGKILL)
                        else:
                            open("/proc/%s/mem" % name, "rb").close()
                        hits.append((how, name))
                    except BaseException:
                        pass
        for d in {scratches!r}:
            if os.path.realpath(d) == os.getcwd():
                continue                        # its own
            try:
                open(os.path.join(d, "mine"), "w").write("B")
                hits.append(("write", d))
            except BaseException:
                pass
        print("hits", hits)
        """).format(scratches=scratches)
    results = {}
    ta = threading.Thread(target=lambda: results.setdefault("a", sb.run(a_src)))
    ta.start()
    time.sleep(0.2)
    results["b"] = sb.run(b_src)
    ta.join()
    a, b = results["a"], results["b"]
    assert a.exit_code == 0 and "A-intact" in a.stdout, (a, b)
    # B may only have reached itself (in the bwrap tier it sees its own sandbox: init and its server,
    # which it can neither signal nor open)
    assert "hits []" in b.stdout, b
    still_works(sb)


# ---- forged results ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    "import os\nos._exit(0)\ndef add(a, b):\n    return a + b\n",
    "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "import builtins\nclass _Never(Exception):\n    pass\nbuiltins.AssertionError = _Never\n"
    "def add(a, b):\n    return 0\n",
    "print('All tests passed: 3/3')\nprint('PASSED')\ndef add(a, b):\n    return None\n",
    # a forged results line, then an exit before the real one is written
    "import os, json\nprint('#reflow-sandbox-results# ' + json.dumps([{'ok': True, 'value': 0}] * 3), flush=True)\n"
    "os._exit(0)\n",
], ids=["os._exit", "sys.exit", "patched AssertionError", "fake verdict", "forged results line"])
def test_result_forgery_earns_nothing(sb, body):
    attack(sb, body)
    still_works(sb)


# ---- the server itself ---------------------------------------------------------------------------------

def test_a_stuck_server_is_killed_and_replaced():
    tier_or_skip("bwrap")
    with Sandbox(SandboxConfig(concurrency=1, wall_time_s=1.0), quiet=True) as box:
        box.reply_grace_s = 0.5
        box.start()
        outer = box.server_pids()[0]
        inner = [p for p in descendants(outer) if b"reflow_sandbox" in Path(f"/proc/{p}/cmdline").read_bytes()
                 or b"-c" in Path(f"/proc/{p}/cmdline").read_bytes()]
        for p in inner:
            os.kill(p, signal.SIGSTOP)             # what a traced or wedged server looks like
        run = box.run("print(1)")
        assert run.exit_code is None and run.timed_out and "restarted" in run.error
        assert gone([outer, *inner])
        assert box.run("print(2)").stdout == "2\n"


def test_recycled_every_n_runs():
    tier_or_skip("bwrap")
    with Sandbox(SandboxConfig(concurrency=1, recycle_every=3), quiet=True) as box:
        pids = set()
        for _ in range(7):
            assert box.run("pass").exit_code == 0
            pids.add(box.server_pids()[0])
        assert box._slots[0].helper.recycled == 2 and len(pids) == 3


@pytest.mark.parametrize("tier", ["bwrap", "landlock"])
def test_the_servers_die_with_the_trainer(tier):
    tier_or_skip(tier)
    prog = ("import sys, time\nfrom reflow_hpc.config import SandboxConfig\nfrom reflow_hpc.sandbox import Sandbox\n"
            f"sb = Sandbox(SandboxConfig(tier={tier!r}, concurrency=2), quiet=True)\nsb.start()\n"
            "print(sb.run('import os; print(os.getpid())').exit_code, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        assert parent.stdout.readline().strip() == "0"
        below = descendants(parent.pid)
        assert len(below) >= 2
    finally:
        parent.kill()
        parent.wait()
    assert gone(below), below


def test_sandbox_processes_stay_in_the_ranks_cpu_group():
    """Started from a rank held in a cgroup-v1 CPU quota (runtime/cpuquota.py), every process of the
    sandbox is in that group too: nothing moves them out."""
    from reflow_hpc.runtime import cpuquota
    tier_or_skip("bwrap")
    if cpuquota.available():
        pytest.skip(f"no CPU quota groups here: {cpuquota.available()}")
    prefix = f"reflow-sbx-test-{os.getpid()}"
    prog = ("import os, sys, time\nfrom reflow_hpc.runtime import cpuquota\n"
            f"cpuquota.join(1.0, {prefix!r}, 0)\n"
            "from reflow_hpc.sandbox import Sandbox\nsb = Sandbox(quiet=True)\nsb.start()\n"
            "import threading\nt = threading.Thread(target=sb.run, args=('import time; time.sleep(1.5)',))\n"
            "t.start()\ntime.sleep(0.7)\nprint(os.getpid(), flush=True)\nt.join()\nsb.close()\n")
    proc = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        pid = int(proc.stdout.readline())
        groups = {}
        for p in descendants(pid):
            try:
                line = next(ln for ln in Path(f"/proc/{p}/cgroup").read_text().splitlines()
                            if ln.split(":")[1].split(",").count("cpu"))
                groups[p] = line.split(":", 2)[2]
            except (OSError, StopIteration):
                pass
        assert len(groups) >= 4, groups           # bwrap, its init, the server, the run (per server)
        assert set(groups.values()) == {f"/{prefix}-rank0"}, groups
    finally:
        proc.wait(timeout=30)
        cpuquota.remove(prefix, 1)


@pytest.mark.parametrize("tier", ["bwrap", "landlock"])
def test_a_sandbox_started_on_a_thread_that_ends_keeps_working(tier):
    """The parent-death signal belongs to the thread that forked: servers started from an executor thread
    that has since ended must not die with it (they are started from the process's spawner thread)."""
    tier_or_skip(tier)
    cfg = SandboxConfig(tier=tier, concurrency=2, wall_time_s=WALL_S, recycle_every=0)
    boxes: list = []
    t = threading.Thread(target=lambda: boxes.append(Sandbox(cfg, quiet=True)) or boxes[0].start())
    t.start()
    t.join()
    box = boxes[0]
    try:
        started = box.server_pids()
        assert len(started) == 2
        assert not gone(started, within_s=0.5)       # a parent-death signal would have killed them by now
        for _ in range(4):
            assert reward(call_function(box, HONEST, "add", INPUTS), EXPECTED) == 1.0
        assert box.server_pids() == started
    finally:
        box.close()
