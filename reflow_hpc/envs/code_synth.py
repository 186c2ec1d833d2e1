"""Generated coding problems a tiny CPU policy learns in minutes: list pipelines, judged in the sandbox.

A problem asks for ``f(xs)``, a list of small integers in, an integer out, as a pipeline of steps
written tersely, with two public examples of at most 3 numbers, a random input and an edge case (the input of a
seeded pool that tells the most plausible bugs apart)::

    f(xs): keep at least 3, times 2, max
    f([1,3,5])==10
    f([4,2])==8

and its solution is one line per step::

    def f(xs):
     xs=[x for x in xs if x>=3]
     xs=[x*2 for x in xs]
     return max(xs,default=0)

Steps: ``task.min_terms`` to ``task.max_terms`` of them (one more with probability
``task.more_terms_prob`` at a time: a long tail of solution lengths), every one but the last a filter
(``keep above N`` ``>``, ``keep at least N`` ``>=``, ``keep below N`` ``<``, ``keep at most N``
``<=``, ``keep even``, ``keep odd``) or a map (``add N``, ``sub N``, ``times N``), the last a reduction
(``sum``, ``count``, ``max``, ``min``; max and min of an empty list are 0). Constants have 1 to
``task.digits`` digits; inputs are 1 to 6 numbers of 0–9 (and the empty list among the hidden
ones); a problem whose hidden outputs take fewer than 3 values is drawn again, as no test would
tell codes apart on it.

**The reward** runs the final code (:func:`reflow_hpc.envs.code.final_code`) in the sandbox on
``task.hidden_tests`` hidden inputs and compares its outputs outside with the reference's:
the fraction that match, or 1 only when all do (``task.test_reward``). The hidden inputs always hold
the empty list, and are completed from a seeded pool until each *plausible bug* of the problem — one
comparison's strictness swapped, a max or min without its default — fails at least one of them, so a
solution that passes them all is right on every case that tells these apart.

**The worked solutions** of the warm start come from a teacher that makes those bugs: each
filter with a bound is written with the wrong strictness, and each max or min without its default,
with probability ``warmstart.bug_fraction`` (every demonstration is valid code that defines ``f``).
A fraction ``warmstart.tool_fraction`` of them first run the draft through the ``python`` tool
followed by ``check(f)``; when it prints ``wrong: …`` the next turn is the corrected code (sometimes
checked again), otherwise (``ok``) the turn ``submit``, which submits the code of the last tool call
as the final code (the policy need not copy its draft).

**The interpreter** of this task defines ``check(f)`` before the model's code (:func:`check_preamble`):
it runs ``f`` on the public examples, which the prompt shows anyway, and prints ``ok`` or the first one
it gets wrong (``wrong: f([4]) gives ValueError, expected 0``) — a judge's "run the examples" button,
so that a tiny policy need not copy the examples into its test. Hidden tests never enter it. So the
warm-started policy writes valid code nearly always and is wrong where the teacher was: the gap RL
closes is correctness, and a policy that tests its draft can repair it — calling the tool pays.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from .code import CodeTask, final_code, parses
from .task import Episode, Observation, Prompt, register_task
from .tools import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN, ToolCall, tool_turn

if TYPE_CHECKING:
    from ..config import Config

FILTERS = {"above": ">", "at least": ">=", "below": "<", "at most": "<="}
SWAPPED = {">": ">=", ">=": ">", "<": "<=", "<=": "<"}
MAPS = {"add": "+", "sub": "-", "times": "*"}
REDUCTIONS = ("sum", "count", "max", "min")
ARGS = "xs"
POOL = 256             # random inputs the examples and hidden tests are chosen from
PUBLIC_LONGEST = 3     # numbers in a public example: short, so that a test call copies them easily
SUBMIT = "submit"      # a final turn that submits the code of the last tool call


def _filter_ok(x: int, op: str, n: int) -> bool:
    return {">": x > n, ">=": x >= n, "<": x < n, "<=": x <= n}[op]


def run_steps(steps: list[tuple], xs: list[int], *, bugs: frozenset = frozenset()) -> int | None:
    """The pipeline on ``xs`` in plain Python (our own steps, never model code); ``bugs`` names the
    steps written with the teacher's bug. None: the program would raise (max or min of [] without default)."""
    for i, (kind, *rest) in enumerate(steps):
        if kind == "filter":
            op, n = rest
            if op in SWAPPED and i in bugs:
                op = SWAPPED[op]
            xs = [x for x in xs if _filter_ok(x, op, n)] if op in SWAPPED else \
                [x for x in xs if x % 2 == (0 if op == "even" else 1)]
        elif kind == "map":
            op, n = rest
            xs = [x + n if op == "+" else x - n if op == "-" else x * n for x in xs]
        else:
            (red,) = rest
            if red == "sum":
                return sum(xs)
            if red == "count":
                return len(xs)
            if not xs:
                return None if i in bugs else 0
            return max(xs) if red == "max" else min(xs)
    raise ValueError("a pipeline ends with a reduction")


def code_of(steps: list[tuple], bugs: frozenset = frozenset()) -> str:
    """The solution's source, with the teacher's bug in the steps named by ``bugs``."""
    lines = [f"def f({ARGS}):"]
    for i, (kind, *rest) in enumerate(steps):
        if kind == "filter":
            op, n = rest
            if op in SWAPPED:
                cond = f"x{SWAPPED[op] if i in bugs else op}{n}"
            else:
                cond = f"x%2=={0 if op == 'even' else 1}"
            lines.append(f" xs=[x for x in xs if {cond}]")
        elif kind == "map":
            op, n = rest
            lines.append(f" xs=[x{op}{n} for x in xs]")
        else:
            (red,) = rest
            if red in ("sum", "count"):
                lines.append(f" return {'sum' if red == 'sum' else 'len'}(xs)")
            else:
                lines.append(f" return {red}(xs)" if i in bugs else f" return {red}(xs,default=0)")
    return "\n".join(lines)


def describe(steps: list[tuple]) -> str:
    words = []
    for kind, *rest in steps:
        if kind == "filter":
            op, n = rest
            name = next((w for w, o in FILTERS.items() if o == op), op)
            words.append(f"keep {name} {n}" if op in SWAPPED else f"keep {name}")
        elif kind == "map":
            op, n = rest
            words.append(f"{next(w for w, o in MAPS.items() if o == op)} {n}")
        else:
            words.append(rest[0])
    return ", ".join(words)


def _show(xs: list[int]) -> str:
    return "[" + ",".join(map(str, xs)) + "]"


@register_task("code_synth")
class CodeSynth(CodeTask):
    """List-pipeline problems with public examples and hidden tests (module docstring)."""

    def __init__(self, cfg: "Config"):
        super().__init__(cfg)
        t = cfg.task
        self.digits, self.hidden = t.digits, t.hidden_tests
        self.min_steps, self.max_steps, self.more = t.min_terms, t.max_terms, t.more_terms_prob
        self.all_or_nothing = t.test_reward == "all"
        self.case_timeout_s = t.test_timeout_s
        w = cfg.warmstart
        self.bug_fraction, self.tool_fraction, self.teacher_seed = w.bug_fraction, w.tool_fraction, w.seed
        self.max_draws = 100_000

    # -- problems ---------------------------------------------------------------------------

    def _const(self, rng: random.Random, low: int = 0) -> int:
        d = rng.randint(1, self.digits)
        return rng.randint(max(low, 0 if d == 1 else 10 ** (d - 1)), 10 ** d - 1)

    def _steps(self, rng: random.Random) -> list[tuple]:
        k = self.min_steps
        while k < self.max_steps and rng.random() < self.more:
            k += 1
        steps: list[tuple] = []
        for _ in range(k - 1):
            if rng.random() < 0.5:
                op = rng.choice([*FILTERS.values(), "even", "odd"])
                steps.append(("filter", op, self._const(rng, 1)) if op in SWAPPED else ("filter", op, 0))
            else:
                op = rng.choice(list(MAPS.values()))
                steps.append(("map", op, self._const(rng, 1) if op != "*" else rng.randint(2, 3)))
        steps.append(("reduce", rng.choice(REDUCTIONS)))
        return steps

    @staticmethod
    def _input(rng: random.Random, longest: int = 6) -> list[int]:
        return [rng.randint(0, 9) for _ in range(rng.randint(1, longest))]

    def _public(self, rng: random.Random, steps: list[tuple]) -> list[list[int]]:
        """Two examples: a random input, and the pool input that tells the most plausible bugs apart
        from the right code (an edge case, as a problem setter would show one)."""
        pool = [self._input(rng, PUBLIC_LONGEST) for _ in range(POOL)]
        bugs = self._buggable(steps)

        def told(xs: list[int]) -> int:
            right = run_steps(steps, xs)
            return sum(run_steps(steps, xs, bugs=frozenset([b])) != right for b in bugs)
        return [pool[0], max(pool[1:], key=told)]

    @staticmethod
    def _buggable(steps: list[tuple]) -> list[int]:
        """The steps the teacher can get wrong: a bound's strictness, max or min's default."""
        return [i for i, (kind, *rest) in enumerate(steps)
                if (kind == "filter" and rest[0] in SWAPPED) or (kind == "reduce" and rest[0] in ("max", "min"))]

    def _hidden(self, rng: random.Random, steps: list[tuple], public: list[list[int]]) -> list[list[int]]:
        """``task.hidden_tests`` inputs: [] first, then random ones, swapping in pool inputs until every
        plausible bug fails at least one (when the pool allows)."""
        cases = [[]] + [self._input(rng) for _ in range(max(0, self.hidden - 1))]
        pool = public + [self._input(rng) for _ in range(POOL)]
        bugs = self._buggable(steps)
        slot = len(cases) - 1
        for b in bugs:
            def caught(xs: list[int]) -> bool:
                return run_steps(steps, xs, bugs=frozenset([b])) != run_steps(steps, xs)
            if any(caught(xs) for xs in cases):
                continue
            hit = next((xs for xs in pool if caught(xs)), None)
            if hit is not None and slot > 0:
                cases[slot] = hit
                slot -= 1
        return cases[: self.hidden]

    def prompt(self, index: int, split: str = "train") -> Prompt:
        self.check_split(split)
        for attempt in range(self.max_draws):
            rng = random.Random(f"{self.name}:{self.seed}:{split}:{index}:{attempt}")
            steps = self._steps(rng)
            public = self._public(rng, steps)
            head = f"f({ARGS}): {describe(steps)}"
            if self.in_eval_split(head) != (split == "eval"):
                continue
            shown = [f"f({_show(xs)})=={run_steps(steps, xs)}" for xs in public]
            text = head + "\n" + "\n".join(shown) + "\n"
            hidden = self._hidden(rng, steps, public)
            expected = [run_steps(steps, xs) for xs in hidden]
            if len(set(expected)) < min(3, len(expected)):
                continue                         # a (nearly) constant function: no test tells codes apart
            meta = {"split": split, "index": index, "steps": [list(s) for s in steps], "public": public,
                    "hidden": hidden, "expected": expected}
            return Prompt(index, text, str(expected), meta)
        raise ValueError(f"task {self.name}: no {split} prompt found in {self.max_draws} draws "
                         f"(task.eval_fraction = {self.eval_fraction})")

    # -- reward -----------------------------------------------------------------------------

    def final(self, prompt: Prompt, response: str) -> str | None:
        """The final code: the last turn's, or, when that turn is ``submit``, the code of the last tool call
        exactly as it ran (after the interpreter's preamble: its ``check(f)`` runs at import, harmlessly)."""
        code = final_code(response)
        if code is not None and code.strip() == SUBMIT:
            end = response.rfind(CALL_CLOSE)
            start = response.rfind(CALL_OPEN, 0, end)
            if not 0 <= start < end:
                return None
            return check_preamble(prompt.meta["public"], prompt.meta["steps"]) + response[start + len(CALL_OPEN):end]
        return code

    def well_formed(self, prompt: Prompt, response: str) -> bool:
        return parses(self.final(prompt, response))

    def reward(self, prompt: Prompt, response: str) -> float:
        from ..sandbox.judge import call_function, outputs_match

        code = self.final(prompt, response)
        if not code:
            return 0.0
        hidden, expected = prompt.meta["hidden"], prompt.meta["expected"]
        run = call_function(self.sandbox(), code, "f", [[xs] for xs in hidden],
                            timeout_s=self.case_timeout_s * len(hidden))
        if run.results is None:
            return 0.0
        ok = [r.get("ok") is True and outputs_match(r.get("value"), e) for r, e in zip(run.results, expected)]
        if self.all_or_nothing:
            return float(all(ok))
        return sum(ok) / len(ok)

    # -- worked solutions -------------------------------------------------------------------

    def solution(self, prompt: Prompt) -> str:
        """The right code, written directly."""
        return code_of([tuple(s) for s in prompt.meta["steps"]])

    def solution_segments(self, prompt: Prompt) -> list[tuple[str, bool]]:
        """The teacher's demonstration (module docstring): seeded by ``warmstart.seed`` and the prompt."""
        steps = [tuple(s) for s in prompt.meta["steps"]]
        rng = random.Random(f"{self.name}:teacher:{self.teacher_seed}:{prompt.meta['split']}:{prompt.meta['index']}")
        bugs = frozenset(i for i in self._buggable(steps) if rng.random() < self.bug_fraction)
        draft = code_of(steps, bugs)
        if rng.random() >= self.tool_fraction:
            return [(draft, True)]
        public = prompt.meta["public"]
        right = [run_steps(steps, xs) for xs in public]
        segments = self._test(steps, bugs, public)
        if [run_steps(steps, xs, bugs=bugs) for xs in public] == right:
            return segments + [(SUBMIT, True)]
        if rng.random() < 0.5:                 # test the correction too: a longer tail of turns
            return segments + self._test(steps, frozenset(), public) + [(SUBMIT, True)]
        return segments + [(code_of(steps), True)]

    def _test(self, steps: list[tuple], bugs: frozenset, public: list[list[int]]) -> list[tuple[str, bool]]:
        """A tool call that checks the code on the public examples, and what the interpreter prints."""
        call = code_of(steps, bugs) + "\n" + CHECK_CALL
        out = "ok\n"
        for xs in public:
            got, want = run_steps(steps, xs, bugs=bugs), run_steps(steps, xs)
            if got != want:
                out = check_line(xs, "ValueError" if got is None else got, want)
                break
        return [(f"{CALL_OPEN}{call}{CALL_CLOSE}", True), (f"{RESULT_OPEN}{out}{RESULT_CLOSE}", False)]

    # -- the interpreter ------------------------------------------------------------------------

    def observe(self, episode: Episode, turn_text: str) -> Observation:
        """CodeTask's turns; a python call runs after :func:`check_preamble` of the prompt's examples."""
        def with_preamble(call: ToolCall) -> ToolCall:
            key = "code" if "code" in call.arguments else "_plain"
            if call.name != "python" or not isinstance(call.arguments.get(key), str):
                return call
            meta = episode.prompt.meta
            return ToolCall(call.name, {**call.arguments, key: check_preamble(meta["public"], meta["steps"])
                                        + call.arguments[key]})
        return tool_turn(self.tools, self.max_turns, episode, turn_text, with_preamble)


CHECK_CALL = "check(f)"


def check_line(xs: list[int], got: object, want: int) -> str:
    return f"wrong: f({_show(xs)}) gives {got}, expected {want}\n"


def check_preamble(public: list[list[int]], steps: list) -> str:
    """Code run before the model's in the interpreter: ``check(f)`` runs ``f`` on the public examples
    (nothing the prompt does not show) and prints ``ok`` or the first example it gets wrong, with
    :func:`check_line`'s words; an exception counts as its name."""
    examples = [(xs, run_steps([tuple(s) for s in steps], xs)) for xs in public]
    return ("def check(f):\n"
            f" for xs,want in {examples!r}:\n"
            "  try:got=f(list(xs))\n"
            "  except Exception as e:got=type(e).__name__\n"
            "  if got!=want:\n"
            "   print('wrong: f(['+','.join(map(str,xs))+']) gives '+str(got)+', expected '+str(want));return\n"
            " print('ok')\n")
