r"""The math scorer: ``math_reward(response, reference) -> 1.0 | 0.0``, used by every math task.

**Which answer.** A response states its answer either on a line ``Answer: X`` (the format the
DAPO-Math-17k prompts ask for; the last such line counts, matched case-insensitively as in the DAPO
recipe) or as ``\boxed{X}`` / ``\fbox{X}`` (braces matched, the last box counts; ``\boxed 5`` too).
When a response has both, the one that starts later in the text counts, so ``Answer: \boxed{34}``
gives ``34``. A box cut off by the response limit gives no answer. No answer, or an answer that
normalises to the empty string, scores 0 — also against an empty reference.

**Normalisation.** Answer and reference are normalised by the rules of ``normalize_final_answer``
published with DAPO (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476; the recipe's ``verl/utils/reward_score/math_dapo.py``), implemented here from their
description: keep what follows the last ``=``; drop the listed units and phrases (``degrees``,
``\text{}``, ``^\circ``, ``{,}``, ``\dots``, …) and all spaces; keep the first ``$…$`` span; unwrap
``\text{}``, ``\textbf{}``, ``\overline{}`` and ``\boxed{}``; expand ``\frac12`` and ``\sqrt2``;
drop ``$``; drop the commas of a plain digit string. Where this module differs, on purpose: groups
are unwrapped with their braces matched and nested groups whole (``\text{\text{5}}`` is ``5``); the
Unicode minus ``−`` is ``-``; surrounding ``*`` (Markdown bold) and a trailing period of the answer
line are dropped; ``\frac`` and ``\sqrt`` shorthands never swallow a command's backslash. ``%`` is
never removed (``5%0`` is not ``50``).

**Equivalence.** Equal normalised strings score 1 at once (the common case, no other process), and
two different plain integers score 0 at once. Anything else is decided by Hugging Face's
``math-verify`` (which parses LaTeX to SymPy: ``\frac{\sqrt2}{2}`` = ``\frac{1}{\sqrt2}``,
``2^{10}`` = ``1024``, ``3\sqrt2`` = ``\sqrt{18}``, ``\{2,1\}`` = ``\{1,2\}``). That check runs in a
separate process, a fresh interpreter started with ``subprocess`` (never forked from an MPI rank),
with its address space capped at 512 MiB (``RLIMIT_AS``) and each call bounded to 2 s from outside:
past the deadline the process is killed, the call scores 0, and a new process is started at once
for the next call. The calls are serialised by a lock, so the scorer is safe from any thread;
math-verify's own signal-based timeouts (main thread only) are disabled. Without math-verify
installed (the ``math`` extra) the first call that needs it raises one line saying so.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
from fractions import Fraction

from ..sandbox.helper import HelperError, HelperProcess

CALL_TIMEOUT_S = 2.0                 # the bound of one equivalence check
MEMORY_LIMIT_BYTES = 512 << 20       # RLIMIT_AS of the equivalence process
START_TIMEOUT_S = 60.0               # a fresh process imports sympy: seconds on a busy node
MAX_ANSWER_CHARS = 20_000            # longer answers are compared as text only (pipe writes stay small)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_equiv_worker.py")

# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOX_COMMANDS = (r"\boxed", r"\fbox")


def _matched_group(text: str, i: int) -> int:
    """Index of the brace that closes the one at ``text[i]``, or -1 when it is never closed."""
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def last_boxed(text: str) -> tuple[int, str | None] | None:
    """(start, content) of the last ``\\boxed``/``\\fbox`` in ``text``; content None when cut off."""
    start = max(text.rfind(c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _matched_group(text, i)
        return start, (text[i + 1:end] if end >= 0 else None)
    m = re.match(r"[^\s$]+", text[i:])   # \boxed 5: one token
    return start, (m.group(0) if m else None)


def extract_answer(response: str) -> str | None:
    """The answer a response states (module docstring), or None."""
    box = last_boxed(response)
    line = None
    for line in _ANSWER_LINE.finditer(response):
        pass
    if box is not None and (line is None or box[0] > line.start()):
        return box[1]
    if line is None:
        return None
    ans = line.group(1).strip().strip("*").strip()
    return ans[:-1] if ans.endswith(".") and not ans[:-1].endswith(".") else ans


# --------------------------------------------------------------------------------------------
# DAPO's normalize_final_answer rules (see the module docstring for the source and the differences)
# --------------------------------------------------------------------------------------------

# Replaced in this order, then the removed expressions, as the recipe lists them.
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
_UNWRAPPED = ("\\text", "\\textbf", "\\overline", "\\boxed")
_FIRST_MATH_SPAN = re.compile(r"\$([^\n]*?)\$")


def _unwrap(s: str, cmd: str) -> str:
    """Every ``cmd{x}`` becomes ``x``, braces matched, innermost groups included."""
    while True:
        k = s.find(cmd + "{")
        if k < 0:
            return s
        i = k + len(cmd)
        end = _matched_group(s, i)
        if end < 0:
            return s
        s = s[:k] + s[i + 1:end] + s[end + 1:]


def normalize_final_answer(answer: str) -> str:
    """The canonical text of an answer under DAPO's rules (module docstring)."""
    s = answer.replace("\u2212", "-").split("=")[-1]
    for old, new in _REPLACED:
        s = s.replace(old, new)
    for junk in _REMOVED:
        s = s.replace(junk, "")
    m = _FIRST_MATH_SPAN.search(s)
    if m:
        s = m.group(1)
    for cmd in _UNWRAPPED:
        s = _unwrap(s, cmd)
    s = re.sub(r"frac([^{\\])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{\\])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


_INTEGER = re.compile(r"[+-]?\d+")


def _plain_integer(s: str) -> Fraction | None:
    # 1,000 digits: far beyond any reference, and far below Python's int conversion limit
    return Fraction(int(s)) if len(s) <= 1000 and _INTEGER.fullmatch(s) else None


# --------------------------------------------------------------------------------------------
# The equivalence process
# --------------------------------------------------------------------------------------------

class EquivalenceProcess:
    """A math-verify process in a fresh interpreter, each call bounded in time and memory: a
    :class:`~reflow_hpc.sandbox.helper.HelperProcess` (started without a fork, killed and restarted past
    a call's deadline, replaced when found dead between calls; safe from any thread)."""

    def __init__(self, timeout_s: float = CALL_TIMEOUT_S, memory_bytes: int = MEMORY_LIMIT_BYTES,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.timeout_s = timeout_s
        # A call whose process died under it is made once more: the input is ours, and a process found
        # dead between calls (killed, or exited after running out of memory) says nothing about it.
        self._helper = HelperProcess([sys.executable, "-P", WORKER, str(memory_bytes)], name="math_reward",
                                     start_timeout_s=start_timeout_s, respawn="eager", retry_lost_call=True)

    @property
    def info(self) -> dict:
        """The process's ready line: pid, whether it loaded reflow_hpc, its memory limit."""
        return self._helper.info

    @property
    def restarts(self) -> int:
        """Processes killed on a deadline or lost during a call."""
        return self._helper.restarts

    def start(self) -> dict:
        """Start the process now (it is otherwise started by the first call that needs it)."""
        try:
            return self._helper.start()
        except HelperError as e:
            raise RuntimeError(f"math_reward: the math-verify process did not start: {e}") from None

    def equal(self, answer: str, reference: str) -> bool:
        try:
            reply = self._helper.call([answer, reference], self.timeout_s)
        except HelperError as e:
            raise RuntimeError(f"math_reward: the math-verify process did not start: {e}") from None
        # None: past the deadline or lost (a fresh process is loading already); "exit": out of memory,
        # the process ends after this reply and the next call finds it gone.
        return bool(reply is not None and reply.get("ok"))

    def close(self) -> None:
        self._helper.close()


_PROCESS = EquivalenceProcess()
atexit.register(_PROCESS.close)


def equivalence_process() -> EquivalenceProcess:
    """The process ``math_reward`` uses (for starting it early, and for tests)."""
    return _PROCESS


# --------------------------------------------------------------------------------------------
# The scorer
# --------------------------------------------------------------------------------------------

def answers_equal(answer: str, reference: str) -> bool:
    """Whether an extracted answer matches the reference (normalised, then by math-verify)."""
    a, b = normalize_final_answer(answer), normalize_final_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = _plain_integer(a), _plain_integer(b)
    if x is not None and y is not None:
        return x == y
    if len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    # math-verify parses the answer as written (its own normalisation), minus the math delimiters;
    # DAPO's rules can mangle text it understands (they drop "a " and "an ").
    return _PROCESS.equal(_for_parser(answer), _for_parser(reference))


def _for_parser(s: str) -> str:
    s = s.replace("\u2212", "-").replace("$", "").strip()
    for cmd in ("\\text", "\\boxed"):
        s = _unwrap(s, cmd)
    return s


def math_reward(response: str, reference: str) -> float:
    """1.0 when the answer the response states equals the reference answer, else 0.0 (module docstring)."""
    got = extract_answer(response)
    return 1.0 if got is not None and answers_equal(got, reference) else 0.0
