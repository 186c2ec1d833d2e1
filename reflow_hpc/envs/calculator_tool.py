"""Multi-turn arithmetic with a calculator tool.

The prompts and the reward are those of ``arithmetic`` (same knobs, same answer rule: the integer
after the last ``####``). The model may call a tool by ending a turn with a tool call, in Qwen3's
form or, for the first tool of ``task.tools`` (the calculator by default), the bare one the tiny
policy writes::

    47+8+35=<tool_call>{"name": "calculator", "arguments": {"expression": "47+8+35"}}</tool_call>
    47+8+35=<tool_call>47+8+35</tool_call><tool_response>90</tool_response>
    #### 90

Turn rules:

- A model turn that ends with ``</tool_call>`` is a tool call (:func:`reflow_hpc.envs.tools.parse_tool_call`).
  The environment runs it with the tools of ``task.tools`` (:mod:`reflow_hpc.envs.tools`: the
  whitelisted calculator of :mod:`.safe_math` — no ``eval``, no subprocess — within
  ``task.turn_timeout_s`` and the ``task.tool_*`` bounds; ``python`` in the code sandbox) and answers
  with its output, or ``error: WHY``, rendered as a tool message (without a chat template
  ``<tool_response>VALUE</tool_response>``); the sample goes on with the next model turn.
- A turn that ends any other way (eos, or the length limit) ends the sample (``finish_reason`` stop).
- At most ``task.max_turns`` model turns per sample: a tool call in the last allowed turn is not
  run, and the sample ends with ``finish_reason`` turns.

The engine stops a turn on ``task.stop_token_ids(tokenizer)`` = eos and ``</tool_call>``; the markers
are single tokens in the character tokenizer of the tiny policy and in the Qwen3 tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .arithmetic import ANSWER_MARKER, Arithmetic
from .task import Episode, Observation, Prompt, register_task
from .tools import (CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN, ToolCall, call_body, make_tools, run_call,
                    tool_turn)

if TYPE_CHECKING:
    from ..config import Config

MARKERS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)


def tool_call(turn_text: str) -> str | None:
    """The body of a turn that ends with a tool call, else None."""
    return call_body(turn_text)


@register_task("calculator_tool")
class CalculatorTool(Arithmetic):
    """Arithmetic prompts; the model may call a calculator between turns."""

    multi_turn = True
    stop = (CALL_CLOSE,)

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        self.max_turns = cfg.task.max_turns
        self.tools = make_tools(cfg)
        self.tool_order = tuple(self.tools)

    def run_tool(self, expression: str) -> str:
        """The observation text of a bare call to the first tool (plain rendering)."""
        out, _ = run_call(self.tools, ToolCall(self.tool_order[0], {"_plain": expression}))
        return f"{RESULT_OPEN}{out}{RESULT_CLOSE}"

    def observe(self, episode: Episode, turn_text: str) -> Observation:
        return tool_turn(self.tools, self.max_turns, episode, turn_text)

    def solution_segments(self, prompt: Prompt) -> list[tuple[str, bool]]:
        """One call with the whole expression, its result, then the answer line."""
        expression = prompt.text.rstrip("=")
        return [(f"{CALL_OPEN}{expression}{CALL_CLOSE}", True),
                (self.run_tool(expression), False),
                (f"\n{ANSWER_MARKER} {prompt.answer}", True)]

    def solution(self, prompt: Prompt) -> str:
        return "".join(text for text, _ in self.solution_segments(prompt))
