"""What the coding tasks share: the final code of a response, the worker's sandbox, the python tool's turns.

**The final code** of a response is what the model wrote in its last turn that is not a tool call
(:func:`final_code`): the last fenced block (```` ```python … ``` ````, or a bare ```` ``` ````) of that turn
when it has one, else the whole turn. Tool calls and their observations before it are the model's
drafts; only the final code is judged.

**The sandbox** (:func:`code_sandbox`) is one pool of fork servers per process and ``[sandbox]``
section (:func:`reflow_hpc.sandbox.shared_sandbox`), shared by the ``python`` tool and the task's
reward, so that a rollout worker holds ``sandbox.concurrency`` servers, not one pool per user. Rewards run on the worker's executor threads
(``task.tool_concurrency``), like tool calls, never on the engine loop.

**Turns** (:class:`CodeTask`) are those of ``calculator_tool``: a model turn that ends with
``</tool_call>`` runs the call with the tools of ``task.tools`` (``python`` runs its code in the
sandbox; its stdout, stderr and exit status are the observation), any other end of a turn ends the
sample, at most ``task.max_turns`` model turns.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import TYPE_CHECKING, Any

from ..config import check_python_tool
from .task import Episode, Observation, Task
from .tools import CALL_CLOSE, RESULT_CLOSE, call_body, make_tools, tool_turn

if TYPE_CHECKING:
    from ..config import Config

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)


def code_sandbox(cfg: "Config") -> Any:
    """The process's sandbox for ``cfg.sandbox`` (:func:`reflow_hpc.sandbox.shared_sandbox`)."""
    from ..sandbox import shared_sandbox
    return shared_sandbox(cfg)


def last_turn(response: str) -> str:
    """The text after the response's last tool output (the whole response when it has none)."""
    end = response.rfind(RESULT_CLOSE)
    tail = response[end + len(RESULT_CLOSE):] if end >= 0 else response
    # a chat template's tool message ends with its own closing text before the next assistant turn
    return tail.split("<|im_start|>assistant\n")[-1]


def final_code(response: str) -> str | None:
    """The code a response ends with (module docstring); None when its last turn is a tool call."""
    turn = last_turn(response)
    if call_body(turn) is not None:
        return None
    blocks = _FENCE.findall(turn)
    code = blocks[-1] if blocks else turn
    return code.replace("<|im_end|>", "").strip("\n")


def parses(code: str | None) -> bool:
    """Whether ``code`` is syntactically valid Python."""
    if not code or not code.strip():
        return False
    try:
        with warnings.catch_warnings():          # "invalid decimal literal" and the like: model text, not ours
            warnings.simplefilter("ignore")
            ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


class CodeTask(Task):
    """Base of the coding tasks: multi-turn with the tools of ``task.tools``; the reward is the subclass's."""

    multi_turn = True
    stop = (CALL_CLOSE,)

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        check_python_tool(cfg)
        self.max_turns = cfg.task.max_turns
        self.tools = make_tools(cfg)
        self.tool_order = tuple(self.tools)

    def sandbox(self) -> Any:
        return code_sandbox(self.cfg)

    def observe(self, episode: Episode, turn_text: str) -> Observation:
        return tool_turn(self.tools, self.max_turns, episode, turn_text)

    def well_formed(self, prompt: Any, response: str) -> bool:
        """The response ends with code that parses (right or wrong)."""
        return parses(final_code(response))
