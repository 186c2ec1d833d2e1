"""Multi-turn arithmetic with a calculator tool.

The prompts and the reward are those of ``arithmetic`` (same knobs, same answer rule: the integer
after the last ``####``). The model may call the calculator by ending a turn with a tool call::

    47+8+35=<tool_call>47+8+35</tool_call><tool_response>90</tool_response>
    #### 90

Turn rules:

- A model turn that ends with ``</tool_call>`` is a tool call: the expression is the text between
  the last ``<tool_call>`` of that turn and the end marker. The environment evaluates it with the
  whitelisted calculator of :mod:`.safe_math` (no ``eval``, no subprocess) within
  ``task.turn_timeout_s`` and the ``task.tool_*`` bounds, and answers
  ``<tool_response>VALUE</tool_response>`` or ``<tool_response>error: WHY</tool_response>``; the
  sample goes on with the next model turn.
- A turn that ends any other way (eos, or the length limit) ends the sample (``finish_reason`` stop).
- At most ``task.max_turns`` model turns per sample: a tool call in the last allowed turn is not
  evaluated, and the sample ends with ``finish_reason`` turns.

The engine stops a turn on ``task.stop_token_ids(tokenizer)`` = eos and ``</tool_call>``; the markers
are single tokens in the character tokenizer of the tiny policy and in the Qwen3 tokenizer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .arithmetic import ANSWER_MARKER, Arithmetic
from .safe_math import Limits, ToolError, evaluate, format_number
from .task import Episode, Observation, Prompt, register_task

if TYPE_CHECKING:
    from ..config import Config

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
MARKERS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)


def tool_call(turn_text: str) -> str | None:
    """The expression of a turn that ends with a tool call, else None."""
    body = turn_text.rstrip()
    if not body.endswith(CALL_CLOSE):
        return None
    body = body[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    return body[start + len(CALL_OPEN):] if start >= 0 else body


@register_task("calculator_tool")
class CalculatorTool(Arithmetic):
    """Arithmetic prompts; the model may call a calculator between turns."""

    multi_turn = True
    stop = (CALL_CLOSE,)

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        t = cfg.task
        self.max_turns, self.turn_timeout_s = t.max_turns, t.turn_timeout_s
        self.limits = Limits(max_chars=t.tool_max_chars, max_nodes=t.tool_max_nodes,
                             max_depth=t.tool_max_depth, max_exponent=t.tool_max_exponent,
                             max_digits=t.tool_max_digits)

    def run_tool(self, expression: str) -> str:
        """The observation text for one tool call."""
        try:
            value = format_number(evaluate(expression, self.limits, time.monotonic() + self.turn_timeout_s))
        except ToolError as e:
            value = f"error: {e}"
        return f"{RESULT_OPEN}{value}{RESULT_CLOSE}"

    def observe(self, episode: Episode, turn_text: str) -> Observation:
        expression = tool_call(turn_text)
        if expression is None:
            return Observation(done=True, finish_reason="stop")
        if episode.turns >= self.max_turns:
            return Observation(done=True, finish_reason="turns")
        episode.tool_calls += 1
        return Observation(self.run_tool(expression), done=False)

    def solution_segments(self, prompt: Prompt) -> list[tuple[str, bool]]:
        """One call with the whole expression, its result, then the answer line."""
        expression = prompt.text.rstrip("=")
        return [(f"{CALL_OPEN}{expression}{CALL_CLOSE}", True),
                (self.run_tool(expression), False),
                (f"\n{ANSWER_MARKER} {prompt.answer}", True)]

    def solution(self, prompt: Prompt) -> str:
        return "".join(text for text, _ in self.solution_segments(prompt))
