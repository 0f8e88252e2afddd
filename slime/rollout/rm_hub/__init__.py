"""Reward functions, ``fn(response, label, cfg) -> float``, registered in :data:`.config.REWARD_FUNCTIONS`.

Built-ins: ``math`` (default), ``deepscaler``, ``geo3k``, all binary; scored in worker processes under a
timeout by :class:`.scorer.RewardScorer`; ``python -m slime.rollout.rm_hub`` scores from the command
line.  What each does and why: ``docs/design/rewards.md``.
"""
