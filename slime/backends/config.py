"""Trainer flags shared by every backend: batch sizes and precision (BACKEND_ARGS), optimizer
(OPTIMIZER_ARGS), checkpoints (CKPT_ARGS); :class:`BackendConfig`, the base of each backend's own flag group;
and what a trainer rank is handed: where it sits (:class:`RankInfo`) and its groups (:class:`TrainerSpec`).

Flag names and meanings follow Megatron-LM (``megatron/training/arguments.py``) and upstream
slime.  The model architecture in Megatron's names (MODEL_ARGS) sits with its checker
(:class:`slime.checkpoints.model_args.ModelConfig`).

Each backend owns a flag group next to its code (``slime/backends/<name>/config.py``, importable
without the backend's packages): :class:`slime.backends.fsdp.config.FSDPConfig` and
:class:`slime.backends.megatron.config.MegatronConfig`, both shown under ``BACKEND_ARGS`` in
``--help``.  Every group is parsed whatever ``--train-backend`` says; the selected backend's
:meth:`BackendConfig.check` then refuses the flags of the other groups that ask for something
(:meth:`BackendConfig.active_flags`) instead of silently ignoring them, and answers the questions
shared code has: the data-parallel size (batch-size checks) and what a complete checkpoint holds
(``--load``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from slime.backends.lr_schedule import LRSchedule
from slime.backends.registry import TRAIN_BACKENDS
from slime.checkpoints.hf import lookup, read_config
from slime.utils.config import ConfigError, check_at_least_one, check_name_or_import_path, flag, flag_name

if TYPE_CHECKING:
    from slime.checkpoints.model_args import ModelConfig
    from slime.grpo.config import GRPOConfig
    from slime.ray.config import ClusterConfig


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Training, any backend (BACKEND_ARGS): which backend, batch sizes, dynamic batching, precision."""

    train_backend: str = flag(
        "megatron",
        help="Trainer: megatron (native Qwen3.5, all parallelisms), fsdp (HF model) or 'package.module:Class'.",
    )
    global_batch_size: int | None = flag(
        None,
        help="Samples per optimizer step (default: rollout_batch_size * n_samples_per_prompt, one step per "
        "rollout); must divide the samples of a rollout step.",
    )
    micro_batch_size: int = flag(1, help="Samples per forward/backward pass on one data-parallel rank.")
    use_dynamic_batch_size: bool = flag(
        False, help="Pack micro-batches up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples. "
        "A Gated-DeltaNet model (Qwen3.5) packs only with --train-backend megatron at TP = PP = CP = EP = 1 (where "
        "packing is proven equal to one sequence at a time)."
    )
    max_tokens_per_gpu: int | None = flag(
        None, help="Token budget of one packed micro-batch per GPU (with --use-dynamic-batch-size), tokens."
    )
    use_rollout_logprobs: bool = flag(
        False,
        help="Use the engines' rollout log-probs as the PPO ratio's old log-probs instead of a trainer forward pass "
        "before the update (saves one forward pass; exact only when rollout and training numerics agree).",
    )
    skip_actor_forward_only: bool = flag(
        False,
        help="Where a rollout step is one optimizer step (--global-batch-size = --rollout-batch-size * "
        "--n-samples-per-prompt), take the PPO ratio's old log-probs from the training forward itself (detached: "
        "the same weights, so the same values up to the rounding that differs between the two passes; every ratio "
        "exactly 1) instead of a forward pass of their own before the update: one forward of the step's tokens "
        "less (miles' flag of this name). The train/rollout gap monitor and "
        "--ci-train-rollout-logprob-abs-diff-threshold read the training forward's log-probs, before the update; "
        "the router agreement with the engine's routes (train/router_agreement), measured in the pass, is not "
        "logged. --global-batch-size defaults to one rollout step's samples, so the flag alone suffices. Not with "
        "--use-routing-replay without --use-rollout-routing-replay (the pass records the routes; R3 works), "
        "--use-rollout-logprobs, or --kl-coef with --normalize-advantages (the whitening needs the old log-probs "
        "before the forward).",
    )
    bf16: bool = flag(False, help="Train in bfloat16 mixed precision (fp32 master weights); default: fp32.")
    freeze_params_name_list: list[str] | None = flag(
        None, nargs="*", metavar="REGEX",
        help="Freeze the parameters whose Hugging Face checkpoint names (e.g. model.visual.blocks.0.attn.qkv.weight, "
        "under both backends) a pattern finds (Python re.search); the others train. Frozen parameters get no "
        "gradient and no optimizer state, and cross the weight sync once per engine start. E.g. 'model\\.visual\\.' "
        "freezes the vision tower. A pattern that matches nothing is an error.",
    )
    only_train_params_name_list: list[str] | None = flag(
        None, nargs="*", metavar="REGEX",
        help="Train only the parameters whose Hugging Face checkpoint names a pattern finds (Python re.search); "
        "freeze the others (see --freeze-params-name-list). E.g. 'layers\\.2[0-3]\\.'.",
    )
    use_routing_replay: bool = flag(
        False, help="R2 routing replay (arXiv 2507.18071), MoE models: record the experts every MoE layer of the "
        "trainer chose in the old-log-prob pass and take exactly those in every training forward of that rollout's "
        "optimizer steps (gate weights from the router's own logits, so the router still learns)."
    )
    use_rollout_routing_replay: bool = flag(
        False, help="R3 rollout routing replay (arXiv 2510.11370), MoE models: the rollout engine returns the experts "
        "it routed each token to (SGLang servers start with --enable-return-routed-experts), and every trainer "
        "forward of the step (old and reference log-probs, training) takes them, gate weights from the trainer's "
        "router logits. Implies --use-routing-replay (upstream slime's rule)."
    )
    ci_train_rollout_logprob_abs_diff_threshold: float | None = flag(
        None, help="Stop the run with an error when a step's mean |trainer - rollout log-prob| (nats; "
        "train/logprob_abs_diff, image or text prompts) passes this bound. Default: no bound (upstream applies 0.1 "
        "under --ci-test, which slime has not)."
    )

    def __post_init__(self):
        check_name_or_import_path("--train-backend", self.train_backend, TRAIN_BACKENDS.names())
        for name, patterns in (("--freeze-params-name-list", self.freeze_params_name_list),
                               ("--only-train-params-name-list", self.only_train_params_name_list)):
            if patterns == []:
                raise ConfigError(f"{name} was given no pattern; give at least one REGEX, or drop the flag")
        if self.freeze_params_name_list and self.only_train_params_name_list:
            raise ConfigError("give one of --freeze-params-name-list and --only-train-params-name-list, not both")
        if self.use_rollout_logprobs and self.ci_train_rollout_logprob_abs_diff_threshold is not None:
            raise ConfigError(
                "--ci-train-rollout-logprob-abs-diff-threshold bounds the gap between the trainer's old log-probs and "
                "the rollout's, and --use-rollout-logprobs skips that trainer pass (the old log-probs are the "
                "rollout's): drop one of them"
            )
        if self.skip_actor_forward_only and self.use_rollout_logprobs:
            raise ConfigError("--skip-actor-forward-only takes the old log-probs from the training forward, "
                              "--use-rollout-logprobs from the rollout: drop one of them")
        if self.skip_actor_forward_only and self.use_routing_replay and not self.use_rollout_routing_replay:
            raise ConfigError("--skip-actor-forward-only skips the old-log-prob pass, whose routes --use-routing-replay "
                              "records for the training forward: drop one of them (--use-rollout-routing-replay, "
                              "the engine's routes, needs no pass)")
        compile_patterns("--freeze-params-name-list", self.freeze_params_name_list)
        compile_patterns("--only-train-params-name-list", self.only_train_params_name_list)
        check_at_least_one(self, "global_batch_size", "micro_batch_size", "max_tokens_per_gpu")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu (tokens per packed micro-batch)")
        if self.use_rollout_routing_replay:
            self.use_routing_replay = True  # R3 is R2 with the engine's routes (upstream's rule)
        threshold = self.ci_train_rollout_logprob_abs_diff_threshold
        if threshold is not None and not threshold > 0:
            raise ConfigError(f"--ci-train-rollout-logprob-abs-diff-threshold must be > 0 nats, got {threshold}")


def compile_patterns(flag: str, patterns: list[str] | None) -> list[re.Pattern]:
    """``patterns`` compiled; ``ConfigError`` naming ``flag`` and the pattern when one is not a regular expression."""
    compiled = []
    for pattern in patterns or ():
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ConfigError(f"{flag} {pattern!r} is not a Python regular expression: {e}") from None
    return compiled


@dataclasses.dataclass(frozen=True)
class OtherBackendFlag:
    """A flag of another backend's group that the command line sets (see :meth:`BackendConfig.active_flags`).

    Attributes:
        field: the config field, e.g. ``"tensor_model_parallel_size"``.
        text: the flag as typed, e.g. ``"--tensor-model-parallel-size 2"``.
        backend: the ``--train-backend`` whose group it is (``None`` when that group is not a built-in's).
    """

    field: str
    text: str
    backend: str | None


@dataclasses.dataclass(kw_only=True)
class BackendConfig:
    """Base of a training backend's own flag group, and the questions shared code asks a backend.

    A subclass is a flag dataclass (:func:`slime.utils.config.flag` fields) named as the
    built-in's ``config`` in :data:`slime.backends.registry.TRAIN_BACKENDS`.  Its fields' own
    checks go in ``__post_init__`` as usual; the hooks below run only for the selected backend,
    called once by :func:`slime.arguments.validate` (``check``, ``data_parallel_size``) and by
    the driver (``checkpoint_parts``).  A ``--train-backend package.module:Class`` gets this
    base class itself: no checks, every rank data-parallel, no checkpoint part checked.
    """

    OFF_VALUES: ClassVar[Mapping[str, tuple[Any, ...]]] = {}
    """Per field, the values that ask for nothing (default: the field's default alone)."""

    def active_flags(self) -> list[tuple[str, str]]:
        """The fields set away from their "off" values, as ``(field, flag as typed)``, in field order;
        e.g. ``[("tensor_model_parallel_size", "--tensor-model-parallel-size 2")]``."""
        active = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value not in self.OFF_VALUES.get(field.name, (field.default,)):
                active.append((field.name, flag_text(field, value)))
        return active

    def check(
        self,
        *,
        train: TrainConfig,
        model: ModelConfig,
        checkpoint: CheckpointConfig,
        cluster: ClusterConfig,
        other_flags: list[OtherBackendFlag],
    ) -> None:
        """Checks of this backend's flags against the shared ones, the model and the trainer GPUs.

        Args:
            train, model, checkpoint, cluster: the shared flag groups (MODEL_ARGS agree with
                ``checkpoint.hf_checkpoint``'s ``config.json`` when this runs).
            other_flags: the active flags of every other backend's group; a backend that does
                not implement them refuses them here.

        Raises:
            ConfigError: naming the flags, their values and the fix.
        """

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks among ``world_size`` trainer GPUs (default: all of them)."""
        return world_size

    def data_parallel_text(self, world_size: int) -> str:
        """How :meth:`data_parallel_size` follows from the flags, for error messages."""
        return f"data-parallel size {self.data_parallel_size(world_size)} (= the {world_size} trainer GPUs)"

    def checkpoint_parts(self) -> tuple[str, ...]:
        """What a complete checkpoint of this backend holds: paths relative to its iteration folder
        (:func:`slime.checkpoints.layout.iteration_dir`), checked before ``--load`` resumes from it."""
        return ()

    def cpu_problem(self) -> str | None:
        """Why these flags cannot train on the CPU (asked when the run finds no GPU: the driver's set-up and
        ``--check-only``), naming the flags and the fix; None (default) where they can."""
        return None

    def replay_routes_problem(self) -> str | None:
        """Why this backend cannot replay routed experts in its layout (the parser then turns replay off), or None."""
        return None

    def train_replay_problem(self) -> str | None:
        """Why this backend cannot replay routed experts in its training forwards (``--use-routing-replay``,
        refused at parse time for this reason), or None; default: :meth:`replay_routes_problem`."""
        return self.replay_routes_problem()


def gdn_batching_problem(
    model: ModelConfig, checkpoint: CheckpointConfig, train: TrainConfig, *, reason: str
) -> str | None:
    """The refusal of packed micro-batches for a hybrid Gated-DeltaNet model, or ``None`` when none applies.

    Upstream's recipe says "for GDN training, use --micro-batch-size 1 and remove
    --use-dynamic-batch-size" (a limit of its GDN implementation).  A backend calls this from its
    :meth:`BackendConfig.check` for every configuration in which packing several sequences into one
    micro-batch is not proven equal to running them one at a time.

    Args:
        model, checkpoint, train: the shared flag groups (the model's layers come from MODEL_ARGS or
            from ``--hf-checkpoint``'s ``config.json``).
        reason: why this configuration is refused, appended to the message.

    Returns:
        The message naming where the GDN layers were found, the batching flag and the fix; ``None``
        when the batching is one sequence per micro-batch or the model has no GDN layer.

    Raises:
        CheckpointError: ``config.json`` exists but is not readable.
    """
    if train.micro_batch_size == 1 and not train.use_dynamic_batch_size:
        return None
    if model.is_hybrid_gdn:
        source = f"--linear-attention-freq {model.linear_attention_freq}"
    else:
        config = read_config(checkpoint.hf_checkpoint) or {}
        _, layer_types = lookup(config, "layer_types")
        if not isinstance(layer_types, list) or "linear_attention" not in layer_types:
            return None
        source = f"layer_types of {checkpoint.hf_checkpoint}/config.json"
    got = "--use-dynamic-batch-size" if train.use_dynamic_batch_size else f"--micro-batch-size {train.micro_batch_size}"
    return (
        f"the model has Gated-DeltaNet (linear-attention) layers ({source}), which train one sequence per "
        f"micro-batch {reason}, but got {got}; use --micro-batch-size 1 and remove --use-dynamic-batch-size"
    )


def flag_text(field: dataclasses.Field, value: Any) -> str:
    """A flag as typed on the command line: ``--name`` for a switch, ``--name VALUE ...`` otherwise."""
    if value is True:
        return flag_name(field)
    if value is False:
        return "--no-" + flag_name(field)[2:]
    values = value if isinstance(value, (list, tuple)) else [value]
    return " ".join([flag_name(field), *map(str, values)])


def refuse_flags(backend: str, refused: list[str], fix: str) -> None:
    """Raise one :class:`ConfigError` listing every flag ``--train-backend <backend>`` does not implement.

    Args:
        backend: the selected backend's name.
        refused: each flag as typed followed by what the backend does instead, e.g.
            ``"--recompute-granularity full (use --gradient-checkpointing)"``.
        fix: the end of the message, e.g. ``"drop these flags, or use --train-backend megatron"``.
    """
    if refused:
        raise ConfigError(f"--train-backend {backend} does not implement {'; '.join(refused)}; {fix}")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule (OPTIMIZER_ARGS). Schedule lengths count optimizer steps."""

    optimizer: str = flag("adam", choices=["adam"], help="Optimizer: adam (AdamW: decoupled weight decay).")
    lr: float = flag(1e-6, help="Peak learning rate.")
    min_lr: float = flag(0.0, help="Floor of the decayed learning rate (linear / cosine decay).")
    lr_decay_style: str = flag(
        "constant", choices=["constant", "linear", "cosine"], help="Learning-rate decay after warm-up."
    )
    lr_warmup_iters: int = flag(0, help="Linear warm-up from 0 to --lr, optimizer steps.")
    lr_decay_iters: int | None = flag(
        None, help="Optimizer steps over which the rate decays to --min-lr (default: all steps of the run)."
    )
    weight_decay: float = flag(0.01, help="Decoupled weight decay coefficient.")
    adam_beta1: float = flag(0.9, help="Adam beta1 (first-moment decay).")
    adam_beta2: float = flag(0.999, help="Adam beta2 (second-moment decay).")
    adam_eps: float = flag(1e-8, help="Adam epsilon added to the denominator.")
    clip_grad: float = flag(1.0, help="Clip the global gradient L2 norm to this value; 0 = no clipping.")

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr must be in [0, --lr = {self.lr}], got {self.min_lr}")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters must be >= 0 optimizer steps, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ConfigError(f"--lr-decay-iters must be >= 1 optimizer step, got {self.lr_decay_iters}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ConfigError(f"--adam-eps must be > 0, got {self.adam_eps}")
        for name in ("weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints (CKPT_ARGS): the Hugging Face model to start from, where to resume from and save to."""

    hf_checkpoint: str = flag(
        help="Local Hugging Face checkpoint folder: architecture, tokenizer, processor, the engines' first weights, "
        "and the policy's unless --load says otherwise (download a hub model first: "
        "hf download Qwen/Qwen3.5-35B-A3B --local-dir DIR; the geo3k launcher does)."
    )
    load: str | None = flag(
        None, help="A --save folder holding checkpoints: resume from its latest one. A Hugging Face model folder: "
        "start a fresh run from its weights. A folder that does not exist or holds neither: start from "
        "--hf-checkpoint (so --save D --load D resumes when it can). Default: start from --hf-checkpoint."
    )
    save: str | None = flag(None, help="Save checkpoints under this folder.")
    save_interval: int | None = flag(None, help="Save every this many rollout steps (needs --save).")
    ref_load: str | None = flag(
        None, help="Reference-model weights for the KL terms: a --save folder (the policy of its latest "
        "checkpoint) or a Hugging Face model folder (default: the weights of --hf-checkpoint)."
    )
    no_save_optim: bool = flag(False, help="Do not save optimizer state (smaller checkpoints; resume restarts Adam).")
    no_load_optim: bool = flag(False, help="Do not load optimizer state when resuming from --load.")

    def __post_init__(self):
        if not self.hf_checkpoint.strip():
            raise ConfigError("--hf-checkpoint must be a checkpoint folder, got an empty string")
        for name in ("load", "save", "ref_load"):  # '' would read as "not given" downstream, silently
            value = getattr(self, name)
            if value is not None and not value.strip():
                flag_name = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag_name} must be a folder, got an empty string; give one, or drop {flag_name}")
        if self.save_interval is not None:
            if self.save_interval < 1:
                raise ConfigError(f"--save-interval must be >= 1 rollout step, got {self.save_interval}")
            if self.save is None:
                raise ConfigError(f"--save-interval {self.save_interval} needs a folder to save to: add --save DIR")


@dataclasses.dataclass
class RankInfo:
    """Where a trainer rank sits in the trainer world: ``rank`` in ``0 .. world_size - 1``, the rendezvous
    ``master_addr`` / ``master_port`` of rank 0, and ``device``, ``"cuda"`` (NCCL process group) or ``"cpu"``
    (gloo)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str


@dataclasses.dataclass
class TrainerSpec:
    """What every trainer rank is handed besides its backend's own group: the shared flag groups and the run's numbers.

    Attributes:
        train, optimizer, grpo, checkpoint: BACKEND_ARGS, OPTIMIZER_ARGS, GRPO_ARGS, CKPT_ARGS.
        rollout_temperature: ``--rollout-temperature`` (> 0); log-probs are of ``softmax(logits / temperature)``.
        num_rollout: rollout steps of the run, or None (a decaying LR schedule then needs ``--lr-decay-iters``).
        steps_per_rollout: optimizer steps per rollout.  seed: rank ``r`` seeds torch with ``seed + r``.
        lr_schedule: the learning rate of each optimizer step, from ``optimizer`` and the run's length.

    Raises:
        ValueError: ``steps_per_rollout < 1``.
        ConfigError: an inconsistent LR schedule (:class:`LRSchedule`).
    """

    train: TrainConfig
    optimizer: OptimizerConfig
    grpo: GRPOConfig
    checkpoint: CheckpointConfig
    rollout_temperature: float
    num_rollout: int | None
    steps_per_rollout: int
    seed: int = 0
    lr_schedule: LRSchedule = dataclasses.field(init=False)

    def __post_init__(self):
        if self.steps_per_rollout < 1:
            raise ValueError(f"num_steps_per_rollout must be >= 1, got {self.steps_per_rollout}")
        total = None if self.num_rollout is None else self.num_rollout * self.steps_per_rollout
        self.lr_schedule = LRSchedule.from_config(self.optimizer, total)
