"""The ``geo3k`` reward: ``math``, plus a relative tolerance for answers that differ only by rounding.

Many Geometry3K labels are rounded to one or two decimals (``129.9`` for ``75\\sqrt{3}`` =
129.904..., ``15.6``, ``6.79``), while a model may give the exact form or round
differently; and the reverse (label ``8\\sqrt{3}``, answer ``13.86``).  math-verify
compares decimals to 6 places, so ``math`` scores those 0.  ``geo3k`` scores 1 when
``math`` does, or when the two answers are **written at different decimal precision**,
evaluate to real numbers ``p`` (prediction) and ``g`` (gold), and differ by no more than
rounding explains:

    |p - g| <= tol * |g|,    tol = --rm-tolerance (default 0.05), and
    |p - g| <= u / 2,        u = 10^-k, k = the decimal places of the coarser plain number.

Precision: the decimal places of an answer are the most digits after a decimal point in
any number it contains (``13.86`` has 2, ``48.0`` 1, ``x = 14.1`` and
``14.1\\text{ cm}`` 1); an integer or an exact expression without a decimal point
(``14``, ``60^\\circ``, ``8\\sqrt{3}``, ``\\frac{40}{3}``, ``\\pi``) has 0.  A *plain
number* is an answer that parses to a bare integer or decimal (``96``, ``13.86``,
``x = 14.1``), not an exact expression (``8\\sqrt{3}``, ``\\frac{40}{3}``).

- Same decimal places (``14.6`` vs ``14.1``, ``96`` vs ``98``, ``8\\sqrt{3}`` vs ``14``):
  ``math`` only.  Neither side is a rounding of the other: two integers, or two decimals
  with the same digits, are the same answer or different ones; and Geometry3K's integer
  labels are exact (its problems ask to round to tenths or hundredths, almost never to
  whole numbers), so ``14`` is not ``8\\sqrt{3}``.  A tolerance here would only accept
  wrong answers, and Geometry3K's multiple-choice distractors are often within 5 % of the
  right option (label ``96``, choices ``94``, ``98``, ``100``; label ``14.6``, choices
  ``14.1``, ``15.1``; label ``105``, choice ``110``).
- Different decimal places (``13.86`` vs ``8\\sqrt{3}``, ``129.9`` vs ``129.904``,
  ``6.79`` vs ``6.8``): one side is a rounded decimal, so the tolerance applies, capped
  at half a unit of the coarser plain number.  The cap is what a rounding can explain
  (``13.86`` stands for [13.855, 13.865]), and it stops a policy from buying the 5 % by
  writing more digits: label ``96`` vs ``94.0`` (cap 0.5), label ``14.6`` vs ``14.10``
  (cap 0.05), label ``8\\sqrt{3}`` = 13.856 vs ``14.5`` (cap 0.05) all score 0.

Counting decimals in the text rather than requiring a plain literal keeps a decorated
decimal (``x = 14.1``, ``14.1\\text{ cm}``) from passing as an exact expression.  Still
accepted, as roundings of each other: label ``8.6`` vs ``9``, label ``12`` vs ``11.5``
(|p - g| = u / 2 exactly).  Not accepted: a label that was itself rounded in the middle of
a calculation and lies more than half a unit from the exact value.

Source: the seed README's "geo3k-specific RM with tolerance=0.05 (to handle rounding in
ground truth labels)", which upstream compared with a strict one (tolerance 0.0) and with
the default ``math`` reward and found all three to train alike.  With ``tol = 0`` this
reward is exactly ``math`` (no float comparison at all).  With ``g = 0`` the test reduces
to ``p == 0``.

Unlike upstream's geo3k verifier, there is no 0.1 "format score": the reward is binary
(0.0 / 1.0) for the reason given in :mod:`slime.rollout.rm_hub.math_reward`.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import sympy

from slime.rollout.rm_hub.answer import last_boxed, numeric_value, parse_latex
from slime.rollout.rm_hub.math_reward import math_reward

if TYPE_CHECKING:
    from slime.rollout.rm_hub import RewardConfig

_FRACTIONAL_DIGITS = re.compile(r"\d*\.(\d+)")
"""A decimal number (``13.86``, ``.5``); group 1 is its fractional digits."""


def decimal_places(answer: str) -> int:
    """The most digits after a decimal point in any number of ``answer``; 0 if it has none.

    ``"13.86"`` -> 2, ``"48.0"`` -> 1, ``"x = 14.1"`` -> 1, ``"14"`` -> 0,
    ``"8\\sqrt{3}"`` -> 0, ``"60^\\circ"`` -> 0.
    """
    return max((len(digits) for digits in _FRACTIONAL_DIGITS.findall(answer)), default=0)


def plain_number_places(parsed: list, answer: str) -> int | None:
    """:func:`decimal_places` of ``answer`` if it parsed (``parsed``, from
    :func:`~slime.rollout.rm_hub.answer.parse_latex`) to a bare integer or decimal, an
    assignment ``x = 14.1`` included; None for an exact expression (``8\\sqrt{3}``,
    ``\\frac{40}{3}``) or anything else."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    if isinstance(expr, sympy.Eq):
        expr = expr.rhs
    if isinstance(expr, (sympy.Integer, sympy.Float)):  # -2.5 parses to Float(-2.5) too
        return decimal_places(answer)
    return None


def geo3k_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """1.0 if ``math`` gives 1.0, or the boxed answer and the label are at different decimal
    precision and within ``cfg.rm_tolerance`` (relative) and half a rounding unit of each other.

    Numbers come from math-verify's parse and SymPy ``evalf``
    (:func:`~slime.rollout.rm_hub.answer.numeric_value`), never from ``eval`` of text;
    an answer that is not a single real number (a set, a symbol, text) gets only the
    ``math`` verdict, and so does an answer with as many decimal places as the label
    (:func:`decimal_places`; see the module docstring).

    Args:
        response: the generated text.
        label: the gold answer, bare LaTeX (e.g. ``129.9`` or ``8\\sqrt{3}``).
        cfg: the reward flags; uses ``rm_tolerance`` (relative, dimensionless).

    Returns:
        0.0 or 1.0.

    Raises:
        EmptyLabelError: ``label`` is empty or blank.
    """
    exact = math_reward(response, label, cfg)
    if exact == 1.0 or cfg.rm_tolerance == 0:
        return exact
    predicted = last_boxed(response)
    if predicted is None or decimal_places(predicted) == decimal_places(label):
        return 0.0
    p_parsed, g_parsed = parse_latex(predicted), parse_latex(label)
    p, g = numeric_value(p_parsed), numeric_value(g_parsed)
    if p is None or g is None:
        return 0.0
    error = abs(p - g)
    plain = [k for k in (plain_number_places(p_parsed, predicted), plain_number_places(g_parsed, label)) if k is not None]
    half_unit = 0.5 * 10.0 ** -min(plain) if plain else math.inf
    # The 1e-9 slack keeps |p - g| = u / 2 exactly (12 vs 11.5) from failing on float error.
    return 1.0 if error <= cfg.rm_tolerance * abs(g) and error <= half_unit * (1 + 1e-9) else 0.0
