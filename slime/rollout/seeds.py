"""Per-request sampling seeds: what makes a rollout's responses a pure function of the run's flags.

Every request the rollout manager sends carries ``sampling_params.sampling_seed`` (SGLang's
name), derived by :func:`sampling_seed` from ``--rollout-seed``, the rollout id and the
request's position in its rollout (``group_index * n_samples_per_prompt + j`` for training,
its position in the eval set for evaluation).  A seed depends on nothing else: not on which
engine serves the request, which batch it shares, the order requests arrive in or anything an
engine did before.  So a run resumed with ``--load`` after a crash draws exactly the responses
the uninterrupted run would have drawn (given the same weights and the same logits), without
any engine RNG state in the checkpoint.

Engines turn the seed into random numbers without keeping state between calls:

- ``transformers`` (:mod:`slime.rollout.engines.hf_engine`): token ``t`` of a request is drawn
  by inverse-CDF sampling with the uniform number :func:`uniform` ``(seed, t)``.
- ``sglang``: pass the seed through as ``sampling_params["sampling_seed"]``; SGLang uses it
  (per request, hashed with the token position) when the server runs with
  ``--enable-deterministic-inference`` (``--sglang-enable-deterministic-inference`` here),
  which also makes its kernels batch-invariant.  Without that flag SGLang ignores the seed,
  and resumed runs are as reproducible as its batching allows.

Upstream slime gives SGLang ``rollout_seed + j`` (``j`` the sample's index in its group), the
same seeds at every rollout step; here the rollout id enters the seed too, so that two steps
that see the same prompt do not draw the same responses.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63
"""Seeds are in ``[0, 2**63)``: a non-negative int64, which SGLang and torch both accept."""

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment, ``2**64 / golden ratio`` (Steele, Lea and Flood 2014)."""


def sampling_seed(rollout_seed: int, rollout_id: int, sample_index: int, stream: str = "train") -> int:
    """The sampling seed of one request.

    ``BLAKE2b-64("slime-sampling-seed|<stream>|<rollout_seed>|<rollout_id>|<sample_index>")``
    with the top bit cleared: distinct inputs give independent-looking seeds (a hash, not a
    sum, so ``(seed, rollout 1, sample 0)`` and ``(seed, rollout 0, sample 1)`` do not collide),
    and the value is the same on every machine, Python version and process.

    Args:
        rollout_seed: ``--rollout-seed``.
        rollout_id: the rollout step (training) or the step an evaluation is logged at.
        sample_index: the request's position in its rollout: ``group_index *
            n_samples_per_prompt + j`` for the ``j``-th sample of a prompt, or the index in
            the eval set's sample list.  Never the engine, batch or arrival order.
        stream: what the requests are for: ``"train"``, or ``"eval/<name>"`` for an eval set,
            so that an eval never replays the training draws of the same step.

    Returns:
        An int in ``[0, 2**63)``.
    """
    key = f"slime-sampling-seed|{stream}|{rollout_seed}|{rollout_id}|{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> (64 - SEED_BITS)


def uniform(seed: int, position: int) -> float:
    """The uniform random number of token ``position`` (0-based) of the request seeded ``seed``.

    Output ``position + 1`` of SplitMix64 started at ``seed`` (Steele, Lea and Flood 2014,
    "Fast splittable pseudorandom number generators"): state ``s = seed + (position + 1) *
    0x9E3779B97F4A7C15 mod 2**64``, mixed by SplitMix64's finaliser; the top 53 bits give a
    float64 in ``[0, 1)`` with every value a multiple of ``2**-53``.  Stateless: any position
    is computed directly, so a draw never depends on earlier calls.

    Args:
        seed: a request's seed (any int; taken mod 2**64).
        position: the index of the token being sampled in the response.

    Returns:
        A float in ``[0, 1)``.
    """
    z = (seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53
