"""Per-request sampling seeds: a rollout's responses as a pure function of the run's flags.

Every request carries ``sampling_params.sampling_seed`` from :func:`sampling_seed`: ``--rollout-seed``, the rollout
id and the request's position in its rollout, nothing else (not the engine, batch or arrival order), so a resumed
run draws what the uninterrupted run would have.  How each engine uses the seed, and the departure from upstream:
``docs/design/rollout_engines.md``.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63
"""Seeds are in ``[0, 2**63)``: a non-negative int64, which SGLang and torch both accept."""

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment, ``2**64 / golden ratio`` (Steele, Lea and Flood 2014)."""


def sampling_seed(rollout_seed: int, rollout_id: int, sample_index: int, stream: str = "train") -> int:
    """One request's seed, an int in ``[0, 2**63)``: BLAKE2b-64 of
    ``"slime-sampling-seed|<stream>|<rollout_seed>|<rollout_id>|<sample_index>"``, top bit cleared.

    Args:
        rollout_seed: ``--rollout-seed``.
        rollout_id: the rollout step (training) or the step an evaluation is logged at.
        sample_index: ``group_index * n_samples_per_prompt + j`` for training, the index in the eval set for an eval.
        stream: ``"train"``, or ``"eval/<name>"`` (an eval never replays the training draws).
    """
    key = f"slime-sampling-seed|{stream}|{rollout_seed}|{rollout_id}|{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> (64 - SEED_BITS)


def uniform(seed: int, position: int) -> float:
    """The uniform number of token ``position`` (0-based) of the request seeded ``seed``: output ``position + 1`` of
    SplitMix64 (Steele, Lea and Flood 2014) started at ``seed`` mod 2**64, a float64 in ``[0, 1)`` (a multiple of
    ``2**-53``), computed directly for any position."""
    z = (seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53
