"""An engine's outputs on a step's samples: the response fields, the prompt length check and the abort warning.

Shared by the rollout manager (:mod:`slime.rollout.manager`), dynamic sampling
(:mod:`slime.rollout.dynamic_sampling`) and the parity gate (:mod:`slime.rollout.parity`).
"""

from __future__ import annotations

import logging

from slime.data.sample import Sample, SampleStatus
from slime.errors import SlimeError
from slime.rollout.engines.base import GenerateOutput, GenerateRequest

logger = logging.getLogger(__name__)


class PromptMismatchError(SlimeError, RuntimeError):
    """A rollout engine saw a prompt of another length than the data pipeline computed, so the
    trainer would train on tokens the engine never conditioned on."""


UNUSABLE = (SampleStatus.FAILED, SampleStatus.ABORTED)
"""Statuses of a sample that is neither scored nor in the metrics, and whose whole group leaves the loss."""
_LOGGED_SAMPLES = 3
"""Samples named in a mismatch or abort warning."""


def record_output(sample: Sample, out: GenerateOutput) -> None:
    """Put an engine's output on its sample: response, token ids, log-probs, full loss mask, routed experts (None
    unless asked), and the status its ``finish_reason`` gives (stop: completed, length: truncated, abort: aborted)."""
    sample.response = out.text
    sample.response_token_ids = list(out.output_ids)
    sample.rollout_log_probs = list(out.output_log_probs)
    sample.loss_mask = [1] * len(out.output_ids)
    sample.rollout_routed_experts = out.routed_experts  # uint8 [P + R - 1, layers, top_k] when asked, else None
    sample.status = {
        "stop": SampleStatus.COMPLETED,
        "length": SampleStatus.TRUNCATED,
        "abort": SampleStatus.ABORTED,
    }[out.finish_reason]


PROMPT_LENGTH_CAUSES = (
    "Likely cause: the engine loads another processor or chat template than --hf-checkpoint, or resizes images "
    "with other pixel bounds than --image-min-pixels / --image-max-pixels (the number of image tokens follows "
    "the resized size)"
)
"""The likely causes of a prompt length mismatch, shown in its warnings and errors."""


def prompt_length_mismatches(samples: list[Sample], outputs: list[GenerateOutput]) -> list[int]:
    """Positions (ascending) where the engine's prompt length (``outputs[i].prompt_tokens``) differs from the
    locally processed ``len(samples[i].prompt_token_ids)``; ``samples`` and ``outputs`` pair up by position.

    Raises:
        ValueError: ``samples`` and ``outputs`` differ in length.
    """
    return [i for i, (sample, out) in enumerate(zip(samples, outputs, strict=True))
            if out.prompt_tokens != len(sample.prompt_token_ids)]


def check_prompt_lengths(
    samples: list[Sample], requests: list[GenerateRequest], outputs: list[GenerateOutput], max_fraction: float
) -> list[int]:
    """Compare each engine's prompt length (``GenerateOutput.prompt_tokens``) with the data pipeline's
    ``len(sample.prompt_token_ids)`` (:func:`prompt_length_mismatches`), for whatever engine served the request.

    A mismatching sample is an error of that sample: its position is returned (the caller marks it
    :attr:`SampleStatus.FAILED`) and a warning names the first few.  Many mismatches are a
    misconfiguration, not a per-sample fault, and stop the run.

    Args:
        samples, requests, outputs: position ``i`` of each is one request (same length).
        max_fraction: ``--max-prompt-length-mismatch-fraction``, in [0, 1].

    Returns:
        Positions (ascending) of the samples whose lengths differ; empty when all agree.

    Raises:
        PromptMismatchError: every sample mismatches, or more than ``max_fraction * len(samples)``
            do; the message names the count of mismatching samples and, for the first few, the
            sample (position in the batch, dataset index, request id), the engine and both lengths,
            with the likely cause.
    """
    bad = [(i, samples[i], requests[i], outputs[i]) for i in prompt_length_mismatches(samples, outputs)]
    if not bad:
        return []
    first = "; ".join(
        f"sample {i} (dataset index {sample.index}, rid {req.rid}): engine "
        f"{'?' if out.engine_index is None else out.engine_index} saw {out.prompt_tokens} prompt tokens, "
        f"the data pipeline computed {len(sample.prompt_token_ids)}"
        for i, sample, req, out in bad[:_LOGGED_SAMPLES]
    )
    cause = PROMPT_LENGTH_CAUSES
    summary = (
        f"{len(bad)} of {len(samples)} prompts have another length in the rollout engine than in the data pipeline"
    )
    if len(bad) == len(samples) or len(bad) / len(samples) > max_fraction:
        raise PromptMismatchError(
            f"{summary} ({first}). The trainer would train on other tokens than the engine generated from. {cause}. "
            f"(More than --max-prompt-length-mismatch-fraction {max_fraction:g} of the samples, or all of them, "
            "stop the run; fewer are counted and left out per sample.)"
        )
    logger.warning(
        "%s (%s): each is an error of that sample (status failed, counted in prompt_length_mismatches); a training "
        "rollout leaves each one's whole group out of the loss, an eval leaves the sample out of its metrics. %s",
        summary, first, cause,
    )  # fmt: skip
    return [i for i, _, _, _ in bad]


ABORT_CAUSES = (
    "Likely cause: generation paused in abort mode or the request aborted while it ran (SGLang's "
    "/pause_generation defaults to mode=abort; a weight sync or memory release during generation), or the engine's "
    "scheduler aborted the request itself (e.g. one it cannot admit); the engine's log names the reason of each"
)
"""The likely causes of ``finish_reason "abort"``, shown in the abort warning and errors."""


def warn_aborted(samples: list[Sample], requests: list[GenerateRequest], outputs: list[GenerateOutput],
                 stream: str) -> int:
    """Warn about the samples of one ``generate`` call that have status ``ABORTED`` (the engine answered
    ``finish_reason "abort"``: the response is cut off wherever the engine stopped), naming the first few.

    Args:
        samples, requests, outputs: position ``i`` of each is one request (same length).
        stream: ``"train"`` or ``"eval/<name>"``, named in the warning.

    Returns:
        The number of aborted samples (0: no warning).
    """
    bad = [(i, s, req, out) for i, (s, req, out) in enumerate(zip(samples, requests, outputs))
           if s.status == SampleStatus.ABORTED]  # fmt: skip
    if bad:
        first = "; ".join(
            f"sample {i} (dataset index {s.index}, rid {req.rid}, engine "
            f"{'?' if out.engine_index is None else out.engine_index}, response length {len(out.output_ids)})"
            for i, s, req, out in bad[:_LOGGED_SAMPLES]
        )
        logger.warning(
            "%d of %d %s samples were aborted by the rollout engine (%s%s): each is left unscored and out of the "
            "metrics (counted in aborted_samples); a training rollout leaves each one's whole group out of the "
            "loss. %s",
            len(bad), len(samples), stream, first, ", ..." if len(bad) > _LOGGED_SAMPLES else "", ABORT_CAUSES,
        )  # fmt: skip
    return len(bad)


def record_outputs(samples: list[Sample], requests: list[GenerateRequest], outputs: list[GenerateOutput],
                   max_fraction: float, stream: str) -> None:
    """One ``generate`` call's outputs onto its samples (:func:`record_output`), a sample whose engine saw another
    prompt length marked ``FAILED`` (:func:`check_prompt_lengths`; also when aborted: its prompt is the first thing
    wrong), the aborted ones warned about (:func:`warn_aborted`).

    Raises:
        PromptMismatchError: too many prompt length mismatches (:func:`check_prompt_lengths`).
    """
    mismatched = check_prompt_lengths(samples, requests, outputs, max_fraction)
    for sample, out in zip(samples, outputs):
        record_output(sample, out)
    for i in mismatched:
        samples[i].status = SampleStatus.FAILED
    warn_aborted(samples, requests, outputs, stream)


def groups_holding(samples: list[Sample], n: int, status: SampleStatus) -> int:
    """Number of the groups (``n`` contiguous samples each) that hold at least one sample of ``status``."""
    return sum(any(s.status == status for s in samples[start : start + n]) for start in range(0, len(samples), n))
