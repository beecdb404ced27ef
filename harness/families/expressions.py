"""The small expressions a ``family.toml`` writes over its config keys (``hidden_size // num_attention_heads``,
``'per_head' if use_qk_norm else 'none'``): Python's own syntax, read by ``ast`` and evaluated over names, numbers,
strings, arithmetic, comparisons, ``and``/``or``/``not``, ``x if c else y``, a comprehension over one loop, an item
(``mlp_layer_types[i]``; no slices), and ``int``, ``len``, ``range``, ``set``, ``all``, ``min``, ``max`` only: a
family file states relations between keys and never runs code."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b}
CALLS = {"int": int, "len": len, "range": range, "set": set, "all": all, "min": min, "max": max}


class ExpressionError(ValueError):
    """An expression the evaluator refuses, or that names a key the config lacks."""


def evaluate(text: str, names: Mapping):
    """`text`'s value with `names` (a config's values) for its names."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"not an expression: {text!r} ({error.msg})") from None
    return _value(tree.body, names, text)


def _value(node, names, text):
    def value(n):
        return _value(n, names, text)

    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ExpressionError(f"{text!r} names {node.id!r}, which the config has not")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return BINARY[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        return not value(node.operand) if isinstance(node.op, ast.Not) else -value(node.operand)
    if isinstance(node, ast.BoolOp):
        values = (value(v) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
        left = value(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = value(right_node)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return value(node.body) if value(node.test) else value(node.orelse)
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(value(e) for e in node.elts)
    if isinstance(node, (ast.GeneratorExp, ast.ListComp)) and len(node.generators) == 1 \
            and isinstance(node.generators[0].target, ast.Name):
        loop = node.generators[0]
        scopes = ({**names, loop.target.id: item} for item in value(loop.iter))
        return [_value(node.elt, scope, text) for scope in scopes
                if all(_value(test, scope, text) for test in loop.ifs)]
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
        return value(node.value)[value(node.slice)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLS and not node.keywords:
        return CALLS[node.func.id](*(value(a) for a in node.args))
    raise ExpressionError(f"{text!r}: {ast.unparse(node)!r} is not allowed in a family expression")
