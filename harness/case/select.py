"""``-k EXPRESSION`` for the many-case commands (``list``, ``nightly``), as pytest's: words joined by ``and``,
``or``, ``not`` and parentheses; a word matches a case when it is a substring of the case's name, family or op
(case-insensitive). ``-k model`` picks the model cases; ``-k "fc1 and not control"`` the fc1 cases but controls."""

from __future__ import annotations

import re

SELECT_HELP = ("only the cases EXPRESSION picks, as pytest -k: words (substrings of a case's name, family or op) "
               "joined by and, or, not, parentheses")
TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


class SelectError(ValueError):
    """An expression that does not parse; the message shows it and where."""


def matcher(expression: str):
    """A predicate over cases for `expression` (raises SelectError when it does not parse)."""
    tokens = TOKEN.findall(expression)
    if not tokens or "".join(tokens) != re.sub(r"\s+", "", expression):
        raise SelectError(f"-k {expression!r}: expected words joined by and, or, not and parentheses")
    position = 0

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def either():
        left = both()
        while peek() == "or":
            take()
            right, first = both(), left
            left = lambda keys, a=first, b=right: a(keys) or b(keys)  # noqa: E731
        return left

    def both():
        left = negated()
        while peek() == "and":
            take()
            right, first = negated(), left
            left = lambda keys, a=first, b=right: a(keys) and b(keys)  # noqa: E731
        return left

    def negated():
        if peek() == "not":
            take()
            inner = negated()
            return lambda keys: not inner(keys)
        return atom()

    def atom():
        token = peek()
        if token is None or token in ("and", "or", "not", ")"):
            rest = " ".join(tokens[position:]) or "the end"
            raise SelectError(f"-k {expression!r}: expected a word or '(' at {rest}")
        take()
        if token == "(":
            inner = either()
            if peek() != ")":
                raise SelectError(f"-k {expression!r}: missing ')'")
            take()
            return inner
        word = token.lower()
        return lambda keys: any(word in key for key in keys)

    predicate = either()
    if position != len(tokens):
        raise SelectError(f"-k {expression!r}: unexpected {' '.join(tokens[position:])!r}")
    return lambda case: predicate([case.name.lower(), case.family.lower(), case.op.lower()])


def select(cases, expression: str | None) -> list:
    """The cases `expression` picks (all of them when it is None)."""
    if expression is None:
        return list(cases)
    keep = matcher(expression)
    return [case for case in cases if keep(case)]
