"""A rollout's samples as a trainer takes them: the checks before any forward, and the response ids a model is fed.

The training step (:func:`slime.backends.step.train_step`) checks every sample first (:func:`check_train_samples`,
agreed over ranks); both backends feed a sample's :func:`model_input_ids` (why placeholders are replaced:
``docs/design/training_step.md``).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist

from slime.data.sample import Sample
from slime.errors import SlimeError

logger = logging.getLogger(__name__)

_placeholder_warned = False

PAD_TOKEN_ID = 0
"""Id written into padding positions (masked out and causal, so any id works) and in place of
image / video placeholder ids that a response generated (:func:`response_input_ids`)."""


class SampleError(SlimeError, ValueError):
    """A sample handed to a trainer is malformed (a custom rollout function's or a saved rollout's); the message
    names its index and the field."""


def check_train_sample(sample: Sample, need_rollout_log_probs: bool | str = False) -> None:
    """Check one sample's per-token fields before a forward pass (with ``need_rollout_log_probs``, True or the flags
    that need them, also its ``rollout_log_probs``).

    Raises:
        SampleError: no prompt or response tokens; a ``loss_mask``, or non-empty ``rollout_log_probs``, not of the
            response's length; no ``rollout_log_probs`` when needed.
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


def check_train_samples(
    samples: Sequence[Sample], need_rollout_log_probs: bool | str = False, group: dist.ProcessGroup | None = None,
    routes_problem: str | None = None,
) -> None:
    """:func:`check_train_sample` on every sample, then ``routes_problem`` (R3's engine routes that do not fit,
    :attr:`slime.routing_replay.StepRoutes.problem`), agreed over the ranks of ``group`` (collective), so that no rank
    waits in a forward pass for one that raised alone: ``SampleError``, this rank's own or one naming another rank's."""
    error = None
    try:
        for sample in samples:
            check_train_sample(sample, need_rollout_log_probs)
        if routes_problem is not None:
            raise SampleError(routes_problem)
    except SampleError as e:
        error = e
    failed = torch.tensor([0 if error is None else 1])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise SampleError("another trainer rank received a malformed sample (its log names it); all ranks stop")


def model_input_ids(sample: Sample, placeholders: set[int]) -> list[int]:
    """The ids a model is fed for ``sample``: its prompt ids, then :func:`response_input_ids` (the response's, image /
    video ``placeholders`` replaced); the sample's images checked first (:func:`check_image_inputs`).

    Raises:
        ValueError: ``pixel_values`` without ``image_grid_thw``, or the reverse (naming the sample).
    """
    check_image_inputs(sample)
    return list(sample.prompt_token_ids) + response_input_ids(sample, placeholders)


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
