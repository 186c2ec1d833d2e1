"""Synthetic, seeded multi-term arithmetic with a long-tailed response length (the CPU default task).

A problem is a chain of ``k`` integers joined by ``+`` (and ``-`` when ``task.ops = "+-"``)::

    prompt:    7+8+5=
    solution:  7+8=15
               15+5=20
               #### 20

Each operand has 1 to ``task.digits`` digits (the digit count drawn uniformly first). The number of
terms ``k`` starts at ``task.min_terms`` and grows by one with probability ``task.more_terms_prob``
at a time, up to ``task.max_terms`` (a truncated geometric tail). With ``task.drift_prompts = D`` the
training prompts drift: prompt ``i`` uses ``more_terms_prob + min(1, i/D)·(more_terms_prob_end −
more_terms_prob)``, so responses grow (or shrink) over the run — a workload whose balance between
generation and training moves, as response lengths do in real RL runs. The worked solution writes one
line per partial sum, so its length grows linearly with ``k``: most responses are short and a few
are several times longer, which is the long tail that makes batch-level rollout wait for
stragglers. At the defaults a worked solution plus eos is 15–19 tokens of the character tokenizer
at the median, about 62 at the 99th percentile (p99/p50 ≈ 3.3) and at most about 95.

Format rule of the reward: the answer is the text after the **last** ``####`` in the response,
stripped of surrounding whitespace, and it must be a plain integer (``-?[0-9]+``, nothing else).
Reward 1.0 when it equals the exact result, else 0.0 (no marker, extra text, or a wrong value).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING

from .task import Prompt, Task, register_task

if TYPE_CHECKING:
    from ..config import Config

ANSWER_MARKER = "####"
_INTEGER = re.compile(r"-?[0-9]+")


# Python refuses to convert integer strings of more than 4,300 digits; no answer of this task comes close.
MAX_ANSWER_CHARS = 1000


def final_answer(response: str) -> int | None:
    """The integer after the last answer marker, or None when the response breaks the format rule (an
    answer longer than MAX_ANSWER_CHARS breaks it too)."""
    pos = response.rfind(ANSWER_MARKER)
    if pos < 0:
        return None
    tail = response[pos + len(ANSWER_MARKER):].strip()
    return int(tail) if len(tail) <= MAX_ANSWER_CHARS and _INTEGER.fullmatch(tail) else None


def integer_reward(answer: str, response: str) -> float:
    got = final_answer(response)
    return 1.0 if got is not None and got == int(answer) else 0.0


@register_task("arithmetic")
class Arithmetic(Task):
    """Chains of additions (and subtractions) answered with running partial sums."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        t = cfg.task
        self.digits, self.ops = t.digits, t.ops
        self.min_terms, self.max_terms, self.more_terms_prob = t.min_terms, t.max_terms, t.more_terms_prob
        self.drift_prompts, self.more_terms_prob_end = t.drift_prompts, t.more_terms_prob_end
        # A split can be empty when eval_fraction is 0 or 1; fail fast instead of spinning.
        self.max_draws = 100_000

    def more_prob(self, index: int, split: str = "train") -> float:
        """The continuation probability of prompt ``index`` (the drift applies to training prompts)."""
        if not self.drift_prompts or split != "train":
            return self.more_terms_prob
        frac = min(1.0, index / self.drift_prompts)
        return self.more_terms_prob + frac * (self.more_terms_prob_end - self.more_terms_prob)

    def _draw(self, rng: random.Random, more: float) -> tuple[list[int], list[str]]:
        k = self.min_terms
        while k < self.max_terms and rng.random() < more:
            k += 1
        terms = [self._operand(rng) for _ in range(k)]
        signs = ["+" if self.ops == "+" else rng.choice("+-") for _ in range(k - 1)]
        return terms, signs

    def _operand(self, rng: random.Random) -> int:
        # Uniform over digit counts first, so 1-digit operands are not drowned out by 2-digit ones.
        d = rng.randint(1, self.digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)

    @staticmethod
    def _text(terms: list[int], signs: list[str]) -> str:
        return str(terms[0]) + "".join(s + str(t) for s, t in zip(signs, terms[1:])) + "="

    def prompt(self, index: int, split: str = "train") -> Prompt:
        self.check_split(split)
        want_eval = split == "eval"
        for attempt in range(self.max_draws):
            rng = random.Random(f"{self.name}:{self.seed}:{split}:{index}:{attempt}")
            terms, signs = self._draw(rng, self.more_prob(index, split))
            text = self._text(terms, signs)
            if self.in_eval_split(text) == want_eval:
                value = terms[0] + sum(t if s == "+" else -t for s, t in zip(signs, terms[1:]))
                return Prompt(index, text, str(value),
                              {"split": split, "terms": terms, "signs": "".join(signs)})
        raise ValueError(f"task {self.name}: no {split} prompt found in {self.max_draws} draws "
                         f"(task.eval_fraction = {self.eval_fraction})")

    def solution(self, prompt: Prompt) -> str:
        terms, signs = prompt.meta["terms"], prompt.meta["signs"]
        lines, acc = [], terms[0]
        for s, t in zip(signs, terms[1:]):
            nxt = acc + t if s == "+" else acc - t
            lines.append(f"{acc}{s}{t}={nxt}")
            acc = nxt
        return "\n".join(lines) + f"\n{ANSWER_MARKER} {acc}"

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        return final_answer(response) is not None

    def reward(self, prompt: Prompt, response: str) -> float:
        return integer_reward(prompt.answer, response)
