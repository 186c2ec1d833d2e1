r"""Verifier of ``\boxed{…}`` answers (DAPO-Math style rewards).

Rules:

- The answer is the content of the **last** ``\boxed{…}`` (or ``\fbox{…}``) in the response, braces
  matched so that nested groups such as ``\boxed{\frac{1}{2}}`` are kept whole; ``\boxed 5`` (one
  token, no braces) is accepted too. No boxed answer means reward 0.
- Both the answer and the reference are normalised: surrounding ``$``, spaces and thin spaces,
  ``\left``/``\right``, ``\displaystyle``, ``\text{…}`` wrappers, a trailing period, degree signs and
  ``\%`` are removed; ``\dfrac``/``\tfrac`` become ``\frac``; ``\frac12`` becomes ``\frac{1}{2}``.
- When both sides read as numbers they are compared exactly as fractions: integers, decimals,
  ``a/b``, ``\frac{a}{b}``, a leading sign on either the whole or the numerator, and thousands
  separators (``1,234`` or ``1{,}234``) are understood, so ``\frac{1}{2}``, ``\dfrac12``, ``1/2`` and
  ``0.5`` are all equal. Tuples and intervals compare element by element with the same rule.
- Otherwise the normalised strings must be identical.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = (r"\boxed", r"\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last boxed group, or None."""
    start = max(text.rfind(c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # \boxed 5: the argument runs to the next space, dollar sign or end.
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None   # unbalanced: the response was cut off inside the box


def _strip_group(s: str, cmd: str) -> str:
    """Replace every ``cmd{x}`` by ``x`` (braces matched)."""
    out, i = [], 0
    while True:
        k = s.find(cmd + "{", i)
        if k < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:k])
        j, depth = k + len(cmd), 0
        while j < len(s):
            depth += s[j] == "{"
            depth -= s[j] == "}"
            if depth == 0:
                break
            j += 1
        out.append(s[k + len(cmd) + 1:j])
        i = j + 1


def normalize(answer: str) -> str:
    """The canonical text of an answer (see the module rules)."""
    s = answer.strip()
    inner = last_boxed(s)
    if inner is not None:
        s = inner
    s = s.strip().strip("$").strip()
    for cmd in (r"\text", r"\textbf", r"\mathrm", r"\mathbf"):
        s = _strip_group(s, cmd)
    for junk in (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\ ", "^\\circ",
                 "^{\\circ}", "°", r"\%", "%"):
        s = s.replace(junk, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace("{,}", ",")
    s = "".join(s.split())
    return s.rstrip(".")


_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


# Python refuses to convert integer strings of more than 4,300 digits (a guard against quadratic time).
# An answer that long is compared as text, never as a number: no reference answer is that long.
MAX_NUMBER_CHARS = 1000


def as_number(s: str) -> Fraction | None:
    """A normalised answer as an exact number, or None (also for one too long to convert)."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    sign = 1
    while s[:1] in ("+", "-"):
        sign = -sign if s[0] == "-" else sign
        s = s[1:]
    if re.fullmatch(_NUM, s):
        return sign * Fraction(s)
    m = re.fullmatch(r"\\frac\{(" + _NUM + r")\}\{(" + _NUM + r")\}", s) or \
        re.fullmatch("(" + _NUM + ")/(" + _NUM + ")", s)
    if m:
        den = Fraction(m.group(2))
        return None if den == 0 else sign * Fraction(m.group(1)) / den
    return None


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    # Tuples and intervals: same brackets, same arity, equal elements.
    if len(a) > 1 and len(b) > 1 and a[0] + a[-1] == b[0] + b[-1] and a[0] in "([" and a[-1] in ")]":
        xs, ys = _split_top(a[1:-1]), _split_top(b[1:-1])
        return len(xs) == len(ys) > 1 and all(_equal(p, q) for p, q in zip(xs, ys))
    return False


def answers_equal(answer: str, reference: str) -> bool:
    """Whether an (already extracted) answer matches the reference answer."""
    return _equal(normalize(answer), normalize(reference))


def boxed_reward(response: str, reference: str) -> float:
    """1.0 when the last boxed answer of the response matches the reference, else 0.0."""
    got = last_boxed(response)
    return 1.0 if got is not None and answers_equal(got, reference) else 0.0
