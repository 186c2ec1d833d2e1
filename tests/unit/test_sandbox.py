"""The sandbox's pieces that need no isolation: tier choice and the config error of a machine without a
usable tier, judging outside the sandbox, the seccomp program, the bounded helper process, the rlimits
tier's limits and the command line. The attack corpus is tests/integration/test_sandbox_attacks.py."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from conftest import ROOT, python_m
from reflow_hpc.config import ConfigError, SandboxConfig, load
from reflow_hpc.sandbox import RunResult, Sandbox, outputs_match, require_tier, reward, tiers
from reflow_hpc.sandbox import server as srv
from reflow_hpc.sandbox.helper import HelperError, HelperProcess
from reflow_hpc.sandbox.judge import MARK, FunctionRun, parse_results


@pytest.fixture
def no_isolation(monkeypatch):
    """A machine with neither bubblewrap nor Landlock."""
    found = (tiers.Probe("bwrap", False, "bubblewrap is not installed (Debian: apt-get install bubblewrap)"),
             tiers.Probe("landlock", False, "the kernel has no Landlock"),
             tiers.Probe("rlimits", True, "rlimits"))
    monkeypatch.setattr(tiers, "probe", lambda python_override="": found)


def test_no_usable_tier_is_a_one_line_config_error(no_isolation):
    cfg = load(None, ["model.warmstart=true"], check_files=False)
    with pytest.raises(ConfigError) as e:
        require_tier(cfg)
    msg = str(e.value)
    assert msg.startswith("config error: sandbox.allow_weak = false: no usable sandbox tier") and "\n" not in msg
    assert "apt-get install bubblewrap" in msg and "sandbox.allow_weak = true" in msg
    cfg.sandbox.allow_weak = True
    assert require_tier(cfg) == "rlimits"
    with pytest.raises(ConfigError) as e:
        require_tier(SandboxConfig(tier="bwrap", allow_weak=True))
    assert str(e.value).startswith('config error: sandbox.tier = "bwrap": tier bwrap is not usable here')
    with pytest.raises(ConfigError, match="sandbox.allow_weak = false"):
        require_tier(SandboxConfig(tier="rlimits"))


def test_the_main_job_refuses_a_python_tool_without_a_tier(no_isolation):
    from reflow_hpc.run import check_sandbox

    check_sandbox(load(None, ["model.warmstart=true"], check_files=False))         # calculator only: no check
    with pytest.raises(ConfigError, match="sandbox.allow_weak"):
        check_sandbox(load(None, ["model.warmstart=true", "task.tools=calculator,python"], check_files=False))
    with pytest.raises(ConfigError, match="sandbox.allow_weak"):      # a coding task judges code in the sandbox
        check_sandbox(load(None, ["model.warmstart=true", "task.name=code_synth", "task.tools=python"],
                           check_files=False))


def test_the_best_usable_tier_is_chosen(monkeypatch):
    found = (tiers.Probe("bwrap", False, "no"), tiers.Probe("landlock", True, "Landlock ABI 7"),
             tiers.Probe("rlimits", True, "rlimits"))
    monkeypatch.setattr(tiers, "probe", lambda python_override="": found)
    assert tiers.choose() == ("landlock", "Landlock ABI 7")
    assert tiers.choose("auto", allow_weak=True)[0] == "landlock"


def test_config_keys_and_bounds():
    cfg = load(None, ["sandbox.concurrency=3", "sandbox.wall_time_s=2.5", "model.warmstart=true"], check_files=False)
    assert cfg.sandbox.concurrency == 3 and cfg.sandbox.wall_time_s == 2.5
    for bad in ("sandbox.concurrency=0", "sandbox.tier=docker", "sandbox.memory_mib=8", "sandbox.output_bytes=1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load(None, [bad, "model.warmstart=true"], check_files=False)


# ---- judging ----------------------------------------------------------------------------------------

def _run(stdout: str, exit_code: int | None = 0, **kw) -> RunResult:
    return RunResult(stdout=stdout, exit_code=exit_code, **kw)


def test_the_judge_reads_only_the_last_results_line_of_a_finished_run():
    good = MARK + json.dumps([{"ok": True, "value": 3}, {"ok": True, "value": [1, 2]}])
    assert parse_results(_run("noise\n" + good + "\n"), 2) is not None
    fake_then_real = MARK + json.dumps([{"ok": True, "value": 0}] * 2) + "\n" + good + "\n"
    assert parse_results(_run(fake_then_real), 2)[0]["value"] == 3
    for bad in (_run("PASSED\n"), _run(good, exit_code=None), _run(good, truncated=True), _run(good, timed_out=True),
                _run(MARK + "{not json"), _run(MARK + json.dumps([{"ok": True, "value": 3}]))):
        assert parse_results(bad, 2) is None
    run = FunctionRun(_run(good), parse_results(_run(good), 2))
    assert reward(run, [3, (1, 2)]) == 1.0 and reward(run, [3, [2, 1]]) == 0.0 and reward(run, [3]) == 0.0
    failed = FunctionRun(_run(""), [{"ok": False, "error": "SystemExit"}, {"ok": True, "value": [1, 2]}])
    assert reward(failed, [None, [1, 2]]) == 0.0


def test_outputs_match():
    assert outputs_match(0.1 + 0.2, 0.3) and outputs_match(2, 2.0) and not outputs_match(True, 1)
    assert not outputs_match(1, True) and not outputs_match("1", 1) and not outputs_match(float("nan"), 1.0)
    assert outputs_match({"a": [1, "x"]}, {"a": [1, "x"]}) and not outputs_match({"a": 1}, {"a": 1, "b": 2})


# ---- the seccomp program ------------------------------------------------------------------------------

@pytest.mark.skipif(platform.machine() not in srv.SECCOMP_ARCHES, reason="no seccomp table for this machine")
@pytest.mark.parametrize("mode", ["fork", "nofork"])
def test_seccomp_program_is_well_formed(mode):
    prog = srv.seccomp_filter(mode, srv.OWN_PID, [1, 2])
    assert len(prog) < 4096 and prog[-1] == (0x06, 0, 0, 0x7FFF0000)         # ends allowing; kernel cap
    for i, (code, jt, jf, _) in enumerate(prog):
        if code in (0x15, 0x35, 0x45):
            assert i + 1 + max(jt, jf) < len(prog)                              # every jump lands inside
    raw = srv.seccomp_pack(prog)
    assert len(raw) == 8 * len(prog)
    assert (srv.OWN_PID.to_bytes(4, "little") in raw) == (mode == "nofork")


# ---- the bounded helper process ---------------------------------------------------------------------------

ECHO = ("import json, sys, time, os\nprint(json.dumps({'ready': True, 'pid': os.getpid()}), flush=True)\n"
        "for line in sys.stdin:\n    req = json.loads(line)\n    time.sleep(req.get('sleep', 0))\n"
        "    print(json.dumps({'echo': req['x']}), flush=True)\n")


def test_helper_calls_deadline_respawn_and_recycle():
    h = HelperProcess([sys.executable, "-c", ECHO], name="echo", recycle_every=3, start_timeout_s=30)
    try:
        first = h.start()["pid"]
        assert h.call({"x": 1}, 10) == {"echo": 1}
        assert h.call({"x": 2, "sleep": 5}, 0.3) is None and "no reply within 0.3 s" in h.last_failure
        assert h.restarts == 1 and h.pid != first
        os.kill(h.pid, 9)                               # found dead before the next call: replaced, call made
        assert h.call({"x": 3}, 10) == {"echo": 3}
        pids = set()
        for i in range(6):
            assert h.call({"x": i}, 10) == {"echo": i}
            pids.add(h.pid)
        assert h.recycled >= 2 and len(pids) >= 2
    finally:
        h.close()


def test_a_helper_that_cannot_start_says_so():
    h = HelperProcess([sys.executable, "-c", "import sys; sys.exit(3)"], name="broken", start_timeout_s=10)
    with pytest.raises(HelperError, match="broken: the helper process did not start: it exited at start"):
        h.call({}, 1)


# ---- the rlimits tier: limits only ------------------------------------------------------------------------

def test_rlimits_tier_bounds_time_output_and_scratch():
    cfg = SandboxConfig(tier="rlimits", allow_weak=True, concurrency=1, wall_time_s=1.0, output_bytes=4096)
    with pytest.raises(Exception, match="allow_weak"):
        Sandbox(SandboxConfig(tier="rlimits"), quiet=True)
    with Sandbox(cfg, quiet=True) as sb:
        assert "WEAK" in sb.notice
        r = sb.run("print('hi')")
        assert (r.stdout, r.exit_code, r.tier) == ("hi\n", 0, "rlimits")
        assert sb.run("while True: pass").timed_out
        assert sb.run("print('x' * 100000)").truncated
        sb.run("open('left', 'w').write('x')")
        assert sb.run("import os; print(os.listdir('.'))").stdout == "[]\n"
        scratch = sb._slots[0].scratch
        assert scratch is not None and oct(scratch.stat().st_mode & 0o777) == "0o700"
    assert not scratch.exists()


def test_command_line_exec_and_probe():
    r = python_m("reflow_hpc.sandbox", "--probe", timeout=60)
    assert r.stdout.startswith("tier: ") and "rlimits: usable" in r.stdout
    r = subprocess.run([sys.executable, "-m", "reflow_hpc.sandbox", "exec", "--timeout", "5", "--set",
                        "sandbox.allow_weak=true"], input="import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
                       "sys.exit(4)\n", capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {k: out[k] for k in ("stdout", "stderr", "exit_code", "timed_out", "truncated")} == \
        {"stdout": "out\n", "stderr": "err\n", "exit_code": 4, "timed_out": False, "truncated": False}
    assert out["tier"] in tiers.TIERS and out["wall_s"] > 0
    assert sum("sandbox tier" in ln for ln in r.stderr.splitlines()) == 1
