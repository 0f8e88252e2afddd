"""The GRPO loss of one micro-batch: clipped policy loss, KL, entropy, aggregation.

Pure torch and backend-neutral: tensors in, tensors out, no model, no ``torch.distributed``; loss
terms in float32 (float64 inputs stay float64).  A backend turns its logits into per-token
log-probs and entropies (:mod:`slime.grpo.log_probs`) and calls :func:`grpo_micro_batch_loss`
once per micro-batch.  Formulas: PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347,
eq. 7) with DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476, Sec. 3.1); KL estimators k1 /
k2 / k3 (Schulman 2020, http://joschu.net/blog/kl-approx.html; DeepSeekMath's KL term, eq. 4, is
k3); GRPO's sample-mean aggregation (DeepSeekMath eq. 3).  Departures from upstream slime:
``low_var_kl`` is k3 clamped to ``[-10, 10]`` (slime / verl); ``--kl-coef`` subtracts
``kl_coef * k1(pi_old, ref)`` from each token's advantage (upstream: PPO / REINFORCE++ rewards
only); Dr.GRPO's constant generation budget is not implemented (``--calculate-per-token-loss``,
token mean, is the nearest option).

Token layouts: every per-token tensor of one call has the same shape, one of

- padded ``[B, T]``: row ``b`` is sample ``b``, ``loss_mask`` is 0 on padding (HF models);
- packed ``[T]``: samples concatenated, with ``cu_seqlens`` (int ``[S + 1]``, ``cu_seqlens[0]
  == 0``, non-decreasing) giving sample ``s`` the tokens ``cu_seqlens[s]:cu_seqlens[s+1]``
  (Megatron THD, varlen flash-attention).  Tokens after ``cu_seqlens[-1]`` (trailing
  padding) must be masked out.  Without ``cu_seqlens`` a 1-D tensor is one sample.

Masked-out tokens never enter the arithmetic (they are replaced by 0 before any ``exp``),
so padding may hold garbage log-probs without producing NaN values or gradients.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from slime.grpo.config import KL_TYPES, GRPOConfig

LOW_VAR_KL_BOUND = 10.0
"""``low_var_kl`` is k3 clamped to ``[-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND]`` (upstream slime / verl)."""


def _float(x: Tensor) -> Tensor:
    """``x`` promoted to at least float32 (bf16 / fp16 / int / bool -> float32; float64 kept)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_same_shape(**tensors: Tensor) -> None:
    """Raise ``ValueError`` naming the arguments when the per-token tensors differ in shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have one shape, got {shapes}")


# --- KL reward shaping --------------------------------------------------------------


def apply_kl_penalty_to_advantages(
    advantages: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor, kl_coef: float, loss_mask: Tensor | None = None
) -> Tensor:
    """Per-token KL reward shaping: ``A_t - kl_coef * (log pi_old(y_t) - log pi_ref(y_t))`` (``--kl-coef``).

    The penalty is the k1 estimate of ``KL(pi_old || pi_ref)`` at each sampled token
    (Schulman 2020), applied to that token only: not accumulated over later tokens, not
    group-normalised.  Used only when ``kl_coef > 0`` (then a reference model exists).

    Args:
        advantages: per-token advantages, ``[T]`` or ``[B, T]``.
        old_log_probs, ref_log_probs: log-probs (nats) of the sampled tokens under the
            rollout policy and the reference model, same shape.
        kl_coef: penalty weight (advantage units per nat), >= 0.
        loss_mask: optional, same shape; masked-out tokens keep their advantage.

    Returns:
        float32 (float64 if given float64) tensor of ``advantages``' shape.

    Raises:
        ValueError: ``kl_coef < 0`` or shapes differ.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef (--kl-coef) must be >= 0, got {kl_coef}")
    _check_same_shape(advantages=advantages, old_log_probs=old_log_probs)
    return _float(advantages) - kl_coef * compute_approx_kl(old_log_probs, ref_log_probs, "k1", loss_mask)


# --- per-token terms ----------------------------------------------------------------


class PolicyLossTerms(NamedTuple):
    """Per-token outputs of :func:`compute_policy_loss`, all 0 at masked-out tokens."""

    loss: Tensor
    """Clipped surrogate loss per token (to be minimised)."""
    clipped: Tensor
    """1.0 where the clipped branch is active (strictly larger), else 0.0."""
    log_ratio: Tensor
    """``log pi(y_t) - log pi_old(y_t)`` in nats; ``-log_ratio`` is the k1 estimate of KL(pi_old || pi)."""


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossTerms:
    """PPO clipped surrogate with asymmetric (clip-higher) range, per token.

    ``ratio = exp(log_probs - old_log_probs)``;
    ``loss_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high))``
    (Schulman et al. 2017, eq. 7, negated; DAPO clip-higher, Yu et al. 2025, Sec. 3.1).
    With ``A > 0`` the ratio is capped at ``1 + eps_clip_high``; with ``A < 0`` it is floored
    at ``1 - eps_clip``; outside those the gradient is 0.  Aggregate ``clipped`` with
    :func:`aggregate_loss` for the clip fraction, and ``-log_ratio`` for the approximate
    KL(pi_old || pi) (k1 on samples of pi_old; upstream slime's ``ppo_kl``).

    Args:
        log_probs: current-policy log-probs of the sampled tokens (nats), ``[T]`` or ``[B, T]``.
        old_log_probs: behaviour (rollout) policy log-probs, same shape.
        advantages: per-token advantages, same shape.
        loss_mask: 1 / True for tokens in the loss, same shape.
        eps_clip, eps_clip_high: clip range (``--eps-clip``, ``--eps-clip-high``), >= 0.

    Returns:
        :class:`PolicyLossTerms` of float32 (float64 if given float64) tensors of the input shape.

    Raises:
        ValueError: shapes differ.
    """
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, _float(log_probs) - _float(old_log_probs), 0.0)
    adv = torch.where(mask, _float(advantages), 0.0)
    ratio = log_ratio.exp()
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped_loss, clipped_loss),
        clipped=(clipped_loss > unclipped_loss).to(ratio.dtype),
        log_ratio=log_ratio,
    )


def compute_approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, kl_type: str, loss_mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman 2020).

    With ``x = log pi(y) - log pi_ref(y)`` (nats) and ``r = pi_ref(y) / pi(y) = exp(-x)``:

    - ``k1 = x``: unbiased, high variance, can be negative;
    - ``k2 = x**2 / 2``: biased, low variance, >= 0;
    - ``k3 = (r - 1) - log r = expm1(-x) + x``: unbiased and >= 0 pointwise (DeepSeekMath eq. 4);
    - ``low_var_kl = clamp(k3, -10, 10)``: upstream slime / verl (k3 >= 0, so it caps at 10).

    Args:
        log_probs: log-probs under ``pi`` (the policy the tokens were sampled from), any shape.
        ref_log_probs: log-probs under the reference policy, same shape.
        kl_type: one of ``k1``, ``k2``, ``k3``, ``low_var_kl`` (``--kl-loss-type``).
        loss_mask: optional, same shape; masked-out tokens give 0 and are never exponentiated.

    Returns:
        float32 (float64 if given float64) tensor of the input shape, nats.

    Raises:
        ValueError: unknown ``kl_type`` (the message lists the valid ones) or shapes differ.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown KL estimator {kl_type!r} (--kl-loss-type); valid: {', '.join(KL_TYPES)}")
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    log_ratio = _float(log_probs) - _float(ref_log_probs)
    if loss_mask is not None:
        _check_same_shape(log_probs=log_probs, loss_mask=loss_mask)
        log_ratio = torch.where(loss_mask.bool(), log_ratio, 0.0)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.expm1(-log_ratio) + log_ratio
    if kl_type == "low_var_kl":
        return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return k3


# --- aggregation ----------------------------------------------------------------------


def _check_layout(per_token: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> Tensor | None:
    """Check the token layout (module docstring) of ``per_token``; return ``cu_seqlens`` as a tensor
    on its device (None for padded tensors or a single packed sample).

    Raises:
        ValueError: not ``[T]`` / ``[B, T]``, ``cu_seqlens`` with padded tensors, or a malformed ``cu_seqlens``.
    """
    if per_token.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError(
                f"cu_seqlens is for packed 1-D tensors, got padded tensors of shape {tuple(per_token.shape)}"
            )
        return None
    if per_token.dim() != 1:
        raise ValueError(f"per-token tensors must be [T] or [B, T], got shape {tuple(per_token.shape)}")
    if cu_seqlens is None:
        return None
    cu = torch.as_tensor(cu_seqlens, device=per_token.device)
    bounds = cu.tolist() if cu.dim() == 1 else None
    if bounds is None or len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be 1-D [S + 1], start at 0 and be non-decreasing, got {cu.tolist()}")
    if bounds[-1] > per_token.numel():
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the packed tensors have {per_token.numel()} tokens")
    return cu


def _per_sample_sums(masked: Tensor, mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> tuple[Tensor, Tensor]:
    """Per-sample sums of ``masked`` and token counts of ``mask``, each ``[S]`` (see the module's layouts)."""
    cu = _check_layout(masked, cu_seqlens)
    if masked.dim() == 2:
        return masked.sum(dim=-1), mask.sum(dim=-1)
    if cu is None:
        return masked.sum().view(1), mask.sum().view(1)
    bounds = cu.tolist()
    num_tokens = masked.numel()
    if mask[bounds[-1] :].any():
        raise ValueError(
            f"tokens {bounds[-1]}..{num_tokens - 1} lie after cu_seqlens[-1] (trailing padding) but have loss_mask 1"
        )
    sample_ids = torch.bucketize(torch.arange(bounds[-1], device=masked.device), cu[1:], right=True)
    num_samples = len(bounds) - 1
    sums = masked.new_zeros(num_samples).index_add(0, sample_ids, masked[: bounds[-1]])
    counts = mask.new_zeros(num_samples, dtype=torch.int64).index_add(0, sample_ids, mask[: bounds[-1]].long())
    return sums, counts


def aggregate_loss(
    values: Tensor,
    loss_mask: Tensor,
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    per_token: bool = False,
    global_normalizer: float | None = None,
    sample_token_counts: Tensor | None = None,
) -> Tensor:
    """Reduce per-token values to one scalar: sample-mean (default) or token-mean.

    - sample-mean (GRPO, DeepSeekMath eq. 3): ``sum_s [sum_{t in s} m_t v_t / n_s] / N``,
      ``n_s`` the masked-token count of sample ``s`` (a sample with none contributes 0),
      ``N`` the number of samples.
    - token-mean (``per_token=True``, ``--calculate-per-token-loss``):
      ``sum_t m_t v_t / N``, ``N`` the number of masked tokens.

    Micro-batches: by default ``N`` counts this call's samples / tokens (so the result is
    this micro-batch's mean).  Pass ``global_normalizer`` = ``N`` of the whole optimizer
    step (all micro-batches of all data-parallel ranks): the result is then this
    micro-batch's share, and summing it over micro-batches and ranks gives exactly the
    global mean.  If the gradient reduction averages over ranks (FSDP / DDP default),
    multiply the loss by the data-parallel size to undo that average.  With context
    parallelism a rank holds part of each sample: pass ``sample_token_counts`` (every
    sample's masked-token count over the whole sequence) so that ``n_s`` is right.

    Args:
        values: per-token values, ``[B, T]`` padded or ``[T]`` packed (module docstring).
        loss_mask: 1 / True for tokens that count, same shape.
        cu_seqlens: sample boundaries of packed ``[T]`` tensors, int ``[S + 1]``.
        per_token: token-mean instead of sample-mean.
        global_normalizer: ``N`` (samples, or tokens when ``per_token``), > 0.
        sample_token_counts: ``[S]`` masked-token counts per sample (sample-mean only).

    Returns:
        0-d tensor of ``values``' float dtype (differentiable).

    Raises:
        ValueError: shapes differ, malformed ``cu_seqlens``, unmasked tokens after
            ``cu_seqlens[-1]``, ``global_normalizer <= 0`` or a wrong ``sample_token_counts`` shape.
    """
    _check_same_shape(values=values, loss_mask=loss_mask)
    if global_normalizer is not None and not global_normalizer > 0:
        raise ValueError(f"global_normalizer must be > 0 (samples or tokens of the step), got {global_normalizer}")
    mask = loss_mask.bool()
    masked = torch.where(mask, _float(values), 0.0)
    if per_token:
        return masked.sum() / (global_normalizer or mask.sum().clamp(min=1))
    sums, counts = _per_sample_sums(masked, mask, cu_seqlens)
    if sample_token_counts is not None:
        if tuple(sample_token_counts.shape) != tuple(sums.shape):
            raise ValueError(
                f"sample_token_counts must have one entry per sample, shape {tuple(sums.shape)}, "
                f"got {tuple(sample_token_counts.shape)}"
            )
        counts = sample_token_counts.to(sums.device)
    per_sample = sums / counts.clamp(min=1)
    return per_sample.sum() / (global_normalizer or max(per_sample.numel(), 1))


# --- the loss -------------------------------------------------------------------------


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: GRPOConfig,
    *,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    global_normalizer: float | None = None,
    sample_token_counts: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch: ``pg_loss + kl_loss_coef * kl_loss - entropy_coef * entropy``.

    Each term is a per-token quantity reduced by :func:`aggregate_loss` (sample-mean, or
    token-mean with ``cfg.calculate_per_token_loss``) with the same ``cu_seqlens`` /
    ``global_normalizer`` / ``sample_token_counts``, so with a global normaliser the loss
    and every metric sum over micro-batches to the step's value.

    - ``pg_loss``: :func:`compute_policy_loss` with ``cfg.eps_clip`` / ``cfg.eps_clip_high``;
    - ``kl_loss``: :func:`compute_approx_kl` (``cfg.kl_loss_type``) of ``log_probs`` vs
      ``ref_log_probs``, when ``cfg.use_kl_loss`` and ``ref_log_probs`` is given;
    - ``entropy``: the given per-token entropy (:func:`slime.grpo.log_probs.entropy_from_logits`),
      when given.

    Args:
        log_probs: current-policy log-probs of the sampled tokens (nats, with grad),
            ``[B, T]`` padded or ``[T]`` packed (module docstring).
        old_log_probs: rollout-policy log-probs, same shape.
        advantages: per-token advantages, same shape.
        loss_mask: 1 / True for response tokens in the loss, same shape.
        cfg: the GRPO flags.
        ref_log_probs: reference-model log-probs, same shape; required when
            ``cfg.use_kl_loss`` and ``cfg.kl_loss_coef > 0``.
        entropy: per-token entropy (nats, with grad), same shape; required when
            ``cfg.entropy_coef != 0``.
        cu_seqlens, global_normalizer, sample_token_counts: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``: ``loss`` a differentiable 0-d float32 tensor; ``metrics`` maps
        to detached 0-d tensors (not python floats, so logging needs no sync): ``pg_loss``, ``pg_clipfrac`` (clipped
        token fraction), ``ppo_kl`` (approx KL(pi_old || pi), k1 = ``old - new``), plus
        ``kl_loss`` when the KL term is computed and ``entropy`` when ``entropy`` is given.

    Raises:
        ValueError: a required tensor is missing, or any error of :func:`aggregate_loss`.
    """
    if cfg.use_kl_loss and cfg.kl_loss_coef > 0 and ref_log_probs is None:
        raise ValueError(f"--use-kl-loss with --kl-loss-coef {cfg.kl_loss_coef} needs ref_log_probs, got None")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"--entropy-coef {cfg.entropy_coef} needs the per-token entropy, got None")

    def aggregate(values: Tensor) -> Tensor:
        return aggregate_loss(
            values,
            loss_mask,
            cu_seqlens=cu_seqlens,
            per_token=cfg.calculate_per_token_loss,
            global_normalizer=global_normalizer,
            sample_token_counts=sample_token_counts,
        )

    terms = compute_policy_loss(log_probs, old_log_probs, advantages, loss_mask, cfg.eps_clip, cfg.eps_clip_high)
    loss = pg_loss = aggregate(terms.loss)
    with torch.no_grad():
        metrics = {"pg_loss": pg_loss.detach(), "pg_clipfrac": aggregate(terms.clipped)}
        metrics["ppo_kl"] = aggregate(-terms.log_ratio)
    if cfg.use_kl_loss and ref_log_probs is not None:
        kl_loss = aggregate(compute_approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type, loss_mask))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if entropy is not None:
        mean_entropy = aggregate(entropy)
        loss = loss - cfg.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    return loss, metrics


def per_token_advantages(
    advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None = None
) -> Tensor:
    """Each sample's advantage on every one of its tokens, in ``loss_mask``'s layout.

    GRPO's outcome supervision (DeepSeekMath, Sec. 4.1.2): every token of a response gets
    the response's advantage.

    Args:
        advantages: ``[S]`` per-sample advantages, any real dtype: ``S = B`` for padded
            ``[B, T]`` tensors, ``len(cu_seqlens) - 1`` for packed ``[T]`` ones, 1 for a packed
            tensor without ``cu_seqlens``.
        loss_mask: a per-token tensor of the micro-batch; only its shape and device are used.
        cu_seqlens: sample boundaries of packed ``[T]`` tensors, int ``[S + 1]``.

    Returns:
        float32 (float64 kept) tensor of ``loss_mask``'s shape; tokens after
        ``cu_seqlens[-1]`` (trailing padding) get 0.

    Raises:
        ValueError: ``advantages`` is not ``[S]``, or a malformed layout / ``cu_seqlens``.
    """
    cu = _check_layout(loss_mask, cu_seqlens)
    if loss_mask.dim() == 2:
        num_samples = loss_mask.shape[0]
    else:
        num_samples = 1 if cu is None else cu.numel() - 1
    adv = _float(advantages).to(loss_mask.device)
    if tuple(adv.shape) != (num_samples,):
        raise ValueError(
            f"advantages must hold one value per sample, shape ({num_samples},), got {tuple(adv.shape)}"
        )
    if loss_mask.dim() == 2:
        return adv[:, None].expand(loss_mask.shape)
    if cu is None:
        return adv.expand(loss_mask.shape)
    sample_ids = torch.bucketize(torch.arange(loss_mask.numel(), device=adv.device), cu[1:], right=True)
    return torch.cat([adv, adv.new_zeros(1)])[sample_ids]  # index S: after the last sample


def grpo_micro_batch_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: GRPOConfig,
    *,
    global_normalizer: float | None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    sample_token_counts: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's GRPO loss, from per-sample advantages: what every
    training backend calls on the per-token log-probs of its forward pass.

    1. every sample's advantage on each of its tokens (:func:`per_token_advantages`);
    2. with ``cfg.kl_coef > 0``, KL reward shaping ``A_t - kl_coef * (log pi_old - log pi_ref)``
       (:func:`apply_kl_penalty_to_advantages`);
    3. :func:`grpo_loss`: clipped policy loss, KL loss, entropy bonus, each aggregated with
       ``global_normalizer``.

    Gradient scale: with ``global_normalizer`` = the step's sample (or token) count over all
    data-parallel ranks, the losses summed over micro-batches and ranks are the step's mean.
    A data-parallel wrapper that *averages* gradients over ``dp`` ranks divides that by
    ``dp``; scale the returned loss back before the backward pass:

    - FSDP / DDP: ``(loss * dp_size).backward()``.
    - megatron-core: :func:`slime.backends.megatron.loss.grpo_loss_func` multiplies it by the
      micro-batches of the step and the data-parallel size (the schedule divides by the first, DDP
      averages over the second); Megatron's own ``calculate_per_token_loss`` stays False, since
      ``--calculate-per-token-loss`` is already in ``global_normalizer``.

    Args:
        log_probs: current-policy log-probs of the sampled tokens (nats, with grad),
            ``[B, T]`` padded or ``[T]`` packed (module docstring).
        old_log_probs: rollout-policy log-probs, same shape.
        advantages: ``[S]`` per-sample advantages (one per sample of the layout).
        loss_mask: 1 / True for response tokens in the loss, same shape as ``log_probs``.
        cfg: the GRPO flags.
        global_normalizer: ``N`` of the whole optimizer step (see :func:`aggregate_loss`), or
            None for this micro-batch's own mean.
        ref_log_probs: reference-model log-probs, same shape; required with ``cfg.kl_coef > 0``
            or with ``cfg.use_kl_loss`` and ``cfg.kl_loss_coef > 0``.
        entropy: per-token entropy (nats, with grad when ``cfg.entropy_coef != 0``), same
            shape; required when ``cfg.entropy_coef != 0``.
        cu_seqlens, sample_token_counts: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` of :func:`grpo_loss`.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref_log_probs``, a wrong ``advantages``
            shape, or any error of :func:`grpo_loss`.
    """
    token_advantages = per_token_advantages(advantages, loss_mask, cu_seqlens)
    if cfg.kl_coef > 0:
        if ref_log_probs is None:
            raise ValueError(f"--kl-coef {cfg.kl_coef} needs ref_log_probs (the reference model's), got None")
        token_advantages = apply_kl_penalty_to_advantages(
            token_advantages, old_log_probs, ref_log_probs, cfg.kl_coef, loss_mask
        )
    return grpo_loss(
        log_probs,
        old_log_probs,
        token_advantages,
        loss_mask,
        cfg,
        ref_log_probs=ref_log_probs,
        entropy=entropy,
        cu_seqlens=cu_seqlens,
        global_normalizer=global_normalizer,
        sample_token_counts=sample_token_counts,
    )
