"""retool: math prompts with a python interpreter, driven by a scripted policy (no model) through the real
sandbox. The tool call reaches the sandbox, its output reaches the next turn's context (the response text
and the tiny tokenizer's rendering), and only the model's final turn is scored. Skips without a sandbox tier."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, sandbox_or_skip
from reflow_hpc import config as C
from reflow_hpc import envs
from reflow_hpc.envs.retool import TOOL_HINT
from reflow_hpc.envs.tools import RESULT_CLOSE, RESULT_OPEN, ObservationRenderer

FIXTURE = ROOT / "tests" / "fixtures" / "math_small.jsonl"
BASE = ["model.warmstart=true", "task.name=retool", "task.tools=python", "task.eval_fraction=0",
        "sandbox.concurrency=1", "sandbox.wall_time_s=5", "task.turn_timeout_s=5"]
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'


def load(*overrides: str, path=FIXTURE) -> C.Config:
    return C.load(None, [*BASE, f"data.path={json.dumps(str(path))}", *overrides])


def test_prompts_are_math_boxed_rows_with_the_tool_hint(tmp_path):
    task = envs.make_task(load())
    rows = [json.loads(ln) for ln in FIXTURE.read_text().splitlines()]
    assert task.size("train") == len(rows)
    p = task.prompt(0)
    assert p.text == rows[p.prompt_id]["prompt"] + "\n\n" + TOOL_HINT + "\n" and p.answer == rows[p.prompt_id]["answer"]
    assert task.multi_turn and task.stop == ("</tool_call>",)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1?"}],
                                "answer": "2"}) + "\n")
    p = envs.make_task(load(path=chat)).prompt(0)
    assert p.messages == (("system", "s"), ("user", p.text)) and p.text.startswith("1+1?\n\n" + TOOL_HINT)


def test_config_errors():
    with pytest.raises(C.ConfigError) as e:
        load("task.tools=calculator")
    assert str(e.value).startswith('config error: task.tools = "calculator": task retool needs the python tool')
    with pytest.raises(C.ConfigError, match="^config error: data.path"):
        load(path=ROOT / "tests" / "fixtures" / "absent.jsonl")


def test_without_math_verify_the_task_does_not_start(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(C.ConfigError) as e:
        envs.make_task(load())
    assert str(e.value).startswith('config error: task.name = "retool": scoring math answers needs math-verify')


def test_the_warm_start_falls_back_to_arithmetic():
    from reflow_hpc.warmstart import sft_task
    assert sft_task(load()).name == "arithmetic"


# --------------------------------------------------------------------------------------------
# A scripted policy through the real sandbox
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task():
    cfg = load()
    sandbox_or_skip(cfg)
    return envs.make_task(cfg)


@pytest.fixture(scope="module")
def renderer():
    pytest.importorskip("tokenizers")
    from reflow_hpc.envs.tokenizer import build_char_tokenizer
    tok = build_char_tokenizer()
    return tok, ObservationRenderer(tok, chat_template=False, max_obs_tokens=64)


def six_times_seven(task):
    return next(task.prompt(i) for i in range(task.size()) if task.prompt(i).text.startswith("What is 6*7?"))


def episode(task, turns, render=None):
    ep = task.start(six_times_seven(task))
    observations = [ep.step(t, render) for t in turns]
    return ep, observations


@pytest.mark.parametrize("final, score", [
    ("The interpreter printed 42, so the answer is \\boxed{42}.", 1.0),
    ("6*7 is computed above.\nAnswer: 42", 1.0),
    ("So the answer is \\boxed{41}.", 0.0),
    ("Answer: 43", 0.0),
    ("I ran the code.", 0.0),                   # 42 is only in the observation: no answer
])
def test_scripted_policy(task, renderer, final, score):
    tok, render = renderer
    ep, (obs, last) = episode(task, [f"Let me compute it.{CALL}", final], render.render)
    # the call reached the sandbox and its output is the next turn's context
    assert not obs.done and obs.tool == "python" and not obs.error
    assert obs.text == f"{RESULT_OPEN}42\n{RESULT_CLOSE}"
    assert tok.decode(list(obs.token_ids), skip_special_tokens=True) == obs.text
    assert ep.response == f"Let me compute it.{CALL}{obs.text}{final}"
    assert ep.parts[1] == (obs.text, False) and ep.tool_calls == 1
    assert last.done and last.finish_reason == "stop"
    assert ep.reward() == score
    assert task.well_formed(ep.prompt, ep.response) == (score == 1.0 or "43" in final or "41" in final)


def test_only_the_final_turn_counts(task):
    # an answer stated before the tool call and not repeated after it does not count
    ep, _ = episode(task, ["Answer: 42 (a guess)" + CALL, "Checked."])
    assert ep.reward() == 0.0
    # a tool call in the last allowed turn is not run, and the sample states no answer
    ep, obs = episode(task, [CALL] * task.max_turns)
    assert obs[-1].done and obs[-1].finish_reason == "turns" and ep.tool_calls == task.max_turns - 1
    assert ep.reward() == 0.0
    # the plain-string reward agrees with the episode's
    assert task.reward(ep.prompt, "x" + CALL + RESULT_OPEN + "42\n" + RESULT_CLOSE + "\\boxed{42}") == 1.0
    assert task.reward(ep.prompt, "\\boxed{42}" + CALL + RESULT_OPEN + "\\boxed{42}" + RESULT_CLOSE + "no") == 0.0


def test_a_failing_tool_call_is_an_error_observation(task):
    bad = '<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>'
    ep, (obs, last) = episode(task, [bad, "\\boxed{42}"])
    assert not obs.done and "ZeroDivisionError" in obs.text and "exit status 1" in obs.text
    assert ep.reward() == 1.0
