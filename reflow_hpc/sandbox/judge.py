"""Judging outside the sandbox: the code only returns outputs, the trainer compares them.

``call_function(sandbox, source, name, inputs)`` runs the model's source in the sandbox, calls
``name(*args)`` on each input there and returns the values as JSON; ``reward(run, expected)`` compares
them with the expected outputs here, where the code cannot reach. The expected outputs never enter the
sandbox, and nothing the code prints, raises, patches or exits with counts as a verdict: a run that
ends before the results line (``os._exit``, ``sys.exit``), that prints "passed", that replaces
``AssertionError`` or fakes the results line with wrong values earns nothing. What a run can still do
is compute its outputs any way it likes, including by recognising the inputs (it sees them): the
judge checks outputs, not how they were made.
"""

from __future__ import annotations

import json
import math
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
