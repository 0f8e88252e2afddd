"""Reward functions ("reward models"), registered by name and selected with ``--rm-type``.

Every reward function has one signature, ``fn(response: str, label: str, cfg:
RewardConfig) -> float``, and is registered in :data:`.config.REWARD_FUNCTIONS`:

``math`` (default)
    1.0 if the last ``\\boxed{}``/``\\fbox{}`` of the response equals the label under
    math-verify, else 0.0 (:mod:`.math_reward`; upstream slime's default math RM).
``deepscaler``
    0.0 unless the response contains ``</think>``; then ``math`` on the text after the
    last one (:mod:`.deepscaler`; upstream slime's DeepScaleR rule).
``geo3k``
    ``math``, or 1.0 when the answers are numbers written at different decimal precision
    whose difference is within ``--rm-tolerance`` relative error and one rounds to the
    other, for Geometry3K's rounded labels (:mod:`.geo3k`; the geo3k RM of upstream slime's
    ``examples/geo3k_vlm/README.md``).
``package.module:function``
    a user function with the same signature, given as ``--rm-type`` or (overriding it)
    ``--custom-rm-path``.

All built-in rewards are binary (0.0 / 1.0): non-binary rewards such as 0 / 0.9 are not
exact in fp32 and left a spurious ``reward - mean`` in groups of equal rewards (seed
README, "Numerical Precision with Non-Binary Rewards").

Rewards are computed in batches by :class:`.scorer.RewardScorer`: a pool of
worker processes that runs each call under a timeout, because math-verify / SymPy can run
for ever on answers such as ``9^{9^{9^{9^{9}}}}``.  ``python -m slime.rollout.rm_hub``
scores responses from the command line (:mod:`.__main__`).
"""
