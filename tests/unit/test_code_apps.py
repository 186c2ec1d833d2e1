"""code_apps: the APPS-format reader and its config errors, the output rules of the judge, and the hidden tests
run in the real sandbox: the fixture's solutions score 1, wrong, crashing, hanging and attacking programs earn
only the cases they pass, the all-or-nothing key. The sandbox tests skip where no tier is usable."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, sandbox_or_skip
from reflow_hpc import config as C
from reflow_hpc import envs
from reflow_hpc.envs.code_apps import ANSWER_CALL, ANSWER_STDIO, call_output_match
from reflow_hpc.sandbox import RunResult
from reflow_hpc.sandbox.judge import MARK, parse_case_results, stdout_match

FIXTURE = ROOT / "tests" / "fixtures" / "apps_small.jsonl"
BASE = ["model.warmstart=true", "task.name=code_apps", "task.tools=python", "task.eval_fraction=0",
        "sandbox.concurrency=1", "sandbox.wall_time_s=2.5", "task.test_timeout_s=0.5"]


def load(*overrides: str, path=FIXTURE) -> C.Config:
    return C.load(None, [*BASE, f"data.path={json.dumps(str(path))}", *overrides])


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def record(**kw) -> dict:
    rec = {"question": "Read n, print n+1.", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})}
    rec.update(kw)
    return rec


# --------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------

def test_the_fixture_loads_in_apps_format():
    rows = C.apps_rows(load())
    assert len(rows) == 12
    calls = [r for r in rows if r.fn_name]
    assert [r.fn_name for r in calls] == ["add", "count_words", "twoSum"]
    assert all(r.solution and len(r.inputs) == len(r.outputs) >= 3 for r in rows)
    assert all(isinstance(i, str) for r in rows if not r.fn_name for i in r.inputs)
    task = envs.make_task(load())
    assert task.size("train") == 12 and task.size("eval") == 0
    assert sorted(task.prompt(i).prompt_id for i in range(12)) == list(range(12))
    by_id = {task.prompt(i).prompt_id: task.prompt(i) for i in range(12)}
    stdio, call = by_id[0], by_id[11]
    assert stdio.text.startswith(rows[0].question) and ANSWER_STDIO in stdio.text and "```python" in stdio.text
    assert "class Solution:" in call.text and ANSWER_CALL.split("`")[0] in call.text and "`twoSum`" in call.text
    assert stdio.meta["kind"] == "stdio" and call.meta["kind"] == "call" and call.meta["tests"] == 3


def test_records_split_by_the_question_and_decoded_fields_are_accepted(tmp_path):
    f = tmp_path / "apps.jsonl"
    rows = [record(question=f"Problem {i}: read n, print n+1.",
                   input_output={"inputs": [["1", "2"]], "outputs": [["2", "3"]]}) for i in range(40)]
    write_jsonl(f, rows)
    task = envs.make_task(load("task.eval_fraction=0.25", path=f))
    assert task.size("train") + task.size("eval") == 40 and task.size("eval") > 0
    train = {task.prompt(i).prompt_id for i in range(task.size("train"))}
    held = {task.prompt(i, "eval").prompt_id for i in range(task.size("eval"))}
    assert not train & held
    assert task.rows[0].inputs == ("1\n2",) and task.rows[0].outputs == ("2\n3",)   # lists of lines joined


@pytest.mark.parametrize("line, where", [
    ("{not json", "line 2 is not JSON"),
    (json.dumps({"input_output": "{}"}), "line 2: field question"),
    (json.dumps(record(input_output="{nope")), "line 2: field input_output is a string that is not JSON"),
    (json.dumps(record(input_output="")), "line 2: field input_output is missing or empty"),
    (json.dumps(record(input_output={"inputs": ["1"], "outputs": []})), "line 2: field input_output has 1 inputs"),
    (json.dumps(record(input_output={"inputs": [1], "outputs": ["2"]})), "line 2: field input_output: inputs[0]"),
    (json.dumps(record(input_output={"fn_name": "f", "inputs": [1], "outputs": [2]})),
     "line 2: field input_output: inputs[0] is not a list of arguments for f"),
    (json.dumps(record(input_output={"fn_name": "no name", "inputs": [[1]], "outputs": [2]})), "fn_name"),
    (json.dumps(record(solutions="not json")), "line 2: field solutions"),
    (json.dumps(record(starter_code=3)), "line 2: field starter_code"),
])
def test_a_malformed_record_is_a_one_line_config_error(tmp_path, line, where):
    f = tmp_path / "bad.jsonl"
    write_jsonl(f, [record(), line])
    with pytest.raises(C.ConfigError) as e:
        envs.make_task(load(path=f))
    msg = str(e.value)
    assert msg.startswith("config error: data.path = ") and where in msg and "\n" not in msg, msg


def test_missing_or_empty_files_and_the_first_record_checked_at_load(tmp_path):
    for path, why in ((tmp_path / "absent.jsonl", "no such file"), (tmp_path, "not a regular file")):
        with pytest.raises(C.ConfigError, match=f"^config error: data.path = .*{why}"):
            load(path=path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(C.ConfigError, match="holds no records"):
        load(path=empty)
    bad_first = tmp_path / "first.jsonl"
    write_jsonl(bad_first, [record(question="")])
    with pytest.raises(C.ConfigError, match="line 1: field question"):
        load(path=bad_first)                                  # validating the config reads the first record
    assert C.load(None, [*BASE, f"data.path={tmp_path / 'absent.jsonl'}"], check_files=False)


def test_the_python_tool_is_required():
    with pytest.raises(C.ConfigError) as e:
        load("task.tools=calculator")
    assert str(e.value).startswith('config error: task.tools = "calculator": task code_apps needs the python tool')


def test_parquet_files_read_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [json.loads(ln) for ln in FIXTURE.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "apps.parquet")
    assert C.apps_rows(load(path=tmp_path / "apps.parquet")) == C.apps_rows(load())


def test_the_warm_start_falls_back_to_arithmetic():
    from reflow_hpc.warmstart import sft_task
    task = envs.make_task(load())
    p = task.prompt(0)
    assert task.solution(p).startswith("```python\n") and task.solution_segments(p) is None
    assert sft_task(load()).name == "arithmetic"


# --------------------------------------------------------------------------------------------
# The judge's rules (no sandbox)
# --------------------------------------------------------------------------------------------

def test_stdout_match_rule():
    assert stdout_match("1 2\n3\n", "1 2 3") and stdout_match("  5  \n\n\n", "5\n") and stdout_match("", "\n")
    assert stdout_match("2.3333333\n", "2.3333333333") and stdout_match("3", "3.0") and stdout_match("-0.0000001", "0")
    assert not stdout_match("2.33", "2.3333333333") and not stdout_match("1 2", "1 2 3")
    assert not stdout_match("123456789012345678901", "123456789012345678900")    # integers exactly
    assert stdout_match("007", "7") and not stdout_match("YES", "yes") and not stdout_match("nan", "nan0")
    assert not stdout_match("inf", "1e999") and not stdout_match("1_0", "10")


def test_call_outputs_follow_apps_list_wrapping():
    assert call_output_match(3, [3]) and call_output_match([0, 1], [0, 1]) and call_output_match([1, 2], [[1, 2]])
    assert not call_output_match(3, [3, 4]) and not call_output_match([3], 3) and not call_output_match(True, [1])


def test_case_results_keep_the_lines_written_before_an_early_end():
    def line(i, out, ok=True):
        return MARK + json.dumps({"case": i, "ok": ok, "stdout": out})
    stdout = "\n".join(["noise", line(0, "1"), MARK + "{cut", line(1, "x"), line(1, "2"), line(7, "9"),
                        MARK + json.dumps({"case": 2, "ok": True}), line(True, "3")])
    for kw in ({}, {"timed_out": True}, {"truncated": True}, {"exit_code": -9}):
        res = parse_case_results(RunResult(stdout=stdout, **{"exit_code": 0, **kw}), 3)
        assert [r and r["stdout"] for r in res] == ["1", "2", None]
    assert parse_case_results(RunResult(stdout=stdout, exit_code=None, error="no reply"), 3) == [None] * 3


# --------------------------------------------------------------------------------------------
# Hidden tests in the sandbox
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task():
    cfg = load()
    sandbox_or_skip(cfg)
    return envs.make_task(cfg)


def by_id(task, pid):
    return next(task.prompt(i) for i in range(task.size()) if task.prompt(i).prompt_id == pid)


def answer(code: str) -> str:
    return f"Here is my program.\n```python\n{code}\n```"


TRIANGLE = "n = int(input())\nprint(n * (n + 1) // 2)\n"        # problem 0: cases n = 1, 4, 10, 100


def test_every_fixture_solution_scores_one(task):
    for i in range(task.size()):
        p = task.prompt(i)
        assert task.reward(p, task.solution(p)) == 1.0, (p.prompt_id, task.test_results(p, task.solution(p)))


def test_a_multi_turn_episode_tests_its_draft_then_ends_with_the_final_code(task):
    p = by_id(task, 0)
    ep = task.start(p)
    call = json.dumps({"name": "python", "arguments": {"code": "n = 4\nprint(n * n)"}})
    obs = ep.step(f"Let me try n = 4.<tool_call>{call}</tool_call>")
    assert not obs.done and obs.tool == "python" and "16" in obs.text
    obs = ep.step(answer(TRIANGLE))
    assert obs.done and obs.finish_reason == "stop"
    assert ep.reward() == 1.0 and task.well_formed(p, ep.response)
    # the draft in the tool call is not the final code: a response that ends with a call scores 0
    assert task.reward(p, f"<tool_call>{call}</tool_call>") == 0.0


@pytest.mark.parametrize("code, score", [
    ("n = int(input())\nprint(n * n)\n", 0.25),                                   # wrong but for n = 1
    ("n = int(input())\nprint(n * (n + 1) // 2, 'extra')\n", 0.0),
    ("raise ValueError('crash')\n", 0.0),
    ("def broken(:\n", 0.0),                                                      # does not parse: no run
    ("", 0.0),
    ("while True:\n    pass\n", 0.0),
    ("n = int(input())\nwhile n == 10:\n    pass\nprint(n * (n + 1) // 2)\n", 0.75),  # one case times out
    ("import sys\nn = int(input())\nprint(n * (n + 1) // 2)\nsys.exit(0)\nprint('after')\n", 1.0),
    ("import sys\nn = int(input())\nprint(n * (n + 1) // 2)\nsys.exit(3)\n", 0.0),  # an error status fails
    ("n = int(open(0).read())\nprint(n * (n + 1) // 2)\n", 1.0),                   # fd 0 holds the case's input
    ("import sys\nn = int(sys.stdin.buffer.read())\nsys.stdout.buffer.write(b'%d' % (n * (n + 1) // 2))\n", 1.0),
    ("import sys\nn = int(input())\nprint(n * (n + 1) // 2)\nsys.stdout.close()\n", 1.0),
    ("import threading\ndef main():\n    n = int(input())\n    print(n * (n + 1) // 2)\n"
     "threading.Thread(target=main).start()\n", 1.0),
])
def test_standard_io_programs_earn_the_cases_they_pass(task, code, score):
    assert task.reward(by_id(task, 0), answer(code)) == score


@pytest.mark.parametrize("code, score", [
    # exits before the driver writes the case's results line: nothing for this case or the ones after
    ("import os\nn = int(input())\nprint(n * (n + 1) // 2, flush=True)\nos._exit(0)\n", 0.0),
    ("import os\nn = int(input())\nif n == 10:\n    os._exit(0)\nprint(n * (n + 1) // 2)\n", 0.5),
    # forged results lines on the real stdout: they count as the outputs they claim ("1": right for n = 1 only)
    ("import os, sys, json\nfor i in range(4):\n"
     "    line = json.dumps({'case': i, 'ok': True, 'stdout': '1'})\n"
     "    sys.__stdout__.write('\\n#reflow-sandbox-results# ' + line + '\\n')\n"
     "sys.__stdout__.flush()\nos._exit(0)\n", 0.25),
    ("import json\nprint('#reflow-sandbox-results# ' + json.dumps({'case': 1, 'ok': True, 'stdout': '10'}))\n", 0.0),
    ("print('All tests passed')\n", 0.0),
    # patching what the driver uses changes nothing but the program's own output
    ("import json, builtins, sys\njson.dumps = lambda *a, **k: '{\"case\": 0, \"ok\": true, \"stdout\": \"1\"}'\n"
     "builtins.print = lambda *a, **k: None\nbuiltins.BaseException = type('X', (Exception,), {})\n"
     "sys.stdout.write('0')\n", 0.0),
    ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n", 0.0),
    ("import signal, time\nn = int(input())\nsignal.setitimer(signal.ITIMER_REAL, 0)\nprint(n * (n + 1) // 2)\n", 1.0),
])
def test_attacks_earn_nothing_beyond_the_cases_they_solve(task, code, score):
    assert task.reward(by_id(task, 0), answer(code)) == score


def test_call_based_problems(task):
    add, words, two = by_id(task, 9), by_id(task, 10), by_id(task, 11)
    assert task.reward(add, answer("def add(a, b):\n    return a + b")) == 1.0       # outputs wrapped: [[3], ...]
    assert task.reward(add, answer("def add(a, b):\n    return [a + b]")) == 1.0
    assert task.reward(add, answer("def add(a, b):\n    return 3")) == pytest.approx(1 / 3)
    assert task.reward(words, answer("def count_words(s):\n    return len(s.split(' '))")) == 0.5
    assert task.reward(two, answer("class Solution:\n    def twoSum(self, nums, target):\n"
                                   "        return [0, 1]")) == pytest.approx(2 / 3)
    for attack in ("import os\nos._exit(0)\ndef add(a, b):\n    return a + b",
                   "def add(a, b):\n    while True:\n        pass",
                   "def add(a, b):\n    import os\n    os._exit(0)"):
        assert task.reward(add, answer(attack)) == 0.0, attack


def test_all_or_nothing():
    cfg = load("task.test_reward=all")
    sandbox_or_skip(cfg)
    task = envs.make_task(cfg)
    p = by_id(task, 0)
    assert task.reward(p, answer("n = int(input())\nprint(n * n)")) == 0.0
    assert task.reward(p, answer(TRIANGLE)) == 1.0
    assert task.reward(by_id(task, 9), answer("def add(a, b):\n    return a - b")) == 0.0
