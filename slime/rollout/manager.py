"""The rollout manager: prompts -> engines -> n samples each -> rewards -> group advantages.

It owns the training prompt stream (with its resumable cursor), the eval datasets, the
reward scorer and a handle on the rollout engines. :meth:`RolloutManager.generate`
returns one rollout step's samples, ready for the trainers; :meth:`evaluate` scores the
``--eval-prompt-data`` sets and returns only metrics, so eval data never reaches training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slime.data.config import DataConfig
from slime.data.dataset import PromptDataset, load_eval_samples
from slime.data.processor import VLProcessor
from slime.data.sample import Sample, SampleStatus
from slime.errors import SlimeError
from slime.grpo.advantages import compute_advantages
from slime.grpo.config import GRPOConfig
from slime.rollout.config import EvalConfig, RolloutConfig
from slime.rollout.outputs import (  # noqa: F401 - PromptMismatchError: re-exported
    ABORT_CAUSES,
    UNUSABLE,
    PromptMismatchError,
    groups_holding,
    record_outputs,
)
from slime.rollout.dynamic_sampling import DynamicSampler
from slime.rollout.filters import NON_FINITE_METRIC, NON_FINITE_WARNING
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.rm_hub.config import RewardConfig
from slime.rollout.replay import load_rollout, replay_path, save_rollout
from slime.rollout.rm_hub.scorer import RewardScorer, RewardStats
from slime.rollout.seeds import sampling_seed
from slime.utils.metrics import json_value

if TYPE_CHECKING:  # the engine group imports Ray; the flags import this module's neighbours (parity)
    from slime.ray.engine_group import RolloutEngineGroup

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutBatch:
    """One rollout step's output.

    Attributes:
        samples: ``rollout_batch_size * n_samples_per_prompt`` samples; the n samples of
            a prompt are contiguous and share ``group_index``.  The groups dropped for a prompt
            length mismatch or an aborted sample (:func:`_drop_unusable_groups`) are among them,
            with ``loss_mask`` 0 and advantage 0, and so are the groups dropped for a NaN or infinite reward
            (:func:`_drop_non_finite_groups`).
        metrics: ``rollout/*`` and ``data/*`` metrics of this step.
    """

    samples: list[Sample]
    metrics: dict[str, float]


class NonFiniteRewardError(SlimeError, RuntimeError):
    """Every usable group of a training rollout holds a NaN or infinite reward, so nothing is left to train on."""


class RolloutAbortedError(SlimeError, RuntimeError):
    """Every group of a training rollout (or every sample of an eval set) was left out for an aborted
    sample (with or without prompt length mismatches), so nothing is left to train on or to measure."""


class RolloutManager:
    """Generates training rollouts and runs evaluation.

    Args:
        rollout, data, reward, grpo, evaluation: the flag groups it needs.
        processor: the one processor (pixel bounds) shared by rollout and training.
        engines: the rollout engines; may be attached later (``manager.engines = ...``), so
            that data and reward errors surface before any engine starts.
        seed: ``--rollout-seed``; fixes the prompt order (with the epoch) and, with the rollout
            id and each request's position, the request's sampling seed (:mod:`slime.rollout.seeds`).
        debug_dump: optional path template (``--save-debug-rollout-data``) for per-sample
            JSONL dumps; ``{rollout_id}`` is substituted; a replayable record goes beside each
            (:mod:`slime.rollout.replay`).
        replay_from: ``--load-debug-rollout-data``: :meth:`generate` reads the saved rollouts instead of
            generating (no engines; the prompt cursor does not move).
        fingerprint: the model's (:func:`slime.rollout.replay.model_fingerprint`), written into and checked
            against the saved rollouts.
        return_routed_experts: ask the engines for each training sample's routed experts
            (:func:`slime.routing_replay.rollout_routes_wanted`), kept on ``rollout_routed_experts``.
        replay_needs_routes: ``--use-rollout-routing-replay`` with ``replay_from``: a saved rollout without
            routes is a ``ReplayError`` naming the file.
    """

    def __init__(
        self,
        *,
        rollout: RolloutConfig,
        data: DataConfig,
        reward: RewardConfig,
        grpo: GRPOConfig,
        evaluation: EvalConfig,
        processor: VLProcessor,
        engines: RolloutEngineGroup | None,
        seed: int,
        debug_dump: str | None = None,
        replay_from: str | None = None,
        fingerprint: dict | None = None,
        return_routed_experts: bool = False,
        replay_needs_routes: bool = False,
    ):
        self.cfg, self.grpo, self.eval_cfg = rollout, grpo, evaluation
        self.return_routed_experts, self.replay_needs_routes = return_routed_experts, replay_needs_routes
        if grpo.overlong_filter and grpo.stop_properly_penalty_coef is not None:
            logger.warning(
                "--overlong-filter and --stop-properly-penalty-coef %g are both set, and both apply to truncated "
                "samples: their rewards are multiplied by %g and enter their groups' mean and std (moving the other "
                "samples' advantages), and their tokens are masked out of the loss (no gradient of their own). "
                "Drop one of the two flags to get only the other's effect",
                grpo.stop_properly_penalty_coef, grpo.stop_properly_penalty_coef,
            )  # fmt: skip
        self.seed = seed
        self.engines = engines
        self.debug_dump, self.replay_from, self.fingerprint = debug_dump, replay_from, fingerprint or {}
        self.dataset = PromptDataset(data, processor, seed=seed)
        self.dataset.check_usable()  # every row skipped: refused now, not in the first rollout step
        self.eval_sets = {
            name: load_eval_samples(data, processor, path) for name, path in evaluation.eval_prompt_pairs
        }
        self.scorer = RewardScorer(reward)
        self.sampler = (
            DynamicSampler(rollout, self.dataset, self.scorer, self.requests) if rollout.dynamic_sampling else None
        )
        video_pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self.vision_token_ids = {processor.image_token_id} | ({video_pad} if isinstance(video_pad, int) else set())

    # -- training rollouts -------------------------------------------------------------

    def generate(self, rollout_id: int) -> RolloutBatch:
        """Sample ``--n-samples-per-prompt`` responses for the next ``--rollout-batch-size`` prompts.

        Rewards are scored against each prompt's label, truncated samples are treated as
        ``--stop-properly-penalty-coef`` / ``--overlong-filter`` say (:func:`_apply_truncation_options`),
        and the rewards are turned into group advantages with the ``--advantage-estimator``
        (shared GRPO math).  A group holding a sample whose engine saw another prompt length
        (status ``FAILED``) or whose engine aborted it (status ``ABORTED``, a cut-off response) is
        left out of the loss (:func:`_drop_unusable_groups`), and counted in
        ``rollout/prompt_length_mismatches`` / ``rollout/aborted_samples`` (samples) and
        ``rollout/prompt_length_mismatch_groups`` / ``rollout/aborted_groups`` (groups holding at
        least one; a group with both counts in both).  The failed and aborted samples are not scored
        and are left out of every per-sample metric (``rollout/num_samples`` counts the others, and so
        does the scorer's ``rollout/reward_responses``); the other samples of their groups are in them.
        A group holding a NaN or infinite reward (the reward function's fault) is left out of the loss the same way
        (:func:`_drop_non_finite_groups`; dynamic sampling drops it before its filter), logged once per group and
        counted in ``rollout/non_finite_reward_groups`` (and the responses in ``rollout/reward_non_finite``); its
        finite rewards stay in the per-sample metrics.
        Sample ``i = group_index * n + j`` of the step is drawn with
        ``sampling_seed(--rollout-seed, rollout_id, i)``, so the step's responses depend neither
        on the engines' history nor on which engine serves which request (exact resume).
        With ``--dynamic-sampling-filter-path`` or an ``--over-sampling-batch-size`` above the batch, the groups
        come from :class:`~slime.rollout.dynamic_sampling.DynamicSampler` (``i`` counts every group drawn).

        Raises:
            PromptMismatchError: too many prompt length mismatches (:func:`.outputs.check_prompt_lengths`), or one
                in every group.
            RolloutAbortedError: every group holds an aborted or failed sample, not all of them a failed one.
            NonFiniteRewardError: every other group holds a NaN or infinite reward.
            DynamicSamplingError: too few groups passed the filter in ``--dynamic-sampling-max-rounds``.
        """
        n = self.cfg.n_samples_per_prompt
        if self.replay_from is not None:
            return self._replay(rollout_id)
        reward_stats = RewardStats()  # the scorer's counts (responses, timeouts, errors, ...) of this step
        if self.sampler is not None:  # rounds of over-sampled prompts, only passing groups kept
            if self.engines is None:
                raise RuntimeError("RolloutManager has no engines attached (set manager.engines first)")
            samples, sampling_metrics = self.sampler.sample(rollout_id, self.engines, self._train_sampling_params(),
                                                            reward_stats)
        else:
            prompts = self.dataset.next_batch(self.cfg.rollout_batch_size)
            samples = []
            for group_index, prompt in enumerate(prompts):
                prompt.group_index = group_index
                samples.extend(prompt.clone_prompt() for _ in range(n))
            self._generate_and_score(samples, self._train_sampling_params(), rollout_id, "train", reward_stats)
            sampling_metrics = {}
        kept, _ = _drop_unusable_groups(samples, n)
        kept, non_finite = _drop_non_finite_groups(kept, n)
        usable = [s for s in samples if s.status not in UNUSABLE]
        metrics = _sample_metrics("rollout", usable)
        metrics["rollout/prompt_length_mismatches"] = float(sum(s.status == SampleStatus.FAILED for s in samples))
        metrics["rollout/prompt_length_mismatch_groups"] = float(groups_holding(samples, n, SampleStatus.FAILED))
        metrics["rollout/aborted_samples"] = float(sum(s.status == SampleStatus.ABORTED for s in samples))
        metrics["rollout/aborted_groups"] = float(groups_holding(samples, n, SampleStatus.ABORTED))
        metrics[NON_FINITE_METRIC] = float(len(non_finite) // n)
        metrics.update(sampling_metrics)  # with dynamic sampling: the faults of every generated group
        # The reward function's verdicts above are before shaping; shaping and advantages see the kept groups only.
        metrics.update(_apply_truncation_options(kept, self.grpo))
        rewards = torch.tensor([s.reward for s in kept], dtype=torch.float64)
        advantages = compute_advantages(rewards, n, self.grpo)
        for sample, advantage in zip(kept, advantages.tolist()):
            sample.advantage = advantage
        metrics["rollout/zero_std_group_frac"] = _zero_std_group_fraction(rewards, n)
        # Image/video placeholder ids a policy generated: trainers feed them as text (backends/fsdp/backend.py).
        metrics["rollout/vision_token_responses"] = float(
            sum(any(t in self.vision_token_ids for t in s.response_token_ids) for s in usable)
        )
        metrics.update({f"data/skipped_{reason}": count for reason, count in self.dataset.skip_counts.items()})
        # The scorer's counts: only the usable samples were scored.
        metrics.update({f"rollout/reward_{k}": v for k, v in dataclasses.asdict(reward_stats).items()})
        self._dump(rollout_id, samples, metrics)
        return RolloutBatch(samples, metrics)

    def _replay(self, rollout_id: int) -> RolloutBatch:
        """The saved rollout ``rollout_id`` (``--load-debug-rollout-data``) with its saved metrics, and
        ``rollout/replayed`` 1; ``ReplayError`` (naming the file) when it is missing or does not fit."""
        samples, metrics, path = load_rollout(
            self.replay_from, rollout_id, fingerprint=self.fingerprint, n_samples_per_prompt=self.cfg.n_samples_per_prompt,
            num_samples=self.cfg.samples_per_rollout, need_routes=self.replay_needs_routes)
        logger.info("rollout %d: replaying %d saved samples from %s", rollout_id, len(samples), path)
        return RolloutBatch(samples, {**metrics, "rollout/replayed": 1.0})

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Accuracy and response statistics on every ``--eval-prompt-data`` set (no training).

        A sample whose engine saw another prompt length (status ``FAILED``) or that its engine aborted
        (status ``ABORTED``) is not scored and is left out of its set's metrics (``num_samples`` counts the
        others, ``eval/reward_responses`` the scored samples of every set), and counted in
        ``eval/<name>/prompt_length_mismatches`` or ``eval/<name>/aborted_samples``.  A NaN or infinite reward is
        left out of its set's reward mean and accuracy, warned once per set and counted in ``eval/reward_non_finite``.

        Raises:
            PromptMismatchError: too many prompt length mismatches in a set (:func:`.outputs.check_prompt_lengths`).
            RolloutAbortedError: every sample of a set was aborted or failed (no accuracy to report).
        """
        e = self.eval_cfg
        params = SamplingParams(
            max_new_tokens=e.eval_max_response_len or self.cfg.rollout_max_response_len,
            temperature=e.eval_temperature if e.eval_temperature is not None else self.cfg.rollout_temperature,
            top_p=e.eval_top_p if e.eval_top_p is not None else self.cfg.rollout_top_p,
            top_k=self.cfg.rollout_top_k,
            stop=self.cfg.rollout_stop,
            stop_token_ids=self.cfg.rollout_stop_token_ids,
        )
        metrics: dict[str, float] = {}
        reward_stats = RewardStats()  # over every set
        for name, prompts in self.eval_sets.items():
            samples = [p.clone_prompt() for p in prompts for _ in range(e.n_samples_per_eval_prompt)]
            self._generate_and_score(samples, params, rollout_id, f"eval/{name}", reward_stats)
            usable = [s for s in samples if s.status not in UNUSABLE]
            failed, aborted = (sum(s.status == status for s in samples) for status in UNUSABLE)
            if not usable:  # check_prompt_lengths stops an all-failed set: some were aborted
                raise RolloutAbortedError(
                    f"every one of the {len(samples)} samples of eval set {name!r} at rollout {rollout_id} was aborted "
                    f"by the rollout engine ({aborted}) or saw another prompt length ({failed}), so the set has no "
                    f"accuracy; see the warnings above for the first few. {ABORT_CAUSES}"
                )
            non_finite = sum(not math.isfinite(s.reward) for s in usable)
            if non_finite:
                logger.warning("eval %s at rollout %d: the reward function gave %d of %d samples a NaN or infinite "
                               "reward; they are left out of its reward_mean and accuracy (eval/reward_non_finite)",
                               name, rollout_id, non_finite, len(usable))
            metrics.update(_sample_metrics(f"eval/{name}", usable))
            metrics[f"eval/{name}/prompt_length_mismatches"] = float(failed)
            metrics[f"eval/{name}/aborted_samples"] = float(aborted)
            logger.info("eval %s at rollout %d: accuracy %.4f over %d samples", name, rollout_id,
                        metrics[f"eval/{name}/accuracy"], len(usable))
        metrics.update({f"eval/reward_{k}": v for k, v in dataclasses.asdict(reward_stats).items()})
        return metrics

    # -- helpers -----------------------------------------------------------------------

    def _train_sampling_params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            max_new_tokens=c.rollout_max_response_len,
            temperature=c.rollout_temperature,
            top_p=c.rollout_top_p,
            top_k=c.rollout_top_k,
            stop=c.rollout_stop,
            stop_token_ids=c.rollout_stop_token_ids,
        )

    def _generate_and_score(self, samples: list[Sample], params: SamplingParams, rollout_id: int, stream: str,
                            reward_stats: RewardStats) -> None:
        """Generate one response per sample (request ``i`` seeded by :func:`sampling_seed` of its
        position ``i``), record it on the sample and score it (the scorer's counts into ``reward_stats``).  A sample
        whose engine saw another prompt length gets status ``FAILED``
        (:func:`slime.rollout.outputs.check_prompt_lengths`, which raises :class:`PromptMismatchError` when too many
        do); one whose engine answered ``finish_reason "abort"`` gets ``ABORTED`` (a warning names the first few,
        :func:`.outputs.warn_aborted`).  Those two keep ``reward`` None: only the other samples are scored."""
        if self.engines is None:
            raise RuntimeError("RolloutManager has no engines attached (set manager.engines first)")
        requests = self.requests(samples, params, rollout_id, stream)
        outputs = self.engines.generate(requests)
        record_outputs(samples, requests, outputs, self.cfg.max_prompt_length_mismatch_fraction, stream)
        # Neither a failed nor an aborted sample is scored: its reward would be a verdict on a response the
        # trainer cannot use (another prompt, or a cut-off one), and it would enter the scorer's counts.
        # Upstream slime does not score an aborted sample either (its generate_and_rm returns it unscored).
        scored = [s for s in samples if s.status not in UNUSABLE]
        rewards = self.scorer.score([s.response for s in scored], [s.label for s in scored], reward_stats)
        for sample, reward in zip(scored, rewards):
            sample.reward = float(reward)

    def requests(self, samples: list[Sample], params: SamplingParams, rollout_id: int, stream: str,
                 first: int = 0) -> list[GenerateRequest]:
        """One request per sample; sample ``k`` is position ``first + k`` of the step (its seed and rid); training
        requests ask for routed experts where :attr:`return_routed_experts` says so."""
        return [
            GenerateRequest(
                text=s.prompt,
                image_data=s.images,
                sampling_params=dataclasses.replace(params, sampling_seed=self._seed(rollout_id, i, stream)),
                rid=f"{s.index}:{i}",
                return_routed_experts=self.return_routed_experts and stream == "train",
            )
            for i, s in enumerate(samples, start=first)
        ]

    def _seed(self, rollout_id: int, sample_index: int, stream: str) -> int:
        return sampling_seed(self.seed, rollout_id, sample_index, stream)

    def _dump(self, rollout_id: int, samples: list[Sample], metrics: dict[str, float]) -> None:
        if not self.debug_dump:
            return
        path = Path(self.debug_dump.format(rollout_id=rollout_id))
        save_rollout(replay_path(path), rollout_id, samples, metrics, self.fingerprint, self.cfg.n_samples_per_prompt)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for s in samples:  # reward None: a failed or aborted sample, not scored
                f.write(json.dumps({  # a NaN / inf reward as the string metrics.jsonl uses: strict JSON
                    "rollout_id": rollout_id, "index": s.index, "group_index": s.group_index, "label": s.label,
                    "response": s.response, "reward": json_value(s.reward), "advantage": json_value(s.advantage),
                    "status": s.status.value,
                    "in_loss": any(s.loss_mask or ()),  # False: a dropped group's sample, or fully masked
                    "response_length": s.response_length, "prompt": s.prompt,
                }, allow_nan=False) + "\n")

    def state_dict(self) -> dict:
        """What a resumed run needs: the prompt cursor (epoch, position, skip counts)."""
        return {"dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])

    def close(self) -> None:
        self.scorer.close()


def _sample_metrics(prefix: str, samples: list[Sample]) -> dict[str, float]:
    """Reward, accuracy (fraction of samples with reward >= 1, i.e. correct under a binary
    reward), response length (tokens) and truncation statistics of ``samples``.  The reward mean and accuracy are
    over the finite rewards only (a NaN or infinite one is the reward function's fault, counted by the scorer's
    ``reward_non_finite``); NaN when there is none."""
    rewards = [s.reward for s in samples if math.isfinite(s.reward)]
    lengths = [s.response_length for s in samples]
    truncated = sum(s.status == SampleStatus.TRUNCATED for s in samples)
    return {
        f"{prefix}/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        f"{prefix}/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else math.nan,
        f"{prefix}/response_len_mean": statistics.fmean(lengths),
        f"{prefix}/response_len_max": float(max(lengths)),
        f"{prefix}/truncated_frac": truncated / len(samples),
        f"{prefix}/truncated_count": float(truncated),
        f"{prefix}/num_samples": float(len(samples)),
    }


def _apply_truncation_options(samples: list[Sample], grpo: GRPOConfig) -> dict[str, float]:
    """Treat the truncated samples (status ``TRUNCATED``: cut at ``--rollout-max-response-len``)
    of a training step as the flags say, in place, and count them.

    - default: nothing changes; a truncated response that already holds a correct box keeps
      its reward 1 (upstream slime).
    - ``--stop-properly-penalty-coef c``: ``reward <- c * reward`` (ProRL, Liu et al. 2025,
      "stop properly" penalty; OpenRLHF's flag), before advantages, so with ``c = 0`` a
      truncated sample ranks with the wrong answers of its group.
    - ``--overlong-filter``: ``loss_mask <- 0`` on every response token (DAPO, Yu et al. 2025,
      "overlong filtering"); the sample gives no gradient, but its reward still enters its
      group's mean and std.  Under the default per-sample loss it still counts in the number
      of samples that normalises the loss (as a sample whose tokens are all masked does).

    Returns:
        ``rollout/truncated_rewarded_count`` (truncated samples the reward function gave a
        reward > 0), ``rollout/truncated_reward_penalized_count`` (rewards the coefficient
        changed), ``rollout/loss_masked_samples`` (samples ``--overlong-filter`` masked), and
        with a coefficient, ``rollout/shaped_reward_mean`` (the mean reward advantages see).
    """
    truncated = [s for s in samples if s.status == SampleStatus.TRUNCATED]
    metrics = {
        "rollout/truncated_rewarded_count": float(sum(s.reward > 0 for s in truncated)),
        "rollout/truncated_reward_penalized_count": 0.0,
        "rollout/loss_masked_samples": 0.0,
    }
    coef = grpo.stop_properly_penalty_coef
    if coef is not None:
        for sample in truncated:
            shaped = coef * sample.reward
            metrics["rollout/truncated_reward_penalized_count"] += float(shaped != sample.reward)
            sample.reward = shaped
        metrics["rollout/shaped_reward_mean"] = statistics.fmean(s.reward for s in samples)
    if grpo.overlong_filter:
        for sample in truncated:
            sample.loss_mask = [0] * sample.response_length
        metrics["rollout/loss_masked_samples"] = float(len(truncated))
    return metrics


def _drop_unusable_groups(samples: list[Sample], n: int) -> tuple[list[Sample], list[Sample]]:
    """Leave every group that holds a ``FAILED`` sample (its engine saw another prompt) or an ``ABORTED`` one
    (its engine cut the response off) out of the loss.

    GRPO advantages compare the ``n`` responses of one prompt, so a group missing one is not a
    group; a failed response was generated from other tokens than the trainer would feed, and an
    aborted one stops wherever the engine stopped (scoring it, as 0 mostly, would bias the group's
    mean and std).  The dropped samples stay in the batch, so its size (a multiple of ``--global-batch-size``,
    split evenly over the data-parallel ranks) is unchanged, but give no gradient: ``loss_mask`` 0 on every
    response token and advantage 0.  As for ``--overlong-filter``, under the default per-sample
    loss they still count in the number of samples that normalises the loss; with
    ``--calculate-per-token-loss`` they count nowhere.

    Upstream slime never trains on an aborted group either, but gets there another way: its rollout
    aborts only the requests left over once it has enough groups (over-sampling), so they are not in the
    step, and with ``--partial-rollout`` it puts those groups back into its data buffer to finish later.
    Here every request of the step is one of its groups, so the group is dropped rather than refilled.

    When every group is dropped the step has nothing to train on, and it stops, as for prompt length
    mismatches: an optimizer step on all-masked samples would still move the weights (AdamW's momentum
    and weight decay) and advance the LR schedule on no signal, and aborts in every group are a
    systematic fault of the engines (paused during generation, or aborting what they cannot admit), not bad luck.

    Args:
        samples: a step's samples, ``n`` contiguous per group.
        n: ``--n-samples-per-prompt``.

    Returns:
        (kept samples, dropped samples), each in batch order and made of whole groups.

    Raises:
        PromptMismatchError: every group holds a failed sample (nothing left to train on).
        RolloutAbortedError: every group holds a failed or an aborted sample, not every one a failed one.
    """
    kept, dropped = _split_groups(samples, n, lambda group: any(s.status in UNUSABLE for s in group))
    if kept:
        return kept, dropped
    groups = len(samples) // n
    failed, aborted = (sum(s.status == status for s in samples) for status in UNUSABLE)
    failed_groups, aborted_groups = (groups_holding(samples, n, status) for status in UNUSABLE)
    if failed_groups == groups:
        raise PromptMismatchError(
            f"every one of the {groups} groups of this rollout holds a sample whose prompt has another "
            f"length in the rollout engine than in the data pipeline ({failed} samples; see the warning above for "
            "the first few and the likely cause), so no group is left to train on; fix the engine's processor / chat "
            "template / pixel bounds"
        )
    raise RolloutAbortedError(
        f"every one of the {groups} groups of this rollout holds a sample the rollout engine aborted ({aborted} "
        f"samples in {aborted_groups} groups) or one whose prompt has another length in the engine than in the data "
        f"pipeline ({failed} samples in {failed_groups} groups), so no group is left to train on; see the warnings "
        f"above for the first few. {ABORT_CAUSES}"
    )


def _drop_non_finite_groups(samples: list[Sample], n: int) -> tuple[list[Sample], list[Sample]]:
    """Leave every group holding a NaN or infinite reward out of the loss (``loss_mask`` 0, advantage 0, as
    :func:`_drop_unusable_groups`), with one warning per group (dynamic sampling's, :data:`.filters.NON_FINITE_WARNING`).

    The reward function returned it (the scorer passes a non-finite float on rather than score it 0.0): its group's
    mean and std, hence every advantage of the group, would be NaN, and a made-up 0.0 would train the group on a
    verdict nobody gave.  Dynamic sampling drops such a group before its filter (upstream slime drops it there as
    a zero-std group) and draws another; here the batch keeps its size and the group gives no gradient, but its
    samples still count in the default sample-mean normaliser (the step's sample count, as upstream's), so the kept
    groups' gradient shrinks by their share of the batch (with ``--calculate-per-token-loss`` they count 0 tokens).

    Args:
        samples: a step's scored samples (``reward`` a float), ``n`` contiguous per group.
        n: ``--n-samples-per-prompt``.

    Returns:
        (kept samples, dropped samples), each in batch order and made of whole groups.

    Raises:
        NonFiniteRewardError: every group holds a non-finite reward (nothing left to train on).
    """
    def non_finite(group: list[Sample]) -> bool:
        if all(math.isfinite(s.reward) for s in group):
            return False
        logger.warning(NON_FINITE_WARNING, group[0].index, [s.reward for s in group], NON_FINITE_METRIC)
        return True

    kept, dropped = _split_groups(samples, n, non_finite)
    if samples and not kept:
        raise NonFiniteRewardError(
            f"every one of the {len(samples) // n} usable groups of this rollout holds a NaN or infinite reward, so no "
            "group is left to train on; the reward function (--custom-rm-path / --rm-type) returned them: see the "
            "warnings above for the groups and rewards"
        )
    return kept, dropped


def _split_groups(samples: list[Sample], n: int, drop) -> tuple[list[Sample], list[Sample]]:
    """(kept, dropped) whole groups of ``n`` contiguous ``samples``; ``drop(group)`` True leaves the group out of the
    loss, in place: ``loss_mask`` 0 on every response token and advantage 0."""
    kept, dropped = [], []
    for start in range(0, len(samples), n):
        group = samples[start : start + n]
        if drop(group):
            for sample in group:
                sample.loss_mask = [0] * sample.response_length
                sample.advantage = 0.0
            dropped.extend(group)
        else:
            kept.extend(group)
    return kept, dropped


def _zero_std_group_fraction(rewards: torch.Tensor, n: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no GRPO signal)."""
    groups = rewards.view(-1, n)
    return (groups.max(dim=1).values == groups.min(dim=1).values).double().mean().item()
