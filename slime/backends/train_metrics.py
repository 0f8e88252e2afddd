"""Backend-neutral training metrics: cross-rank sums, and the train-vs-rollout log-prob gap.

Loss terms computed with a global normaliser (:func:`slime.backends.steps.loss_normalizer`)
are each rank's share of the step's value, so the step value is a plain sum over
micro-batches and ranks: :func:`all_reduce_sums` does the rank part.

The log-prob gap measures how far the trainer's log-probs of the sampled tokens are from
the engine's (``train/logprob_abs_diff``): the mean of ``|log p_train(y_t) - log
p_rollout(y_t)|`` over loss-masked response tokens, token-weighted over all samples of all
ranks.  It is split by prompt kind, ``..._image`` (prompts with images) and ``..._text``,
since a vision-tower mismatch (preprocessing, precision) shows up only in the first.  Upstream
slime reports the same quantity as ``train_rollout_logprob_abs_diff``.  Tokens that follow a
generated image / video placeholder are left out (the trainer feeds the placeholder as a pad
token, so their context differs by design, not by precision) and counted in
``train/logprob_gap_altered_tokens``.
"""

from __future__ import annotations

import logging
from typing import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.data.sample import Sample

logger = logging.getLogger(__name__)

_GAP_KINDS = ("image", "text")


def all_reduce_sums(values: Mapping[str, float | Tensor], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum scalar values over the ranks of ``group`` (collective; float64 on CPU).

    Every rank must pass the same keys.  Without an initialised ``torch.distributed`` the
    values come back as floats unchanged.

    Args:
        values: name -> Python number or 0-d tensor (any device; detached first).
        group: a process group that takes CPU tensors (gloo, or ``"cpu:gloo,cuda:nccl"``).

    Returns:
        name -> summed float, in the order of ``sorted(values)``.
    """
    keys = sorted(values)
    local = torch.tensor(
        [float(values[k].detach().double().cpu()) if isinstance(values[k], Tensor) else float(values[k]) for k in keys],
        dtype=torch.float64,
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return dict(zip(keys, local.tolist()))


def logprob_gap_sums(
    samples: Sequence[Sample], train_log_probs: Sequence[Tensor], placeholder_ids: Collection[int] = ()
) -> dict[str, float]:
    """This rank's sums for the log-prob gap: ``gap/<kind>/abs_diff`` (nats) and ``gap/<kind>/tokens``.

    ``kind`` is ``image`` when the sample's prompt has images, else ``text``.  Only
    loss-masked response tokens count.  Samples without ``rollout_log_probs`` are left
    out (logged once per call with their count and first index).  A response that generated
    one of ``placeholder_ids`` (an image / video placeholder, which the trainer feeds as a pad
    token, :mod:`slime.backends.fsdp.inputs`) has its tokens *after* the first one left out
    too, since they see another context by design; they are counted in ``gap/altered/tokens``.

    Args:
        samples: the samples, with ``rollout_log_probs`` and ``loss_mask`` of length R each.
        train_log_probs: the trainer's log-probs of each sample's response, float ``[R]`` each.
        placeholder_ids: response token ids the trainer does not feed as the engine did.

    Returns:
        The five sums (floats), always all present so ranks can reduce them together.

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
    """Turn (all-reduced) :func:`logprob_gap_sums` into ``train/logprob_abs_diff[_image|_text]``
    and ``train/logprob_gap_altered_tokens`` (tokens left out after a generated placeholder).

    A split with no token is omitted (not reported as 0); so is the overall value when
    neither split has one.
    """
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
