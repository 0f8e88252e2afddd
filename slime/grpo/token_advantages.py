"""Per-token advantages of one micro-batch, from the per-sample ones of :mod:`slime.grpo.advantages`.

Layouts of :mod:`slime.grpo.loss` (padded ``[B, T]``, or packed ``[T]`` with ``cu_seqlens``); log-probs in nats;
float32 (float64 kept); no gradient flows (advantages are constants of the loss).  Two stages, in order:

1. each sample's advantage on each of its tokens, minus ``--kl-coef`` times the token's k1 estimate of
   KL(pi_old || pi_ref); with ``reinforce_plus_plus`` instead the token's discounted return (REINFORCE++,
   Hu 2025, arXiv:2501.03262, eq. 7-8; upstream slime's ``get_reinforce_plus_plus_returns``): the token rewards
   are ``-kl_coef * k1`` on every loss-masked token plus the sample's reward on its last one, summed over the
   later positions with ``--gamma`` per position;
2. with ``--normalize-advantages``, whitened with the rollout step's mean and unbiased variance over every
   loss-masked token of every data-parallel rank (:class:`Whitening`, upstream's ``distributed_masked_whiten``,
   epsilon 1e-8), gathered once per rollout by the training step (:func:`rollout_whitening`).

Sources and departures from upstream: ``docs/design/grpo.md``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from slime.grpo.config import GRPOConfig
from slime.grpo.layout import as_float, check_layout, check_same_shape, log_ratio, spread_per_sample

if TYPE_CHECKING:
    from slime.data.sample import Sample

WHITEN_EPS = 1e-8
"""Added to the variance under the square root (upstream's ``distributed_masked_whiten``)."""
CHUNK = 128
"""Positions per block of :func:`reverse_discounted_cumsum` (a matrix product within, a carry between blocks)."""


def per_token_advantages(
    advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None = None
) -> Tensor:
    """Each sample's advantage ``[S]`` on each of its tokens, in ``loss_mask``'s shape (0 after ``cu_seqlens[-1]``).

    Raises:
        ValueError: ``advantages`` is not ``[S]``, or a malformed layout / ``cu_seqlens``.
    """
    try:
        return spread_per_sample(advantages, loss_mask, cu_seqlens)
    except ValueError as e:
        raise ValueError(f"advantages: {e}") from None


def apply_kl_penalty_to_advantages(
    advantages: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor, kl_coef: float, loss_mask: Tensor | None = None
) -> Tensor:
    """``A_t - kl_coef * (log pi_old(y_t) - log pi_ref(y_t))`` per token (``--kl-coef``; k1 of KL(pi_old || pi_ref)).

    Masked tokens keep their advantage; float32 (float64 kept), ``advantages``' shape.

    Raises:
        ValueError: ``kl_coef < 0`` or shapes differ.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef (--kl-coef) must be >= 0, got {kl_coef}")
    check_same_shape(advantages=advantages, old_log_probs=old_log_probs)
    return as_float(advantages) - kl_coef * log_ratio(old_log_probs, ref_log_probs, loss_mask)


def reverse_discounted_cumsum(x: Tensor, gamma: float) -> Tensor:
    """``y_t = sum_{k >= t} gamma^(k - t) x_k`` along the last dim of ``x`` ``[..., L]`` (same shape and dtype), in
    blocks of :data:`CHUNK` positions: no ``gamma^-t`` factor, so no overflow for long sequences and small ``gamma``."""
    if gamma == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    length = x.shape[-1]
    idx = torch.arange(min(CHUNK, max(length, 1)), device=x.device)
    lag = (idx[None, :] - idx[:, None]).to(x.dtype)  # M[t, k] = gamma^(k - t) for k >= t
    block = torch.where(lag >= 0, torch.tensor(gamma, dtype=x.dtype, device=x.device) ** lag.clamp(min=0), 0.0)
    out = torch.empty_like(x)
    carry = x.new_zeros(x.shape[:-1])
    for start in reversed(range(0, length, CHUNK)):
        c = min(CHUNK, length - start)
        decay = gamma ** (c - idx[:c]).to(x.dtype)  # gamma^(end - t): how far the next block's first return carries
        out[..., start : start + c] = x[..., start : start + c] @ block[:c, :c].T + carry[..., None] * decay
        carry = out[..., start]
    return out


def _each_sample(fn: Callable[..., Tensor], like: Tensor, cu_seqlens, *tensors: Tensor) -> Tensor:
    """``fn(*rows)`` on every sample's ``[..., L]`` rows of ``tensors`` (the padded rows at once, packed segments one at
    a time), in ``like``'s shape, 0 after ``cu_seqlens[-1]``."""
    cu = check_layout(like, cu_seqlens)
    if cu is None:
        return fn(*tensors)
    out = torch.zeros_like(like)
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            out[a:b] = fn(*(t[a:b] for t in tensors))
    return out


def reinforce_plus_plus_returns(
    rewards: Tensor, penalty: Tensor, loss_mask: Tensor, gamma: float, cu_seqlens: Tensor | Sequence[int] | None = None
) -> Tensor:
    """REINFORCE++'s per-token returns (module docstring, stage 1): token rewards ``-penalty_t`` on loss-masked tokens
    plus the sample's reward (``rewards`` ``[S]``) on its last loss-masked token, summed with :func:`reverse_discounted_
    cumsum` within each sample.  A sample without a loss-masked token gets 0 (upstream asserts there is none).

    Raises:
        ValueError: ``rewards`` is not ``[S]``, shapes differ, or a malformed layout.
    """
    check_same_shape(penalty=penalty, loss_mask=loss_mask)
    mask = loss_mask.bool()
    spread = per_token_advantages(rewards, loss_mask, cu_seqlens)

    def returns(reward: Tensor, cost: Tensor, on: Tensor) -> Tensor:
        if on.shape[-1] == 0:
            return torch.zeros_like(reward)
        pos = torch.arange(on.shape[-1], device=on.device)
        last = torch.where(on, pos, -1).amax(-1, keepdim=True)
        return reverse_discounted_cumsum(torch.where(pos == last, reward, 0.0) - torch.where(on, cost, 0.0), gamma)

    return _each_sample(returns, spread, cu_seqlens, spread, as_float(penalty).to(spread.dtype), mask)


def token_advantages(
    advantages: Tensor, loss_mask: Tensor, cfg: GRPOConfig, *, old_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None, cu_seqlens: Tensor | Sequence[int] | None = None,
    whitening: Whitening | None = None,
) -> Tensor:
    """Stage 1 of the module docstring: per-sample ``advantages`` ``[S]`` -> per-token advantages in ``loss_mask``'s
    shape (``--kl-coef`` shaping from ``old_log_probs`` and ``ref_log_probs``; REINFORCE++'s returns), then stage 2
    with ``whitening`` (the rollout's :func:`rollout_whitening`) when given.  Detached.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref_log_probs`` or ``old_log_probs``, a wrong ``advantages`` shape,
            or a malformed layout.
    """
    stage_one = _stage_one(advantages, loss_mask, cfg, old_log_probs, ref_log_probs, cu_seqlens)
    return stage_one if whitening is None else whitening.apply(stage_one)


def _stage_one(advantages, loss_mask, cfg, old_log_probs, ref_log_probs, cu_seqlens) -> Tensor:
    penalty = None
    if cfg.kl_coef > 0:
        if ref_log_probs is None or old_log_probs is None:
            raise ValueError(f"--kl-coef {cfg.kl_coef} needs old_log_probs and ref_log_probs (the reference model's), "
                             "got None")
        penalty = cfg.kl_coef * log_ratio(old_log_probs.detach(), ref_log_probs.detach(), loss_mask)
    with torch.no_grad():
        if cfg.reinforce_plus_plus_returns:
            zero = torch.zeros(loss_mask.shape, dtype=as_float(advantages).dtype, device=loss_mask.device)
            return reinforce_plus_plus_returns(advantages, zero if penalty is None else penalty, loss_mask, cfg.gamma,
                                               cu_seqlens)
        spread = per_token_advantages(advantages.detach(), loss_mask, cu_seqlens)
        return spread if penalty is None else spread - penalty


class Whitening(NamedTuple):
    """Stage 2 of the module docstring: ``(A_t - mean) * rstd`` with the rollout step's statistics."""

    mean: float
    rstd: float
    """``1 / sqrt(unbiased variance + WHITEN_EPS)``."""

    def apply(self, token_advantages: Tensor) -> Tensor:
        """The whitened advantages, same shape and dtype."""
        return (token_advantages - self.mean) * self.rstd


def whitening_sums(token_advantages: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """This rank's ``{"adv/sum", "adv/sum_sq", "adv/tokens"}`` over loss-masked tokens (float64), to be summed over the
    data-parallel ranks and given to :func:`whitening_of`."""
    mask = loss_mask.bool()
    values = token_advantages.detach().double()[mask]
    return {"adv/sum": float(values.sum()), "adv/sum_sq": float(values.square().sum()), "adv/tokens": float(mask.sum())}


def whitening_of(sums: dict[str, float]) -> Whitening:
    """The :class:`Whitening` of the summed :func:`whitening_sums` (Bessel's correction from 2 tokens on); the identity
    ``(0, 1)`` when no token is loss-masked (the step trains nothing; upstream raises)."""
    count = sums["adv/tokens"]
    if count <= 0:
        return Whitening(0.0, 1.0)
    mean = sums["adv/sum"] / count
    var = max(sums["adv/sum_sq"] / count - mean * mean, 0.0)
    if count >= 2:
        var *= count / (count - 1)
    return Whitening(mean, 1.0 / math.sqrt(var + WHITEN_EPS))


def rollout_whitening(samples: Sequence[Sample], old_log_probs: Sequence[Tensor] | None,
                      ref_log_probs: Sequence[Tensor] | None, cfg: GRPOConfig,
                      reduce: Callable[[Mapping[str, float]], dict[str, float]]) -> Whitening:
    """The :class:`Whitening` of ``--normalize-advantages``: every loss-masked token's advantage after
    :func:`token_advantages` over this rank's ``samples`` (with their old and reference log-probs), summed over the
    data-parallel ranks by ``reduce`` (collective), once per rollout as upstream.  A rank that computes no loss passes
    no ``samples`` (it adds zeros); ``old_log_probs`` None: the old log-probs are the training forward's
    (``--skip-actor-forward-only``), which only a shaping without ``--kl-coef`` allows.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``old_log_probs`` or ``ref_log_probs`` (:func:`token_advantages`).
    """
    sums = {"adv/sum": 0.0, "adv/sum_sq": 0.0, "adv/tokens": 0.0}
    for i, sample in enumerate(samples):
        mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
        token_adv = token_advantages(torch.tensor([sample.advantage], dtype=torch.float32), mask, cfg,
                                     old_log_probs=None if old_log_probs is None else old_log_probs[i],
                                     ref_log_probs=None if ref_log_probs is None else ref_log_probs[i])
        for name, value in whitening_sums(token_adv, mask).items():
            sums[name] += value
    return whitening_of(reduce(sums))
