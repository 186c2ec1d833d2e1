r"""Math problems from a local file, rewarded by the ``\boxed{…}`` verifier (DAPO-Math style).

The file (``data.path``) is JSONL, one JSON object per line, or parquet when ``pyarrow`` is
installed. ``data.prompt_key`` and ``data.answer_key`` name the fields; a dotted key reads a nested
field (``reward_model.ground_truth``). A prompt field that is a list of chat messages
(``[{"role": "user", "content": …}]``) contributes the content of its last user message.

Rows are split once into train and eval by the hash of their prompt text (``task.eval_fraction``);
``prompt_id`` is the row number in the file. Index ``i`` of a split walks the split's rows in an
order reshuffled every epoch from ``run.seed`` (``data.shuffle``), so a run may draw more prompts
than the file holds.

A missing, unreadable or malformed file is a config error at load time, naming ``data.path`` or
the field key.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, validator
from .boxed import boxed_reward
from .task import Prompt, Task, register_task

if TYPE_CHECKING:
    from ..config import Config


def _field(record: dict, dotted: str) -> Any:
    cur: Any = record
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def _prompt_text(value: Any) -> str:
    if isinstance(value, list):   # chat messages
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError("a chat-message prompt without a user message")
        value = users[-1]
    if not isinstance(value, str):
        raise ValueError(f"prompt is a {type(value).__name__}, expected a string or chat messages")
    return value


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def _check_readable(cfg: "Config") -> Path:
    raw = cfg.data.path
    if not raw:
        raise ConfigError("data.path", raw, f"task {cfg.task.name} needs a JSONL or parquet file of "
                                            "prompts and answers")
    path = Path(raw)
    if not path.exists():
        raise ConfigError("data.path", raw, "no such file")
    if not path.is_file():
        raise ConfigError("data.path", raw, "not a regular file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError("data.path", raw, f"cannot read: {e.strerror or e.__class__.__name__}") from None
    if _is_parquet(path) and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError("data.path", raw, "reading parquet needs pyarrow, which is not installed "
                                            "(install it, or convert the file to JSONL)")
    return path


def _iter_records(path: Path, raw: str):
    if _is_parquet(path):
        import pyarrow.parquet as pq
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("data.path", raw, f"line {lineno} is not JSON: {e.msg}") from None
            if not isinstance(rec, dict):
                raise ConfigError("data.path", raw, f"line {lineno} is not a JSON object")
            yield lineno, rec


def _read_row(cfg: "Config", where: int, rec: dict) -> tuple[str, str]:
    d = cfg.data
    try:
        text = _prompt_text(_field(rec, d.prompt_key))
    except KeyError:
        raise ConfigError("data.prompt_key", d.prompt_key, f"no such field in record {where} of {d.path}") from None
    except ValueError as e:
        raise ConfigError("data.prompt_key", d.prompt_key, f"record {where} of {d.path}: {e}") from None
    try:
        answer = _field(rec, d.answer_key)
    except KeyError:
        raise ConfigError("data.answer_key", d.answer_key, f"no such field in record {where} of {d.path}") from None
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    return text, str(answer)


def load_rows(cfg: "Config") -> list[tuple[str, str]]:
    """(prompt text, reference answer) of every record of ``data.path``."""
    path = _check_readable(cfg)
    rows = [_read_row(cfg, where, rec) for where, rec in _iter_records(path, cfg.data.path)]
    if not rows:
        raise ConfigError("data.path", cfg.data.path, "the file holds no records")
    return rows


@validator(reads_files=True)
def _check_data(cfg: "Config") -> None:
    """File tasks: the file must exist and be readable, and its first record must have the fields."""
    if cfg.task.name != "math_boxed":
        return
    path = _check_readable(cfg)
    for where, rec in _iter_records(path, cfg.data.path):
        _read_row(cfg, where, rec)
        break
    else:
        raise ConfigError("data.path", cfg.data.path, "the file holds no records")


@register_task("math_boxed")
class MathBoxed(Task):
    r"""Prompts and reference answers from a file; reward 1 when the last \boxed{} answer matches."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        self.shuffle = cfg.data.shuffle
        self.rows = load_rows(cfg)
        self.split_rows: dict[str, list[int]] = {"train": [], "eval": []}
        for i, (text, _) in enumerate(self.rows):
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
        text, answer = self.rows[row]
        return Prompt(row, text, answer, {"split": split})

    def reward(self, prompt: Prompt, response: str) -> float:
        return boxed_reward(response, prompt.answer)
