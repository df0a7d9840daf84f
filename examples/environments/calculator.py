"""A calculator tool for word problems (examples/tool_use_qwen3_1.7b.yaml).

One environment per episode; its public method ``calculate`` is the tool the model sees
(name, docstring and type hints become its schema). Arithmetic only: numbers, + - * / //
% ** and parentheses; anything else, or a result too large, is an error the model reads.
"""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


#: The largest magnitude of any number along the way (a power is refused before it is
#: computed: ((10**64)**64)**64 took seconds, and one more **64 a long time).
LIMIT = 1e100


def _checked(value: float | int) -> float | int:
    if isinstance(value, complex):
        raise ValueError("not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a finite number")
    if abs(value) > LIMIT:
        raise ValueError("result too large")
    return value


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        power = isinstance(node.op, ast.Pow) and left != 0
        if power and right * math.log10(abs(left)) > math.log10(LIMIT):
            raise ValueError("result too large")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


class Calculator:
    """Counts the calls of one episode (``calls``) besides answering them."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **row) -> None:
        self.calls = 0

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) / 7".
        """
        self.calls += 1
        value = _evaluate(ast.parse(expression, mode="eval").body)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(round(value, 6) if isinstance(value, float) else value)
