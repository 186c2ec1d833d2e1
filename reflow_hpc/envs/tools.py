"""Tool calls in the model's own format, the registry of tools, and how an observation is rendered.

**The call.** A model turn that ends with ``</tool_call>`` is a tool call. Its body — the text between
the turn's last ``<tool_call>`` and that end marker — is Qwen3's (Hermes) form, one JSON object::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "47+8+35"}}
    </tool_call>

``arguments`` may also be a JSON string holding the object (some chat templates write it so). A
body that is not a JSON object goes, whole, to the first tool of ``task.tools`` as its *plain
argument* (the calculator's expression, the python tool's code): the bare form the tiny CPU policy
writes, ``<tool_call>47+8+35</tool_call>``. A body that is JSON but malformed (no name, arguments
not an object, a tool not in ``task.tools``) is answered with an error observation; the sample goes on.

**The registry.** A tool is a class registered with ``@register_tool("name")``
(:mod:`reflow_hpc.plugins`; a user's module in ``run.plugins`` adds one the same way); its
constructor takes the config, and ``run(arguments)`` returns the output text or raises
:class:`ToolError` (the message becomes the observation, and counts as a tool error). Built in:

- ``calculator`` (``{"expression": str}``): the whitelisted calculator of :mod:`.safe_math`,
  bounded by ``task.turn_timeout_s`` and the ``task.tool_*`` keys;
- ``python`` (``{"code": str}``): the code runs in the code sandbox (:mod:`reflow_hpc.sandbox`), never
  in the rollout worker; its stdout (and stderr, exit status and a timeout note when there are any)
  is the output. Nothing the code prints decides a reward.

``run`` is called on the rollout worker's executor threads (``task.tool_concurrency`` of them), never
on the engine loop, so a tool may block (a sandbox round trip, a remote service); it must be
thread-safe, and should bound its own time (``task.turn_timeout_s``: the runner stops waiting for
it then, and the observation says it timed out).

**The observation** (:class:`ObservationRenderer`) is the tool's output, cut to ``task.max_obs_tokens``
tokens with a truncation marker when longer, wrapped as a tool message:

- with ``task.chat_template`` on and a tokenizer that has one, by the model's chat template: the text
  that follows an assistant message in ``[user, assistant, tool]`` rendered with the generation prompt
  (for Qwen3: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n
  <|im_start|>assistant\\n``). The model's turn stopped on ``</tool_call>``, so the end of its message
  is part of the observation;
- otherwise the plain rendering ``<tool_response>OUTPUT</tool_response>`` (the markers are single
  tokens of the tiny policy's tokenizer).

The wrapper's pieces and the output are tokenised separately and their ids joined, so that the cap is
exact; only observation text is ever tokenised here — the model's own tokens stay the ids it sampled.
Observation tokens carry version −1 and log-prob 0: no loss.
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..plugins import register_tool, tool_class, tool_names
from .safe_math import Limits, ToolError as CalculatorError, evaluate, format_number
from .task import RESULT_CLOSE as RESULT_CLOSE, RESULT_OPEN as RESULT_OPEN, Episode, Observation

if TYPE_CHECKING:
    from ..config import Config

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TRUNCATED = "\n[... output truncated: {n} more tokens]"
# A tool output is cut to this many characters per allowed token before it is tokenised, which bounds
# the tokeniser's work on a huge output; a token rarely spans more characters.
CHARS_PER_TOKEN_BOUND = 16


class ToolError(Exception):
    """A tool call that fails; the message is the observation (and the call counts as a tool error)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""        # a malformed call: the observation says why


def call_body(turn_text: str) -> str | None:
    """The body of a turn that ends with a tool call, else None."""
    body = turn_text.rstrip()
    if not body.endswith(CALL_CLOSE):
        return None
    body = body[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    return body[start + len(CALL_OPEN):] if start >= 0 else body


def parse_tool_call(turn_text: str, tools: tuple[str, ...]) -> ToolCall | None:
    """The call a turn ends with (None: no call). ``tools`` are the names offered, the first the one a
    plain (non-JSON) body goes to."""
    body = call_body(turn_text)
    if body is None:
        return None
    text = body.strip()
    try:
        obj = json.loads(text) if text.startswith("{") else None
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return ToolCall(tools[0], {"_plain": body})
    name, args = obj.get("name"), obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(str(name), error="arguments is a string that is not JSON")
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a "name"')
    if not isinstance(args, dict):
        return ToolCall(name, error='"arguments" must be an object')
    if name not in tools:
        return ToolCall(name, error=f"unknown tool {name!r}; available: {', '.join(tools)}")
    return ToolCall(name, args)


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------


class Tool(abc.ABC):
    """Base class of tools: ``run(arguments) -> output text``; ToolError for a failed call."""

    name = ""
    plain_argument = ""       # the argument a plain (non-JSON) call body fills

    def __init__(self, cfg: "Config"):
        self.cfg = cfg

    @abc.abstractmethod
    def run(self, arguments: dict) -> str:
        """The tool's output for ``arguments`` (ToolError: an error the model sees)."""

    def argument(self, arguments: dict, key: str) -> str:
        value = arguments.get(key, arguments.get("_plain"))
        if not isinstance(value, str):
            raise ToolError(f'{self.name} needs a string argument "{key}"')
        return value


@register_tool("calculator")
class Calculator(Tool):
    """Whitelisted arithmetic (no eval, no subprocess): ``{"expression": "47+8+35"}`` → ``90``."""

    plain_argument = "expression"

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        t = cfg.task
        self.timeout_s = t.turn_timeout_s
        self.limits = Limits(max_chars=t.tool_max_chars, max_nodes=t.tool_max_nodes, max_depth=t.tool_max_depth,
                             max_exponent=t.tool_max_exponent, max_digits=t.tool_max_digits)

    def run(self, arguments: dict) -> str:
        try:
            return format_number(evaluate(self.argument(arguments, "expression"), self.limits,
                                          time.monotonic() + self.timeout_s))
        except CalculatorError as e:
            raise ToolError(str(e)) from None


@register_tool("python")
class Python(Tool):
    """Model-written Python, run in the code sandbox: ``{"code": "print(2**10)"}`` → ``1024``."""

    plain_argument = "code"

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        self.timeout_s = cfg.task.turn_timeout_s

    def sandbox(self) -> Any:
        """The process's sandbox (``[sandbox]``, shared with a coding task's reward), started at the first
        call. No usable tier raises SandboxUnavailable: the sample fails with that one line, rather than
        learn from error outputs."""
        from ..sandbox import shared_sandbox
        return shared_sandbox(self.cfg)

    def run(self, arguments: dict) -> str:
        code = self.argument(arguments, "code")
        out = self.sandbox().run(code, timeout_s=self.timeout_s)      # a RunResult
        if out.error:
            raise ToolError(f"the sandbox gave no result: {out.error}")
        text = out.stdout
        if out.stderr:
            text += ("\n" if text else "") + "stderr:\n" + out.stderr
        if out.timed_out:
            raise ToolError(f"timed out after {self.timeout_s:g} s" + (f"; output so far:\n{text}" if text else ""))
        if out.exit_code:
            text += f"\nexit status {out.exit_code}"
        return text


def make_tools(cfg: "Config") -> dict[str, Tool]:
    """The tools of ``task.tools``, built once per worker, in the order listed."""
    out: dict[str, Tool] = {}
    for name in (n.strip() for n in cfg.task.tools.split(",")):
        if not name:
            continue
        cls = tool_class(name)
        if cls is None:
            raise ValueError(f"task.tools: unknown tool {name!r}; registered: {', '.join(tool_names())}")
        out[name] = cls(cfg)
    return out


def run_call(tools: dict[str, Tool], call: ToolCall) -> tuple[str, str]:
    """(output, error) of one call: the output, or ``("error: WHY", WHY)`` for a failed one."""
    if call.error:
        return f"error: {call.error}", call.error
    tool = tools[call.name]
    args = call.arguments
    if "_plain" in args and tool.plain_argument:
        args = {tool.plain_argument: args["_plain"]}
    try:
        return str(tool.run(args)), ""
    except ToolError as e:
        return f"error: {e}", str(e)


def tool_turn(tools: dict[str, Tool], max_turns: int, episode: Episode, turn_text: str,
              rewrite: Callable[[ToolCall], ToolCall] | None = None) -> Observation:
    """What a multi-turn task observes after a model turn: a turn that ends with a tool call gets the call's
    output (``rewrite`` may change a well-formed call first, e.g. to run a preamble before its code), any
    other ends the sample (stop), and a call in the last of ``max_turns`` turns is not run (turns)."""
    call = parse_tool_call(turn_text, tuple(tools))
    if call is None:
        return Observation(done=True, finish_reason="stop")
    if episode.turns >= max_turns:
        return Observation(done=True, finish_reason="turns")
    episode.tool_calls += 1
    if rewrite is not None and not call.error:
        call = rewrite(call)
    out, error = run_call(tools, call)
    return Observation(out, done=False, tool=call.name or "?", error=error)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


_MARK = "\x00REFLOW-TOOL-MARK\x00"


class ObservationRenderer:
    """Turns an observation's text into the tokens inserted after a model turn (module docstring)."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, max_obs_tokens: int):
        self.tokenizer = tokenizer
        self.max_obs_tokens = max_obs_tokens
        self.templated = bool(chat_template and getattr(tokenizer, "chat_template", None))
        # The template's wrapper is rendered at the first tool output: a single-turn task never needs it.
        self.before, self.after = (None, None) if self.templated else (RESULT_OPEN, RESULT_CLOSE)

    def wrap(self) -> tuple[str, str]:
        """The text before and after a tool's output."""
        if self.before is None:
            self.before, self.after = self._template_wrap()
        return self.before, self.after

    def _template_wrap(self) -> tuple[str, str]:
        """The chat template's text around a tool message that follows an assistant turn."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK},
                    {"role": "tool", "content": _MARK + _MARK}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        start = text.find(_MARK) + len(_MARK)
        mid = text.find(_MARK + _MARK, start)
        if start < len(_MARK) or mid < 0:
            raise ValueError("the tokenizer's chat template does not render a tool message after an assistant one "
                             "(set task.chat_template = false for the plain rendering)")
        return text[start:mid], text[mid + 2 * len(_MARK):]

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def render(self, obs: Observation) -> Observation:
        """``obs`` with ``text`` (what the episode's response text gets) and ``token_ids`` set; a tool's
        output is wrapped as a tool message and capped, any other text inserted as it is."""
        if not obs.tool:
            return replace(obs, token_ids=tuple(self.encode(obs.text)))
        before, after = self.wrap()
        cap = self.max_obs_tokens
        raw = obs.text[: cap * CHARS_PER_TOKEN_BOUND]
        body = self.encode(raw)
        cut = len(body) > cap or len(raw) < len(obs.text)
        content = raw
        if cut:
            probe = self.encode(TRUNCATED.format(n=f"{len(body)}+"))      # the longest the marker can be
            keep = max(cap - len(probe), 0)
            more = f"{len(body) - keep}+" if len(raw) < len(obs.text) else str(len(body) - keep)
            marker = TRUNCATED.format(n=more)
            content = self.tokenizer.decode(body[:keep], skip_special_tokens=False) + marker
            body = body[:keep] + self.encode(marker)
        ids = self.encode(before) + body + self.encode(after)
        return replace(obs, text=before + content + after, token_ids=tuple(ids), truncated=cut)


def as_array(ids: tuple[int, ...] | None) -> np.ndarray:
    return np.asarray(ids or (), dtype=np.int32)
