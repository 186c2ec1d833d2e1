r"""Programming problems in the APPS format (Hendrycks et al. 2021), judged on their hidden tests in the sandbox.

**The file** (``data.path``) is JSONL, one problem per line, or parquet when ``pyarrow`` is installed,
with APPS's own field names:

- ``question``: the problem statement;
- ``input_output``: the hidden tests, a JSON string (or an already decoded object)
  ``{"inputs": [...], "outputs": [...]}``, with ``"fn_name"`` for a call-based problem. A standard
  input/output problem's inputs and outputs are texts (a list of lines is joined with newlines); a
  call-based problem's inputs are argument lists and its outputs the expected return values;
- ``starter_code`` (optional): shown in the prompt (a call-based problem's signature);
- ``solutions`` (optional): a JSON list of solutions; the first is the worked solution
  (:meth:`CodeApps.solution`);
- ``problem_id`` (optional): kept in the prompt's meta.

A missing, unreadable or malformed file or record is a config error at load naming ``data.path``, the
line and the field (the reader is ``config.apps_rows``, so that validating a config checks the file
without this module). Rows are split once into train and eval by the hash of their question
(``task.eval_fraction``); index ``i`` of a split walks its rows in an order reshuffled every epoch
from ``run.seed`` (``data.shuffle``), as ``math_boxed`` does; ``prompt_id`` is the row number.

**Turns** are :class:`~reflow_hpc.envs.code.CodeTask`'s: the model may run code (on the examples of
the statement, say) with the ``python`` tool (``task.tools`` must offer it; the tool's code runs with an
empty stdin, so the prompt of a standard input/output problem says to set ``sys.stdin`` to an example's
input), read the output, revise, and ends with its final code (:func:`~reflow_hpc.envs.code.final_code`:
the last fenced block of its last turn), at most ``task.max_turns`` model turns.

**The reward** is the fraction of the hidden tests the final code passes (``task.test_reward =
"fraction"``), or 1 only when it passes all (``"all"``); code that does not parse scores 0 without
a run. The tests run in the sandbox, in one run per sample bounded by ``sandbox.wall_time_s``, and
the outputs are compared here, where the code cannot reach (:mod:`reflow_hpc.sandbox.judge`):

- standard input/output: :func:`~reflow_hpc.sandbox.judge.run_program` runs the program once per
  test with that test's stdin, each bounded by ``task.test_timeout_s``; a test passes when the
  program ends normally (an exception, ``sys.exit(1)`` or the time limit fail it) and its stdout has
  the expected whitespace-separated tokens in order, decimal numbers (not both integers) within 1e-6
  absolute or relative (:func:`~reflow_hpc.sandbox.judge.stdout_match`). A run that ends early
  (``os._exit``, a crash, the run's wall limit) earns nothing for the tests from there on;
- call-based (``fn_name``): :func:`~reflow_hpc.sandbox.judge.call_function` calls ``fn_name(*args)``
  for every test (``Solution().fn_name`` when the code defines only a LeetCode-style ``class
  Solution``); a test passes when the call returned and its value equals the expected one by
  :func:`~reflow_hpc.sandbox.judge.outputs_match` (tuples are lists) — or, as APPS's own evaluator
  allows, the expected value is a one-element list and the value equals its element (APPS wraps many
  return values in a list). The calls share one time limit, ``task.test_timeout_s`` per test (at most
  ``sandbox.wall_time_s``): a call that never returns ends the run, and no test passes.

**Warm start.** The tiny CPU policy is not warm-started on APPS: statements and solutions are far
longer than its context, and not every record has a solution, so :meth:`CodeApps.solution_segments`
is None and ``python -m reflow_hpc.warmstart`` falls back to arithmetic (the policy then writes no
working code, and every sample is scored 0 — the run is a systems check, not a learning one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import apps_rows
from .code import CodeTask, final_code, parses
from .task import Prompt, RowSplits, register_task

if TYPE_CHECKING:
    from ..config import AppsRow, Config

ANSWER_STDIO = ("Write a Python 3 program that reads the input from standard input and prints the answer to "
                "standard output. (The python tool runs code with an empty standard input: to try an example, "
                "set sys.stdin = io.StringIO(its input) first.)")
ANSWER_CALL = "Complete the function `{fn}`{where}; each test calls it and checks the value it returns."
TOOL_HINT = ('You may run Python code to test it: end a turn with <tool_call>{"name": "python", "arguments": '
             '{"code": "..."}}</tool_call> and its output comes back. End with your final code in a ```python block.')


def prompt_text(row: "AppsRow") -> str:
    """The problem as the model sees it: statement, starter code, how to answer."""
    parts = [row.question.strip()]
    if row.starter_code.strip():
        parts.append("Starter code:\n```python\n" + row.starter_code.strip("\n") + "\n```")
    if row.fn_name:
        parts.append(ANSWER_CALL.format(fn=row.fn_name, where=" of the starter code" if row.starter_code.strip()
                                        else ""))
    else:
        parts.append(ANSWER_STDIO)
    parts.append(TOOL_HINT)
    return "\n\n".join(parts) + "\n"


def call_output_match(value: Any, expected: Any) -> bool:
    """A call's return value against APPS's expected output (module docstring)."""
    from ..sandbox.judge import outputs_match
    if outputs_match(value, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and outputs_match(value, expected[0])


def with_solution_shim(code: str, fn_name: str) -> str:
    """``code`` plus a module-level ``fn_name`` calling ``Solution().fn_name`` when the code defines no
    ``fn_name`` of its own (LeetCode-style problems, as APPS's evaluator calls them)."""
    return (f"{code}\n\n"
            f"if {fn_name!r} not in globals() and 'Solution' in globals():\n"
            f"    def {fn_name}(*args):\n"
            f"        return Solution().{fn_name}(*args)\n")


@register_task("code_apps")
class CodeApps(RowSplits, CodeTask):
    """APPS problems: multi-turn with the python tool, rewarded by the hidden tests (module docstring)."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        t = cfg.task
        self.all_or_nothing = t.test_reward == "all"
        self.case_timeout_s = t.test_timeout_s
        self.rows = apps_rows(cfg)
        self.split_by_text((row.question for row in self.rows), shuffle=cfg.data.shuffle,
                           source=f" of {cfg.data.path}")

    # -- prompts ----------------------------------------------------------------------------

    def prompt(self, index: int, split: str = "train") -> Prompt:
        row_id = self.row_of(index, split)
        row = self.rows[row_id]
        meta = {"split": split, "problem_id": row.problem_id, "tests": len(row.inputs),
                "kind": "call" if row.fn_name else "stdio"}
        return Prompt(row_id, prompt_text(row), "", meta)

    # -- reward -----------------------------------------------------------------------------

    def test_results(self, prompt: Prompt, response: str) -> list[bool]:
        """Per hidden test of the prompt's problem, whether the response's final code passes it."""
        from ..sandbox.judge import call_function, case_passed, run_program

        row = self.rows[prompt.prompt_id]
        code = final_code(response)
        if not parses(code):
            return [False] * len(row.inputs)
        wall = self.cfg.sandbox.wall_time_s
        if row.fn_name:
            run = call_function(self.sandbox(), with_solution_shim(code, row.fn_name), row.fn_name, row.inputs,
                                timeout_s=min(wall, self.case_timeout_s * len(row.inputs)))
            if run.results is None:
                return [False] * len(row.inputs)
            return [r.get("ok") is True and call_output_match(r.get("value"), e)
                    for r, e in zip(run.results, row.outputs)]
        prog = run_program(self.sandbox(), code, row.inputs, timeout_s=wall, case_timeout_s=self.case_timeout_s)
        return [case_passed(r, e) for r, e in zip(prog.results, row.outputs)]

    def reward(self, prompt: Prompt, response: str) -> float:
        passed = self.test_results(prompt, response)
        if self.all_or_nothing:
            return float(all(passed))
        return sum(passed) / len(passed)

    # -- worked solutions -------------------------------------------------------------------

    def solution(self, prompt: Prompt) -> str | None:
        """The record's first solution, as a final answer (a fenced block), or None when it has none."""
        code = self.rows[prompt.prompt_id].solution
        return None if code is None else "```python\n" + code.strip("\n") + "\n```"

    def solution_segments(self, prompt: Prompt) -> None:
        """None: no warm start on APPS (module docstring)."""
        return None
