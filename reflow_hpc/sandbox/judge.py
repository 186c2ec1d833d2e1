"""Judging outside the sandbox: the code only returns outputs, the trainer compares them.

``call_function(sandbox, source, name, inputs)`` runs the model's source in the sandbox, calls
``name(*args)`` on each input there and returns the values as JSON; ``reward(run, expected)`` compares
them with the expected outputs here, where the code cannot reach. The expected outputs never enter the
sandbox, and nothing the code prints, raises, patches or exits with counts as a verdict: a run that
ends before the results line (``os._exit``, ``sys.exit``), that prints "passed", that replaces
``AssertionError`` or fakes the results line with wrong values earns nothing. What a run can still do
is compute its outputs any way it likes, including by recognising the inputs (it sees them): the
judge checks outputs, not how they were made.

``run_program(sandbox, source, stdins, timeout_s, case_timeout_s)`` does the same for a standard
input/output program (APPS's "standard input" problems): one sandbox run executes the source once per
case, each time in a fresh namespace as ``__main__`` with ``sys.stdin`` holding the case's input (fd 0
too, for ``open(0)``) and ``sys.stdout`` captured, bounded by ``case_timeout_s`` (``signal.setitimer``;
``SystemExit`` with status 0 ends a case normally). After each case the driver writes one results
line ``MARK {"case": i, "ok": …, "stdout": …}``; the judge takes, for each case, the last well-formed
line naming it (:func:`parse_case_results`), so a run that exits, crashes or is cut off (its wall
limit, the output cap) in case ``k`` keeps the cases before ``k`` and earns nothing for ``k`` and after,
and a forged line counts only as the output it claims. A case past its time limit fails and the next
one starts; a program that catches the timeout (a bare ``except:``) runs on until the wall limit. :func:`stdout_match` compares an output with the expected one
here: their whitespace-separated tokens must be equal, in order; two tokens that are both decimal
numbers, not both integers, are equal within 1e-6 (absolute or relative).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .client import RunResult, Sandbox

MARK = "#reflow-sandbox-results# "

# Inputs arrive on stdin; the solution is executed from a string, so no text of it can change the driver.
_DRIVER = """\
import json as _json, sys as _sys
_ns = {{"__name__": "__solution__"}}
exec(compile({source!r}, "<solution>", "exec"), _ns)
_inputs = _json.loads(_sys.stdin.read())
_out = []
for _args in _inputs:
    try:
        _f = _ns[{name!r}]
        _v = _f(*_args)
        _json.dumps(_v, allow_nan=False)
        _out.append({{"ok": True, "value": _v}})
    except BaseException as _e:
        _out.append({{"ok": False, "error": type(_e).__name__}})
_sys.stdout.write("\\n" + {mark!r} + _json.dumps(_out, allow_nan=False) + "\\n")
_sys.stdout.flush()
"""


@dataclass
class FunctionRun:
    run: RunResult
    results: list[dict] | None            # per input {"ok", "value"} or {"ok": false, "error"}; None: no results


def call_function(sandbox: Sandbox, source: str, name: str, inputs: Sequence[Sequence[Any]],
                  timeout_s: float | None = None) -> FunctionRun:
    """Run ``source`` in the sandbox and call ``name(*args)`` there for each ``args`` of ``inputs``."""
    code = _DRIVER.format(source=source, name=name, mark=MARK)
    run = sandbox.run(code, stdin=json.dumps([list(a) for a in inputs]), timeout_s=timeout_s)
    return FunctionRun(run, parse_results(run, len(inputs)))


def parse_results(run: RunResult, n: int) -> list[dict] | None:
    """The results line of a finished run (the last one), or None when there is none or it is malformed."""
    if run.exit_code is None or run.truncated or run.timed_out:
        return None
    lines = [ln for ln in run.stdout.split("\n") if ln.startswith(MARK)]
    if not lines:
        return None
    try:
        results = json.loads(lines[-1][len(MARK):])
    except ValueError:
        return None
    if not isinstance(results, list) or len(results) != n or not all(isinstance(r, dict) for r in results):
        return None
    return results


def _normal(v: Any) -> Any:
    return json.loads(json.dumps(v))


def outputs_match(got: Any, expected: Any) -> bool:
    """Equal as JSON values; floats within a relative 1e-9."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, float) or isinstance(expected, float):
            return math.isfinite(got) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12)
        return got == expected
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(outputs_match(a, b) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(outputs_match(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


def reward(run: FunctionRun, expected: Sequence[Any]) -> float:
    """1.0 when every call returned its expected output, else 0.0."""
    if run.results is None or len(run.results) != len(expected):
        return 0.0
    ok = all(r.get("ok") is True and outputs_match(r.get("value"), _normal(e)) for r, e in zip(run.results, expected))
    return 1.0 if ok else 0.0


# --------------------------------------------------------------------------------------------
# Standard input/output programs: one run, a results line per case
# --------------------------------------------------------------------------------------------

# The cases' inputs arrive on stdin as a JSON list of strings. Everything the driver uses after the
# program starts running is bound before it does, so that a program replacing a module's function or
# a builtin changes only what its own cases print.
_PROGRAM_DRIVER = """\
import io as _io, json as _json, os as _os, signal as _signal, sys as _sys, tempfile as _tempfile
import threading as _threading
_out, _dumps, _loads = _sys.stdout, _json.dumps, _json.loads
_write, _flush = _out.write, _out.flush
_real_stdin = _sys.stdin
_TextIO, _BytesIO, _dup2 = _io.TextIOWrapper, _io.BytesIO, _os.dup2
_fstat, _open, _O_RDONLY, _OSError = _os.fstat, _os.open, _os.O_RDONLY, OSError
_setitimer, _REAL, _SIGALRM, _on_signal = _signal.setitimer, _signal.ITIMER_REAL, _signal.SIGALRM, _signal.signal
_threads_now, _BaseException, _SystemExit, _type = _threading.enumerate, BaseException, SystemExit, type
_exec, _int, _set, _enumerate = exec, int, set, enumerate
_builtins = __builtins__
_cases = _loads(_sys.stdin.read())


class _CaseTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _CaseTimeout()


class _Captured(_BytesIO):
    def close(self):                # a program that closes sys.stdout keeps what it wrote
        pass


def _stdin_fd(data):
    # fd 0 holds the case's input too (open(0), os.read(0, n)): a file in the run's scratch directory.
    # A case that closed fd 0 (open(0) closes it with its file) leaves it free: fill it first, so that
    # the file is opened on another descriptor and only its duplicate becomes fd 0.
    try:
        try:
            _fstat(0)
        except _OSError:
            _open("/dev/null", _O_RDONLY)
        with _tempfile.TemporaryFile() as f:
            f.write(data)
            f.flush()
            f.seek(0)
            _dup2(f.fileno(), 0)
    except _BaseException:
        pass


try:
    _code, _compile_error = compile({source!r}, "<solution>", "exec"), None
except BaseException as _e:         # SyntaxError, ValueError (null bytes), RecursionError, MemoryError
    _code, _compile_error = None, type(_e).__name__

for _i, _case in _enumerate(_cases):
    _buf = _Captured()
    _result = {{"case": _i, "ok": True}}
    _before = _set(_threads_now())
    _wrapper = None
    try:
        _data = _case.encode("utf-8", "surrogatepass")
        _stdin_fd(_data)
        _sys.stdin = _TextIO(_BytesIO(_data), encoding="utf-8", errors="replace")
        _sys.stdout = _wrapper = _TextIO(_buf, encoding="utf-8", errors="backslashreplace")
        _on_signal(_SIGALRM, _alarm)
        _setitimer(_REAL, {case_timeout!r})
        try:
            if _code is None:
                raise SyntaxError(_compile_error)
            _exec(_code, {{"__name__": "__main__", "__builtins__": _builtins}})
            for _t in _threads_now():   # threads the case started (a common way to raise the stack size)
                if _t not in _before and not _t.daemon:
                    _t.join()
        finally:
            _setitimer(_REAL, 0)
    except _CaseTimeout:
        _result = {{"case": _i, "ok": False, "error": "timeout"}}
    except _SystemExit as _e:
        if not (_e.code is None or (_type(_e.code) is _int and _e.code == 0)):
            _result = {{"case": _i, "ok": False, "error": "SystemExit"}}
    except _BaseException as _e:
        _result = {{"case": _i, "ok": False, "error": _type(_e).__name__}}
    finally:
        _sys.stdin, _sys.stdout = _real_stdin, _out
    try:
        if _wrapper is not None:
            _wrapper.flush()
    except _BaseException:
        pass
    _result["stdout"] = _buf.getvalue().decode("utf-8", "backslashreplace")
    _write("\\n" + {mark!r} + _dumps(_result) + "\\n")
    _flush()
"""


@dataclass
class ProgramRun:
    run: RunResult
    results: list[dict | None]   # per case {"case", "ok", "stdout"} (+ "error"); None: no results line for it


def run_program(sandbox: Sandbox, source: str, stdins: Sequence[str], timeout_s: float | None = None,
                case_timeout_s: float = 4.0) -> ProgramRun:
    """Run ``source`` as a standard input/output program once per input of ``stdins``, in one sandbox run
    (``timeout_s``: its wall limit, at most ``sandbox.wall_time_s``); each case bounded by ``case_timeout_s``."""
    code = _PROGRAM_DRIVER.format(source=source, mark=MARK, case_timeout=float(case_timeout_s))
    run = sandbox.run(code, stdin=json.dumps(list(stdins)), timeout_s=timeout_s)
    return ProgramRun(run, parse_case_results(run, len(stdins)))


def parse_case_results(run: RunResult, n: int) -> list[dict | None]:
    """For each of ``n`` cases, the last well-formed results line naming it, or None. A run cut short
    (an exit, a crash, its wall limit, the output cap) keeps the lines written before; only a run with
    no result at all (the sandbox gave none) has none."""
    out: list[dict | None] = [None] * n
    if run.exit_code is None:
        return out
    for line in run.stdout.split("\n"):
        if not line.startswith(MARK):
            continue
        try:
            r = json.loads(line[len(MARK):])
        except ValueError:
            continue
        if not isinstance(r, dict) or not isinstance(r.get("stdout"), str):
            continue
        i = r.get("case")
        if type(i) is int and 0 <= i < n:
            out[i] = r
    return out


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_INTEGER = re.compile(r"[-+]?\d+")


def _integer(s: str) -> tuple[bool, str]:
    digits = s.lstrip("+-").lstrip("0")
    return (s.startswith("-") and bool(digits), digits)


def _token_equal(got: str, expected: str) -> bool:
    if got == expected:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(expected):
        return _integer(got) == _integer(expected)     # exactly, however many digits
    a, b = float(got), float(expected)
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def stdout_match(got: str, expected: str) -> bool:
    """A program's output against the expected one (module docstring): the same whitespace-separated
    tokens in order, decimal numbers (not both integers) within 1e-6 absolute or relative."""
    g, e = got.split(), expected.split()
    return len(g) == len(e) and all(_token_equal(a, b) for a, b in zip(g, e))


def case_passed(result: dict | None, expected: str) -> bool:
    """Whether one case of a :class:`ProgramRun` ended normally with the expected output."""
    return result is not None and result.get("ok") is True and stdout_match(result["stdout"], expected)
