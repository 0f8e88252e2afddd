"""The ``deepscaler`` reward: the ``math`` reward, but only for a response that closed its thinking.

Source: upstream slime's ``deepscaler`` rule-based reward (after DeepScaleR): a response
that does not contain the thinking-end marker ``</think>`` scores 0; otherwise only the
text after the last marker is graded, so a box inside the reasoning does not count.

Departures from upstream: upstream grades with its Hendrycks-MATH string normaliser and a
SymPy grader, here the text after the marker is graded exactly like ``math``
(math-verify, see :mod:`slime.rollout.rm_hub.math_reward`); upstream also accepts a
``###Response`` marker from an older prompt format, which the Qwen3.5 chat format never
produces, so it is not accepted here.

Binary (0.0 / 1.0) for the reason given in :mod:`slime.rollout.rm_hub.math_reward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime.rollout.rm_hub.math_reward import math_reward

if TYPE_CHECKING:
    from slime.rollout.rm_hub.config import RewardConfig

THINK_END = "</think>"
"""The thinking-end marker of Qwen3 / Qwen3.5 (and DeepSeek-R1) chat formats."""


def deepscaler_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """0.0 without ``</think>`` in ``response``; else the ``math`` reward of the text after the last one.

    Args:
        response: the generated text, thinking included.
        label: the gold answer, bare LaTeX.
        cfg: the reward flags (unused; the registry has one signature).

    Returns:
        0.0 or 1.0.

    Raises:
        EmptyLabelError: ``label`` is empty or blank (checked even without the marker).
    """
    _, marker, answer_part = response.rpartition(THINK_END)
    # Without the marker nothing is graded; math_reward still checks the label.
    return math_reward(answer_part if marker else "", label, cfg)
