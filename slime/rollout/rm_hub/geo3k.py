"""The ``geo3k`` reward: ``math``, plus a relative tolerance for answers that differ only by rounding.

Many Geometry3K labels are rounded to one or two decimals (``129.9`` for ``75\\sqrt{3}`` =
129.904..., ``15.6``, ``6.79``), while a model may give the exact form or round
differently; and the reverse (label ``8\\sqrt{3}``, answer ``13.86``).  math-verify
compares decimals to 6 places, so ``math`` scores those 0.  ``geo3k`` scores 1 when
``math`` does, or when the two answers are **written at different decimal precision**,
evaluate to real numbers ``p`` (prediction) and ``g`` (gold), and one is a rounding of
the other at the rounded side's precision:

    |p - g| <= tol * |g|,    tol = --rm-tolerance (default 0.05), and
    |p - g| <= u / 2,        u = 10^-k, k = the decimal places of the *rounded side*:
                             the label if it is a plain number, else the answer if it
                             is; if neither is, ``math`` only.

Precision: the decimal places of an answer are the most digits after a decimal point in
any number it contains (``13.86`` has 2, ``48.0`` 1, ``x = 14.1`` and
``14.1\\text{ cm}`` 1); an integer or an exact expression without a decimal point
(``14``, ``60^\\circ``, ``8\\sqrt{3}``, ``\\frac{40}{3}``, ``\\pi``) has 0.  A *plain
number* is an answer that parses to a bare integer or decimal (``96``, ``13.86``,
``x = 14.1``), not an expression (``8\\sqrt{3}``, ``\\frac{40}{3}``, ``14\\cdot1.0``).

- Same decimal places (``14.6`` vs ``14.1``, ``96`` vs ``98``, ``8\\sqrt{3}`` vs ``14``):
  ``math`` only.  Neither side is a rounding of the other: two integers, or two decimals
  with the same digits, are the same answer or different ones; and Geometry3K's integer
  labels are exact (its problems ask to round to tenths or hundredths, almost never to
  whole numbers), so ``14`` is not ``8\\sqrt{3}``.  Geometry3K's multiple-choice
  distractors are often within 5 % of the right option (label ``96``, choices ``94``,
  ``98``, ``100``; label ``14.6``, choices ``14.1``, ``15.1``; label ``105``, choice ``110``).
- Label a plain number (``129.9``, ``14.6``, ``96``): the answer must round to it at the
  label's precision, the precision the problem asked for ("round to the nearest
  tenth").  ``75\\sqrt{3}`` = 129.904 and ``129.904`` score 1 for ``129.9``; ``15``
  (rounded further), ``14.10`` or ``14.5`` for ``14.6``, and ``94.0`` for ``96`` score 0,
  so neither dropping nor adding digits buys a tolerance.  ``96.4`` for ``96`` scores 1.
- Label exact (``8\\sqrt{3}`` = 13.856): the answer must be a plain decimal that is a
  rounding of it at its own precision: ``13.86`` and ``13.9`` score 1, ``13.8`` and
  ``14.5`` score 0; an expression with a decimal in it (``14\\cdot1.0``,
  ``8.1\\sqrt{3}``) gets ``math`` only.

Counting decimals in the text rather than requiring a plain literal keeps a decorated
decimal (``x = 14.1``, ``14.1\\text{ cm}``) from passing as an exact expression.
Accepted at the edge: label ``12`` vs ``11.5`` or ``12.5`` (|p - g| = u / 2 exactly).  Not
accepted: a label that was itself rounded in the middle of a calculation and lies more
than half a unit from the exact value.

Source: upstream slime's ``examples/geo3k_vlm/README.md``, its "geo3k-specific RM with
tolerance=0.05 (to handle rounding in ground truth labels)", which upstream compared with a strict one (tolerance 0.0) and with
the default ``math`` reward and found all three to train alike.  With ``tol = 0`` this
reward is exactly ``math`` (no float comparison at all).  With ``g = 0`` the test reduces
to ``p == 0``.

Unlike upstream's geo3k verifier, there is no 0.1 "format score": the reward is binary
(0.0 / 1.0) for the reason given in :mod:`slime.rollout.rm_hub.math_reward`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import sympy

from slime.rollout.rm_hub.answer import answer_alternatives, last_boxed, numeric_value, parse_latex, parsed_expression
from slime.rollout.rm_hub.math_reward import math_reward

if TYPE_CHECKING:
    from slime.rollout.rm_hub.config import RewardConfig

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
    if isinstance(parsed_expression(parsed), (sympy.Integer, sympy.Float)):  # -2.5 parses to Float(-2.5) too
        return decimal_places(answer)
    return None


def geo3k_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """1.0 if ``math`` gives 1.0, or the boxed answer and the label are at different decimal
    precision, within ``cfg.rm_tolerance`` (relative) of each other, and one rounds to the
    other (within half a unit of the label's last digit, or the answer's when the label is exact).

    Numbers come from math-verify's parse and SymPy ``evalf``
    (:func:`~slime.rollout.rm_hub.answer.numeric_value`), never from ``eval`` of text;
    an answer that is not a single real number (a set, a symbol, text, several alternatives
    as :func:`~slime.rollout.rm_hub.answer.answer_alternatives` finds them) gets only the
    ``math`` verdict, and so does an answer with as many decimal places as the label
    (:func:`decimal_places`) or a pair where neither side is a plain number (see the
    module docstring).

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
    if answer_alternatives(predicted) is not None:
        return 0.0  # several values (a hedge): ``math``'s set comparison only, no tolerance
    p_parsed, g_parsed = parse_latex(predicted), parse_latex(label)
    p, g = numeric_value(p_parsed), numeric_value(g_parsed)
    if p is None or g is None:
        return 0.0
    # The rounded side sets the precision: the label if it is a plain number, else the answer.
    places = plain_number_places(g_parsed, label)
    if places is None:
        places = plain_number_places(p_parsed, predicted)
    if places is None:
        return 0.0  # two expressions: no side is a rounding
    error = abs(p - g)
    half_unit = 0.5 * 10.0**-places
    # The 1e-9 slack keeps |p - g| = u / 2 exactly (12 vs 11.5) from failing on float error.
    return 1.0 if error <= cfg.rm_tolerance * abs(g) and error <= half_unit * (1 + 1e-9) else 0.0
