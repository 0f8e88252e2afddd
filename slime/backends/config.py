"""Trainer flags shared by every backend: batch sizes and precision (BACKEND_ARGS), optimizer
(OPTIMIZER_ARGS), checkpoints (CKPT_ARGS), the model architecture in Megatron's names (MODEL_ARGS),
and :class:`BackendConfig`, the base of each backend's own flag group.

Flag names and meanings follow Megatron-LM (``megatron/training/arguments.py``) and upstream
slime, so the ``MODEL_ARGS`` arrays of ``scripts/models/*.sh`` parse unchanged.  Every
MODEL_ARGS flag is optional: the FSDP backend reads the architecture from ``--hf-checkpoint``;
the values that are given must agree with it (:mod:`slime.checkpoints.model_args`, at parse time).

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

import ast
import dataclasses
import re
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from slime.backends.registry import TRAIN_BACKENDS
from slime.checkpoints.hf import lookup, read_config
from slime.utils.config import ConfigError, check_at_least_one, check_name_or_import_path, flag, flag_name

if TYPE_CHECKING:
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


def _layer_pattern(flag_name: str, text: str | None, num_layers: int | None) -> int | list[int] | None:
    """Parse a Megatron per-layer frequency flag: an int N, or a literal 0/1 list with one entry per layer.

    Megatron also evaluates Python expressions such as ``([1]*3+[0])*10``; slime accepts only
    literals (``ast.literal_eval``), so a launcher must expand them, as scripts/models/*.sh do.
    """
    if text is None:
        return None
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ConfigError(f"{flag_name} must be an integer or a list like '[1, 0, 1]', got {text!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{flag_name} must be >= 1, got {value}")
        return value
    if not value or any(type(entry) is not int or entry not in (0, 1) for entry in value):
        raise ConfigError(f"{flag_name} list must hold one 0 or 1 per layer, got {text!r}")
    if num_layers is not None and len(value) != num_layers:
        raise ConfigError(
            f"{flag_name} lists {len(value)} layers but --num-layers is {num_layers}; give one entry per layer"
        )
    return value


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Model architecture (MODEL_ARGS), Megatron names; unset ones come from --hf-checkpoint, given ones must match it.

    The comparison with ``<hf_checkpoint>/config.json`` is :func:`slime.checkpoints.model_args.check_model_args`.
    """

    spec: list[str] | None = flag(
        None, nargs=2, metavar=("MODULE", "FUNC"), help="Megatron layer-spec provider: module and function name."
    )
    num_layers: int | None = flag(None, help="Transformer layers.")
    hidden_size: int | None = flag(None, help="Hidden size (model width).")
    ffn_hidden_size: int | None = flag(None, help="Dense MLP intermediate size.")
    num_attention_heads: int | None = flag(None, help="Query heads of the full-attention layers.")
    group_query_attention: bool = flag(False, help="Use grouped-query attention (--num-query-groups KV heads).")
    num_query_groups: int | None = flag(None, help="Key/value heads with --group-query-attention.")
    kv_channels: int | None = flag(None, help="Head dimension of the full-attention layers.")
    use_gated_attention: bool = flag(
        False, help="Gate the attention output (upstream slime's alias of --attention-output-gate)."
    )
    normalization: str | None = flag(None, choices=["LayerNorm", "RMSNorm"], help="Normalization layer.")
    apply_layernorm_1p: bool = flag(False, help="Zero-centred norm weight: the norm scales by (1 + weight).")
    position_embedding_type: str | None = flag(
        None, choices=["learned_absolute", "rope", "mrope", "relative", "none"], help="Position embedding."
    )
    norm_epsilon: float | None = flag(None, help="Epsilon of the normalization layers.")
    rotary_percent: float | None = flag(
        None, help="Fraction of each head dimension that is rotated by RoPE, in (0, 1]."
    )
    rotary_base: int | None = flag(None, help="RoPE base (theta).")
    max_position_embeddings: int | None = flag(None, help="Longest sequence the position embedding covers, tokens.")
    swiglu: bool = flag(False, help="SwiGLU MLP activation.")
    untie_embeddings_and_output_weights: bool = flag(False, help="Separate input-embedding and output-layer weights.")
    vocab_size: int | None = flag(
        None,
        help="Vocabulary size, tokens: the embedding rows, i.e. the vocab_size of --hf-checkpoint's config, which "
        "counts the checkpoint's padding rows beyond the tokenizer's ids (248320 for Qwen3.5-35B-A3B); must equal it.",
    )
    disable_bias_linear: bool = flag(False, help="No bias in the linear layers.")
    qk_layernorm: bool = flag(False, help="Normalize queries and keys per head before attention.")
    moe_ffn_hidden_size: int | None = flag(None, help="Intermediate size of each routed expert.")
    moe_shared_expert_intermediate_size: int | None = flag(None, help="Intermediate size of the shared expert.")
    moe_shared_expert_gate: bool = flag(False, help="Gate the shared expert's output with a sigmoid.")
    moe_router_score_function: str | None = flag(None, choices=["softmax", "sigmoid"], help="Router score function.")
    moe_token_dispatcher_type: str | None = flag(
        None, choices=["allgather", "alltoall", "flex"], help="How tokens reach their experts across EP ranks."
    )
    moe_router_topk: int | None = flag(None, help="Experts each token is routed to.")
    moe_layer_freq: str | None = flag(
        None,
        help="Which layers are MoE: an integer N (every N-th layer, Megatron) or a 0/1 list with one entry per layer, "
        "e.g. '[1, 1, 1]'.",
    )
    num_experts: int | None = flag(None, help="Routed experts per MoE layer.")
    moe_grouped_gemm: bool = flag(False, help="Run the local experts as one grouped GEMM.")
    moe_token_drop_policy: str | None = flag(
        None, choices=["probs", "position"], help="Which tokens an over-capacity expert drops."
    )
    moe_router_dtype: str | None = flag(None, choices=["fp32", "fp64"], help="Precision of the router computation.")
    moe_permute_fusion: bool = flag(False, help="Fused token permutation kernels.")
    moe_aux_loss_coeff: float | None = flag(None, help="Weight of the MoE load-balancing loss; 0 = off.")
    attention_output_gate: bool = flag(False, help="Gate the attention output with a sigmoid of the input (Qwen3.5).")
    linear_attention_freq: str | None = flag(
        None,
        help="Hybrid linear attention (Gated DeltaNet): an integer N puts N-1 linear-attention layers before each "
        "full-attention layer (Megatron), or a 0/1 list with 1 = linear attention, one entry per layer.",
    )
    linear_conv_kernel_dim: int | None = flag(
        None, help="Short-convolution kernel size of the linear-attention layers, tokens."
    )
    linear_key_head_dim: int | None = flag(None, help="Key head dimension of the linear-attention layers.")
    linear_value_head_dim: int | None = flag(None, help="Value head dimension of the linear-attention layers.")
    linear_num_key_heads: int | None = flag(None, help="Key heads of the linear-attention layers.")
    linear_num_value_heads: int | None = flag(None, help="Value heads of the linear-attention layers.")

    def __post_init__(self):
        check_at_least_one(
            self,
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "max_position_embeddings",
            "vocab_size",
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "moe_router_topk",
            "num_experts",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
        if self.num_query_groups is not None and self.num_attention_heads is not None:
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError(
                    f"--num-attention-heads {self.num_attention_heads} is not a multiple of --num-query-groups "
                    f"{self.num_query_groups}; each KV head must serve the same number of query heads"
                )
        topk, experts = self.moe_router_topk, self.num_experts
        if topk is not None and experts is not None and topk > experts:
            raise ConfigError(f"--moe-router-topk {topk} exceeds --num-experts {experts}; use <= {experts}")
        if self.rotary_percent is not None and not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.norm_epsilon is not None and self.norm_epsilon <= 0:
            raise ConfigError(f"--norm-epsilon must be > 0, got {self.norm_epsilon}")
        if self.moe_aux_loss_coeff is not None and self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        _layer_pattern("--moe-layer-freq", self.moe_layer_freq, self.num_layers)
        _layer_pattern("--linear-attention-freq", self.linear_attention_freq, self.num_layers)

    @property
    def moe_layer_pattern(self) -> list[int] | None:
        """1 for each MoE layer, 0 for each dense one (needs --num-layers for the integer form); None if unknown.

        Integer N follows Megatron: layer ``i`` (from 0) is MoE when ``i % N == 0``.
        """
        return self.moe_layers(self.num_layers)

    def moe_layers(self, num_layers: int | None) -> list[int] | None:
        """:attr:`moe_layer_pattern` with the integer form expanded over ``num_layers`` layers (e.g. the
        checkpoint's count when --num-layers is unset); None if unknown."""
        value = _layer_pattern("--moe-layer-freq", self.moe_layer_freq, self.num_layers)
        if isinstance(value, int):
            return None if num_layers is None else [int(i % value == 0) for i in range(num_layers)]
        return value

    @property
    def linear_attention_pattern(self) -> list[int] | None:
        """1 for each linear-attention (Gated DeltaNet) layer, 0 for each full-attention one; None if unknown.

        Integer N follows Megatron: layer ``i`` (from 0) is full attention when ``(i + 1) % N == 0``.
        """
        return self.linear_attention_layers(self.num_layers)

    def linear_attention_layers(self, num_layers: int | None) -> list[int] | None:
        """:attr:`linear_attention_pattern` with the integer form expanded over ``num_layers`` layers
        (e.g. the checkpoint's count when --num-layers is unset); None if unknown."""
        value = _layer_pattern("--linear-attention-freq", self.linear_attention_freq, self.num_layers)
        if isinstance(value, int):
            return None if num_layers is None else [int((i + 1) % value != 0) for i in range(num_layers)]
        return value

    @property
    def is_hybrid_gdn(self) -> bool:
        """Whether MODEL_ARGS describe a hybrid model with Gated DeltaNet (linear-attention) layers."""
        value = _layer_pattern("--linear-attention-freq", self.linear_attention_freq, self.num_layers)
        if isinstance(value, int):
            return value > 1
        return bool(value) and 1 in value
