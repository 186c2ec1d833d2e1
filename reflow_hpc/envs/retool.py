r"""Math with a Python interpreter (ReTool-style, Feng et al. 2025): the model may run code between turns.

**Prompts** are ``math_boxed``'s: the same file (``data.path``, ``data.prompt_key``,
``data.answer_key``), the same train/eval split by the hash of the problem text and the same walk
(:mod:`reflow_hpc.envs.math_boxed`). Each prompt ends with one more paragraph, :data:`TOOL_HINT`, that
says how to call the interpreter (appended to the last user message of a chat prompt).

**Turns** are :class:`~reflow_hpc.envs.code.CodeTask`'s: a model turn that ends with a ``python`` tool
call (``<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>``, or the bare
``<tool_call>print(6*7)</tool_call>``) runs the code in the sandbox, and its stdout (stderr and exit
status when there are any) comes back as the observation; any other end of a turn ends the sample; at
most ``task.max_turns`` model turns. ``task.tools`` must offer ``python`` (a config error otherwise).

**The reward** is :func:`~reflow_hpc.envs.math_score.math_reward` (``Answer: X`` or ``\boxed{X}``,
math-verify for equivalence; math-verify must be installed, as for ``math_boxed``) of the model's
**final turn only**: the text after the last tool output (:func:`~reflow_hpc.envs.code.last_turn`).
So a number that only appears in an observation — the interpreter printed ``42`` — is never taken
for the model's answer, and neither is an answer stated in an earlier turn and not repeated. A
sample whose last turn is a tool call (it reached ``task.max_turns`` while calling) states no answer
and scores 0. There are no worked solutions, so the tiny policy's warm start falls back to arithmetic.
"""

from __future__ import annotations

import dataclasses

from .code import CodeTask, last_turn
from .math_boxed import MathBoxed
from .math_score import extract_answer, math_reward
from .task import Prompt, register_task
from .tools import call_body

TOOL_HINT = ('You may run Python code: end a turn with <tool_call>{"name": "python", "arguments": {"code": "..."}}'
             '</tool_call> and its output comes back. Give your final answer after "Answer:" or in \\boxed{}.')


def final_turn(response: str) -> str | None:
    """The text the answer is read from (module docstring); None when the last turn is a tool call."""
    turn = last_turn(response)
    return None if call_body(turn) is not None else turn


@register_task("retool")
class ReTool(CodeTask, MathBoxed):
    """Math problems from a file; the model may run Python with the ``python`` tool (module docstring)."""

    def prompt(self, index: int, split: str = "train") -> Prompt:
        p = super().prompt(index, split)
        text = f"{p.text.rstrip()}\n\n{TOOL_HINT}\n"
        messages = p.messages
        if messages:
            last = max(i for i, (role, _) in enumerate(messages) if role == "user")
            messages = tuple((role, text if i == last else content) for i, (role, content) in enumerate(messages))
        return dataclasses.replace(p, text=text, messages=messages)

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        turn = final_turn(response)
        return turn is not None and extract_answer(turn) is not None

    def reward(self, prompt: Prompt, response: str) -> float:
        turn = final_turn(response)
        return 0.0 if turn is None else math_reward(turn, prompt.answer)
