"""The ``math`` reward (the default ``--rm-type``): 1 if the last boxed answer equals the label.

Source: upstream slime's default ``math`` reward model for the geo3k recipe (the seed
README: "we use the default math RM"), graded here with ``math-verify`` (pinned 0.9.0).
math-verify's ``verify`` compares the parsed gold and prediction numerically (rounded to
6 decimals when one side is a decimal, to 15 significant digits otherwise) and then
symbolically (``simplify(gold - pred) == 0``), so ``\\frac{1}{2}`` = ``0.5``,
``\\sqrt{75}`` = ``5\\sqrt{3}``, ``\\frac{5\\pi}{3}`` = ``\\frac{5}{3}\\pi`` and
``60^\\circ`` = ``60``; but ``13.86`` != ``8\\sqrt{3}`` (= 13.8564...).  A ``\\text{...}`` that
holds one math expression is graded as that expression (``\\text{12.6 cm}`` = ``12.6``; see
:func:`~slime.rollout.rm_hub.answer.unwrap_math_text`), while an answer that offers several
values (a hedge such as ``71 \\text{ or } 33`` or ``12\\text{ cm} \\text{ or } 13\\text{ cm}``,
alternatives separated by ``or``, ``and`` or commas) is graded as the set of its alternatives
(:func:`~slime.rollout.rm_hub.answer.answer_alternatives`), so it scores 0 against either value.

The reward is binary, 0.0 or 1.0, on purpose: upstream slime's ``examples/geo3k_vlm/README.md``
("Numerical Precision with Non-Binary Rewards") reports that a 0 / 0.9 "format score" left ``reward - mean``
non-zero in fp32 for groups whose rewards were all equal, which gave a spurious
gradient; 0 and 1 are exact in every float type.
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
    """Whether answer ``predicted`` (bare LaTeX, e.g. a boxed content) equals ``label``.

    Both strings are parsed with :func:`~slime.rollout.rm_hub.answer.parse_latex` and
    compared with ``math_verify.verify(gold, prediction)`` (gold first: math-verify's
    comparison is not symmetric for assignments and relations), with its timeout disabled
    (the scorer times the whole reward call).

    An answer that offers several values (:func:`~slime.rollout.rm_hub.answer.answer_alternatives`:
    ``12\\text{ cm} \\text{ or } 13\\text{ cm}``) is compared as a set: it matches when every
    alternative equals one of the label's (the label split the same way, or the whole label)
    and every one of the label's is given, each pair compared as above.  So a hedge between
    different values scores 0 against a one-value label, whatever units decorate it, while
    ``12 \\text{ or } 12`` is 12 and ``3 \\text{ and } 2`` matches the label ``2, 3``.  An
    alternative that is not math (``12 \\text{ or more}``) makes the answer match nothing.
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
    """1.0 if the last ``\\boxed{}``/``\\fbox{}`` of ``response`` equals ``label``, else 0.0.

    A response without a complete box scores 0.0.  The label is checked first, so an
    empty label raises whatever the response.  ``cfg`` is unused (every reward
    function takes it, so the registry has one signature).

    Args:
        response: the generated text.
        label: the gold answer, bare LaTeX (geo3k: ``5\\sqrt{3}``, ``\\frac{40}{3}``, ``129.9``).
        cfg: the reward flags.

    Returns:
        0.0 or 1.0.

    Raises:
        EmptyLabelError: ``label`` is empty or blank.
    """
    if not label.strip():
        raise EmptyLabelError(f"label {label!r} is empty: every dataset row needs a non-empty answer")
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, label) else 0.0
