"""Backend-neutral batching for the trainers: optimizer steps, micro-batches, per-token tensors,
the loss normaliser of a step, and weight buckets.

Every training backend cuts its share of a rollout the same way::

    for step_samples in split_into_steps(samples, num_steps):            # one optimizer step each
        normalizer = loss_normalizer(step_samples, per_token, group)      # global: all DP ranks
        for micro in split_into_micro_batches(step_samples, micro_batch_size):
            logits = model(...)                                           # backend-specific layout
            log_probs = gather_log_probs(response_logits, response_tokens, temperature)  # or vocab-parallel
            loss, _ = grpo_micro_batch_loss(..., global_normalizer=normalizer)
            (loss * dp_size).backward()                                   # dp_size undoes the gradient
                                                                          # average over ranks

so that the gradients summed over micro-batches and averaged over data-parallel ranks are
the gradient of the step's global mean loss (:func:`slime.grpo.loss.aggregate_loss`).
Log-probs from logits: :mod:`slime.grpo.log_probs`; the loss:
:func:`slime.grpo.loss.grpo_micro_batch_loss`.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from slime.data.sample import Sample

logger = logging.getLogger(__name__)

T = TypeVar("T")

logger = logging.getLogger(__name__)
_placeholder_warned = False

PAD_TOKEN_ID = 0
"""Id written into padding positions (masked out and causal, so any id works) and in place of
image / video placeholder ids that a response generated (:func:`response_input_ids`)."""


class SampleError(ValueError):
    """A sample handed to a trainer is malformed; the message names its index and the field."""


def check_train_sample(sample: Sample, need_rollout_log_probs: bool = False) -> None:
    """Check the per-token fields of one sample before it enters a forward pass.

    Args:
        sample: the sample.
        need_rollout_log_probs: also require ``rollout_log_probs`` (``use_rollout_logprobs``).

    Raises:
        SampleError: no prompt or no response tokens, a ``loss_mask`` whose length differs
            from the response's, ``rollout_log_probs`` neither empty nor of the response's
            length, or empty when ``need_rollout_log_probs``.
    """
    r = sample.response_length
    where = f"sample {sample.index} (group {sample.group_index})"
    if not sample.prompt_token_ids:
        raise SampleError(f"{where} has no prompt_token_ids")
    if r == 0:
        raise SampleError(f"{where} has no response tokens; drop empty responses before training")
    if len(sample.loss_mask) != r:
        raise SampleError(
            f"{where}: loss_mask has {len(sample.loss_mask)} entries but the response has {r} tokens; "
            "give one 0/1 per response token"
        )
    if sample.rollout_log_probs and len(sample.rollout_log_probs) != r:
        raise SampleError(
            f"{where}: rollout_log_probs has {len(sample.rollout_log_probs)} entries but the response has {r} tokens"
        )
    if need_rollout_log_probs and not sample.rollout_log_probs:
        raise SampleError(
            f"{where} has no rollout_log_probs, which --use-rollout-logprobs needs; "
            "check that the rollout engine returns log-probs"
        )


def check_train_samples(
    samples: Sequence[Sample], need_rollout_log_probs: bool = False, group: dist.ProcessGroup | None = None
) -> None:
    """:func:`check_train_sample` on every sample, then agree across ranks (collective).

    A rank that raised alone would leave the others waiting in the forward pass's
    collectives; so every rank learns whether any rank found a malformed sample, and all
    raise.

    Raises:
        SampleError: this rank's own error, or one saying that another rank found one.
    """
    error = None
    try:
        for sample in samples:
            check_train_sample(sample, need_rollout_log_probs)
    except SampleError as e:
        error = e
    failed = torch.tensor([0 if error is None else 1])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise SampleError("another trainer rank received a malformed sample (its log names it); all ranks stop")


def check_image_inputs(sample: Sample) -> None:
    """Raises ``ValueError`` (naming the sample) unless ``sample.multimodal_inputs`` has both
    ``pixel_values`` and ``image_grid_thw`` (the processor gives them together) or neither."""
    mm = sample.multimodal_inputs
    if ("pixel_values" in mm) != ("image_grid_thw" in mm):
        raise ValueError(
            f"sample {sample.index}: multimodal_inputs has {sorted(mm)}; pixel_values and image_grid_thw come "
            "together (both from the processor) or not at all"
        )


def response_input_ids(sample: Sample, placeholders: set[int]) -> list[int]:
    """The sample's response ids as the model *input* sees them: image / video placeholder ids replaced
    by :data:`PAD_TOKEN_ID` (the log-prob *targets* keep the generated ids).

    A model treats every placeholder id in its input as a slot for vision features, so a response that
    contains one (a policy may sample any id) cannot be fed as is.  Only the tokens after a replaced one
    see a different context than the engine did (which embedded the id as text); the trainer's own old
    log-probs see the same substitution, so the PPO ratio is unaffected.  Logged as a warning the first
    time per process, then at debug level (the rollout manager counts such responses in
    ``rollout/vision_token_responses``).
    """
    global _placeholder_warned
    ids = list(sample.response_token_ids)
    hits = [i for i, token in enumerate(ids) if token in placeholders]
    if hits:
        logger.log(
            logging.DEBUG if _placeholder_warned else logging.WARNING,
            "sample %d: the response contains %d image/video placeholder token(s) (first at response position %d); "
            "they are fed to the model as token %d (log-prob targets unchanged)%s",
            sample.index,
            len(hits),
            hits[0],
            PAD_TOKEN_ID,
            "" if _placeholder_warned else "; further cases are logged at debug level",
        )
        _placeholder_warned = True
        for i in hits:
            ids[i] = PAD_TOKEN_ID
    return ids


def split_into_steps(samples: Sequence[T], num_steps: int) -> list[list[T]]:
    """Cut this rank's samples into ``num_steps`` consecutive equal chunks, one per optimizer step.

    Raises:
        ValueError: ``num_steps < 1`` or ``len(samples)`` is not a positive multiple of it.
    """
    if num_steps < 1 or len(samples) == 0 or len(samples) % num_steps:
        raise ValueError(
            f"{len(samples)} samples cannot be cut into {num_steps} equal optimizer steps; the trainer group "
            "must send a positive multiple of num_steps samples to every rank (--global-batch-size / DP size each)"
        )
    size = len(samples) // num_steps
    return [list(samples[i * size : (i + 1) * size]) for i in range(num_steps)]


def split_into_micro_batches(samples: Sequence[T], micro_batch_size: int) -> list[list[T]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (``--micro-batch-size``); the last may be smaller.

    Raises:
        ValueError: ``micro_batch_size < 1``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    return [list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]


def pad_per_token(rows: Sequence[Sequence[float] | Tensor], dtype: torch.dtype, device=None, pad: float = 0) -> Tensor:
    """Right-pad per-token rows of different lengths into one ``[B, max_len]`` tensor.

    Args:
        rows: B rows (lists or 1-D tensors); row ``b`` fills ``out[b, :len(rows[b])]``.
        dtype, device: of the result.
        pad: value of the padding.

    Returns:
        ``[B, max_len]`` tensor (``max_len = 0`` when every row is empty).
    """
    max_len = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), max_len), pad, dtype=dtype, device=device)
    for b, row in enumerate(rows):
        if len(row):
            out[b, : len(row)] = torch.as_tensor(row, dtype=dtype, device=device)
    return out


def loss_normalizer(samples: Sequence[Sample], per_token: bool, group: dist.ProcessGroup | None = None) -> float:
    """``N`` of one optimizer step over all data-parallel ranks, for ``aggregate_loss(global_normalizer=N)``.

    Per-sample aggregation (default): the number of samples of the step; per-token
    (``--calculate-per-token-loss``): the number of loss-masked response tokens.  Summed over
    ``group`` with an all-reduce (collective: every rank of ``group`` must call it), so ranks
    with unequal response lengths agree.

    Args:
        samples: this rank's samples of the step.
        per_token: count tokens instead of samples.
        group: the data-parallel process group, which must take CPU tensors (gloo, or
            ``"cpu:gloo,cuda:nccl"``); None for the default group, or no reduction when
            ``torch.distributed`` is not initialised.

    Returns:
        ``N`` (float, > 0).  A per-token step whose samples have every token masked (e.g.
        ``--overlong-filter`` with every sample truncated) gets ``N = 1``: its loss is 0 and it
        gives no gradient, as the same step does under per-sample aggregation; a warning says so.

    Raises:
        ValueError: the step has no sample on any rank (nothing to train on).
    """
    tokens = sum(int(sum(s.loss_mask)) for s in samples)
    counts = torch.tensor([len(samples), tokens], dtype=torch.float64)  # one all-reduce for both
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    num_samples, num_tokens = counts.tolist()
    if num_samples <= 0:
        raise ValueError("the optimizer step has no samples on any data-parallel rank; check the batch split")
    if not per_token:
        return num_samples
    if num_tokens <= 0:
        logger.warning(
            "every response token of this optimizer step is masked out of the loss (e.g. --overlong-filter with "
            "every sample truncated): the step's loss is 0 and gives no gradient"
        )
        return 1.0
    return num_tokens


def bucket_by_bytes(
    groups: Iterable[list[tuple[str, Tensor]]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Concatenate groups of named tensors into buckets of about ``bucket_bytes`` bytes.

    Groups are never split (a group is e.g. one whole layer): a bucket is emitted as soon as
    it holds at least ``bucket_bytes`` bytes, so it exceeds the target by less than its last
    group; a group larger than the target forms a bucket of its own.  Order is kept.

    Args:
        groups: lists of ``(name, tensor)``.
        bucket_bytes: target bucket size, bytes, > 0.

    Yields:
        Non-empty lists of ``(name, tensor)``.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for group in groups:
        bucket.extend(group)
        size += sum(t.numel() * t.element_size() for _, t in group)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
