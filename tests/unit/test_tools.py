"""Tool calls in the model's own format: parsing, the registry, rendering and capping of observations."""

from __future__ import annotations

import pytest

from reflow_hpc import config as C
from reflow_hpc.envs import make_task
from reflow_hpc.envs.task import Observation
from reflow_hpc.envs.tools import (ObservationRenderer, Tool, ToolError, make_tools, parse_tool_call, run_call)
from reflow_hpc.plugins import register_tool, tool_names

TOOLS = ("calculator", "python")


class CharTokenizer:
    """One id per character; no chat template unless given."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        out = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


def test_qwen3_json_calls_bare_calls_and_malformed_ones():
    call = parse_tool_call('think <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
                           '</tool_call>', TOOLS)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "1+2"}, "")
    call = parse_tool_call('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>',
                           TOOLS)
    assert call.arguments == {"code": "print(1)"}
    assert parse_tool_call("<tool_call>4*5</tool_call>", TOOLS).arguments == {"_plain": "4*5"}
    assert parse_tool_call("no call here", TOOLS) is None
    assert "unknown tool" in parse_tool_call('<tool_call>{"name": "web"}</tool_call>', TOOLS).error
    assert parse_tool_call('<tool_call>{"arguments": {}}</tool_call>', TOOLS).error
    assert parse_tool_call('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', TOOLS).error


def test_calculator_tool_runs_both_forms_and_reports_errors():
    cfg = C.load(None, ["task.name=calculator_tool"], check_files=False)
    tools = make_tools(cfg)
    assert run_call(tools, parse_tool_call("<tool_call>47+8+35</tool_call>", TOOLS)) == ("90", "")
    out, err = run_call(tools, parse_tool_call('<tool_call>{"name": "calculator", "arguments": '
                                               '{"expression": "import os"}}</tool_call>', TOOLS))
    assert out.startswith("error: ") and err
    task = make_task(cfg)
    assert task.run_tool("2+2") == "<tool_response>4</tool_response>"     # the plain rendering, as before


def test_a_plugin_registers_a_tool_and_config_checks_the_names():
    @register_tool("echo_for_test")
    class Echo(Tool):
        plain_argument = "text"

        def run(self, arguments):
            if not arguments.get("text"):
                raise ToolError("nothing to echo")
            return arguments["text"]

    assert "echo_for_test" in tool_names()
    cfg = C.load(None, ["task.name=calculator_tool", "task.tools=echo_for_test,calculator"], check_files=False)
    tools = make_tools(cfg)
    assert list(tools) == ["echo_for_test", "calculator"]
    assert run_call(tools, parse_tool_call("<tool_call>hi</tool_call>", tuple(tools))) == ("hi", "")
    assert run_call(tools, parse_tool_call('<tool_call>{"name": "echo_for_test", "arguments": {}}</tool_call>',
                                           tuple(tools))) == ("error: nothing to echo", "nothing to echo")
    with pytest.raises(C.ConfigError, match="task.tools"):
        C.load(None, ["task.tools=calculator,nope"], check_files=False)


def test_plain_and_templated_rendering_and_the_cap():
    plain = ObservationRenderer(CharTokenizer(), chat_template=False, max_obs_tokens=64)
    obs = plain.render(Observation("42", done=False, tool="calculator"))
    assert obs.text == "<tool_response>42</tool_response>" and list(obs.token_ids) == [ord(c) for c in obs.text]
    templated = ObservationRenderer(CharTokenizer("x"), chat_template=True, max_obs_tokens=64)
    obs = templated.render(Observation("42", done=False, tool="calculator"))
    assert obs.text == "</assistant><tool>42</tool><assistant>"
    long = plain.render(Observation("x" * 5000, done=False, tool="python"))
    body = long.text[len("<tool_response>"):-len("</tool_response>")]
    assert long.truncated and 60 <= len(body) <= 64 and "output truncated" in body
    assert len(long.token_ids) == len(body) + len("<tool_response></tool_response>")
    short = plain.render(Observation("x" * 64, done=False, tool="python"))
    assert not short.truncated
