"""SGLang's sampler (0.5, ``python/sglang/srt/layers/sampler.py``, pytorch backend) for the transformers engine.

Sampling: ``p = softmax(logits / T)``; top-k keeps the k most likely tokens and top-p the sorted tokens whose mass
*before* them is ``<= top_p`` (both on the same unrenormalised sorted ``p``); one token is drawn from what is kept.
Greedy (``T == 0``) is SGLang's ``top_k = 1`` at ``T = 1``.  Log-probs: ``log_softmax(logits / T)`` of the chosen
token before filtering, float32.  The randomness is one uniform number per row (:func:`slime.rollout.seeds.uniform`).
"""

from __future__ import annotations

import torch

from slime.rollout.engines.base import SamplingParams
from slime.rollout.seeds import SEED_BITS


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by the module's rules: the first kept token (sorted stably, ties by id) whose cumulative
    kept mass exceeds ``u * (kept mass)``.

    Args:
        logits: float32 ``[B, V]``.  temperature: float32 ``[B]``, >= 0 (0: greedy).
        top_p: float32 ``[B]`` in (0, 1].  top_k: int64 ``[B]``; -1 (or >= V) keeps every token.
        uniforms: float64 ``[B]`` in [0, 1) (unused for greedy rows).

    Returns:
        ``(tokens, log_probs)``: int64 ``[B]`` and float32 ``[B]`` (nats, unfiltered, ``T = 1`` for greedy rows).
    """
    vocab = logits.shape[-1]
    greedy = temperature == 0
    log_probs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1), dim=-1)
    tokens = logits.argmax(dim=-1)
    if not greedy.all():
        sorted_probs, order = log_probs.exp().sort(dim=-1, descending=True, stable=True)
        top_k = torch.where(top_k < 0, vocab, top_k)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        rank = torch.arange(vocab, device=logits.device)
        # Both conditions, and p > 0, hold on a prefix of the sorted tokens that has the top token.
        keep = (rank < top_k.unsqueeze(-1)) & (mass_before <= top_p.unsqueeze(-1)) & (sorted_probs > 0)
        cdf = torch.where(keep, sorted_probs, 0.0).double().cumsum(dim=-1)
        threshold = uniforms.to(cdf.device, torch.float64) * cdf[:, -1]
        choice = torch.searchsorted(cdf, threshold.unsqueeze(-1), right=True).squeeze(-1)
        choice = torch.minimum(choice, keep.sum(dim=-1) - 1)  # u * mass rounding up to the mass
        sampled = order.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def check_sampling_params(params: SamplingParams, name: str) -> None:
    """Raise ValueError naming the request and the field when a sampling parameter is out of range."""
    if params.max_new_tokens < 1:
        raise ValueError(f"{name}: max_new_tokens = {params.max_new_tokens}; use at least 1")
    if params.temperature < 0:
        raise ValueError(f"{name}: temperature = {params.temperature}; use > 0 to sample, or 0 for greedy decoding")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"{name}: top_p = {params.top_p} is outside (0, 1]; 1.0 disables nucleus sampling")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"{name}: top_k = {params.top_k}; use a positive k, or -1 to disable top-k")
    seed = params.sampling_seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**SEED_BITS):
        raise ValueError(f"{name}: sampling_seed = {seed!r}; use an int in [0, 2**{SEED_BITS}), or None")
    if params.stop and not all(isinstance(s, str) and s for s in params.stop):
        raise ValueError(f"{name}: stop = {params.stop!r}; every stop string must be a non-empty string")
