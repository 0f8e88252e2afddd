"""The ``math`` reward (the default ``--rm-type``): 1 if the last boxed answer equals the label.

Source: upstream slime's default math reward of the geo3k recipe, graded with ``math-verify`` (pinned
0.9.0), numerically then symbolically; a hedge is graded as the set of its alternatives.  Binary on
purpose.  Details: ``docs/design/rewards.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from math_verify import verify

from slime.rollout.rm_hub.answer import answer_alternatives, last_boxed, parse_latex, parsed_expression

if TYPE_CHECKING:
    from slime.rollout.rm_hub.config import RewardConfig


class EmptyLabelError(ValueError):
    """A label is empty or blank, so no response can match it."""


def answers_match(predicted: str, label: str) -> bool:
    """Whether answer ``predicted`` (bare LaTeX) equals ``label`` under ``math_verify.verify(gold, prediction)``.

    An answer with several values (:func:`~slime.rollout.rm_hub.answer.answer_alternatives`) matches when
    its alternatives and the label's are the same set.
    """
    alternatives = answer_alternatives(predicted)
    if alternatives is None:
        return verify(parse_latex(label), parse_latex(predicted), timeout_seconds=None)
    given = [parse_latex(alternative) for alternative in alternatives]
    if any(parsed_expression(parsed) is None for parsed in given):
        return False
    golds = [parse_latex(gold) for gold in answer_alternatives(label) or [label]]

    def same(gold, parsed) -> bool:
        return verify(gold, parsed, timeout_seconds=None)

    return all(any(same(gold, parsed) for gold in golds) for parsed in given) and all(
        any(same(gold, parsed) for parsed in given) for gold in golds
    )


def math_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """1.0 if the last ``\\boxed{}``/``\\fbox{}`` of ``response`` equals ``label`` (bare LaTeX), else 0.0.

    Raises:
        EmptyLabelError: ``label`` is empty or blank (checked first, whatever the response).
    """
    if not label.strip():
        raise EmptyLabelError(f"label {label!r} is empty: every dataset row needs a non-empty answer")
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, label) else 0.0
