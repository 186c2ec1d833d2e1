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
from typing import TYPE_CHECKING

from ..config import ConfigError, data_rows
from .math_score import extract_answer, math_reward
from .task import Prompt, RowSplits, Task, register_task

if TYPE_CHECKING:
    from ..config import Config, DataRow


def load_rows(cfg: "Config") -> list["DataRow"]:
    """(prompt text, reference answer, chat messages) of every record of ``data.path``."""
    return data_rows(cfg)


@register_task("math_boxed")
class MathBoxed(RowSplits, Task):
    r"""Prompts and reference answers from a file; reward 1 when the stated answer (``Answer: X`` or
    ``\boxed{X}``) equals the reference, by ``math_reward``."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        if importlib.util.find_spec("math_verify") is None:   # fail at start, not at the first reward
            raise ConfigError("task.name", cfg.task.name, "scoring math answers needs math-verify, which is not "
                                                          "installed (pip install -e '.[math]')")
        self.rows = load_rows(cfg)
        self.split_by_text((text for text, _, _ in self.rows), shuffle=cfg.data.shuffle, source=f" of {cfg.data.path}")

    def prompt(self, index: int, split: str = "train") -> Prompt:
        row = self.row_of(index, split)
        text, answer, messages = self.rows[row]
        return Prompt(row, text, answer, {"split": split}, messages)

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        return extract_answer(response) is not None

    def reward(self, prompt: Prompt, response: str) -> float:
        return math_reward(response, prompt.answer)
