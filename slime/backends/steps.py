"""A rollout's samples as the training step takes them: checks, optimizer steps, micro-batches, the loss normaliser.

The skeleton (:meth:`slime.backends.base.TrainerBackend.train`) is the one caller of the plan and the normaliser;
both backends build their model inputs with :func:`response_input_ids` (``docs/design/training_step.md``).
"""

from __future__ import annotations

import logging
from typing import Sequence, TypeVar

import torch
import torch.distributed as dist

from slime.data.routes import RouteError, RouteShape, check_routes
from slime.data.sample import Sample
from slime.errors import SlimeError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_placeholder_warned = False

PAD_TOKEN_ID = 0
"""Id written into padding positions (masked out and causal, so any id works) and in place of
image / video placeholder ids that a response generated (:func:`response_input_ids`)."""


# ---------------------------------------------------------------------------------------- checks


class SampleError(SlimeError, ValueError):
    """A sample handed to a trainer is malformed (a custom rollout function's or a saved rollout's); the message
    names its index and the field."""


def check_train_sample(sample: Sample, need_rollout_log_probs: bool | str = False,
                       routes: RouteShape | None = None) -> None:
    """Check one sample's per-token fields before a forward pass (with ``need_rollout_log_probs``, True or the flags
    that need them, also its ``rollout_log_probs``; with ``routes`` its ``rollout_routed_experts`` of that shape, :func:`check_routes`).

    Raises:
        SampleError: no prompt or response tokens; a ``loss_mask``, or non-empty ``rollout_log_probs``, not of the
            response's length; no ``rollout_log_probs`` when needed; with ``routes``, none or malformed ones.
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
            f"{where} has no rollout_log_probs, which "
            f"{'--use-rollout-logprobs' if need_rollout_log_probs is True else need_rollout_log_probs} needs; "
            "check that the rollout engine returns log-probs"
        )
    if routes is not None:
        if sample.rollout_routed_experts is None:
            raise SampleError(f"{where} has no rollout_routed_experts to replay; the engine returns them only when "
                              "asked (return_routed_experts) and started to capture them")
        try:
            check_routes(sample.rollout_routed_experts, len(sample.prompt_token_ids), r, routes, where)
        except RouteError as e:
            raise SampleError(str(e)) from None


def check_train_samples(
    samples: Sequence[Sample], need_rollout_log_probs: bool | str = False, group: dist.ProcessGroup | None = None,
    routes: RouteShape | None = None,
) -> None:
    """:func:`check_train_sample` on every sample, agreed over the ranks of ``group`` (collective), so that no rank
    waits in a forward pass for one that raised alone: ``SampleError``, this rank's own or one naming another rank's."""
    error = None
    try:
        for sample in samples:
            check_train_sample(sample, need_rollout_log_probs, routes)
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
    """The response ids as the model *input* sees them: image / video placeholder ids (which a model takes as slots for
    vision features) replaced by :data:`PAD_TOKEN_ID`; the log-prob targets keep the generated ids.  Warned about
    once per process (why: ``docs/design/training_step.md``)."""
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


# ---------------------------------------------------------------------------------------- steps, micro-batches


def split_into_steps(samples: Sequence[T], num_steps: int) -> list[list[T]]:
    """Cut this rank's samples into ``num_steps`` consecutive equal chunks, one per optimizer step; ``ValueError``
    unless ``len(samples)`` is a positive multiple of ``num_steps >= 1``."""
    if num_steps < 1 or len(samples) == 0 or len(samples) % num_steps:
        raise ValueError(
            f"{len(samples)} samples cannot be cut into {num_steps} equal optimizer steps; the trainer group "
            "must send a positive multiple of num_steps samples to every rank (--global-batch-size / DP size each)"
        )
    size = len(samples) // num_steps
    return [list(samples[i * size : (i + 1) * size]) for i in range(num_steps)]


def split_into_micro_batches(samples: Sequence[T], micro_batch_size: int) -> list[list[T]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be smaller); ``ValueError`` below 1."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    return [list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]


def sample_tokens(sample: Sample) -> int:
    """Prompt + response tokens of one sample (its length in a packed micro-batch)."""
    return len(sample.prompt_token_ids) + sample.response_length


def balanced_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Item indices in ``num_bins`` (``1 .. len(lengths)``, else ``ValueError``) non-empty bins of nearly equal total
    length: longest-processing-time-first (Graham 1969), each item into the lightest bin; items in index order per bin.
    """
    if not 1 <= num_bins <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} samples into {num_bins} non-empty micro-batches")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def bins_for_budget(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest bins (at least the token total over the budget) in which :func:`balanced_bins` keeps
    every bin within ``max_tokens``, except a bin holding a single longer item."""
    n = len(lengths)
    k = max(1, min(n, -(-sum(lengths) // max_tokens)))
    while k < n and any(len(b) > 1 and sum(lengths[i] for i in b) > max_tokens for b in balanced_bins(lengths, k)):
        k += 1
    return k


def plan_micro_batches(
    samples: Sequence[Sample], *, micro_batch_size: int, max_tokens: int | None, dp_group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """One step's (or log-prob pass's) micro-batches, as lists of sample indices: runs of ``micro_batch_size``
    consecutive samples, or with ``max_tokens`` (``--max-tokens-per-gpu`` under ``--use-dynamic-batch-size``)
    :func:`balanced_bins` of at most that many tokens (a longer sample alone, logged), as many on every rank of
    ``dp_group`` (the most any rank needs: expert all-to-alls and megatron-core's schedule need one count; None: no
    agreement).

    Raises:
        ValueError: no samples, or ``micro_batch_size < 1``.
    """
    if not samples:
        raise ValueError("no samples to cut into micro-batches")
    if max_tokens is None:
        return split_into_micro_batches(list(range(len(samples))), micro_batch_size)
    lengths = [sample_tokens(s) for s in samples]
    long = [s.index for s, n in zip(samples, lengths) if n > max_tokens]
    if long:
        logger.warning("%d sample(s) exceed --max-tokens-per-gpu %d (first: sample %d, %d tokens); each gets a "
                       "micro-batch of its own", len(long), max_tokens, long[0], max(lengths))
    count = torch.tensor([bins_for_budget(lengths, max_tokens)])
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return balanced_bins(lengths, min(int(count), len(samples)))


# ---------------------------------------------------------------------------------------- the loss normaliser


def loss_normalizer(samples: Sequence[Sample], per_token: bool, group: dist.ProcessGroup | None = None) -> float:
    """``N`` of one optimizer step over the ranks of ``group``, for ``aggregate_loss(global_normalizer=N)``: the step's
    samples, or with ``per_token`` (``--calculate-per-token-loss``) its loss-masked response tokens.  Collective (an
    all-reduce over ``group``, which takes CPU tensors; None: the default group, no reduction without
    ``torch.distributed``).  A per-token step with every token masked gets ``N = 1`` (loss 0, no gradient), with a
    warning.

    Raises:
        ValueError: the step has no sample on any rank.
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
