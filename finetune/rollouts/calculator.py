"""A calculator tool for agents' recipes (`rl.tools: [finetune.rollouts.calculator:calculate]`).

Arithmetic only, read with Python's own parser and evaluated node by node (never `eval`): numbers, + - * / // %
and **, parentheses, unary signs. Anything else, a result past `LARGEST`, or a division by zero raises, which an
episode turns into the `Error: ...` text the model reads (counted as a failed call).
"""

from __future__ import annotations

import ast
import math
import operator

LARGEST = 1e100
"""The largest magnitude a step may reach: a power like 9**9**9 is refused before it is computed."""

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "(12.5 - 3) * 4 ** 2".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and left not in (0, 1, -1) and abs(right) * math.log10(abs(left)) > 100:
            raise ValueError(f"{left} ** {right} is past the calculator's range (1e100)")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > LARGEST:
            raise ValueError(f"{ast.unparse(node)} is past the calculator's range (1e100)")
        return value
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: use numbers, + - * / // % ** and parentheses")
