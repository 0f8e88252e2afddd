"""The ``geo3k`` reward: ``math``, plus a relative tolerance for labels that are rounded decimals.

Many Geometry3K labels are rounded to one or two decimals (``129.9`` for ``75\\sqrt{3}`` =
129.904..., ``15.6``, ``6.79``), while a model may give the exact form or round
differently; and the reverse (label ``8\\sqrt{3}``, answer ``13.86``).  math-verify
compares decimals to 6 places, so ``math`` scores those 0.  ``geo3k`` scores 1 when
``math`` does, or when both answers evaluate to real numbers ``p`` (prediction) and ``g``
(gold) with

    |p - g| <= tol * |g|,    tol = --rm-tolerance (default 0.05).

Source: the seed README's "geo3k-specific RM with tolerance=0.05 (to handle rounding in
ground truth labels)", which upstream compared with a strict one (tolerance 0.0) and with
the default ``math`` reward and found all three to train alike.  With ``tol = 0`` this
reward is exactly ``math`` (no float comparison at all).  With ``g = 0`` the test reduces
to ``p == 0``.

Unlike upstream's geo3k verifier, there is no 0.1 "format score": the reward is binary
(0.0 / 1.0) for the reason given in :mod:`slime.rollout.rm_hub.math_reward`.  A 5 %
tolerance can accept a wrong multiple-choice option that lies within 5 % of the right
one; this is the recipe's trade-off, and ``--rm-tolerance 0`` avoids it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime.rollout.rm_hub.answer import last_boxed, numeric_value, parse_latex
from slime.rollout.rm_hub.math_reward import math_reward

if TYPE_CHECKING:
    from slime.rollout.rm_hub import RewardConfig


def geo3k_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """1.0 if ``math`` gives 1.0, or the boxed answer is within ``cfg.rm_tolerance`` (relative) of the label.

    Numbers come from math-verify's parse and SymPy ``evalf``
    (:func:`~slime.rollout.rm_hub.answer.numeric_value`), never from ``eval`` of text;
    an answer that is not a single real number (a set, a symbol, text) gets only the
    ``math`` verdict.

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
    if predicted is None:
        return 0.0
    p = numeric_value(parse_latex(predicted))
    g = numeric_value(parse_latex(label))
    if p is None or g is None:
        return 0.0
    return 1.0 if abs(p - g) <= cfg.rm_tolerance * abs(g) else 0.0
