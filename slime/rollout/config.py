"""Rollout flags: generation (ROLLOUT_ARGS), evaluation (EVAL_ARGS) and the engine parity check
(:mod:`slime.rollout.parity`), ordinary flag groups (see :mod:`slime.utils.config`).  The SGLang pass-through
(SGLANG_ARGS) is the SGLang engine's: :class:`slime.rollout.engines.sglang.flags.SGLangConfig`.
"""

from __future__ import annotations

import dataclasses

from slime.rollout.engines import ENGINES
from slime.utils.config import ConfigError, check_at_least_one, check_name_or_import_path, flag

DEFAULT_MAX_ROUNDS = 10
"""``--dynamic-sampling-max-rounds`` when a filter is set and the flag is not."""


def _check_sampling(prefix: str, temperature: float | None, top_p: float | None, *, greedy_ok: bool) -> None:
    """Shared sampling-parameter checks for the rollout and eval groups.

    Raises:
        ConfigError: a negative temperature; temperature 0 where greedy decoding is not allowed
            (``greedy_ok=False``: training rollouts, where greedy decoding gives every sample of a
            GRPO group the same response, hence zero advantage); top_p outside (0, 1].
    """
    if temperature is not None and (temperature < 0 or (temperature == 0 and not greedy_ok)):
        if greedy_ok:
            bound, fix = ">= 0", "use 0 for greedy decoding or > 0 to sample, e.g. 1.0"
        else:
            bound = "> 0"
            fix = "GRPO needs sampled (not greedy) responses, e.g. 1.0 (greedy evaluation: --eval-temperature 0)"
        raise ConfigError(f"--{prefix}-temperature must be {bound}, got {temperature}; {fix}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"--{prefix}-top-p must be in (0, 1], got {top_p}; 1.0 disables nucleus sampling")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Rollout generation (ROLLOUT_ARGS): how many steps, how many prompts and samples, how to sample."""

    rollout_backend: str = flag(
        "sglang",
        help="Rollout engine: sglang (SGLang servers on GPUs), transformers (Hugging Face generate; CPU or GPU, "
        "for tests and small models) or a 'package.module:Class' path.",
    )
    num_rollout: int | None = flag(
        None, help="Rollout steps to run (each one: generate, reward, train, sync weights). Give this or --num-epoch."
    )
    num_epoch: int | None = flag(
        None,
        help="Passes over the prompt data; the number of rollout steps is num_epoch * prompts // "
        "rollout_batch_size, computed once the data is loaded. Give this or --num-rollout.",
    )
    rollout_batch_size: int = flag(help="Prompts per rollout step.")
    n_samples_per_prompt: int = flag(
        1, help="Responses sampled per prompt (the GRPO group size); a step yields rollout_batch_size * this samples."
    )
    rollout_max_response_len: int = flag(
        help="Maximum response length, tokens (SGLang's max_new_tokens). Required: engines' own defaults are short."
    )
    rollout_temperature: float = flag(
        1.0, help="Sampling temperature during rollout; must be > 0 (GRPO needs different responses per prompt)."
    )
    rollout_top_p: float = flag(1.0, help="Nucleus sampling mass during rollout, in (0, 1]; 1.0 = off.")
    rollout_top_k: int = flag(-1, help="Sample only from the k most likely tokens during rollout; -1 = off.")
    rollout_stop: list[str] | None = flag(None, help="Stop strings for rollout (the response ends before them).")
    rollout_stop_token_ids: list[int] | None = flag(
        None, help="Stop token ids for rollout (>= 0), for special tokens that are awkward to type as strings."
    )
    rollout_seed: int = flag(
        42,
        help="Seed of the prompt shuffle and of every request's sampling seed (derived from it, the rollout id and "
        "the sample's position: resumed runs draw the same responses as uninterrupted ones).",
    )
    rollout_engine_start_timeout: float = flag(
        1800.0,
        help="Seconds the rollout engines may take to start (load weights, capture CUDA graphs) until their "
        "health check passes; an engine that is not healthy by then stops the run with its index, node and bundles.",
    )

    over_sampling_batch_size: int | None = flag(
        None,
        help="Prompts drawn per sampling round (upstream slime's flag). A step draws rounds of this many prompts "
        "until --rollout-batch-size groups pass --dynamic-sampling-filter-path (every group without a filter), "
        "keeps the first of them in draw order and aborts the groups still in flight. Unset = --rollout-batch-size; "
        "must be >= it. The data cursor counts every prompt drawn.",
    )
    dynamic_sampling_filter_path: str | None = flag(
        None, metavar="NAME_OR_PATH",
        help="DAPO dynamic sampling: the filter that decides whether a group of scored samples may train: "
        "nonzero_std (its rewards vary), nonzero_std_with_fallback (the same; once --dynamic-sampling-max-rounds "
        "are spent, the best rejected groups fill the batch instead of stopping the run), upstream's "
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std[_with_fallback] (the same "
        "two), or a 'package.module:function' taking the group's list of samples and returning a "
        "slime.rollout.filters.GroupVerdict or a bool. Unset = no filter. Eval is never filtered.",
    )
    dynamic_sampling_max_rounds: int | None = flag(
        None,
        help="Most sampling rounds of --over-sampling-batch-size prompts per rollout step (not in upstream slime, "
        "which samples until the batch is full; NeMo-RL's dynamic_sampling_max_gen_batches). When they give fewer "
        "than --rollout-batch-size passing groups the step stops with an error, or, with a fallback filter, fills "
        f"the batch with the best rejected groups. Only with dynamic sampling (a filter, or over-sampling); unset = "
        f"{DEFAULT_MAX_ROUNDS}.",
    )

    partial_rollout: bool = flag(
        False,
        help="Upstream slime's partial rollout (put the groups aborted at a dynamic-sampling step's stop back into the "
        "data buffer and continue their responses in a later step) is refused: the engines here cannot resume a "
        "response, and an exact resume would need the half-made responses checkpointed. The aborted groups are "
        "dropped and their prompts counted in the data cursor.",
    )
    max_prompt_length_mismatch_fraction: float = flag(
        0.1,
        help="Largest fraction of a rollout's (or an eval set's) samples whose prompt length in the engine may differ "
        "from the data pipeline's before the run stops (PromptMismatchError). Below it, each mismatching sample is "
        "an error of that sample, counted (rollout/prompt_length_mismatches) and logged: its GRPO group is left out "
        "of the loss, and it is left out of the eval metrics. A rollout where every sample mismatches always stops "
        "(a misconfigured processor, chat template or pixel bounds). In [0, 1]; 0 = any mismatch stops the run.",
    )

    def __post_init__(self):
        check_name_or_import_path("--rollout-backend", self.rollout_backend, ENGINES.names())
        if self.num_rollout is None and self.num_epoch is None:
            raise ConfigError("give --num-rollout N (rollout steps) or --num-epoch N (passes over the prompt data)")
        if self.num_rollout is not None and self.num_epoch is not None:
            raise ConfigError(
                f"--num-rollout {self.num_rollout} and --num-epoch {self.num_epoch} both given; keep one of them"
            )
        check_at_least_one(
            self, "num_rollout", "num_epoch", "rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len"
        )
        _check_sampling("rollout", self.rollout_temperature, self.rollout_top_p, greedy_ok=False)
        if not self.rollout_engine_start_timeout > 0:  # also refuses NaN
            raise ConfigError(
                f"--rollout-engine-start-timeout must be > 0 seconds, got {self.rollout_engine_start_timeout}; "
                "e.g. 1800 for a large model"
            )
        if not 0 <= self.max_prompt_length_mismatch_fraction <= 1:  # also refuses NaN
            raise ConfigError(
                "--max-prompt-length-mismatch-fraction must be in [0, 1], got "
                f"{self.max_prompt_length_mismatch_fraction}; e.g. 0.1, or 0 to stop at the first mismatch"
            )
        self._check_dynamic_sampling()
        if self.partial_rollout:
            raise ConfigError(
                "--partial-rollout (upstream: the groups aborted when a dynamic-sampling step stops go back to the "
                "data buffer and a later step continues their responses) is not supported: the rollout engines here "
                "cannot resume a half-made response, and an exact resume would need those responses checkpointed; "
                "the aborted groups are dropped (their prompts counted in the data cursor, "
                "rollout/dynamic_sampling/dropped_cancelled). Drop the flag"
            )
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ConfigError(f"--rollout-top-k must be -1 (off) or >= 1, got {self.rollout_top_k}")
        negative = [token_id for token_id in self.rollout_stop_token_ids or [] if token_id < 0]
        if negative:
            raise ConfigError(
                f"--rollout-stop-token-ids must be token ids >= 0, got {' '.join(map(str, negative))} in "
                f"{' '.join(map(str, self.rollout_stop_token_ids))}; use the tokenizer's id of the stop token"
            )

    def _check_dynamic_sampling(self) -> None:
        from slime.rollout.filters import FILTERS, check_filter_path

        if self.over_sampling_batch_size is None:
            self.over_sampling_batch_size = self.rollout_batch_size
        if self.over_sampling_batch_size < self.rollout_batch_size:
            raise ConfigError(
                f"--over-sampling-batch-size {self.over_sampling_batch_size} must be >= --rollout-batch-size "
                f"{self.rollout_batch_size} (prompts drawn per round, at least one batch); leave it unset for "
                "--rollout-batch-size"
            )
        if not self.dynamic_sampling:
            if self.dynamic_sampling_max_rounds is not None:
                raise ConfigError(
                    f"--dynamic-sampling-max-rounds {self.dynamic_sampling_max_rounds} caps the sampling rounds of "
                    "dynamic sampling, which is off: set --dynamic-sampling-filter-path (or an "
                    "--over-sampling-batch-size above --rollout-batch-size), or drop the flag"
                )
            return
        if self.dynamic_sampling_max_rounds is None:
            self.dynamic_sampling_max_rounds = DEFAULT_MAX_ROUNDS
        if self.dynamic_sampling_max_rounds < 1:
            raise ConfigError(f"--dynamic-sampling-max-rounds must be >= 1, got {self.dynamic_sampling_max_rounds}")
        if self.dynamic_sampling_filter_path is None:
            return
        name = check_filter_path(self.dynamic_sampling_filter_path)
        if name in FILTERS.builtins and self.n_samples_per_prompt < 2:
            raise ConfigError(
                f"--dynamic-sampling-filter-path {self.dynamic_sampling_filter_path} keeps groups whose rewards vary, "
                f"and --n-samples-per-prompt {self.n_samples_per_prompt} makes groups of one sample, which never "
                "vary; use --n-samples-per-prompt >= 2 or drop the filter"
            )

    @property
    def dynamic_sampling(self) -> bool:
        """Whether a step samples in rounds (:mod:`slime.rollout.dynamic_sampling`): a filter, or more prompts
        drawn per round than trained on."""
        return self.dynamic_sampling_filter_path is not None or self.over_sampling_batch_size != self.rollout_batch_size

    @property
    def samples_per_rollout(self) -> int:
        """Samples generated per rollout step: ``rollout_batch_size * n_samples_per_prompt``."""
        return self.rollout_batch_size * self.n_samples_per_prompt


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """Evaluation (EVAL_ARGS): which datasets, how often, how to sample. Unset sampling flags follow ROLLOUT_ARGS."""

    eval_interval: int | None = flag(None, help="Evaluate every this many rollout steps. With --eval-prompt-data, the eval also runs before training "
        "(unless --skip-eval-before-train) and after the last step, so unset = only then.")
    eval_prompt_data: list[str] | None = flag(
        None,
        metavar="NAME PATH",
        help="Evaluation datasets as name/path pairs, e.g. geo3k /data/geo3k/test.parquet aime /data/aime.jsonl.",
    )
    n_samples_per_eval_prompt: int = flag(1, help="Responses sampled per evaluation prompt.")
    eval_max_response_len: int | None = flag(
        None, help="Maximum evaluation response length, tokens (default: --rollout-max-response-len)."
    )
    eval_temperature: float | None = flag(
        None,
        help="Sampling temperature for evaluation (default: --rollout-temperature). 0 = greedy decoding (the "
        "most likely token at every step; --eval-top-p and --rollout-top-k are then ignored, and every sample "
        "of a prompt is the same response).",
    )
    eval_top_p: float | None = flag(
        None, help="Nucleus sampling mass for evaluation, in (0, 1] (default: --rollout-top-p)."
    )
    skip_eval_before_train: bool = flag(False, help="Do not evaluate the initial model before the first step.")

    def __post_init__(self):
        if self.eval_prompt_data is not None:
            if len(self.eval_prompt_data) % 2:
                raise ConfigError(
                    f"--eval-prompt-data takes NAME PATH pairs, got {len(self.eval_prompt_data)} values "
                    f"{self.eval_prompt_data}; add the missing name or path"
                )
            names = self.eval_prompt_data[::2]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ConfigError(f"--eval-prompt-data names must be unique; repeated: {', '.join(repeated)}")
        if self.eval_interval is not None:
            if self.eval_interval < 1:
                raise ConfigError(f"--eval-interval must be >= 1 rollout step, got {self.eval_interval}")
            if not self.eval_prompt_data:
                raise ConfigError(
                    f"--eval-interval {self.eval_interval} needs datasets to evaluate: add --eval-prompt-data NAME PATH"
                )
        check_at_least_one(self, "n_samples_per_eval_prompt", "eval_max_response_len")
        _check_sampling("eval", self.eval_temperature, self.eval_top_p, greedy_ok=True)

    @property
    def eval_prompt_pairs(self) -> list[tuple[str, str]]:
        """``--eval-prompt-data`` as ``[(name, path), ...]`` in command-line order (empty when unset)."""
        values = self.eval_prompt_data or []
        return list(zip(values[::2], values[1::2]))


@dataclasses.dataclass(kw_only=True)
class ParityConfig:
    """The engine parity check (ROLLOUT_ARGS (engine parity)): engine vs trainer log-probs on fixed prompts."""

    skip_engine_parity_check: bool = flag(
        False, help="Do not compare the rollout engine's log-probs with the trainer's before step 0 and after the "
        "first weight sync (the check that catches, e.g., SGLang 0.5.17's wrong image positions for Qwen3.5)."
    )
    engine_parity_prompts: int = flag(
        8, help="Prompts of the check: the first training rows with an image, each sent with and without it."
    )
    engine_parity_response_len: int = flag(64, help="Response tokens sampled per prompt of the check.")
    engine_parity_replay_routes: bool = flag(
        True, help="For an MoE checkpoint, the trainer replays the engine's routed experts (every MoE layer takes "
        "the engine's top-k experts at every position, with gate weights from the trainer's own router logits) "
        "when it scores the check's responses: at real width a random router's near-ties flip routes under any "
        "rounding difference, which hides an engine bug. What it costs: the SGLang servers start with "
        "--enable-return-routed-experts and then capture the routes of every forward of the run, not only the "
        "check's (a device-to-host copy of layers x top-k int32 per token, into a pinned host buffer of that size "
        "per KV-cache token: 1.25 KiB per token for Qwen3.5-35B-A3B), and each check answer carries them. Turned off, "
        "with a warning, where it cannot run: models of more than 256 experts per layer, --train-backend megatron at "
        "TP, PP, CP or EP > 1 (not proven yet)."
    )
    engine_parity_max_gap: float = flag(
        1.0, help="Ceiling on the mean |engine - trainer| log-prob gap per response token (nats), image or text: "
        "above it the check refuses whatever the trainer's floor; the tests against the floor decide below it."
    )
    engine_parity_max_ratio: float = flag(
        1.5, help="Largest image-prompt gap as a multiple of the text-prompt gap, each in units of the trainer's own "
        "floor on its tokens (at least 1e-3 nats), the text gap counted as at least half such a unit."
    )
    engine_parity_floor_factor: float = flag(
        3.0, help="Largest gap of a kind as a multiple of the trainer's own floor on the same tokens (at least 1e-3 "
        "nats): its log-probs with one rounding step of noise on the token embeddings against without, with the "
        "engine's routes replayed when they are."
    )

    def __post_init__(self):
        check_at_least_one(self, "engine_parity_prompts", "engine_parity_response_len")
        for name in ("engine_parity_max_gap", "engine_parity_max_ratio", "engine_parity_floor_factor"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
