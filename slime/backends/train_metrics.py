"""Backend-neutral training metrics: cross-rank sums, and the train-vs-rollout log-prob gap.

Loss terms computed with the step's global normaliser are each rank's share, so a step's value is a sum over
micro-batches and ranks (:func:`all_reduce_sums`).  The gap ``train/logprob_abs_diff`` is the mean
``|log p_train(y_t) - log p_rollout(y_t)|`` over loss-masked response tokens of all samples of all ranks (upstream's
``train_rollout_logprob_abs_diff``), also split by prompt kind (``_image``, ``_text``: a vision-tower mismatch shows
only in the first); tokens after a generated image / video placeholder are left out and counted in
``train/logprob_gap_altered_tokens`` (``docs/design/training_step.md``).  Metrics named ``*_min`` / ``*_max`` (the IS
weight's) are extremes, reduced by min / max over micro-batches, ranks and steps instead (:func:`all_reduce_extrema`).
"""

from __future__ import annotations

import logging
import math
from typing import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.data.sample import Sample

logger = logging.getLogger(__name__)

_GAP_KINDS = ("image", "text")


def all_reduce_sums(values: Mapping[str, float | Tensor], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum scalar values (numbers or 0-d tensors on any device) over the ranks of ``group`` (collective, float64 on CPU;
    ``group`` must take CPU tensors); every rank passes the same keys.  Returns name -> float in sorted order, the
    values unchanged without ``torch.distributed``."""
    keys = sorted(values)
    local = torch.tensor(
        [float(values[k].detach().double().cpu()) if isinstance(values[k], Tensor) else float(values[k]) for k in keys],
        dtype=torch.float64,
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return dict(zip(keys, local.tolist()))


EXTREMA = ("_min", "_max")
"""Suffixes of the metrics reduced as extremes rather than summed and averaged."""


def neutral_extremum(name: str) -> float:
    """``inf`` for a ``*_min`` metric, ``-inf`` for a ``*_max`` one: what a micro-batch or rank without tokens gives."""
    return math.inf if name.endswith("_min") else -math.inf


def fold_extremum(name: str, current: float, value: float) -> float:
    """``min`` or ``max`` (by ``name``'s suffix) of two values of one extreme metric."""
    return min(current, value) if name.endswith("_min") else max(current, value)


def all_reduce_extrema(values: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Per-rank extremes (``*_min`` / ``*_max`` floats) reduced over the ranks of ``group`` (collective, float64 on CPU;
    every rank passes the same keys); ``inf`` / ``-inf`` where no rank had a token."""
    keys = sorted(values)
    signs = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in keys], dtype=torch.float64)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64) * signs
    if keys and dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, (local * signs).tolist()))


def extrema_over_steps(per_step: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each extreme metric's min / max over the optimizer steps, over its finite values (omitted without any)."""
    out = {}
    for name, values in per_step.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            out[name] = min(finite) if name.endswith("_min") else max(finite)
    return out


def logprob_gap_sums(
    samples: Sequence[Sample], train_log_probs: Sequence[Tensor], placeholder_ids: Collection[int] = ()
) -> dict[str, float]:
    """This rank's sums for the log-prob gap (module docstring): ``gap/<kind>/abs_diff`` (nats), ``gap/<kind>/tokens``
    (``kind``: ``image`` when the prompt has images, else ``text``) and ``gap/altered/tokens``, always all present.
    Samples without ``rollout_log_probs`` are left out (logged); ``train_log_probs`` holds one float ``[R]`` per sample;
    ``placeholder_ids`` are the response ids the trainer does not feed as the engine did.

    Raises:
        ValueError: the lists differ in length, or a sample's tensors differ from its R.
    """
    if len(samples) != len(train_log_probs):
        raise ValueError(f"{len(samples)} samples but {len(train_log_probs)} log-prob tensors")
    sums = {f"gap/{kind}/{what}": 0.0 for kind in _GAP_KINDS for what in ("abs_diff", "tokens")}
    sums["gap/altered/tokens"] = 0.0
    missing = [s.index for s in samples if not s.rollout_log_probs]
    if missing:
        logger.warning(
            "%d sample(s) have no rollout_log_probs (first: sample %d); they are left out of train/logprob_abs_diff",
            len(missing),
            missing[0],
        )
    for sample, train_lp in zip(samples, train_log_probs):
        if not sample.rollout_log_probs:
            continue
        r = sample.response_length
        if train_lp.shape != (r,) or len(sample.loss_mask) != r or len(sample.rollout_log_probs) != r:
            raise ValueError(
                f"sample {sample.index}: response has {r} tokens but train log-probs {tuple(train_lp.shape)}, "
                f"loss_mask {len(sample.loss_mask)}, rollout_log_probs {len(sample.rollout_log_probs)}"
            )
        mask = torch.as_tensor(sample.loss_mask, dtype=torch.bool)
        first = next((t for t, token in enumerate(sample.response_token_ids) if token in placeholder_ids), None)
        if first is not None:
            sums["gap/altered/tokens"] += float(mask[first + 1 :].sum())
            mask[first + 1 :] = False
        diff = (train_lp.detach().double().cpu() - torch.as_tensor(sample.rollout_log_probs, dtype=torch.float64)).abs()
        kind = "image" if sample.has_images else "text"
        sums[f"gap/{kind}/abs_diff"] += float(diff[mask].sum())
        sums[f"gap/{kind}/tokens"] += float(mask.sum())
    return sums


def logprob_gap_metrics(summed: Mapping[str, float]) -> dict[str, float]:
    """All-reduced :func:`logprob_gap_sums` -> ``train/logprob_abs_diff[_image|_text]`` and
    ``train/logprob_gap_altered_tokens``; a split without tokens is omitted (so is the overall value without any)."""
    metrics = {"train/logprob_gap_altered_tokens": summed.get("gap/altered/tokens", 0.0)}
    total_diff = total_tokens = 0.0
    for kind in _GAP_KINDS:
        diff, tokens = summed[f"gap/{kind}/abs_diff"], summed[f"gap/{kind}/tokens"]
        if tokens > 0:
            metrics[f"train/logprob_abs_diff_{kind}"] = diff / tokens
        total_diff += diff
        total_tokens += tokens
    if total_tokens > 0:
        metrics["train/logprob_abs_diff"] = total_diff / total_tokens
    return metrics
