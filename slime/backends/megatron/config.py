"""``--train-backend megatron``'s own flags (BACKEND_ARGS (megatron)), checks, data-parallel size and checkpoint layout.

Importable without megatron-core: the parser builds :class:`MegatronConfig` for every run, so
upstream's command lines parse (and are checked) on any machine.  Flag names, defaults and the
rules checked here are Megatron-LM's (``megatron/training/arguments.py``, megatron-core 0.16
``ModelParallelConfig`` / ``TransformerConfig.__post_init__`` and
``parallel_state.initialize_model_parallel``).

The rules that depend on the model's sizes (heads, experts, layers over TP / EP / PP; CP) are the
native Qwen3.5 model's own, :func:`slime.models.qwen3_5.config.check_parallel_layout`, called here
with the sizes of ``--hf-checkpoint``'s ``config.json`` or, before the checkpoint is on disk,
of MODEL_ARGS; this module keeps only Megatron's rules on the GPU count.

The backend itself is not in this version yet (see :data:`slime.backends.registry.TRAIN_BACKENDS`):
selecting it stops at parse time after these checks, naming its packages.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slime.backends.config import BackendConfig, OtherBackendFlag, refuse_flags
from slime.utils.config import ConfigError, check_at_least_one, flag

if TYPE_CHECKING:
    from slime.backends.config import CheckpointConfig, ModelConfig, TrainConfig
    from slime.ray.config import ClusterConfig

INSTEAD: dict[str, str] = {
    "gradient_checkpointing": "use --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "attn_implementation": "use --attention-backend",
}
"""What the Megatron backend does instead of another backend's flag, by field."""

SIZES_FROM_MODEL_ARGS: dict[str, str] = {
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "linear_num_key_heads": "linear_num_key_heads",
    "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
}
""":class:`slime.models.qwen3_5.config.ShardedSizes` field -> the MODEL_ARGS (:class:`ModelConfig`) field."""


@dataclasses.dataclass(kw_only=True)
class MegatronConfig(BackendConfig):
    """Megatron backend only (BACKEND_ARGS): parallelism, recompute, dropout, attention, numerics, HF conversion."""

    OFF_VALUES = {"expert_tensor_parallel_size": (None, 1)}

    tensor_model_parallel_size: int = flag(1, help="Tensor-parallel GPUs (Megatron TP).")
    sequence_parallel: bool = flag(False, help="Split activations along the sequence across the TP group (Megatron).")
    pipeline_model_parallel_size: int = flag(1, help="Pipeline stages (Megatron PP).")
    context_parallel_size: int = flag(
        1, help="Context-parallel GPUs splitting each sequence (Megatron CP, THD zigzag)."
    )
    expert_model_parallel_size: int = flag(1, help="Expert-parallel GPUs sharing out the MoE experts (Megatron EP).")
    expert_tensor_parallel_size: int | None = flag(
        None, help="Tensor-parallel GPUs inside each expert (Megatron ETP; default: --tensor-model-parallel-size)."
    )
    recompute_granularity: str | None = flag(
        None, choices=["full", "selective"], help="Activation recomputation: full layers or selected modules."
    )
    recompute_method: str | None = flag(
        None, choices=["uniform", "block"], help="With full recompute: spread over layers (uniform) or first N (block)."
    )
    recompute_num_layers: int | None = flag(
        None, help="With full recompute: layers per recompute unit (uniform) or recomputed layers (block)."
    )
    attention_dropout: float = flag(
        0.0, help="Dropout on attention probabilities; keep 0 in RL so training log-probs match the rollout's."
    )
    hidden_dropout: float = flag(0.0, help="Dropout on hidden states; keep 0 in RL so training log-probs match.")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, help="Accumulate and all-reduce gradients in fp32.")
    attention_softmax_in_fp32: bool = flag(False, help="Compute the attention softmax in fp32.")
    attention_backend: str = flag(
        "auto", choices=["flash", "fused", "unfused", "local", "auto"], help="Megatron attention implementation."
    )
    qkv_format: str = flag(
        "thd", choices=["thd", "bshd"], help="Sequence layout: thd (packed, no padding) or bshd (padded batch)."
    )
    megatron_to_hf_mode: str = flag(
        "raw",
        choices=["raw", "bridge"],
        help="Megatron backend only (upstream slime's flag): how Megatron weights are converted to and from "
        "Hugging Face names and layouts (loading --hf-checkpoint, weight sync to the engines): raw = slime's own "
        "converters, bridge = Megatron-Bridge. --train-backend fsdp trains the HF model itself and refuses bridge.",
    )

    def __post_init__(self):
        check_at_least_one(
            self,
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "recompute_num_layers",
        )
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        # Same rules as megatron.core TransformerConfig.__post_init__ (recompute section).
        if self.recompute_granularity is None:
            if self.recompute_method is not None or self.recompute_num_layers is not None:
                raise ConfigError(
                    "--recompute-method / --recompute-num-layers have no effect without --recompute-granularity; "
                    "add --recompute-granularity full"
                )
        elif self.recompute_granularity == "full":
            if self.recompute_method is None or self.recompute_num_layers is None:
                raise ConfigError(
                    "--recompute-granularity full needs --recompute-method {uniform,block} and --recompute-num-layers N"
                )
        elif self.recompute_num_layers is not None:
            raise ConfigError(
                f"--recompute-num-layers {self.recompute_num_layers} applies to --recompute-granularity full only; "
                "drop it for selective"
            )

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one replica of the dense layers: ``TP * PP * CP`` (Megatron)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def expert_tensor_parallel(self) -> int:
        """Expert tensor-parallel size with Megatron's default applied (``ETP = TP`` when unset)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP * PP * CP)`` (Megatron; :meth:`check` makes it a whole number)."""
        return world_size // self.model_parallel_size

    def data_parallel_text(self, world_size: int) -> str:
        return (
            f"data-parallel size {self.data_parallel_size(world_size)} (= {world_size} trainer GPUs / "
            f"(TP {self.tensor_model_parallel_size} * PP {self.pipeline_model_parallel_size} * "
            f"CP {self.context_parallel_size}))"
        )

    def checkpoint_parts(self) -> tuple[str, ...]:
        """``trainer/``: the Megatron backend saves model and optimizer as one ``torch.distributed.checkpoint``
        there (sharded, reloadable at another parallel layout) and writes a Hugging Face ``model/`` folder
        only when asked, since a full export of Qwen3.5-35B-A3B is ~70 GB per save."""
        return ("trainer",)

    def check(
        self,
        *,
        train: TrainConfig,
        model: ModelConfig,
        checkpoint: CheckpointConfig,
        cluster: ClusterConfig,
        other_flags: list[OtherBackendFlag],
    ) -> None:
        """Refuse the other backends' active flags, lay the trainer GPUs out as Megatron does (TP x CP x DP x
        PP for the dense layers, ETP x EP x expert-DP x PP for the experts), then check the layout against
        the model's sizes with the model's own rules (:meth:`check_model_layout`).

        Raises:
            ConfigError: a refused flag; parallel sizes that do not divide the trainer GPUs; EP > 1 with
                TP > 1 but no ``--sequence-parallel``; a layout the model cannot shard (see
                :func:`slime.models.qwen3_5.config.check_parallel_layout`).  The message names the flags and the fix.
        """
        refused = [f"{f.text} ({INSTEAD.get(f.field, f'a flag of --train-backend {f.backend}')})" for f in other_flags]
        owners = sorted({f.backend for f in other_flags if f.backend})
        refuse_flags("megatron", refused, f"drop these flags, or use --train-backend {' / '.join(owners)}")
        self._check_parallel_sizes(cluster)
        self.check_model_layout(model, checkpoint.hf_checkpoint)

    def check_model_layout(self, model: ModelConfig, hf_checkpoint: str) -> None:
        """The native Qwen3.5 model's layout rules at parse time, on the sizes of ``<hf_checkpoint>/config.json``
        when it exists, else on those MODEL_ARGS give (sizes neither gives are not checked).

        Raises:
            ConfigError: from :func:`slime.models.qwen3_5.config.check_parallel_layout`, or an unreadable
                ``config.json``.
        """
        from slime.backends.config import read_hf_config
        from slime.models.qwen3_5.config import ParallelLayout, Qwen35ConfigError, ShardedSizes, check_parallel_layout

        config = read_hf_config(hf_checkpoint)
        if config is not None:
            sizes = ShardedSizes.from_hf_config(config, f"--hf-checkpoint {hf_checkpoint}/config.json")
        else:
            sizes = ShardedSizes(
                **{size: getattr(model, field) for size, field in SIZES_FROM_MODEL_ARGS.items()},
                names={size: "--" + field.replace("_", "-") for size, field in SIZES_FROM_MODEL_ARGS.items()},
            )
        layout = ParallelLayout(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            context_parallel_size=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
        )
        try:
            check_parallel_layout(sizes, layout)
        except Qwen35ConfigError as e:
            raise ConfigError(str(e)) from None

    def _check_parallel_sizes(self, cluster: ClusterConfig) -> None:
        """Megatron's rules on the trainer GPU count (the model-size rules are :meth:`check_model_layout`'s)."""
        world = cluster.actor_num_gpus
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel
        nodes, per_node = cluster.actor_num_nodes, cluster.actor_num_gpus_per_node
        gpus = f"--actor-num-nodes {nodes} * --actor-num-gpus-per-node {per_node}"
        if world % (tp * pp * cp):
            raise ConfigError(
                f"the trainer's {world} GPUs ({gpus}) are not a multiple of --tensor-model-parallel-size {tp} * "
                f"--pipeline-model-parallel-size {pp} * --context-parallel-size {cp} = {tp * pp * cp}; "
                "change the parallel sizes or the GPU count"
            )
        # megatron-core 0.16 parallel_state.initialize_model_parallel lays the expert layers out as
        # ETP x EP x expert-DP x PP and raises unless world_size % (ETP * EP * PP) == 0 (ETP defaults to TP).
        if world % (etp * ep * pp):
            raise ConfigError(
                f"the trainer's {world} GPUs ({gpus}) are not a multiple of --expert-tensor-parallel-size {etp} * "
                f"--expert-model-parallel-size {ep} * --pipeline-model-parallel-size {pp} = {etp * ep * pp} "
                "(megatron-core's expert layout); change the parallel sizes or the GPU count"
            )
        # megatron.core ModelParallelConfig.__post_init__: EP > 1 with TP > 1 needs sequence parallelism.
        if ep > 1 and tp > 1 and not self.sequence_parallel:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                "(Megatron); add it"
            )
