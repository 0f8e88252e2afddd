"""The command line: one parser assembled from the subsystems' flag groups, and the cross-group checks.

Each subsystem declares its flags as a dataclass next to its code (:mod:`slime.utils.config`
explains how); this module only

1. assembles them into one ``argparse`` parser, one argument group per dataclass, titled after
   the arrays of the upstream launcher scripts (``MODEL_ARGS``, ``ROLLOUT_ARGS``, ...);
2. builds each dataclass from the parsed flags (its ``__post_init__`` checks its own fields) and
   collects every ``--sglang-*`` flag into :class:`~slime.rollout.engines.sglang.flags.SGLangConfig`;
3. runs the checks that span several groups (:func:`validate`): MODEL_ARGS against the
   checkpoint's ``config.json`` and the model built from it, refusing those nothing reads
   (:mod:`slime.checkpoints.model_args`), the selected training backend's and rollout engine's own
   checks (their configs, named in the registries: e.g. the FSDP backend refuses the Megatron backend's
   flags, the Megatron backend checks its parallel layout against the model's sizes, the
   transformers engine refuses ``--sglang-*``), batch sizes against the backend's
   data-parallel size (Gated-DeltaNet batching is the backends' own check), and last whether the selected backend and engine
   can run here (a planned one, or one whose packages are missing, is refused with what is and is
   not installed); and warns about flags that do nothing (KL flags without a KL term, GRPO groups
   of one response).

Every error is raised at parse time and names the flag(s), the value(s) and a fix.
The one check that needs the real cluster (enough GPUs) is :func:`check_resources`, which the driver
calls once Ray is up.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import sys

from slime.backends.config import (
    BackendConfig,
    CheckpointConfig,
    OptimizerConfig,
    OtherBackendFlag,
    TrainConfig,
    TrainerSpec,
)
from slime.backends.fsdp.config import FSDPConfig
from slime.backends.megatron.config import MegatronConfig
from slime.backends.registry import TRAIN_BACKENDS
from slime.checkpoints.model_args import ModelConfig, check_model_args
from slime.data.config import DataConfig
from slime.routing_replay import check_routing_replay, resolve_parity_replay, rollout_routes_wanted
from slime.errors import SlimeError
from slime.grpo.config import ADVANTAGE_ESTIMATORS, GRPOConfig, is_group_relative
from slime.ray.config import ClusterConfig, RunModeConfig
from slime.rollout.config import EvalConfig, ParityConfig, RolloutConfig
from slime.rollout.engines import ENGINES
from slime.rollout.engines.config import EngineConfig, EngineSpec
from slime.rollout.engines.sglang.flags import SGLANG_HELP, SGLangConfig, extract_sglang_args
from slime.rollout.rm_hub.config import RewardConfig
from slime.utils.config import ConfigError, add_group, build_group, flag_name, to_argv
from slime.utils.metrics_config import LoggingConfig, WandbConfig
from slime.weight_sync.config import WeightSyncConfig

logger = logging.getLogger(__name__)

GROUPS: tuple[tuple[str, type, str], ...] = (
    # (SlimeConfig attribute, dataclass, --help title), in the order of the upstream launcher.
    ("model", ModelConfig, "MODEL_ARGS"),
    ("checkpoint", CheckpointConfig, "CKPT_ARGS"),
    ("data", DataConfig, "ROLLOUT_ARGS (prompt data)"),
    ("rollout", RolloutConfig, "ROLLOUT_ARGS (generation)"),
    ("reward", RewardConfig, "ROLLOUT_ARGS (reward)"),
    ("parity", ParityConfig, "ROLLOUT_ARGS (engine parity check)"),
    ("eval", EvalConfig, "EVAL_ARGS"),
    ("grpo", GRPOConfig, "GRPO_ARGS"),
    ("optimizer", OptimizerConfig, "OPTIMIZER_ARGS"),
    ("sglang", SGLangConfig, "SGLANG_ARGS"),
    ("wandb", WandbConfig, "WANDB_ARGS"),
    ("train", TrainConfig, "BACKEND_ARGS"),
    ("megatron", MegatronConfig, "BACKEND_ARGS (megatron)"),
    ("fsdp", FSDPConfig, "BACKEND_ARGS (fsdp)"),
    ("weight_sync", WeightSyncConfig, "BACKEND_ARGS (weight sync)"),
    ("cluster", ClusterConfig, "MISC_ARGS (cluster)"),
    ("run_mode", RunModeConfig, "MISC_ARGS (run mode)"),
    ("logging", LoggingConfig, "MISC_ARGS (logging)"),
)

SECRET_FLAGS = ("--wandb-key",)
"""Flags whose values :func:`config_to_argv` hides when asked to redact (for logs)."""


@dataclasses.dataclass
class SlimeConfig:
    """Every flag group of a run. Each subsystem is handed its own group, never the whole config.

    ``train.global_batch_size`` left unset is filled here with the samples of one rollout step
    (``rollout_batch_size * n_samples_per_prompt``: one optimizer step per rollout).
    """

    model: ModelConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    rollout: RolloutConfig
    reward: RewardConfig
    parity: ParityConfig
    eval: EvalConfig
    grpo: GRPOConfig
    optimizer: OptimizerConfig
    sglang: SGLangConfig
    wandb: WandbConfig
    logging: LoggingConfig
    cluster: ClusterConfig
    run_mode: RunModeConfig
    train: TrainConfig
    megatron: MegatronConfig
    fsdp: FSDPConfig
    weight_sync: WeightSyncConfig

    def __post_init__(self):
        if self.train.global_batch_size is None:
            self.train.global_batch_size = self.rollout.samples_per_rollout

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout step: ``samples_per_rollout / global_batch_size``, a whole number >= 1
        (:func:`validate` refuses flags for which it is not)."""
        return self.rollout.samples_per_rollout // self.train.global_batch_size

    def backend_configs(self) -> list[BackendConfig]:
        """Every training backend's own flag group, in :data:`GROUPS` order."""
        return [getattr(self, attr) for attr, cls, _ in GROUPS if issubclass(cls, BackendConfig)]

    @property
    def train_backend_config(self) -> BackendConfig:
        """The ``--train-backend``'s own flag group (its config in :data:`slime.backends.registry.TRAIN_BACKENDS`);
        a plain :class:`BackendConfig` for a backend given as an import path."""
        cls = TRAIN_BACKENDS.config_class(self.train.train_backend)
        return next((group for group in self.backend_configs() if type(group) is cls), BackendConfig())

    def trainer_spec(self) -> TrainerSpec:
        """What every trainer rank is handed besides its backend's own group (:class:`TrainerSpec`).

        Raises:
            ConfigError: an inconsistent LR schedule.
        """
        return TrainerSpec(train=self.train, optimizer=self.optimizer, grpo=self.grpo, checkpoint=self.checkpoint,
                           rollout_temperature=self.rollout.rollout_temperature, num_rollout=self.rollout.num_rollout,
                           steps_per_rollout=self.steps_per_rollout, seed=self.cluster.seed)

    def engine_spec(self, parity_check: bool) -> EngineSpec:
        """What every rollout engine is handed (:class:`EngineSpec`); ``parity_check``: the engine kind runs the
        engine parity check (whether it captures routes for it, :func:`slime.routing_replay.rollout_routes_wanted`)."""
        return EngineSpec(
            hf_checkpoint=self.checkpoint.hf_checkpoint, rollout_seed=self.rollout.rollout_seed,
            image_min_pixels=self.data.image_min_pixels, image_max_pixels=self.data.image_max_pixels,
            sglang=self.sglang, output_dir=self.logging.output_dir,
            return_routed_experts=rollout_routes_wanted(self.train, self.parity, self.checkpoint.hf_checkpoint,
                                                        parity_check=parity_check),
        )

    def backend_config(self, backend_cls: type) -> BackendConfig:
        """The flag group a ``--train-backend`` class is handed: the group its ``flag_group`` names (a built-in's, and
        a subclass's given as ``package.module:Class``), else :attr:`train_backend_config`."""
        return getattr(self, getattr(backend_cls, "flag_group", ""), None) or self.train_backend_config

    @property
    def engine_config(self) -> type[EngineConfig]:
        """The ``--rollout-backend``'s checks (its config in :data:`slime.rollout.engines.ENGINES`)."""
        return ENGINES.config_class(self.rollout.rollout_backend) or EngineConfig


def build_parser() -> argparse.ArgumentParser:
    """The ``slime`` argument parser, one argument group per config dataclass (so ``--help`` is grouped).

    ``--sglang-*`` flags are not argparse options: :func:`parse_args` takes them out first
    (see :func:`slime.rollout.engines.sglang.flags.extract_sglang_args`); their group only documents them.
    Abbreviated flags are refused (``allow_abbrev=False``) so that logged command lines are exact.
    """
    parser = argparse.ArgumentParser(
        prog="slime",
        usage="%(prog)s --hf-checkpoint DIR --rollout-batch-size N --rollout-max-response-len TOKENS "
        "(--num-rollout N | --num-epoch N) [FLAG ...]",
        description="GRPO post-training of vision-language models (Ray + SGLang/transformers + Megatron/FSDP). "
        "Flags are grouped like the arrays of the upstream launcher scripts.",
        allow_abbrev=False,
    )
    for _, cls, title in GROUPS:
        if cls is SGLangConfig:
            parser.add_argument_group(title, SGLANG_HELP)
        else:
            add_group(parser, cls, title)
    return parser


def parse_args(argv: list[str] | None = None) -> SlimeConfig:
    """Parse and check a command line; every check except the GPU count runs here.

    Args:
        argv: the flags (default: ``sys.argv[1:]``).

    Returns:
        The :class:`SlimeConfig`.

    Raises:
        SystemExit: code 2 on any bad input, after printing the usage and an ``error:`` line
            that names the flag, the value and the fix (argparse's behaviour); code 0 after ``--help``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        sglang, rest = extract_sglang_args(argv)
    except ConfigError as e:
        parser.error(str(e))
    namespace, unknown = parser.parse_known_args(rest)
    if unknown:
        parser.error(_unrecognized(unknown))
    try:
        groups = {attr: build_group(cls, namespace) for attr, cls, _ in GROUPS if cls is not SGLangConfig}
        cfg = SlimeConfig(sglang=sglang, **groups)
        validate(cfg)
    except SlimeError as e:  # a flag, or a file a flag names (an unreadable config.json)
        parser.error(str(e))
    return cfg


def _known_flags() -> list[str]:
    flags = ["--help"]
    for _, cls, _ in GROUPS:
        if cls is SGLangConfig:
            continue
        for field in dataclasses.fields(cls):
            flags.append(flag_name(field))
            if field.default is True:
                flags.append("--no-" + flag_name(field)[2:])
    return flags


def _unrecognized(unknown: list[str]) -> str:
    """argparse's "unrecognized arguments" message, with the closest known flags for each unknown one:
    those it abbreviates (abbreviations are refused), else the most similar spelling (difflib)."""
    known = _known_flags()
    hints = []
    for token in unknown:
        if token.startswith("--"):
            name = token.partition("=")[0]
            close = [flag for flag in known if flag.startswith(name)][:3] or difflib.get_close_matches(name, known, n=1)
            if close:
                hints.append(f"{token} -> did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")


def validate(cfg: SlimeConfig, *, num_gpus_available: int | None = None) -> None:
    """Checks that involve more than one flag group (each group checks its own fields when built).

    Args:
        cfg: the parsed config.
        num_gpus_available: GPUs in the Ray cluster (CPU bundles on a machine without GPUs);
            when given, the run must fit in them. :func:`parse_args` leaves it out.

    Also turns the engine parity check's routing replay off, with a warning, where it cannot run
    (:func:`slime.routing_replay.resolve_parity_replay`).

    Raises:
        ConfigError: the message names the flags, their values and a fix.
        CheckpointError: ``--hf-checkpoint``'s ``config.json`` exists but cannot be read.
    """
    backend = cfg.train_backend_config
    check_model_args(cfg.model, cfg.checkpoint.hf_checkpoint,
                     attention_softmax_in_fp32=isinstance(backend, MegatronConfig)
                     and backend.attention_softmax_in_fp32)
    backend.check(train=cfg.train, model=cfg.model, checkpoint=cfg.checkpoint, cluster=cfg.cluster,
                  other_flags=_other_backend_flags(cfg))
    cfg.engine_config.check(cfg.rollout, cfg.sglang, cfg.checkpoint.hf_checkpoint)
    resolve_parity_replay(cfg.parity, cfg.checkpoint.hf_checkpoint, backend,
                          parity_check=cfg.engine_config.parity_check)
    check_routing_replay(cfg.train, cfg.checkpoint, backend)
    _check_batch_sizes(cfg.rollout, cfg.train, cfg.cluster, backend)
    _check_group_size(cfg.rollout, cfg.grpo)
    _check_kl(cfg.grpo, cfg.checkpoint)
    _check_off_policy(cfg.grpo, cfg.train)
    _check_skip_old_pass(cfg)
    _check_rollout_only(cfg)
    _check_runs_here(cfg)
    if num_gpus_available is not None:
        check_resources(cfg.cluster, num_gpus_available)


def _other_backend_flags(cfg: SlimeConfig) -> list[OtherBackendFlag]:
    """The active flags (:meth:`BackendConfig.active_flags`) of every backend group but the selected one's."""
    selected = cfg.train_backend_config
    return [
        OtherBackendFlag(field, text, TRAIN_BACKENDS.name_of_config(type(group)))
        for group in cfg.backend_configs()
        if group is not selected
        for field, text in group.active_flags()
    ]


def _check_runs_here(cfg: SlimeConfig) -> None:
    """The selected engine and backend exist in this version and their packages are installed
    (:meth:`slime.utils.registry.Registry.problem`: nothing is imported); both are reported at once."""
    problems = [
        problem
        for registry, name in ((ENGINES, cfg.rollout.rollout_backend), (TRAIN_BACKENDS, cfg.train.train_backend))
        if (problem := registry.problem(name)) is not None
    ]
    if problems:
        raise ConfigError(". ".join(problems))


def _fitting_batch_sizes(samples: int, step: int) -> list[int]:
    """Global batch sizes that divide ``samples`` and are multiples of ``step``."""
    return [gbs for gbs in range(step, samples + 1, step) if samples % gbs == 0]


def _check_batch_sizes(
    rollout: RolloutConfig, train: TrainConfig, cluster: ClusterConfig, backend: BackendConfig
) -> None:
    """A rollout step's samples split into whole optimizer steps, and each step into whole micro-batches per rank.

    The data-parallel size is the backend's (:meth:`BackendConfig.data_parallel_size`: FSDP all
    trainer GPUs, Megatron GPUs / (TP * PP * CP)); with --use-dynamic-batch-size the micro-batches
    are packed by tokens, so only the data-parallel split must be even.  This is the one check of
    these flags: the trainer group and the backends rely on it.
    """
    samples = rollout.samples_per_rollout
    gbs = train.global_batch_size
    dp = backend.data_parallel_size(cluster.actor_num_gpus)
    per_rank = 1 if train.use_dynamic_batch_size else train.micro_batch_size
    step = dp * per_rank
    fits = _fitting_batch_sizes(samples, step)
    fix = (
        f"e.g. --global-batch-size {min(fits, key=lambda g: (abs(g - gbs), g))}"
        if fits
        else f"make --rollout-batch-size * --n-samples-per-prompt a multiple of {step}"
    )
    rollout_samples = (
        f"--rollout-batch-size {rollout.rollout_batch_size} * --n-samples-per-prompt {rollout.n_samples_per_prompt} "
        f"= {samples} samples per rollout step"
    )
    if samples % gbs:
        raise ConfigError(f"{rollout_samples} is not a multiple of --global-batch-size {gbs}; {fix}")
    if gbs % step:
        layout = backend.data_parallel_text(cluster.actor_num_gpus)
        per_rank_text = "" if train.use_dynamic_batch_size else f" * --micro-batch-size {train.micro_batch_size}"
        raise ConfigError(
            f"--global-batch-size {gbs} is not a multiple of {layout}{per_rank_text} = {step}; {fix}"
        )


def _check_group_size(rollout: RolloutConfig, grpo: GRPOConfig) -> None:
    """Warn when a group-relative estimator (marked in its registry entry, :func:`slime.grpo.config.group_relative`)
    gets groups of one response: every advantage is then 0.  An estimator given as an import path is
    not imported at parse time, so it is not checked here."""
    name = grpo.advantage_estimator
    if rollout.n_samples_per_prompt != 1 or name not in ADVANTAGE_ESTIMATORS.names():
        return
    if is_group_relative(ADVANTAGE_ESTIMATORS.get(name)):
        logger.warning(
            "--advantage-estimator %s with --n-samples-per-prompt 1: each group has one response, so every "
            "advantage is 0 and the policy-gradient term vanishes; use --n-samples-per-prompt >= 2 (e.g. 8)",
            name,
        )


def _check_rollout_only(cfg: SlimeConfig) -> None:
    """``--debug-rollout-only`` starts no trainer: refuse the flags that act only in a training step (ConfigError
    naming them); warn that ``--save`` writes no checkpoint (the launcher always passes one)."""
    if not cfg.run_mode.debug_rollout_only:
        return
    train, grpo = cfg.train, cfg.grpo
    trainer_only = {
        "--use-tis": grpo.use_tis,
        "--use-opsm": grpo.use_opsm,
        "--get-mismatch-metrics": grpo.get_mismatch_metrics,
        "--custom-pg-loss-reducer-function-path": grpo.custom_pg_loss_reducer_function_path is not None,
        "--freeze-params-name-list": bool(train.freeze_params_name_list),
        "--only-train-params-name-list": bool(train.only_train_params_name_list),
        "--use-routing-replay": train.use_routing_replay and not train.use_rollout_routing_replay,
        "--ci-train-rollout-logprob-abs-diff-threshold": train.ci_train_rollout_logprob_abs_diff_threshold is not None,
        "--skip-actor-forward-only": train.skip_actor_forward_only,
    }
    given = [name for name, on in trainer_only.items() if on]
    if given:
        raise ConfigError(f"--debug-rollout-only runs no training step, so {', '.join(given)} would do nothing; drop "
                          "them (--use-rollout-routing-replay stays: the engines return routes for a later replay)")
    if cfg.checkpoint.save:
        logger.warning("--debug-rollout-only: no checkpoint is written to --save %s (no trainer runs)",
                       cfg.checkpoint.save)


def _check_off_policy(grpo: GRPOConfig, train: TrainConfig) -> None:
    """``--use-tis`` and ``--get-mismatch-metrics`` compare the trainer's old log-probs with the engine's: with
    ``--use-rollout-logprobs`` they are the same, every weight is 1 and every metric trivial (upstream refuses the
    first pair; for the second it runs one more forward pass, which this project does not).  Warns about a PPO clip
    range that GSPO's sequence ratios (geometric means, near 1) never reach, and, as upstream, about CISPO with a lower
    clip bound."""
    for name, on in (("--use-tis", grpo.use_tis), ("--get-mismatch-metrics", grpo.get_mismatch_metrics)):
        if on and train.use_rollout_logprobs:
            raise ConfigError(
                f"{name} with --use-rollout-logprobs: it compares the trainer's old log-probs with the rollout's, "
                "which --use-rollout-logprobs makes the same (every ratio 1); drop one of them"
            )
    if grpo.cispo and grpo.eps_clip < 1:
        logger.warning(
            "--advantage-estimator cispo with --eps-clip %g keeps the lower clip bound %g of the IS ratio; CISPO "
            "(arXiv:2506.13585) clips only from above: --eps-clip 1 (and e.g. --eps-clip-high 4)",
            grpo.eps_clip, 1 - grpo.eps_clip)
    if grpo.gspo and max(grpo.eps_clip, grpo.eps_clip_high) >= 0.01:
        logger.warning(
            "--advantage-estimator gspo clips a sequence ratio (a geometric mean of token ratios, close to 1) at "
            "--eps-clip %g / --eps-clip-high %g, which it seldom reaches; the GSPO paper uses 3e-4 / 4e-4",
            grpo.eps_clip, grpo.eps_clip_high)


def _check_skip_old_pass(cfg: SlimeConfig) -> None:
    """``--skip-actor-forward-only`` reuses the training forward's log-probs as the old ones, which equal the
    pass's only before the first update of the rollout step: one optimizer step per rollout step.  With ``--kl-coef``
    and ``--normalize-advantages`` the whitening statistics need the old log-probs before any forward."""
    if not cfg.train.skip_actor_forward_only:
        return
    if cfg.steps_per_rollout != 1:
        raise ConfigError(
            f"--skip-actor-forward-only needs one optimizer step per rollout step, but --global-batch-size "
            f"{cfg.train.global_batch_size} makes {cfg.steps_per_rollout} of the {cfg.rollout.samples_per_rollout} "
            f"samples (the later steps' old log-probs are the weights before the first update): set "
            f"--global-batch-size {cfg.rollout.samples_per_rollout}, or drop the flag")
    if cfg.grpo.kl_coef > 0 and cfg.grpo.normalize_advantages:
        raise ConfigError(
            f"--skip-actor-forward-only with --kl-coef {cfg.grpo.kl_coef} and --normalize-advantages: the "
            "whitening of the KL-shaped advantages needs the old log-probs before the training forward; drop one")
    if rollout_routes_wanted(cfg.train, cfg.parity, cfg.checkpoint.hf_checkpoint,
                             parity_check=cfg.engine_config.parity_check):
        logger.warning("--skip-actor-forward-only: the engines capture routed experts for the parity check's "
                       "route replay (or R3), but the trainer's router agreement with them (train/router_agreement) "
                       "is measured in the old-log-prob pass, which this flag skips: it is not logged (and without "
                       "R3 training rollouts ask for no routes)")


def _check_kl(grpo: GRPOConfig, checkpoint: CheckpointConfig) -> None:
    """Warn about KL flags that do nothing. (``--kl-loss-coef > 0`` without ``--use-kl-loss`` is
    an error raised by :class:`GRPOConfig` itself: a coefficient must never be silently ignored.)  A ``--kl-loss-type``
    other than the default without ``--use-kl-loss`` only warns: upstream's own launchers pass one so."""
    if grpo.kl_loss_type != GRPOConfig.kl_loss_type and not grpo.use_kl_loss:
        logger.warning(
            "--kl-loss-type %s has no effect without --use-kl-loss (the KL loss is off; --kl-coef's reward shaping "
            "always uses k1); add --use-kl-loss --kl-loss-coef C, or drop --kl-loss-type", grpo.kl_loss_type)
    if grpo.use_kl_loss and grpo.kl_loss_coef == 0:
        logger.warning(
            "--use-kl-loss with --kl-loss-coef 0 adds no KL term; set --kl-loss-coef > 0 or drop --use-kl-loss"
        )
    if checkpoint.ref_load is not None and not grpo.needs_ref_model:
        logger.warning(
            "--ref-load %s is unused: no KL term is active (--use-kl-loss with --kl-loss-coef > 0, or --kl-coef > 0)",
            checkpoint.ref_load,
        )


def check_resources(cluster: ClusterConfig, num_gpus_available: int) -> None:
    """The one check that needs the cluster: the run's GPUs (:attr:`ClusterConfig.num_gpus_needed`) fit in it.

    Raises:
        ConfigError: naming the flags that set the GPU count, the count needed and the cluster's.
    """
    needed = cluster.num_gpus_needed
    if needed <= num_gpus_available:
        return
    layout = (
        f"{cluster.actor_num_gpus} trainer GPUs shared with the engines (--colocate)"
        if cluster.colocate
        else f"{cluster.actor_num_gpus} trainer GPUs + --rollout-num-gpus {cluster.rollout_num_gpus}"
    )
    raise ConfigError(
        f"the run needs {needed} GPUs ({layout}) but the cluster has {num_gpus_available}; lower "
        "--actor-num-nodes / --actor-num-gpus-per-node / --rollout-num-gpus, or add --colocate"
    )


def config_to_argv(cfg: SlimeConfig, *, redact: bool = False) -> list[str]:
    """The flags that reproduce ``cfg``: ``parse_args(config_to_argv(cfg)) == cfg``.

    Args:
        cfg: the config.
        redact: replace the values of secret flags (``SECRET_FLAGS``: the wandb key) with
            ``<redacted>``, for logs; the result then no longer reproduces ``cfg``.
    """
    argv: list[str] = []
    for attr, _, _ in GROUPS:
        argv += getattr(cfg, attr).to_argv() if attr == "sglang" else to_argv(getattr(cfg, attr))
    if redact:
        argv = ["<redacted>" if i and argv[i - 1] in SECRET_FLAGS else arg for i, arg in enumerate(argv)]
    return argv
