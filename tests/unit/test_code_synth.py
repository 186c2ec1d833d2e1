"""The generated coding task: problems, hidden tests that catch every plausible bug, the teacher's
demonstrations, and rewards judged in the real sandbox."""

from __future__ import annotations

import ast
import random

import pytest

from conftest import sandbox_or_skip
from reflow_hpc.config import load
from reflow_hpc.envs import make_task
from reflow_hpc.envs.code import parses
from reflow_hpc.envs.code_synth import SWAPPED, code_of, run_steps
from reflow_hpc.envs.task import Episode

SETS = ["model.warmstart=true", "task.name=code_synth", "task.tools=python", "task.max_terms=6",
        "warmstart.bug_fraction=0.5", "warmstart.tool_fraction=0.5"]


def task(*extra: str):
    return make_task(load(None, [*SETS, *extra], check_files=False))


def buggable(steps):
    return [i for i, (kind, *rest) in enumerate(steps)
            if (kind == "filter" and rest[0] in SWAPPED) or (kind == "reduce" and rest[0] in ("max", "min"))]


def test_prompts_are_deterministic_and_splits_disjoint():
    t = task()
    assert t.prompt(7).text == task().prompt(7).text
    train = {t.prompt(i).text.split("\n")[0] for i in range(300)}
    held = {t.prompt(i, "eval").text.split("\n")[0] for i in range(60)}
    assert not train & held


def test_reference_code_computes_what_the_steps_say():
    t = task()
    for i in range(300):
        p = t.prompt(i)
        steps = [tuple(s) for s in p.meta["steps"]]
        ns: dict = {}
        exec(code_of(steps), ns)                  # our own generated code, not a model's
        for xs, want in zip(p.meta["hidden"], p.meta["expected"]):
            assert ns["f"](list(xs)) == want == run_steps(steps, xs)
        for line, xs in zip(p.text.splitlines()[1:], p.meta["public"]):
            assert line == f"f([{','.join(map(str, xs))}])=={run_steps(steps, xs)}"
        assert len(set(p.meta["expected"])) >= 3 and [] in p.meta["hidden"]


def test_every_plausible_bug_fails_a_hidden_test_whenever_some_input_tells_it_apart():
    t = task()
    rng = random.Random(1)
    pool = [[rng.randint(0, 9) for _ in range(rng.randint(0, 6))] for _ in range(1500)]
    told = 0
    for i in range(250):
        p = t.prompt(i)
        steps = [tuple(s) for s in p.meta["steps"]]
        for b in buggable(steps):
            bug = frozenset([b])
            if not any(run_steps(steps, xs, bugs=bug) != run_steps(steps, xs) for xs in pool):
                continue             # the same function on this domain (x>3 vs x>=3 on even numbers)
            told += 1
            assert any(run_steps(steps, xs, bugs=bug) != e for xs, e in zip(p.meta["hidden"], p.meta["expected"])), \
                (p.text, b)
    assert told > 60


def test_the_teachers_demonstrations_are_valid_code_with_bugs_at_its_rate():
    t = task()
    drafts = bugs = tools = 0
    for i in range(400):
        p = t.prompt(i)
        segs = t.solution_segments(p)
        text = "".join(s for s, _ in segs)
        code = t.final(p, text)
        assert parses(code) and any(isinstance(n, ast.FunctionDef) and n.name == "f" for n in ast.parse(code).body)
        tools += len(segs) > 1
        drafts += len(buggable(p.meta["steps"]))
        bugs += code.split("\ncheck(f)")[0].split("print('ok')\n")[-1] != t.solution(p)
    assert 0.35 < tools / 400 < 0.65
    assert bugs > 0.15 * 400


@pytest.fixture(scope="module")
def sandboxed():
    sandbox_or_skip(load(None, SETS, check_files=False))
    return task("sandbox.concurrency=1")


def test_reward_runs_the_final_code_on_the_hidden_tests(sandboxed):
    t = sandboxed
    p = next(t.prompt(i) for i in range(100) if buggable(t.prompt(i).meta["steps"]))
    right = t.solution(p)
    assert t.reward(p, right) == 1.0
    steps = [tuple(s) for s in p.meta["steps"]]
    wrong = code_of(steps, frozenset(buggable(steps)))
    assert t.reward(p, wrong) < 1.0
    assert t.reward(p, "def f(xs):\n return 0") < 1.0
    assert t.reward(p, "import os\nos._exit(0)") == 0.0
    assert t.reward(p, "<tool_call>" + right + "</tool_call>") == 0.0          # no final code
    assert t.reward(p, "<tool_call>" + wrong + "</tool_call><tool_response>0</tool_response>submit") < 1.0
    assert t.reward(p, "<tool_call>" + right + "\nprint(f([]))</tool_call><tool_response>0</tool_response>submit") == 1.0
    # what the teacher submits after an ok: its checked draft, as it ran (check(f) included)
    assert t.reward(p, "<tool_call>" + right + "\ncheck(f)</tool_call><tool_response>ok\n</tool_response>submit") == 1.0
    assert t.reward(p, "submit") == 0.0                                           # nothing was run
    assert task("task.test_reward=all").all_or_nothing
    # the final code in a fenced block after a tool call counts; the draft does not
    episode = Episode(t, p)
    obs = episode.step("<tool_call>" + wrong + "\nprint(f([]))</tool_call>")
    assert not obs.done and obs.tool == "python"
    episode.step("```python\n" + right + "\n```")
    assert episode.reward() == 1.0


def test_the_interpreter_checks_the_public_examples_as_the_demonstrations_say(sandboxed):
    """``check(f)`` in a python call prints what the teacher's demonstrations show for the same code."""
    t = sandboxed
    seen = set()
    for i in range(80):
        p = t.prompt(i)
        segs = t.solution_segments(p)
        if len(segs) < 2:
            continue
        episode = Episode(t, p)
        obs = episode.step(segs[0][0])
        assert not obs.done and obs.tool == "python" and episode.tool_calls == 1
        assert obs.text == segs[1][0]                   # rendered plainly: <tool_response>…</tool_response>
        seen.add(obs.text.removeprefix("<tool_response>").split(":")[0].strip())
    assert seen == {"ok\n</tool_response>", "wrong"}
    # the model's own test line runs too, after the preamble
    p = t.prompt(0)
    obs = Episode(t, p).step("<tool_call>" + t.solution(p) + "\nprint(f([]))</tool_call>")
    assert obs.text == "<tool_response>0\n</tool_response>" and not obs.error


def test_the_python_tool_is_required_at_load_and_by_the_task():
    from reflow_hpc.config import ConfigError
    with pytest.raises(ConfigError, match='task.tools = "calculator": task code_synth needs the python tool'):
        load(None, [*SETS, "task.tools=calculator"], check_files=False)
    unchecked = load(None, SETS, check_files=False)
    unchecked.task.tools = "calculator"                     # a config built without validation
    with pytest.raises(ConfigError, match="needs the python tool"):
        make_task(unchecked)
