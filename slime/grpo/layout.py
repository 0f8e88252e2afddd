"""Per-token tensors in the loss's two layouts, padded ``[B, T]`` and packed ``[T]`` with ``cu_seqlens``.

Shape checks, log-ratios, per-sample sums and counts, and per-sample values spread back onto their tokens, shared by
:mod:`slime.grpo.loss` and :mod:`slime.grpo.correction` (the layouts: :mod:`slime.grpo.loss`'s docstring).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def as_float(x: Tensor) -> Tensor:
    """``x`` in float32, or float64 if it already is (differentiable)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def check_same_shape(**tensors: Tensor) -> None:
    """Raises ``ValueError`` (listing every shape) unless all ``tensors`` have one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have one shape, got {shapes}")


def log_ratio(log_probs: Tensor, base_log_probs: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """``log_probs - base_log_probs`` per token, float32 (float64 kept), 0 where ``loss_mask`` is 0 (nowhere without
    one): the log-ratio of two policies' log-probs of the same tokens.

    Raises:
        ValueError: the tensors (``loss_mask`` too, if given) are not of one shape.
    """
    check_same_shape(log_probs=log_probs, base_log_probs=base_log_probs,
                     **({} if loss_mask is None else {"loss_mask": loss_mask}))
    diff = as_float(log_probs) - as_float(base_log_probs)
    return diff if loss_mask is None else torch.where(loss_mask.bool(), diff, 0.0)


def check_layout(per_token: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> Tensor | None:
    """``cu_seqlens`` as a tensor on ``per_token``'s device (None if padded or one sample), the layout checked.

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


def num_samples(per_token: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> int:
    """Samples of the layout: rows if padded, ``len(cu_seqlens) - 1`` if packed, else 1."""
    cu = check_layout(per_token, cu_seqlens)
    if per_token.dim() == 2:
        return per_token.shape[0]
    return 1 if cu is None else cu.numel() - 1


def per_sample_sums(
    masked: Tensor, mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None
) -> tuple[Tensor, Tensor]:
    """``(sums [S], counts [S] int64)`` of ``masked`` (already 0 off ``mask``) and of ``mask`` per sample.

    Raises:
        ValueError: a malformed layout, or tokens after ``cu_seqlens[-1]`` with ``mask`` set.
    """
    cu = check_layout(masked, cu_seqlens)
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
    count = len(bounds) - 1
    sums = masked.new_zeros(count).index_add(0, sample_ids, masked[: bounds[-1]])
    counts = mask.new_zeros(count, dtype=torch.int64).index_add(0, sample_ids, mask[: bounds[-1]].long())
    return sums, counts


def spread_per_sample(values: Tensor, like: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> Tensor:
    """Per-sample ``values`` ``[S]`` on each of the sample's tokens, in ``like``'s shape (0 after ``cu_seqlens[-1]``);
    differentiable, float32 (float64 kept).

    Raises:
        ValueError: ``values`` is not ``[S]``, or a malformed layout / ``cu_seqlens``.
    """
    count = num_samples(like, cu_seqlens)
    vals = as_float(values).to(like.device)
    if tuple(vals.shape) != (count,):
        raise ValueError(f"expected one value per sample, shape ({count},), got {tuple(vals.shape)}")
    if like.dim() == 2:
        return vals[:, None].expand(like.shape)
    if cu_seqlens is None:
        return vals.expand(like.shape)
    cu = torch.as_tensor(cu_seqlens, device=like.device)
    sample_ids = torch.bucketize(torch.arange(like.numel(), device=like.device), cu[1:], right=True)
    return torch.cat([vals, vals.new_zeros(1)])[sample_ids]  # index S: after the last sample


def sequence_sums(values: Tensor, loss_mask: Tensor, cu_seqlens, *, mean: bool) -> Tensor:
    """Each sample's sum (``mean``: mean) of ``values`` over its masked tokens, on each of its tokens, in ``values``'
    shape; 0 for a sample without masked tokens.  Differentiable; masked-out values never enter the arithmetic."""
    mask = loss_mask.bool()
    sums, counts = per_sample_sums(torch.where(mask, as_float(values), 0.0), mask, cu_seqlens)
    return spread_per_sample(sums / counts.clamp(min=1) if mean else sums, values, cu_seqlens)
