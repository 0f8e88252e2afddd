"""Reward functions for end-to-end tests, passed as ``--custom-rm-path tests.rewards:<name>``.

Light on purpose (no torch, no slime imports): they run in the reward-scorer worker processes.
"""

from __future__ import annotations


def odd_length_reward(response: str, label: str, cfg) -> float:
    """1 if the response has an odd number of characters, else 0: a reward that a random policy
    earns about half the time, so GRPO groups have non-zero advantages and training moves the
    weights (the tiny random model never writes a correct box, so the math reward is always 0)."""
    return float(len(response) % 2)


def boxed_ratio_reward(response: str, label: str, cfg) -> float:
    """A reward function with a bug, for the NaN-reward tests: ``answer / label`` for a response ``\\boxed{<answer>}``
    (integers), NaN when the answer is below the label, +inf for a response without a box."""
    if not (response.startswith("\\boxed{") and response.endswith("}")):
        return float("inf")
    answer = int(response[len("\\boxed{") : -1])
    return float("nan") if answer < int(label) else answer / int(label)
