"""Reward functions for end-to-end tests, passed as ``--custom-rm-path tests.rewards:<name>``.

Light on purpose (no torch, no slime imports): they run in the reward-scorer worker processes.
"""

from __future__ import annotations

import itertools

_calls = itertools.count()


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


def alternating_reward(response: str, label: str, cfg) -> float:
    """1.0 for every other response this scorer process scores: with one scorer worker (``--rm-num-workers 1``) the
    two samples of every group get different rewards, so every advantage is +-1 and each step moves the weights (a
    random tiny model never earns a real reward), and a weight sync that missed a tensor would show in the
    engine / trainer log-prob gap (``tests/test_megatron_loop.py``)."""
    return float(next(_calls) % 2)


def environment_reward(response: str, label: str, cfg) -> float:
    """``float(os.environ['SLIME_TEST_REWARD'])``: a reward read from the environment, as a judge's URL or an API key
    would be (``tests/test_rm_hub.py``: workers see the driver's environment of when they start)."""
    import os

    return float(os.environ.get("SLIME_TEST_REWARD", "-1"))
