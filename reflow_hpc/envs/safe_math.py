"""A calculator that evaluates model-written arithmetic without running model-written code.

The expression is parsed with :mod:`ast` and walked by a small interpreter that knows only a
whitelist: integer and decimal literals, ``+ - * / // % **`` and unary ``+ -``, and parentheses
(``^`` is read as ``**``). Names, attribute access, calls, subscripts, comparisons, strings and
everything else are rejected before anything is evaluated. Nothing is passed to ``eval``, nothing
is imported and no process is started (the caller may be an MPI rank, which must not fork).

Bounds keep every evaluation small and fast:

- ``max_chars`` on the text (checked before parsing, so the parser's own work is bounded);
- ``max_nodes`` and ``max_depth`` on the syntax tree;
- ``max_exponent`` on ``|exponent|`` of ``**``, and ``max_digits`` on the size of every
  intermediate result (checked *before* a power is computed, so ``9**9**9`` never runs);
- a deadline (a ``time.monotonic()`` value) checked at every node.

Every violation raises :class:`ToolError` with a short message meant to be shown to the model.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass
from typing import Callable


class ToolError(Exception):
    """A calculator input that is rejected or fails; the message is the observation."""


@dataclass(frozen=True)
class Limits:
    max_chars: int = 200
    max_nodes: int = 64
    max_depth: int = 16
    max_exponent: int = 64
    max_digits: int = 40


_BINARY: dict[type, Callable] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

Number = int | float


def _digits(x: Number) -> float:
    """Decimal digits of the integer part (0 for |x| < 1)."""
    if isinstance(x, int):
        return len(str(abs(x))) if x else 0
    return math.log10(abs(x)) + 1 if abs(x) >= 1 else 0


def evaluate(expr: str, limits: Limits = Limits(), deadline: float | None = None) -> Number:
    """Value of a whitelisted arithmetic expression; ToolError on anything else."""
    if len(expr) > limits.max_chars:
        raise ToolError(f"expression longer than {limits.max_chars} characters")
    text = expr.strip().replace("^", "**")
    if not text:
        raise ToolError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("syntax error") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise ToolError(f"expression has more than {limits.max_nodes} parts")
    return _Walker(limits, deadline).value(tree.body, 1)


class _Walker:
    def __init__(self, limits: Limits, deadline: float | None):
        self.limits, self.deadline = limits, deadline

    def value(self, node: ast.AST, depth: int) -> Number:
        if depth > self.limits.max_depth:
            raise ToolError(f"expression nested deeper than {self.limits.max_depth}")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ToolError("timeout")
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ToolError(f"not a number: {v!r}"[:60])
            return self._bounded(v)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.value(node.operand, depth + 1))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a = self.value(node.left, depth + 1)
            b = self.value(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                self._check_power(a, b)
            try:
                out = _BINARY[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except (OverflowError, ValueError):
                raise ToolError("result out of range") from None
            if isinstance(out, complex):
                raise ToolError("result is not a real number")
            return self._bounded(out)
        raise ToolError(f"not allowed: {type(node).__name__}")

    def _check_power(self, base: Number, exp: Number) -> None:
        if abs(exp) > self.limits.max_exponent:
            raise ToolError(f"exponent beyond ±{self.limits.max_exponent}")
        if exp > 0 and abs(base) > 1 and exp * math.log10(abs(base)) >= self.limits.max_digits:
            raise ToolError(f"result longer than {self.limits.max_digits} digits")

    def _bounded(self, x: Number) -> Number:
        if isinstance(x, float) and not math.isfinite(x):
            raise ToolError("result out of range")
        if _digits(x) > self.limits.max_digits:
            raise ToolError(f"result longer than {self.limits.max_digits} digits")
        return x


def format_number(x: Number) -> str:
    """Integers exactly; floats with up to 12 significant digits (integral floats without '.0')."""
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)
