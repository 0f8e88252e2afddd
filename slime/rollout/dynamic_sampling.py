"""DAPO dynamic sampling with over-sampling: one training step's groups, drawn in rounds until enough pass.

A round draws ``--over-sampling-batch-size`` prompts (the data cursor counts each) and queues their
``n`` requests each; groups are scored and judged by the filter (:mod:`slime.rollout.filters`) as they
complete.  The step keeps the first ``--rollout-batch-size`` passing groups *in draw order* and stops, aborting
the groups still in flight, as soon as every group before the last of them is complete; a new round is drawn as
soon as the groups drawn could not fill the batch even if every pending one passed.  So the kept groups,
their order and the rounds depend only on each group's outcome (seeded by its position), never on which call
returns first: a resumed run draws the same.  After ``--dynamic-sampling-max-rounds`` the best rejected
groups whose verdict allows it (``fallback``) fill the batch, else the step stops with
:class:`DynamicSamplingError`.  Rationale and metrics: ``docs/design/dynamic_sampling.md``.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import statistics
import time
from typing import TYPE_CHECKING

from slime.data.sample import Sample, SampleStatus
from slime.errors import SlimeError
from slime.rollout.filters import DROP_PREFIX, NON_FINITE, NON_FINITE_METRIC, GroupVerdict, resolve_filter, verdict_of
from slime.rollout.outputs import (
    UNUSABLE,
    check_prompt_lengths,
    groups_holding,
    prompt_length_mismatches,
    record_output,
    warn_aborted,
)

if TYPE_CHECKING:
    from slime.data.dataset import PromptDataset
    from slime.rollout.config import RolloutConfig
    from slime.rollout.engines.base import GenerateOutput, GenerateRequest, SamplingParams
    from slime.rollout.rm_hub.scorer import RewardScorer, RewardStats
    from slime.rollout.scheduler import Step

logger = logging.getLogger(__name__)

PREFIX = "rollout/dynamic_sampling/"


ALWAYS_LOGGED = (*(f"{PREFIX}dropped_{why}" for why in ("surplus", "cancelled", "unusable")), DROP_PREFIX + NON_FINITE)
"""The drop metrics written every step, 0 when nothing was dropped for them."""


class DynamicSamplingError(SlimeError, RuntimeError):
    """The rounds ran out before ``--rollout-batch-size`` groups passed the filter (and no fallback filled it)."""


PENDING, PASSED, REJECTED, UNUSABLE = "pending", "passed", "rejected", "unusable"


class DynamicSampler:
    """Samples one step's groups from the rollout manager's ``dataset`` (its cursor), scored by its ``scorer``.

    Args:
        cfg, dataset, scorer: the manager's flags, prompt stream and reward scorer.
        make_requests: ``(samples, params, rollout_id, stream, first) -> requests`` (the manager's
            :meth:`~slime.rollout.manager.RolloutManager.requests`: sample ``k`` is the step's position ``first + k``).

    Raises:
        ConfigError: ``--dynamic-sampling-filter-path`` does not import.
    """

    def __init__(self, cfg: RolloutConfig, dataset: PromptDataset, scorer: RewardScorer, make_requests):
        self.cfg, self.dataset, self.scorer, self.make_requests = cfg, dataset, scorer, make_requests
        path = cfg.dynamic_sampling_filter_path
        self.filter = resolve_filter(path) if path is not None else None

    def sample(self, rollout_id: int, engines, params: SamplingParams,
               reward_stats: RewardStats) -> tuple[list[Sample], dict[str, float]]:
        """Run the step's rounds (see the module docstring) on ``engines`` (a
        :class:`~slime.ray.engine_group.RolloutEngineGroup`, ``generate(requests, on_outputs)``); the scorer's
        counts go into ``reward_stats``.

        Returns:
            The ``rollout_batch_size * n`` samples of the kept groups, ``group_index`` ``0 .. rollout_batch_size - 1``
            in draw order, scored (rewards before shaping), and the step's metrics.

        Raises:
            DynamicSamplingError: the rounds ran out short of passing (or fallback) groups.
            PromptMismatchError: too many prompt length mismatches among the generated samples.
            EngineError: see :meth:`RequestScheduler.generate`.
        """
        self.rollout_id, self.n, self.target = rollout_id, self.cfg.n_samples_per_prompt, self.cfg.rollout_batch_size
        self.params, self.reward_stats = params, reward_stats
        self.samples: list[Sample] = []
        self.outputs: list[GenerateOutput | None] = []
        self.requests: list[GenerateRequest] = []
        self.seconds: list[float] = []  # per request: its call's seconds split evenly over the call's requests
        self.state: list[str] = []
        self.verdicts: list[GroupVerdict | None] = []
        self.rounds, self.decided = 0, False
        start = time.monotonic()
        first = self._draw_round()
        engines.generate(first, on_outputs=self._on_outputs)  # the outputs of done groups are recorded
        seconds = time.monotonic() - start
        done = [g for g, state in enumerate(self.state) if state != PENDING]
        idx = [g * self.n + j for g in done for j in range(self.n)]
        if idx:  # the messages name each sample's request (rid, engine) as sent
            samples, reqs, outs = ([xs[i] for i in idx] for xs in (self.samples, self.requests, self.outputs))
            check_prompt_lengths(samples, reqs, outs, self.cfg.max_prompt_length_mismatch_fraction)
            warn_aborted(samples, reqs, outs, "train")
        kept, fallback = self._kept()
        metrics = self._metrics(kept, fallback, seconds)
        batch = []
        for position, g in enumerate(kept):
            for sample in self.samples[g * self.n : (g + 1) * self.n]:
                sample.group_index = position
                batch.append(sample)
        return batch, metrics

    # -- rounds ------------------------------------------------------------------------

    def _draw_round(self) -> list[GenerateRequest]:
        """Draw the next round's prompts; returns their requests (positions continue the step's)."""
        self.rounds += 1
        prompts = self.dataset.next_batch(self.cfg.over_sampling_batch_size)
        new = [p.clone_prompt() for p in prompts for _ in range(self.n)]
        first = len(self.samples)
        for k, sample in enumerate(new):
            sample.group_index = (first + k) // self.n  # the group's draw position until it is kept
        self.samples += new
        self.outputs += [None] * len(new)
        self.seconds += [0.0] * len(new)
        self.state += [PENDING] * len(prompts)
        self.verdicts += [None] * len(prompts)
        requests = self.make_requests(new, self.params, self.rollout_id, "train", first)
        self.requests += requests
        return requests

    def _on_outputs(self, step: Step, indices: list[int], outputs: list[GenerateOutput], seconds: float) -> None:
        for i in indices:
            self.seconds[i] += seconds / len(indices)
        if step.stopped:  # a call drained after the stop: its time counts, its groups are cancelled
            return
        for i, out in zip(indices, outputs):
            self.outputs[i] = out
            record_output(self.samples[i], out)
            if prompt_length_mismatches([self.samples[i]], [out]):
                self.samples[i].status = SampleStatus.FAILED
        complete = sorted({i // self.n for i in indices if all(
            self.outputs[k] is not None for k in range((i // self.n) * self.n, (i // self.n + 1) * self.n))})
        complete = [g for g in complete if self.state[g] == PENDING]
        groups = {g: self.samples[g * self.n : (g + 1) * self.n] for g in complete}
        scored = [s for g in complete for s in groups[g] if s.status not in UNUSABLE]
        for sample, reward in zip(scored, self.scorer.score([s.response for s in scored], [s.label for s in scored],
                                                              self.reward_stats)):
            sample.reward = float(reward)
        for g in complete:
            if any(s.status in UNUSABLE for s in groups[g]):
                self.state[g] = UNUSABLE
                continue
            verdict = verdict_of(self.filter, groups[g])  # a NaN reward drops the group, filter or not
            self.verdicts[g], self.state[g] = verdict, PASSED if verdict.keep else REJECTED
        self._advance(step)

    def _advance(self, step: Step) -> None:
        """Stop once the kept groups are known; draw a round once the groups drawn cannot fill the batch."""
        passed = 0
        for state in self.state:
            if state == PENDING:
                break
            passed += state == PASSED
            if passed == self.target:
                self.decided = True
                step.stop()
                return
        counts = collections.Counter(self.state)
        if counts[PASSED] + counts[PENDING] < self.target and self.rounds < self.cfg.dynamic_sampling_max_rounds:
            step.add(self._draw_round())

    def _kept(self) -> tuple[list[int], list[int]]:
        """(kept groups in draw order, the fallback groups among them)."""
        passed = [g for g, state in enumerate(self.state) if state == PASSED]
        if self.decided:
            return passed[: self.target], []
        spare = sorted((g for g, state in enumerate(self.state) if state == REJECTED and self.verdicts[g].fallback),
                       key=lambda g: (-self.verdicts[g].score, g))
        if len(passed) + len(spare) < self.target:
            reasons = dict(self._dropped_reasons(set(passed)))
            raise DynamicSamplingError(
                f"rollout {self.rollout_id}: {self.rounds} sampling round(s) of {self.cfg.over_sampling_batch_size} "
                f"prompts gave {len(passed)} groups that pass --dynamic-sampling-filter-path "
                f"{self.cfg.dynamic_sampling_filter_path} (dropped: {reasons or 'none'}), short of "
                f"--rollout-batch-size {self.target}. Raise --dynamic-sampling-max-rounds (now "
                f"{self.cfg.dynamic_sampling_max_rounds}) or --over-sampling-batch-size, or use a fallback filter "
                "(nonzero_std_with_fallback) that fills the batch with the best rejected groups"
            )
        fallback = spare[: self.target - len(passed)]
        if fallback:
            logger.warning(
                "rollout %d: %d sampling round(s) gave %d of --rollout-batch-size %d groups that pass "
                "--dynamic-sampling-filter-path %s; the batch is filled with %d rejected group(s) (fallback; "
                "rollout/dynamic_sampling/groups_fallback)", self.rollout_id, self.rounds, len(passed), self.target,
                self.cfg.dynamic_sampling_filter_path, len(fallback))
        return sorted(passed + fallback), fallback

    # -- metrics -----------------------------------------------------------------------

    def _dropped_reasons(self, kept: set[int]) -> collections.Counter:
        """Metric name -> groups not kept: the filter's drops (``rollout/dynamic_filter/drop_<reason>``, upstream's
        names) and ours (``rollout/dynamic_sampling/dropped_{surplus,cancelled,unusable}``)."""
        reasons: collections.Counter = collections.Counter()
        for g, state in enumerate(self.state):
            if g in kept:
                continue
            if state == REJECTED:
                reasons[DROP_PREFIX + _metric_name(self.verdicts[g].reason or "filtered")] += 1
            else:  # passed beyond the batch, cut off by the stop, or holding an aborted / mismatching sample
                why = {PASSED: "surplus", PENDING: "cancelled", UNUSABLE: "unusable"}[state]
                reasons[f"{PREFIX}dropped_{why}"] += 1
        return reasons

    def _metrics(self, kept: list[int], fallback: list[int], seconds: float) -> dict[str, float]:
        """The ``rollout/dynamic_sampling/*`` and ``rollout/dynamic_filter/drop_*`` metrics; see
        ``docs/design/dynamic_sampling.md``."""
        generated = [g for g, state in enumerate(self.state) if state != PENDING]
        done = [s for g in generated for s in self.samples[g * self.n : (g + 1) * self.n]]
        rewards = [s.reward for s in done if s.status not in UNUSABLE and math.isfinite(s.reward)]
        total = sum(self.seconds)
        kept_s = sum(self.seconds[g * self.n + j] for g in kept for j in range(self.n))
        metrics = {
            "rounds": self.rounds,
            "groups_drawn": len(self.state),
            "groups_generated": len(generated),
            "groups_passed": sum(state == PASSED for state in self.state),
            "groups_kept": len(kept),
            "groups_fallback": len(fallback),
            "dropped_generation_time_frac": (total - kept_s) / total if total > 0 else 0.0,
            "generate_time_s": seconds,
            "generated_reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        }
        out = {PREFIX + k: float(v) for k, v in metrics.items()}
        # Every step, 0 when nothing was dropped (a continuous series in the plots): our reasons and the one every
        # filter shares; a filter's own reasons (zero_std_<reward>, ...) only when they occur.
        out.update({name: 0.0 for name in ALWAYS_LOGGED})
        out.update({name: float(n) for name, n in self._dropped_reasons(set(kept)).items()})
        # The engine-side faults of every generated group (the kept ones have none).
        out["rollout/prompt_length_mismatches"] = float(sum(s.status == SampleStatus.FAILED for s in done))
        out["rollout/prompt_length_mismatch_groups"] = float(groups_holding(done, self.n, SampleStatus.FAILED))
        out["rollout/aborted_samples"] = float(sum(s.status == SampleStatus.ABORTED for s in done))
        out["rollout/aborted_groups"] = float(groups_holding(done, self.n, SampleStatus.ABORTED))
        out[NON_FINITE_METRIC] = float(sum(v is not None and v.reason == NON_FINITE for v in self.verdicts))
        return out


def _metric_name(reason: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", reason)
