"""The ``deepscaler`` reward: the ``math`` reward, but only for a response that closed its thinking.

Source: upstream slime's ``deepscaler`` rule (after DeepScaleR); graded with ``math`` instead of
upstream's Hendrycks-MATH normaliser (departures: ``docs/design/rewards.md``).
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

    Raises:
        EmptyLabelError: ``label`` is empty or blank (checked even without the marker).
    """
    _, marker, answer_part = response.rpartition(THINK_END)
    # Without the marker nothing is graded; math_reward still checks the label.
    return math_reward(answer_part if marker else "", label, cfg)
