"""The engine parity check: the rollout engine and the trainer must agree on log-probs, images included.

For the first two rollout steps of a run (start-up weights, then after the first weight sync):

1. :meth:`EngineParityCheck.generate` (engines on the GPU, before the step's rollout): each of
   ``--engine-parity-prompts`` training rows with an image is sampled twice, with its image and as text alone,
   for ``--engine-parity-response-len`` tokens, with the engine's routed experts of an MoE model
   (``--engine-parity-replay-routes``); every prompt length the engine reports must equal the trainer's
   (:func:`check_probe_prompt_lengths`).
2. :meth:`EngineParityCheck.compare` (the trainer on the GPU): the trainer's log-probs of the same responses,
   plain and with one rounding step of noise on its token embeddings, both replaying the engine's routes when
   it returned them (:func:`slime.backends.step.compute_log_probs`).  Per kind (image / text):
   the gap is the mean ``|engine - trainer|`` over response tokens (nats), the trainer's floor the mean
   ``|noisy - plain|``.  Responses that sampled an image/video placeholder are left out.

:func:`verdict` refuses the run (:class:`EngineParityError`) on a text gap beyond its bounds (the weights or
sampling differ), or an image gap beyond them or far above the text gap (the multimodal-RoPE bug of SGLang
0.5.17 / 0.5.18, :mod:`slime.rollout.engines.sglang.versions`).  Metrics: ``parity/logprob_gap_{image,text}``,
``..._max``, ``parity/trainer_floor_{image,text}``, ``parity/routes_replayed``.  The rule, its figures and
why routes are replayed: docs/design/parity_gate.md.  Engines whose class sets
:attr:`~slime.rollout.engines.base.RolloutEngine.parity_check` (SGLang) are checked unless
``--skip-engine-parity-check``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import TYPE_CHECKING

from slime.data.sample import Sample
from slime.errors import SlimeError
from slime.rollout.config import ParityConfig
from slime.rollout.engines.base import GenerateOutput, GenerateRequest, SamplingParams
from slime.rollout.outputs import PROMPT_LENGTH_CAUSES, prompt_length_mismatches
from slime.rollout.seeds import sampling_seed

if TYPE_CHECKING:
    from slime.data.dataset import PromptDataset
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.ray.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)

GAP_FLOOR = 1e-3
"""Nats: the least scale of a kind's gap (its trainer floor below this counts as this; bf16 engines of a small model
agree with an fp32 trainer to about it)."""
TEXT_UNITS_AT_LEAST = 0.5
"""The ratio test counts the text gap as at least this many units of its floor, so that a text gap far below its
floor does not tighten the image bound past ``max_ratio * 0.5`` floors.  Half a unit: at real width with the routes
replayed a healthy engine sits at 0.54-0.62 floors on both kinds (H100, 2026-12-06), and at one unit the
multimodal-RoPE bug's 1.30 image floors passed the default ratio 1.5 (docs/design/parity_gate.md)."""
CHECKED_STEPS = 2
"""The check runs at the first this many rollout steps of a run (start-up weights, then after the first sync)."""


class EngineParityError(SlimeError, RuntimeError):
    """The engine's log-probs disagree with the trainer's beyond the bounds (the message says which and why)."""


@dataclasses.dataclass
class ParityGaps:
    """Gaps of one check, nats per response token: means and maxima over tokens, and token counts.

    ``floor_image`` / ``floor_text``: the trainer's own floor on the same tokens, the mean ``|trainer with one
    rounding step of noise - trainer|`` (:func:`slime.backends.rounding.rounding_step_noise`); 0 when not measured.
    """

    image: float
    text: float
    image_max: float
    text_max: float
    image_tokens: int
    text_tokens: int
    floor_image: float = 0.0
    floor_text: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "parity/logprob_gap_image": self.image,
            "parity/logprob_gap_text": self.text,
            "parity/logprob_gap_image_max": self.image_max,
            "parity/logprob_gap_text_max": self.text_max,
            "parity/tokens_image": float(self.image_tokens),
            "parity/tokens_text": float(self.text_tokens),
            "parity/trainer_floor_image": self.floor_image,
            "parity/trainer_floor_text": self.floor_text,
        }


def token_gaps(samples: list[Sample], trainer_log_probs: list[list[float]],
               reference: list[list[float]] | None = None) -> list[float]:
    """``|reference - trainer|`` per response token of every sample, in order; the reference defaults to the
    engine's log-probs (``sample.rollout_log_probs``).

    Raises:
        ValueError: a sample whose trainer log-probs have another length than its response.
    """
    reference = [s.rollout_log_probs for s in samples] if reference is None else reference
    gaps = []
    for sample, trainer, ref in zip(samples, trainer_log_probs, reference, strict=True):
        if len(trainer) != len(ref):
            raise ValueError(f"sample {sample.index}: {len(trainer)} trainer log-probs for {len(ref)} response tokens")
        gaps += [abs(a - b) for a, b in zip(ref, trainer)]
    return gaps


def summarize(image_gaps: list[float], text_gaps: list[float], image_floor: list[float] = (),
              text_floor: list[float] = ()) -> ParityGaps:
    """Means and maxima (0 for an empty list) of the per-token gaps of each kind, and the mean floors."""
    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0

    return ParityGaps(mean(image_gaps), mean(text_gaps), max(image_gaps, default=0.0), max(text_gaps, default=0.0),
                      len(image_gaps), len(text_gaps), mean(image_floor), mean(text_floor))


def verdict(gaps: ParityGaps, max_gap: float, max_ratio: float, floor_factor: float = 3.0) -> str | None:
    """Why the gaps refuse the run, or None when they pass.

    With each kind's trainer floor ``f`` (0 when not measured) and its scale ``s = max(f, GAP_FLOOR)``:

    - text: refused when ``text > max_gap`` (the ceiling) or ``text > floor_factor * s_text`` (the weights or
      sampling differ);
    - image: refused when ``image > max_gap``, ``image > floor_factor * s_image``, or when the image gap in units
      of its scale is more than ``max_ratio`` times the text gap in its own, counted as at least
      :data:`TEXT_UNITS_AT_LEAST`: ``image / s_image > max_ratio * max(text / s_text, 0.5)`` (the image path differs:
      the multimodal-RoPE bug).

    A kind with no response token to compare refuses too (its gap would read 0 and pass): every response of
    it was empty or left out for a sampled image/video placeholder.  The rule and its figures:
    docs/design/parity_gate.md."""
    empty = [kind for kind, tokens in (("image", gaps.image_tokens), ("text", gaps.text_tokens)) if tokens == 0]
    if empty:
        return (f"no {' and no '.join(empty)}-prompt response token to compare (every such response was empty or "
                "sampled an image/video placeholder, see parity/skipped_vision_token_responses), so the check "
                "cannot tell whether the engine agrees with the trainer. Way out: more --engine-parity-prompts or "
                "a longer --engine-parity-response-len; --skip-engine-parity-check runs anyway")
    scale_image, scale_text = max(gaps.floor_image, GAP_FLOOR), max(gaps.floor_text, GAP_FLOOR)

    def beyond(gap: float, floor: float, scale: float) -> str | None:
        """The bound ``gap`` passes, in words, or None."""
        if gap > max_gap:
            return f"the ceiling --engine-parity-max-gap {max_gap:g}"
        if gap > floor_factor * scale:
            if floor >= GAP_FLOOR:
                return (f"{floor_factor:g} x the trainer's own floor {floor:.3g} on these tokens "
                        "(--engine-parity-floor-factor)")
            return (f"{floor_factor:g} x {GAP_FLOOR:g} nats (the trainer's own floor on these tokens, {floor:.3g}, "
                    f"counted as at least {GAP_FLOOR:g}; --engine-parity-floor-factor)")
        return None

    text_bound = beyond(gaps.text, gaps.floor_text, scale_text)
    if text_bound:
        return (f"text-prompt gap {gaps.text:.3g} nats > {text_bound}: the engine's weights or sampling differ from "
                "the trainer's (a failed weight sync, another dtype or temperature)")
    image_bound = beyond(gaps.image, gaps.floor_image, scale_image)
    image_units, text_units = gaps.image / scale_image, gaps.text / scale_text
    if image_bound is None and image_units > max_ratio * max(text_units, TEXT_UNITS_AT_LEAST):
        image_bound = (f"{max_ratio:g} x the text gap {gaps.text:.3g}, each in units of the trainer's floor on its "
                       f"tokens (--engine-parity-max-ratio; image {image_units:.3g} units of {scale_image:.3g}, text "
                       f"{text_units:.3g} units of {scale_text:.3g}, counted as at least {TEXT_UNITS_AT_LEAST:g})")
    if image_bound:
        return (f"image-prompt gap {gaps.image:.3g} nats (max {gaps.image_max:.3g}) > {image_bound}: the engine "
                "computes image tokens differently from the trainer. Likely cause: an engine with the Qwen3.5 "
                "multimodal-RoPE bug (SGLang 0.5.17 / 0.5.18 without slime's fix: image tokens get wrong rotary "
                "positions). Way out: keep slime's SGLang plugin enabled (do not set SLIME_SGLANG_MROPE_FIX=0), or "
                "use SGLang >= 0.5.19; --skip-engine-parity-check runs anyway")
    return None


class EngineParityCheck:
    """The check of the module docstring for one run.

    Args:
        cfg: the check's flags.
        dataset: the training prompts (their first rows with an image are the check's prompts).
        temperature: ``--rollout-temperature`` (the trainer's log-probs use it too).
        enabled: the engine asks for the check and it is not skipped.
        start: the run's first rollout id (the check runs at ``start`` and ``start + 1``).
        seed: ``--rollout-seed``; request ``i`` of step ``k`` is seeded ``sampling_seed(seed, k, i, "parity")``.

    Raises:
        ValueError: enabled, but the training data has no row with an image among its first rows.
    """

    def __init__(self, cfg: ParityConfig, dataset: PromptDataset | None, temperature: float, *, enabled: bool,
                 start: int = 0, seed: int = 0):
        self.cfg, self.temperature, self.start, self.seed = cfg, temperature, start, seed
        self.enabled = enabled and not cfg.skip_engine_parity_check
        self.image_prompts: list[Sample] = []
        self.text_prompts: list[Sample] = []
        self.vision_token_ids: set[int] = set()
        if self.enabled:
            self.image_prompts, self.text_prompts = probe_prompts(dataset, cfg.engine_parity_prompts)
            self.vision_token_ids = vision_token_ids(dataset.processor)

    @classmethod
    def off(cls) -> EngineParityCheck:
        """A check that never runs."""
        return cls(ParityConfig(skip_engine_parity_check=True), None, 1.0, enabled=False)

    def due(self, rollout_id: int) -> bool:
        return self.enabled and self.start <= rollout_id < self.start + CHECKED_STEPS

    def when(self, rollout_id: int) -> str:
        """The check's moment in words, for its messages."""
        return "before the first update" if rollout_id == self.start else "after the first weight sync"

    def generate(self, engines: RolloutEngineGroup, rollout_id: int) -> list[Sample] | None:
        """Engine side: the check's samples with responses and engine log-probs, or None when not due; with
        ``--engine-parity-replay-routes`` the requests ask for routed experts, which engines that capture them
        (SGLang started with ``--enable-return-routed-experts``) put on each sample.

        Raises:
            EngineParityError: the engine saw another prompt length than the trainer's processor computed for
                one of the prompts (:func:`check_probe_prompt_lengths`).
        """
        if not self.due(rollout_id):
            return None
        samples = [p.clone_prompt() for p in self.image_prompts + self.text_prompts]
        requests = [
            GenerateRequest(s.prompt, s.images, SamplingParams(
                max_new_tokens=self.cfg.engine_parity_response_len, temperature=self.temperature,
                sampling_seed=sampling_seed(self.seed, rollout_id, i, "parity")), rid=f"parity:{i}",
                return_routed_experts=self.cfg.engine_parity_replay_routes)
            for i, s in enumerate(samples)
        ]  # fmt: skip
        outputs = engines.generate(requests)
        where = f"{self.when(rollout_id)} (rollout {rollout_id})"
        check_probe_prompt_lengths(samples, requests, outputs, len(self.image_prompts), where)
        for sample, out in zip(samples, outputs):
            sample.response_token_ids = list(out.output_ids)
            sample.rollout_log_probs = list(out.output_log_probs)
            sample.rollout_routed_experts = out.routed_experts
            sample.loss_mask = [1] * len(out.output_ids)
        return samples

    def compare(self, trainers: TrainerGroup, samples: list[Sample] | None, rollout_id: int) -> dict[str, float]:
        """Trainer side: the gaps as metrics ({} when ``samples`` is None).

        When every sample carries the engine's routed experts (and ``--engine-parity-replay-routes``), both of
        the trainer's passes replay them (``parity/routes_replayed`` 1.0, else 0.0).

        Raises:
            EngineParityError: the gaps refuse the run (:func:`verdict`), or only some samples carry routes.
        """
        if samples is None:
            return {}
        replay = self.replays_routes(samples, rollout_id)
        trainer = trainers.compute_log_probs(samples, replay_routes=replay)
        noisy = trainers.compute_log_probs(samples, rounding_noise=True, replay_routes=replay)
        gaps, skipped = self.gaps(samples, trainer, noisy)
        when = self.when(rollout_id)
        logger.info("engine parity %s (rollout %d): image gap %.3g (max %.3g, trainer floor %.3g) over %d tokens, "
                    "text gap %.3g (max %.3g, trainer floor %.3g) over %d tokens; engine routes %s", when, rollout_id,
                    gaps.image, gaps.image_max, gaps.floor_image, gaps.image_tokens, gaps.text, gaps.text_max,
                    gaps.floor_text, gaps.text_tokens, "replayed" if replay else "not replayed")
        why = verdict(gaps, self.cfg.engine_parity_max_gap, self.cfg.engine_parity_max_ratio,
                      self.cfg.engine_parity_floor_factor)
        if why:
            raise EngineParityError(f"engine parity check {when} (rollout {rollout_id}) failed: {why}")
        return {**gaps.metrics(), "parity/skipped_vision_token_responses": float(skipped),
                "parity/routes_replayed": float(replay)}

    def gaps(self, samples: list[Sample], trainer: list[list[float]],
             noisy: list[list[float]]) -> tuple[ParityGaps, int]:
        """The gaps of :meth:`compare`: ``samples`` as :meth:`generate` returns them (the image prompts first)
        against the trainer's log-probs ``trainer``, the floors from its ``noisy`` ones; and how many responses
        were left out for a sampled image/video placeholder (the trainer is fed that id replaced, so the later
        tokens see another context than the engine's)."""
        n = len(self.image_prompts)
        keep = [not self.vision_token_ids.intersection(s.response_token_ids) for s in samples]
        kinds = [[(s, t, f) for s, t, f, k in zip(samples[a:b], trainer[a:b], noisy[a:b], keep[a:b]) if k]
                 for a, b in ((0, n), (n, None))]
        engine_gaps = [token_gaps([s for s, _, _ in kind], [t for _, t, _ in kind]) for kind in kinds]
        floors = [token_gaps([s for s, _, _ in kind], [f for _, _, f in kind], [t for _, t, _ in kind])
                  for kind in kinds]
        return summarize(*engine_gaps, *floors), keep.count(False)

    def replays_routes(self, samples: list[Sample], rollout_id: int) -> bool:
        """Whether :meth:`compare` replays the engine's routes: ``--engine-parity-replay-routes`` and every sample
        carries them (none does: a dense model, or an engine that does not capture them).

        Raises:
            EngineParityError: some samples carry routes and others not (naming the first without).
        """
        if not self.cfg.engine_parity_replay_routes:
            return False
        missing = [s for s in samples if s.rollout_routed_experts is None]
        if len(missing) == len(samples):
            return False
        if missing:
            raise EngineParityError(
                f"engine parity check {self.when(rollout_id)} (rollout {rollout_id}): the engine returned routed "
                f"experts for {len(samples) - len(missing)} of its {len(samples)} answers but none for the prompt of "
                f"training row {missing[0].index}, so they cannot be replayed for all; --no-engine-parity-replay-"
                "routes compares without them"
            )
        return True


def check_probe_prompt_lengths(samples: list[Sample], requests: list[GenerateRequest], outputs: list[GenerateOutput],
                               num_image: int, when: str) -> None:
    """Refuse the check's answers when the engine saw another prompt length than the trainer's processor computed
    (:func:`slime.rollout.outputs.prompt_length_mismatches`) for any of its prompts.

    The engine's log-probs would then be of other prompts than the trainer scores, so the gaps would not measure
    the engine: an image-token count that differs shows as an image gap far above the text gap, which
    :func:`verdict` would blame on the multimodal-RoPE bug.  Unlike a training rollout (where a few mismatching
    samples are left out), one mismatching fixed prompt stops the run: the prompts are few and chosen, so a
    mismatch is the configuration's, not the sample's.

    Args:
        samples, requests, outputs: position ``i`` of each is one prompt of the check (the ``num_image`` image
            prompts first, then the text prompts).
        num_image: number of image prompts.
        when: the check's moment (:meth:`EngineParityCheck.when` and the rollout id), named in the message.

    Raises:
        EngineParityError: some prompt's lengths differ; the message gives their count and, for the first few,
            the prompt (image or text, training row, request id), the engine and both lengths, with the likely
            causes.
    """
    bad = prompt_length_mismatches(samples, outputs)
    if not bad:
        return

    def describe(i: int) -> str:
        engine = "?" if outputs[i].engine_index is None else outputs[i].engine_index
        return (f"the {'image' if i < num_image else 'text'} prompt of training row {samples[i].index} (rid "
                f"{requests[i].rid}): engine {engine} saw {outputs[i].prompt_tokens} prompt tokens, the trainer's "
                f"processor computed {len(samples[i].prompt_token_ids)}")

    first = "; ".join(describe(i) for i in bad[:3])
    raise EngineParityError(
        f"engine parity check {when} failed before comparing log-probs: {len(bad)} of its {len(samples)} prompts "
        f"have another length in the rollout engine than in the trainer ({first}). The engine's log-probs would be of "
        f"other prompts, so the gaps would not measure the engine (an image-prompt gap would read as the "
        f"multimodal-RoPE bug, which this is not). {PROMPT_LENGTH_CAUSES}; both sides read --hf-checkpoint's "
        "processor files, but with their own code: the engine's multimodal processor may resize the (already resized) "
        "images again with its own pixel bounds, or another transformers version may tokenize otherwise"
    )


def vision_token_ids(processor) -> set[int]:
    """The image and video placeholder ids of ``processor`` (:class:`slime.data.processor.VLProcessor`)."""
    ids = {processor.image_token_id}
    video = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return ids | ({video} if isinstance(video, int) else set())


def probe_prompts(dataset: PromptDataset, n: int) -> tuple[list[Sample], list[Sample]]:
    """The first ``n`` rows of ``dataset`` that carry an image, with their image and as text only.

    Raises:
        ValueError: fewer than ``n`` such rows in the data (the message says how many were found).
    """
    image_samples, text_samples = [], []
    for row in range(dataset.num_rows):
        sample = dataset.make_sample(row, count_skips=False)
        if sample is None or not sample.images:
            continue
        text = dataset.make_sample(row, drop_images=True, count_skips=False)
        if text is None:
            continue
        image_samples.append(sample)
        text_samples.append(text)
        if len(image_samples) == n:
            return image_samples, text_samples
    raise ValueError(
        f"the engine parity check needs {n} training rows with an image, found {len(image_samples)} in "
        f"{dataset.num_rows} rows; lower --engine-parity-prompts or add --skip-engine-parity-check"
    )
