"""Countdown-style arithmetic: the built-in default task.

A prompt ``abc>TT:`` gives three digits ``a b c`` (1-9, repeats allowed) and a target ``TT`` (1-99,
always written with two digits, so every prompt is exactly 7 characters). The answer is an expression
over two or three of the digits, each digit used at most once (a digit that appears twice in the
prompt may be used twice), with ``+ - *`` and parentheses. Numbers are single digits: ``35`` is not
allowed, and there is no unary minus. The reward is 1.0 iff the expression evaluates to the target.

Expressions are checked by a tiny recursive-descent parser (never ``eval``), with a cap on the
length and the nesting depth, so that the verifier never raises on garbage.

Only (digits, target) pairs with at least one solution are ever prompted. The validation prompts are
drawn, per seed, from a fixed *held-out pool* (about 1/8 of all pairs, chosen by a stable hash of the
prompt). The built-in base policy is fine-tuned only on pairs outside that pool, so its validation
numbers are clean for every split seed.

Canonical form (for counting distinct correct answers), two modes:

- ``"syntactic"`` (default): the parsed expression printed back with minimal parentheses. Whitespace
  and redundant parentheses go, so ``(3*8)``, `` 3 * 8`` and ``3*(8)`` are one answer, and so are
  ``3+(5+8)`` and ``3+5+8``; but ``3*8`` and ``8*3`` are two. This matches how the feasibility study
  counted distinct answers (the policy's different ways of writing a solution).
- ``"algebraic"``: additive chains flattened into signed terms and multiplicative chains into factors,
  each sorted, then printed with minimal parentheses. ``3+5`` and ``5+3`` are one answer, and so are
  ``8-(3-5)`` and ``5+8-3``. Two answers share it exactly when they are the same sum of products of
  the same digits, up to reordering and regrouping. On validation there are ~1.25 algebraically
  distinct solutions per prompt against ~3.7 syntactic ones.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from functools import lru_cache
from typing import Any

from entropy_rft.tasks.base import Example, Task, int_param

OPS = "+-*"
MAX_EXPR_CHARS = 64
MAX_DEPTH = 16
CANONICAL_MODES = ("syntactic", "algebraic")
_PROMPT_RE = re.compile(r"^([1-9])([1-9])([1-9])>(\d\d):$")

# An expression tree: ("n", digit) or (op, left, right).
Node = tuple[Any, ...]


class ParseError(ValueError):
    """The text is not a valid expression."""


# ----------------------------------------------------------------------------- parsing


def parse_expression(text: str) -> Node:
    """Parse ``text`` (single digits, ``+ - *``, parentheses; whitespace ignored) into a tree.

    Raises :class:`ParseError` on anything else, including numbers of two or more digits, unary
    minus, empty input, overlong input or nesting deeper than ``MAX_DEPTH``.
    """
    s = "".join(text.split())
    if not s:
        raise ParseError("empty expression")
    if len(s) > MAX_EXPR_CHARS:
        raise ParseError("expression too long")
    pos = 0

    def peek() -> str:
        return s[pos] if pos < len(s) else ""

    def expr(depth: int) -> Node:
        nonlocal pos
        node = term(depth)
        while peek() in ("+", "-") and peek():
            op = s[pos]
            pos += 1
            node = (op, node, term(depth))
        return node

    def term(depth: int) -> Node:
        nonlocal pos
        node = factor(depth)
        while peek() == "*":
            pos += 1
            node = ("*", node, factor(depth))
        return node

    def factor(depth: int) -> Node:
        nonlocal pos
        if depth > MAX_DEPTH:
            raise ParseError("nesting too deep")
        c = peek()
        if c == "(":
            pos += 1
            node = expr(depth + 1)
            if peek() != ")":
                raise ParseError(f"expected ')' at {pos}")
            pos += 1
            return node
        if c.isdigit() and c.isascii():
            pos += 1
            if peek().isdigit():
                raise ParseError("numbers must be single digits")
            return ("n", int(c))
        raise ParseError(f"unexpected {c!r} at {pos}" if c else "unexpected end")

    node = expr(0)
    if pos != len(s):
        raise ParseError(f"unexpected {s[pos]!r} at {pos}")
    return node


def evaluate(node: Node) -> int:
    """The integer value of an expression tree."""
    if node[0] == "n":
        return node[1]
    a, b = evaluate(node[1]), evaluate(node[2])
    if node[0] == "+":
        return a + b
    if node[0] == "-":
        return a - b
    return a * b


def leaves(node: Node) -> list[int]:
    """The digits an expression uses, left to right."""
    if node[0] == "n":
        return [node[1]]
    return leaves(node[1]) + leaves(node[2])


def uses_allowed_digits(used: list[int], digits: tuple[int, ...], min_operands: int = 2) -> bool:
    """Whether ``used`` is a sub-multiset of ``digits`` with at least ``min_operands`` elements."""
    if len(used) < min_operands or len(used) > len(digits):
        return False
    pool = list(digits)
    for d in used:
        if d not in pool:
            return False
        pool.remove(d)
    return True


# ----------------------------------------------------------------------------- printing


def _prec(node: Node) -> int:
    return 3 if node[0] == "n" else (2 if node[0] == "*" else 1)


def render(node: Node) -> str:
    """Print a tree with the minimal parentheses that keep its meaning."""
    if node[0] == "n":
        return str(node[1])
    op, left, right = node
    p = _prec(node)
    ls = render(left)
    rs = render(right)
    if _prec(left) < p:
        ls = f"({ls})"
    if _prec(right) < p or (op == "-" and _prec(right) == p):
        rs = f"({rs})"
    return f"{ls}{op}{rs}"


def _signed_terms(node: Node, sign: int, out: list[tuple[int, Node]]) -> None:
    if node[0] in ("+", "-"):
        _signed_terms(node[1], sign, out)
        _signed_terms(node[2], sign if node[0] == "+" else -sign, out)
    else:
        out.append((sign, node))


def _factors(node: Node, out: list[Node]) -> None:
    if node[0] == "*":
        _factors(node[1], out)
        _factors(node[2], out)
    else:
        out.append(node)


def canonical_form(node: Node) -> str:
    """Normal form of a tree: flattened, sorted sums and products, minimal parentheses."""
    if node[0] == "n":
        return str(node[1])
    if node[0] == "*":
        fs: list[Node] = []
        _factors(node, fs)
        parts = sorted(f"({canonical_form(f)})" if f[0] in "+-" else canonical_form(f) for f in fs)
        return "*".join(parts)
    terms: list[tuple[int, Node]] = []
    _signed_terms(node, 1, terms)
    pos = sorted(canonical_form(t) for s, t in terms if s > 0)
    neg = sorted(canonical_form(t) for s, t in terms if s < 0)
    return "+".join(pos) + "".join(f"-{t}" for t in neg)


# ----------------------------------------------------------------------------- enumeration


@lru_cache(maxsize=1024)
def expressions(digits: tuple[int, ...]) -> tuple[str, ...]:
    """Every distinct expression string (minimal parentheses) over 2 or 3 of ``digits``.

    Sorted, so the result is deterministic. About 110-130 expressions for three distinct digits.
    """
    out: set[str] = set()
    idx = range(len(digits))
    for a, b in itertools.permutations(idx, 2):
        for o in OPS:
            out.add(render((o, ("n", digits[a]), ("n", digits[b]))))
    for a, b, c in itertools.permutations(idx, 3):
        x, y, z = ("n", digits[a]), ("n", digits[b]), ("n", digits[c])
        for o1, o2 in itertools.product(OPS, OPS):
            out.add(render((o2, (o1, x, y), z)))
            out.add(render((o1, x, (o2, y, z))))
    return tuple(sorted(out))


@lru_cache(maxsize=1024)
def values(digits: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    """Map each reachable value to the expressions (from :func:`expressions`) that give it."""
    by_value: dict[int, list[str]] = {}
    for e in expressions(digits):
        by_value.setdefault(evaluate(parse_expression(e)), []).append(e)
    return {v: tuple(es) for v, es in by_value.items()}


def format_prompt(digits: tuple[int, ...], target: int) -> str:
    """``(3, 5, 8), 24 -> '358>24:'``."""
    return "".join(str(d) for d in digits) + f">{target:02d}:"


def parse_prompt(prompt: str) -> tuple[tuple[int, ...], int]:
    """Inverse of :func:`format_prompt`. Raises ``ValueError`` on a malformed prompt."""
    m = _PROMPT_RE.match(prompt.strip())
    if not m:
        raise ValueError(f"not a countdown prompt: {prompt!r}")
    return (int(m[1]), int(m[2]), int(m[3])), int(m[4])


@lru_cache(maxsize=8)
def _all_pairs(max_target: int) -> tuple[tuple[tuple[int, ...], int], ...]:
    pairs = []
    for digits in itertools.product(range(1, 10), repeat=3):
        for t in sorted(values(digits)):
            if 1 <= t <= max_target:
                pairs.append((digits, t))
    return tuple(pairs)


def _held_out(prompt: str, modulus: int) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h % modulus == 0


# ----------------------------------------------------------------------------- the task


class CountdownTask(Task):
    """Countdown over three digits 1-9 and a target 1-``max_target``.

    Args:
        n_val: validation prompts per split (drawn from the held-out pool).
        max_target: largest target (at most 99, so it fits two characters).
        holdout_mod: about 1/``holdout_mod`` of all pairs form the held-out pool.
        canonical_mode: ``"syntactic"`` or ``"algebraic"``, see the module docstring.
    """

    name = "countdown"
    max_response_tokens = 16

    def __init__(
        self,
        n_val: int = 256,
        max_target: int = 99,
        holdout_mod: int = 8,
        canonical_mode: str = "syntactic",
    ) -> None:
        n_val, max_target, holdout_mod = (int_param("countdown", k, v) for k, v in
                                          (("n_val", n_val), ("max_target", max_target), ("holdout_mod", holdout_mod)))
        if canonical_mode not in CANONICAL_MODES:
            raise ValueError(
                f"countdown: canonical_mode must be one of {CANONICAL_MODES}, got {canonical_mode!r}"
            )
        if not 1 <= max_target <= 99:
            raise ValueError(f"countdown: max_target must be in 1..99, got {max_target}")
        if holdout_mod < 2:
            raise ValueError(f"countdown: holdout_mod must be >= 2, got {holdout_mod}")
        self.n_val = int(n_val)
        self.max_target = int(max_target)
        self.holdout_mod = int(holdout_mod)
        self.canonical_mode = canonical_mode
        self._normalise = render if canonical_mode == "syntactic" else canonical_form
        pool = self.held_out_pool()
        if not 0 < self.n_val <= len(pool):
            raise ValueError(f"countdown: n_val must be in 1..{len(pool)}, got {n_val}")

    # -- data
    def example(self, digits: tuple[int, ...], target: int) -> Example:
        """The example for one (digits, target) pair."""
        sols = values(digits).get(target, ())
        n_sol = len({self._normalise(parse_expression(e)) for e in sols})
        return Example(
            prompt=format_prompt(digits, target),
            answer=target,
            meta={"digits": tuple(digits), "target": target, "n_solutions": n_sol},
        )

    def all_pairs(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Every (digits, target) pair with at least one solution, in a fixed order."""
        return _all_pairs(self.max_target)

    def held_out_pool(self) -> list[tuple[tuple[int, ...], int]]:
        """Pairs that validation may draw from; the base policy never trains on them."""
        return [p for p in self.all_pairs() if _held_out(format_prompt(*p), self.holdout_mod)]

    def sft_pairs(self) -> list[tuple[tuple[int, ...], int]]:
        """Pairs outside the held-out pool: the base policy's SFT data comes only from these."""
        return [p for p in self.all_pairs() if not _held_out(format_prompt(*p), self.holdout_mod)]

    def split(self, seed: int) -> tuple[list[Example], list[Example]]:
        """``n_val`` validation pairs sampled from the held-out pool; train is every other pair.

        Both lists are shuffled with ``random.Random(seed)``; the result depends only on the seed.
        """
        rng = random.Random(seed)
        val_pairs = rng.sample(self.held_out_pool(), self.n_val)
        val_set = set(val_pairs)
        train_pairs = [p for p in self.all_pairs() if p not in val_set]
        rng.shuffle(train_pairs)
        return [self.example(*p) for p in train_pairs], [self.example(*p) for p in val_pairs]

    # -- verifier
    @staticmethod
    def _digits_target(example: Example) -> tuple[tuple[int, ...], int]:
        digits = example.meta.get("digits") if isinstance(example.meta, dict) else None
        if digits is None:
            return parse_prompt(example.prompt)
        return tuple(digits), int(example.answer)

    def _valid_tree(self, response: str, example: Example) -> Node | None:
        try:
            node = parse_expression(str(response))
            digits, _ = self._digits_target(example)
        except (ParseError, ValueError, TypeError):
            return None
        if not uses_allowed_digits(leaves(node), digits):
            return None
        return node

    def reward(self, response: str, example: Example) -> float:
        """1.0 iff ``response`` is a valid expression over the prompt's digits equal to the target."""
        node = self._valid_tree(response, example)
        if node is None:
            return 0.0
        try:
            return 1.0 if evaluate(node) == self._digits_target(example)[1] else 0.0
        except (ValueError, TypeError):
            return 0.0

    def canonical(self, response: str, example: Example) -> str | None:
        """The canonical form (module docstring) of a valid expression, else ``None``."""
        node = self._valid_tree(response, example)
        return None if node is None else self._normalise(node)

    def solutions(self, example: Example) -> list[str]:
        """All correct expression strings (minimal parentheses) for ``example``, sorted."""
        digits, target = self._digits_target(example)
        return list(values(digits).get(target, ()))
