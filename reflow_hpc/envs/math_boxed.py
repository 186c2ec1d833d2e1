r"""Math problems from a local file (DAPO-Math style), scored by :func:`reflow_hpc.envs.math_reward`.

The file (``data.path``) is JSONL, one JSON object per line, or parquet when ``pyarrow`` is
installed. ``data.prompt_key`` and ``data.answer_key`` name the fields; a dotted key reads a nested
field (``reward_model.ground_truth``). A prompt field that is a list of chat messages
(``[{"role": "system", …}, {"role": "user", "content": …}]``; DAPO-Math-17k's hold one user message) is kept whole:
with ``task.chat_template`` every message goes through the tokenizer's chat template, system message
included; the prompt's ``text`` is its last user message (the problem, which the eval split hashes).

Rows are split once into train and eval by the hash of their prompt text (``task.eval_fraction``);
``prompt_id`` is the row number in the file. Index ``i`` of a split walks the split's rows in an
order reshuffled every epoch from ``run.seed`` (``data.shuffle``), so a run may draw more prompts
than the file holds.

A missing, unreadable or malformed file is a config error at load time, naming ``data.path`` or
the field key: the reader is ``config.data_rows``, so that validating a config checks the file
without this module.
"""

from __future__ import annotations

import importlib.util
import random
from typing import TYPE_CHECKING

from ..config import ConfigError, data_rows
from .math_score import extract_answer, math_reward
from .task import Prompt, Task, register_task

if TYPE_CHECKING:
    from ..config import Config, DataRow


def load_rows(cfg: "Config") -> list["DataRow"]:
    """(prompt text, reference answer, chat messages) of every record of ``data.path``."""
    return data_rows(cfg)


@register_task("math_boxed")
class MathBoxed(Task):
    r"""Prompts and reference answers from a file; reward 1 when the stated answer (``Answer: X`` or
    ``\boxed{X}``) equals the reference, by ``math_reward``."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        if importlib.util.find_spec("math_verify") is None:   # fail at start, not at the first reward
            raise ConfigError("task.name", cfg.task.name, "scoring math answers needs math-verify, which is not "
                                                          "installed (pip install -e '.[math]')")
        self.shuffle = cfg.data.shuffle
        self.rows = load_rows(cfg)
        self.split_rows: dict[str, list[int]] = {"train": [], "eval": []}
        for i, (text, _, _) in enumerate(self.rows):
            self.split_rows["eval" if self.in_eval_split(text) else "train"].append(i)
        self._orders: dict[tuple[str, int], list[int]] = {}

    def size(self, split: str = "train") -> int:
        self.check_split(split)
        return len(self.split_rows[split])

    def _order(self, split: str, epoch: int) -> list[int]:
        key = (split, epoch)
        if key not in self._orders:
            order = list(self.split_rows[split])
            if self.shuffle:
                random.Random(f"{self.name}:{self.seed}:{split}:{epoch}").shuffle(order)
            if len(self._orders) > 4:   # only the current epochs are ever asked for
                self._orders.clear()
            self._orders[key] = order
        return self._orders[key]

    def prompt(self, index: int, split: str = "train") -> Prompt:
        n = self.size(split)
        if n == 0:
            raise ValueError(f"task {self.name}: the {split} split of {self.cfg.data.path} is empty "
                             f"(task.eval_fraction = {self.eval_fraction})")
        epoch, pos = divmod(index, n)
        row = self._order(split, epoch)[pos]
        text, answer, messages = self.rows[row]
        return Prompt(row, text, answer, {"split": split}, messages)

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        return extract_answer(response) is not None

    def reward(self, prompt: Prompt, response: str) -> float:
        return math_reward(response, prompt.answer)
