"""The task and environment interface, and the registry of tasks by name.

A **task** hands out prompts and scores responses:

- ``prompt(index, split)`` is deterministic in (``run.seed``, ``index``, ``split``): the same config
  gives the same prompt for the same index on every rank and every restart, so prompts can be named by
  index in control messages and checkpoints. ``split`` is ``"train"`` (what the RL run and the warm
  start draw from) or ``"eval"`` (held out). A prompt belongs to the eval split when a stable hash of
  its text falls into the first ``task.eval_fraction`` of the hash range, so the two splits never
  share a prompt text.
- ``reward(prompt, response)`` scores the full response text (every model turn and every observation
  in order, special tokens such as eos removed).
- ``solution_segments(prompt)`` is an optional worked solution for supervised warm start, as
  ``(text, generated)`` segments: segments with ``generated = False`` (tool observations) are part of
  the sequence but carry no loss, exactly like non-generated tokens in a sample.

Every task is also an **environment**: ``start(prompt)`` opens an :class:`Episode`, and a rollout
driver alternates model turns and observations::

    episode = task.start(prompt)
    stop = task.stop_token_ids(tokenizer)            # eos + end-of-tool-call marker, if any
    while True:
        turn_text = <generate until a stop id, decode with skip_special_tokens=True>
        obs = episode.step(turn_text)
        if obs.done:
            break                                    # obs.finish_reason: stop | turns
        <append tokenizer.encode(obs.text, add_special_tokens=False) with version -1, log-prob 0>
    reward = episode.reward()

A single-turn task's episode ends after the first turn; a multi-turn environment (``multi_turn =
True``) turns a tool call at the end of a model turn into an observation, up to ``task.max_turns``
model turns, each tool call bounded by ``task.turn_timeout_s``.

Register a task with ``@register_task("name")`` on a class whose constructor takes the
:class:`~reflow_hpc.config.Config`; ``make_task(cfg)`` builds ``task.name``. The table of names is
:mod:`reflow_hpc.plugins`, which validating a config reads; the built-in tasks' rules are
``config``'s own, and a plugin's task may add its own in :meth:`Task.check`. This package imports
neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..config import ConfigError
from ..plugins import register_task as register_task, task_class, task_names

if TYPE_CHECKING:
    from ..config import Config

SPLITS = ("train", "eval")
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"   # around a tool's output, plain rendering


@dataclass(frozen=True)
class Prompt:
    prompt_id: int   # identity of the prompt within its task and split (row number for file tasks)
    text: str        # the problem: a chat prompt's last user message (what the eval split hashes)
    answer: str      # reference answer, as text
    meta: dict = field(default_factory=dict)   # small JSON-able extras (split, terms, ...)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of a chat prompt, system message included

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages: its own, whole, or its text as one user message."""
        if self.messages:
            return [{"role": role, "content": content} for role, content in self.messages]
        return [{"role": "user", "content": self.text}]

    def raw(self) -> str:
        """The prompt as raw text: a chat prompt's contents separated by blank lines, or its text."""
        return "\n\n".join(content for _, content in self.messages) if self.messages else self.text


@dataclass(frozen=True)
class Observation:
    """What the environment returns after a model turn."""
    text: str = ""            # to append to the response (not generated: version -1, no loss)
    done: bool = True
    finish_reason: str = ""   # when done: stop (the model ended) | turns (turn limit reached)
    tool: str = ""            # text is this tool's output: rendered as a tool message (envs/tools.py)
    error: str = ""           # the tool call failed (text says so too): counted as a tool error
    token_ids: tuple[int, ...] | None = None   # set by the renderer: the ids to insert
    truncated: bool = False   # the renderer cut the output to task.max_obs_tokens


class Task:
    """Base class of tasks: prompts by index, reward of a response, optional worked solution."""

    name: ClassVar[str] = ""
    multi_turn: ClassVar[bool] = False
    stop: ClassVar[tuple[str, ...]] = ()   # strings that end a model turn besides eos

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.seed = cfg.run.seed
        self.eval_fraction = cfg.task.eval_fraction

    @classmethod
    def check(cls, cfg: "Config", *, files: bool) -> None:
        """Rules of the keys a plugin's task reads, raising ConfigError; validating a config that selects
        the task calls it (``files``: whether rules that read files apply). The built-in tasks keep
        theirs in ``config``, which judges a config alike whether or not this package was imported."""

    # -- prompts and rewards ----------------------------------------------------------------

    def prompt(self, index: int, split: str = "train") -> Prompt:
        raise NotImplementedError

    def size(self, split: str = "train") -> int | None:
        """Distinct prompts in a split; None for a synthetic task (every index is a new prompt)."""
        return None

    def reward(self, prompt: Prompt, response: str) -> float:
        raise NotImplementedError

    def well_formed(self, prompt: Prompt, response: str) -> bool | None:
        """Whether ``response`` states an answer in the form the verifier reads (right or wrong); None
        when the task has no such rule. Evaluation reports the reward among well-formed samples, which
        separates learning the format from learning the task."""
        return None

    def solution(self, prompt: Prompt) -> str | None:
        """A worked solution (the response text a perfect policy would write), if the task has one."""
        return None

    def solution_segments(self, prompt: Prompt) -> list[tuple[str, bool]] | None:
        """The worked solution as (text, generated) segments; observations are not generated."""
        text = self.solution(prompt)
        return None if text is None else [(text, True)]

    # -- the environment side ---------------------------------------------------------------

    def start(self, prompt: Prompt) -> "Episode":
        return Episode(self, prompt)

    def observe(self, episode: "Episode", turn_text: str) -> Observation:
        """React to one model turn. Single-turn tasks end the episode at once."""
        return Observation(done=True, finish_reason="stop")

    def stop_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """Token ids that end a model turn: eos and each stop string, which must be one token."""
        ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        for s in self.stop:
            enc = tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(f"task {self.name}: stop string {s!r} is {len(enc)} tokens in this "
                                 f"tokenizer; the engine stops on single token ids")
            ids.append(int(enc[0]))
        return tuple(ids)

    # -- helpers for subclasses -------------------------------------------------------------

    def in_eval_split(self, text: str) -> bool:
        """The held-out rule: a stable hash of the prompt text (independent of the seed)."""
        h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
        return h < self.eval_fraction * 2.0 ** 64

    @staticmethod
    def check_split(split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")


class RowSplits:
    """Prompts from a fixed list of rows (a file's records, a package's problems), mixed into a Task before
    it: :meth:`split_by_text` puts each row into train or eval by the hash of its text
    (``task.eval_fraction``), and index ``i`` of a split walks that split's rows in an order reshuffled
    every epoch from ``run.seed`` (``shuffle``), so a run may draw more prompts than there are rows."""

    split_rows: dict[str, list[int]]

    def split_by_text(self, texts: Any, *, shuffle: bool, source: str = "") -> None:
        """``source``: where the rows come from, for the error of an empty split (" of FILE")."""
        self.shuffle, self._rows_source = shuffle, source
        self.split_rows = {"train": [], "eval": []}
        for i, text in enumerate(texts):
            self.split_rows["eval" if self.in_eval_split(text) else "train"].append(i)
        self._orders: dict[tuple[str, int], list[int]] = {}

    def size(self, split: str = "train") -> int:
        self.check_split(split)
        return len(self.split_rows[split])

    def row_of(self, index: int, split: str) -> int:
        """The row that prompt ``index`` of ``split`` is."""
        n = self.size(split)
        if n == 0:
            raise ValueError(f"task {self.name}: the {split} split{self._rows_source} is empty "
                             f"(task.eval_fraction = {self.eval_fraction})")
        epoch, pos = divmod(index, n)
        key = (split, epoch)
        if key not in self._orders:
            order = list(self.split_rows[split])
            if self.shuffle:
                random.Random(f"{self.name}:{self.seed}:{split}:{epoch}").shuffle(order)
            if len(self._orders) > 4:   # only the current epochs are ever asked for
                self._orders.clear()
            self._orders[key] = order
        return self._orders[key][pos]


class Episode:
    """One sample's conversation with its environment; the response text grows turn by turn."""

    def __init__(self, task: Task, prompt: Prompt):
        self.task, self.prompt = task, prompt
        self.turns = 0               # model turns seen so far
        self.tool_calls = 0
        self.parts: list[tuple[str, bool]] = []   # (text, generated) in order
        self.finish_reason = ""

    def step(self, turn_text: str, render: Callable[[Observation], Observation] | None = None) -> Observation:
        """One model turn in, the observation out; ``render`` (the runner's
        :class:`~reflow_hpc.envs.tools.ObservationRenderer`) wraps and caps a tool's output, and the
        response text gets what it returns."""
        if self.finish_reason:
            raise RuntimeError(f"prompt {self.prompt.prompt_id}: episode already ended ({self.finish_reason})")
        self.turns += 1
        self.parts.append((turn_text, True))
        obs = self.task.observe(self, turn_text)
        if obs.tool and not obs.done:
            obs = render(obs) if render is not None else plain_render(obs)
        if obs.text:
            self.parts.append((obs.text, False))
        if obs.done:
            self.finish_reason = obs.finish_reason or "stop"
        return obs

    def end(self, finish_reason: str) -> None:
        """End the episode from outside (e.g. the driver's response token limit was reached)."""
        self.finish_reason = finish_reason

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def response(self) -> str:
        return "".join(text for text, _ in self.parts)

    def reward(self) -> float:
        return self.task.reward(self.prompt, self.response)


# --------------------------------------------------------------------------------------------
# Registry: the table is reflow_hpc.plugins' (register_task is re-exported from there)
# --------------------------------------------------------------------------------------------


def plain_render(obs: Observation) -> Observation:
    """A tool's output as ``<tool_response>OUTPUT</tool_response>``, uncapped: the rendering of a driver
    without a tokenizer at hand (a runner renders with envs/tools.py's ObservationRenderer)."""
    return Observation(f"{RESULT_OPEN}{obs.text}{RESULT_CLOSE}", obs.done, obs.finish_reason, obs.tool, obs.error)


def make_task(cfg: "Config") -> Task:
    """The task named by ``task.name``, built from the whole config."""
    cls = task_class(cfg.task.name)
    if cls is None:
        raise ConfigError("task.name", cfg.task.name, "allowed: " + ", ".join(task_names()))
    return cls(cfg)


def prompt_token_ids(tokenizer: Any, prompt: Prompt | str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt: raw text (with the tokenizer's bos rule), or rendered by the chat template
    (a Prompt's own messages whole, system message included; a string as one user message)."""
    if chat_template:
        messages = prompt.chat() if isinstance(prompt, Prompt) else [{"role": "user", "content": prompt}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt.raw() if isinstance(prompt, Prompt) else prompt)]
