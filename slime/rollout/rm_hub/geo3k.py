"""The ``geo3k`` reward: ``math``, plus a relative tolerance for answers that differ only by rounding.

Scores 1 when ``math`` does, or when the answers are written at different decimal precision, evaluate
to real numbers ``p`` and ``g`` (gold), and one is a rounding of the other:

    |p - g| <= tol * |g|,    tol = --rm-tolerance, and
    |p - g| <= u / 2,        u = 10^-k, k = the decimal places of the rounded side: the label if it
                             is a plain number, else the answer if it is; if neither is, ``math`` only.

Source: the geo3k RM of upstream slime's ``examples/geo3k_vlm/README.md`` (tolerance 0.05); the rules
with examples: ``docs/design/rewards.md``.
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
    """The most digits after a decimal point in any number of ``answer`` (``"x = 14.1"`` -> 1); 0 if none."""
    return max((len(digits) for digits in _FRACTIONAL_DIGITS.findall(answer)), default=0)


def plain_number_places(parsed: list, answer: str) -> int | None:
    """:func:`decimal_places` of ``answer`` if it parsed to a bare integer or decimal (``x = 14.1`` too), else None."""
    if isinstance(parsed_expression(parsed), (sympy.Integer, sympy.Float)):  # -2.5 parses to Float(-2.5) too
        return decimal_places(answer)
    return None


def geo3k_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """0.0 or 1.0: ``math``, or the tolerance of the module docstring with ``cfg.rm_tolerance`` (relative).

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
