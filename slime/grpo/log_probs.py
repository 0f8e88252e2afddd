"""Per-token log-probs and entropies of the sampled tokens, from a model's logits.

With ``z = logits / temperature`` (the distribution the engines sample from and report):
``log p(y) = z_y - logsumexp(z)`` and ``H = logsumexp(z) - sum_v p_v z_v`` (nats), in float32 whatever
the logits' dtype (float64 kept).  Full vocabulary ``[..., V]``: :func:`gather_log_probs`,
:func:`entropy_from_logits`, both in one call :func:`full_vocab_log_probs`.  Vocab-parallel ``[..., V_p]``
shards of a TP group (megatron-core's ``vocab_parallel_cross_entropy`` scheme, never gathering the
vocabulary): :func:`vocab_parallel_log_probs`.
The derivation and the padded-vocabulary rule: ``docs/design/grpo.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(logits: Tensor, tokens: Tensor, temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"--rollout-temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must agree up to the vocab dim"
        )


def gather_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs (nats) of ``tokens`` under ``softmax(logits / temperature)``, full vocabulary.

    Args:
        logits: ``[..., V]`` at the positions that predict ``tokens``.
        tokens: int64 ``[...]`` ids in ``[0, V)``.
        temperature: ``--rollout-temperature``, > 0.

    Returns:
        ``[...]`` float32.

    Raises:
        ValueError: ``temperature <= 0`` or the leading shapes differ.
    """
    _check_inputs(logits, tokens, temperature)
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim: ``[..., V]`` -> ``[...]`` float32.

    Pass the temperature-scaled logits; they must be finite (a ``-inf`` logit gives NaN gradients).
    """
    log_p = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def full_vocab_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, with_entropy: bool = False,
                         entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """:func:`vocab_parallel_log_probs` for full-vocabulary logits ``[..., V]``: :func:`gather_log_probs` and, with
    ``with_entropy``, :func:`entropy_from_logits` of ``logits / temperature``; ``entropy_grad`` False computes the
    entropy without autograd (a metric only).

    Returns:
        ``(log_probs, entropy)``, float32 ``[...]``; ``entropy`` None unless ``with_entropy``.

    Raises:
        ValueError: ``temperature <= 0`` or the leading shapes differ.
    """
    log_probs = gather_log_probs(logits, tokens, temperature)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = entropy_from_logits(logits.float() / temperature)
    return log_probs, entropy


def vocab_parallel_log_probs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``tokens`` under ``softmax(logits / temperature)`` from vocab-parallel logits.

    Equal to :func:`gather_log_probs` / :func:`entropy_from_logits` on the gathered logits; collective over
    ``group`` (two all-reduces forward, none backward); differentiable.

    Args:
        logits: ``[..., V_p]`` this rank's shard (columns ``[r V_p, (r + 1) V_p)``), any float dtype.
        tokens: int64 ``[...]`` global ids, the same on every rank.
        temperature: ``--rollout-temperature``, > 0.
        group: the TP group; None: the default group, or one rank if ``torch.distributed`` is not initialised.
        vocab_size: the real vocabulary ``V``; columns of id ``>= V`` (padding) are left out.  None: all count.
        with_entropy: also return the entropy.

    Returns:
        ``(log_probs, entropy)``, float32 (float64 for float64 logits) ``[...]``; ``entropy`` None unless
        ``with_entropy``.  A token id outside ``[0, V)`` gets NaN (harmless under a loss mask).

    Raises:
        ValueError: ``temperature <= 0``, the leading shapes differ, ``tokens`` is not an integer
            tensor, or ``vocab_size`` is not in ``[1, tp * V_p]``.
    """
    _check_inputs(logits, tokens, temperature)
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor of token ids, got {tokens.dtype}")
    if dist.is_available() and dist.is_initialized():
        tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    elif group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    else:
        tp_rank, tp_size = 0, 1
    shard = logits.shape[-1]
    if vocab_size is None:
        vocab_size = shard * tp_size
    if not 1 <= vocab_size <= shard * tp_size:
        raise ValueError(
            f"vocab_size {vocab_size} must be in [1, {shard * tp_size}] ({tp_size} TP ranks x {shard} logits each)"
        )
    vocab_start = tp_rank * shard
    num_valid = max(0, min(shard, vocab_size - vocab_start))
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, tokens, float(temperature), group, tp_size > 1, vocab_start, num_valid, with_entropy
    )
    return log_probs, entropy


class _VocabParallelLogProbs(torch.autograd.Function):
    """Forward and backward of :func:`vocab_parallel_log_probs` (the math: ``docs/design/grpo.md``)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, group, reduce, vocab_start, num_valid, with_entropy):
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(logits.dtype)
        z = logits[..., :num_valid].to(dtype, copy=True).div_(temperature)  # [..., n], this rank's real columns
        if num_valid > 0:
            z_max = z.amax(dim=-1)
        else:  # every column of this rank is padding
            z_max = torch.full(tokens.shape, float("-inf"), dtype=dtype, device=z.device)
        if reduce:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z.sub_(z_max.unsqueeze(-1))  # shifted logits, <= 0

        owned = (tokens >= vocab_start) & (tokens < vocab_start + num_valid)
        local_ids = torch.where(owned, tokens - vocab_start, 0)
        if num_valid > 0:
            target = torch.where(owned, z.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1), 0.0)
        else:
            target = torch.zeros(tokens.shape, dtype=dtype, device=z.device)
        e = z.exp()
        sums = [target, e.sum(dim=-1), owned.to(dtype)]
        if with_entropy:
            # e * z is 0 * -inf = NaN where a logit is -inf (a masked column): that term is 0.
            sums.append(e.mul_(z).masked_fill_(e.isnan(), 0.0).sum(dim=-1))
        del e
        totals = torch.stack(sums)
        if reduce:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        log_sum = totals[1].log()
        log_probs = torch.where(totals[2] == 1, totals[0] - log_sum, float("nan"))
        entropy = mean_z = None
        if with_entropy:
            mean_z = totals[3] / totals[1]  # E_p[z - m]
            entropy = log_sum - mean_z

        ctx.temperature, ctx.num_valid, ctx.shape, ctx.dtype = temperature, num_valid, logits.shape, logits.dtype
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(z, local_ids, owned, log_sum, mean_z)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        z, local_ids, owned, log_sum, mean_z = ctx.saved_tensors
        none = (None,) * 7
        if ctx.num_valid == 0 or (grad_log_probs is None and grad_entropy is None):
            return (torch.zeros(ctx.shape, dtype=ctx.dtype, device=z.device), *none)
        p = (z - log_sum.unsqueeze(-1)).exp_()  # this rank's share of softmax(z)
        if grad_entropy is not None:
            # -p * (g_lp + g_H * (z - E[z])); the product is NaN only where p = 0 and z = -inf
            weight = (z - mean_z.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_log_probs is not None:
                weight.add_(grad_log_probs.unsqueeze(-1))
            g = p.mul_(weight).neg_()
            g.masked_fill_(g.isnan(), 0.0)
            del weight
        else:
            g = p.mul_(grad_log_probs.unsqueeze(-1)).neg_()
        if grad_log_probs is not None:
            g.scatter_add_(-1, local_ids.unsqueeze(-1), torch.where(owned, grad_log_probs, 0.0).unsqueeze(-1))
        g.div_(ctx.temperature)
        if ctx.num_valid == ctx.shape[-1]:
            return (g.to(ctx.dtype), *none)
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=z.device)  # padded columns: zero gradient
        grad[..., : ctx.num_valid] = g
        return (grad, *none)
