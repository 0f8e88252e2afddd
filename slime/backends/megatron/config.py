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

The backend is :class:`slime.backends.megatron.backend.MegatronBackend`; what it does not implement
(yet) is refused here at parse time, with the reason: context parallelism (the model's rule),
megatron-core's ``bshd`` layout, TransformerEngine's fused attention, attention dropout,
Megatron-Bridge conversion, and packed micro-batches of a Gated-DeltaNet model in a layout whose
packed-equals-one-at-a-time parity is not proven (:data:`PACKED_GDN_PROVEN`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slime.backends.config import BackendConfig, OtherBackendFlag, gdn_batching_problem, refuse_flags
from slime.utils.config import ConfigError, check_at_least_one, flag

if TYPE_CHECKING:
    from slime.backends.config import CheckpointConfig, TrainConfig
    from slime.checkpoints.model_args import ModelConfig
    from slime.ray.config import ClusterConfig

PACKED_GDN_PROVEN: tuple[dict[str, int], ...] = (
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
         expert_model_parallel_size=1),
)
"""Parallel layouts in which the native model's packed micro-batches of a Gated-DeltaNet model are proven
equal to the same sequences run one at a time (any data-parallel size: replicas are independent).

TP = PP = CP = EP = 1: bit-identical in bf16 with fla's kernels and ``varlen_attn`` on an H200
(``docs/results/h200_megatron_qwen35.md``, "bf16 packed vs the same sequences one at a time"), and
within 1e-5 in fp32 on the CPU (``tests/test_qwen35_model.py``).  Other layouts keep upstream's limit
until a GPU test proves them (``tests/test_megatron_gpu.py`` has the TP2 check for a 2-GPU machine)."""

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
        1, help="Context-parallel GPUs splitting each sequence (Megatron CP, THD zigzag). Not implemented for the "
        "native Qwen3.5 model yet: only 1."
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
    moe_token_dispatcher_type: str | None = flag(
        None, choices=["allgather", "alltoall", "flex"],
        help="How tokens reach their experts (megatron-core's MoE token dispatcher; upstream scripts put it in "
        "MODEL_ARGS): allgather or alltoall; default: allgather where each rank holds every expert whole (EP = ETP = "
        "1: nothing to exchange, one permutation; 1.9 percent faster in one H100 bench, "
        "docs/results/h200_train_phase.md) and on CPU (the only one there: the all-to-all dispatcher copies its "
        "counts on a CUDA stream), alltoall otherwise. flex (DeepEP / HybridEP) is refused: not installed.",
    )
    attention_dropout: float = flag(
        0.0, help="Dropout on attention probabilities; keep 0 in RL so training log-probs match the rollout's."
    )
    hidden_dropout: float = flag(0.0, help="Dropout on hidden states; keep 0 in RL so training log-probs match.")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, help="Accumulate and all-reduce gradients in fp32.")
    attention_softmax_in_fp32: bool = flag(False, help="Compute the attention softmax in fp32.")
    attention_backend: str = flag(
        "auto", choices=["flash", "fused", "unfused", "local", "auto"],
        help="Megatron attention implementation: auto = fla + torch's varlen FlashAttention for bf16 on CUDA, the "
        "torch paths otherwise; flash = varlen FlashAttention (CUDA, bf16); local / unfused = SDPA; fused "
        "(TransformerEngine) is refused (not installed). The vision tower follows: varlen = all images of a "
        "micro-batch in one call a block, SDPA = one call per image.",
    )
    qkv_format: str = flag(
        "thd", choices=["thd", "bshd"],
        help="Sequence layout: thd (packed, no padding) or bshd (padded batch); the native Qwen3.5 model runs thd "
        "only.",
    )
    megatron_to_hf_mode: str = flag(
        "raw",
        choices=["raw", "bridge"],
        help="Megatron backend only (upstream slime's flag): how Megatron weights are converted to and from "
        "Hugging Face names and layouts (loading --hf-checkpoint, weight sync to the engines): raw = slime's own "
        "converters, bridge = Megatron-Bridge (not supported yet: refused). --train-backend fsdp trains the HF model "
        "itself and refuses bridge.",
    )
    save_hf: str | None = flag(
        None,
        help="Megatron backend only (upstream slime's flag): with every --save checkpoint, also write the weights "
        "as a Hugging Face folder here (transformers from_pretrained / --hf-checkpoint); '{rollout_id}' in the path "
        "is replaced by the rollout id, otherwise each save overwrites the folder.",
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

    def _parallel_flags(self) -> list[str]:
        """``"--flag N"`` for each of TP, PP, CP and EP above 1, in that order."""
        sizes = {"--tensor-model-parallel-size": self.tensor_model_parallel_size,
                 "--pipeline-model-parallel-size": self.pipeline_model_parallel_size,
                 "--context-parallel-size": self.context_parallel_size,
                 "--expert-model-parallel-size": self.expert_model_parallel_size}
        return [f"{name} {size}" for name, size in sizes.items() if size > 1]

    def cpu_problem(self) -> str | None:
        """The flags a CPU run cannot take: model, pipeline or expert parallelism (megatron-core's schedules,
        all-to-all and RNG tracker need CUDA) and the all-to-all dispatcher (:meth:`token_dispatcher`)."""
        parallel = self._parallel_flags()
        if parallel:
            return (f"the Megatron backend on CPU runs data parallelism only, not {' '.join(parallel)} "
                    "(megatron-core's pipeline schedules, token all-to-all and CUDA RNG tracker need CUDA); use a GPU "
                    "or drop these flags")
        try:
            self.token_dispatcher(cuda=False)
        except ConfigError as e:
            return str(e)
        return None

    def token_dispatcher(self, *, cuda: bool) -> str:
        """megatron-core's MoE token dispatcher on a CUDA (``cuda``) or CPU rank: ``--moe-token-dispatcher-type``,
        else allgather where every rank holds every expert whole (EP = ETP = 1: no tokens cross ranks, and the
        all-gather dispatcher permutes them once where the all-to-all one also sorts them by expert chunk) and on the
        CPU, alltoall on CUDA with EP or ETP > 1.

        Raises:
            ConfigError: ``alltoall`` on a CPU run (megatron-core's all-to-all dispatcher needs CUDA streams)."""
        local = self.expert_model_parallel_size * self.expert_tensor_parallel == 1
        chosen = self.moe_token_dispatcher_type or ("alltoall" if cuda and not local else "allgather")
        if chosen == "alltoall" and not cuda:
            raise ConfigError("--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's all-to-all dispatcher "
                              "copies its token counts on a CUDA stream); this run trains on the CPU: use allgather "
                              "or drop the flag")
        return chosen

    def layout(self):
        """The parallel sizes as the native Qwen3.5 model takes them
        (:class:`slime.models.qwen3_5.config.ParallelLayout`)."""
        from slime.models.qwen3_5.config import ParallelLayout

        return ParallelLayout(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel,
            context_parallel_size=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
        )

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
        """``trainer/state`` (model, optimizer: a ``torch.distributed.checkpoint`` of full tensors under their
        Hugging Face names, reloadable at another parallel layout) and ``trainer/scheduler.pt``; the per-rank
        RNG files are optional (a resume with more ranks starts the extra ones fresh).  A Hugging Face folder
        is written only with ``--save-hf`` (see :mod:`slime.backends.megatron.checkpoint`)."""
        return ("trainer/state", "trainer/scheduler.pt")

    def check(
        self,
        *,
        train: TrainConfig,
        model: ModelConfig,
        checkpoint: CheckpointConfig,
        cluster: ClusterConfig,
        other_flags: list[OtherBackendFlag],
    ) -> None:
        """Refuse the other backends' active flags and what this backend does not implement, lay the trainer
        GPUs out as Megatron does (TP x CP x DP x PP for the dense layers, ETP x EP x expert-DP x PP for the
        experts), check the layout against the model's sizes with the model's own rules
        (:meth:`check_model_layout`), last the Gated-DeltaNet batching (:data:`PACKED_GDN_PROVEN`).

        Raises:
            ConfigError: a refused flag; parallel sizes that do not divide the trainer GPUs; TP > 1 without
                ``--sequence-parallel`` (megatron-core's MoE layer refuses to train so); a layout the model cannot shard (see
                :func:`slime.models.qwen3_5.config.check_parallel_layout`); ``--save-hf`` without ``--save``;
                packed GDN micro-batches in an unproven layout.  The message names the flags and the fix.
        """
        refused = [f"{f.text} ({INSTEAD.get(f.field, f'a flag of --train-backend {f.backend}')})" for f in other_flags]
        owners = sorted({f.backend for f in other_flags if f.backend})
        refuse_flags("megatron", refused, f"drop these flags, or use --train-backend {' / '.join(owners)}")
        refuse_flags("megatron", self._not_implemented(), "drop or change these flags")
        self._check_parallel_sizes(cluster)
        self.check_model_layout(model, checkpoint.hf_checkpoint)
        if self.save_hf is not None and not self.save_hf.strip():
            raise ConfigError("--save-hf must be a folder, got an empty string; give one, or drop --save-hf")
        if self.save_hf is not None and checkpoint.save is None:
            raise ConfigError(
                f"--save-hf {self.save_hf} is written with each checkpoint, but no --save DIR is given; add --save"
            )
        proven = any(all(getattr(self, k) == v for k, v in layout.items()) for layout in PACKED_GDN_PROVEN)
        if not proven:
            problem = gdn_batching_problem(
                model, checkpoint, train,
                reason=f"at --tensor-model-parallel-size {self.tensor_model_parallel_size} "
                f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size} --expert-model-parallel-size "
                f"{self.expert_model_parallel_size} (packed micro-batches are proven equal to one sequence at a time "
                "only at TP = PP = CP = EP = 1, where they are allowed)",
            )
            if problem:
                raise ConfigError(problem)

    def replay_routes_problem(self) -> str | None:
        """Why this layout cannot replay routed experts (the engine parity check's
        ``--engine-parity-replay-routes``, turned off at parse time for this reason), or None.

        Replay is proven at TP = PP = CP = EP = 1 (``tests/test_qwen35_model.py``, ``tests/test_megatron_backend.py``);
        the code also takes each rank's sequence-parallel share, a stage's global layer numbers and a rank's
        tokens before dispatch under EP (:func:`slime.models.qwen3_5.router.replayed_routes`), which no test
        on more than one GPU has checked yet."""
        parallel = self._parallel_flags()
        if not parallel:
            return None
        return (f"routing replay in the Megatron trainer is proven only at TP = PP = CP = EP = 1 (no multi-GPU "
                f"test yet), not at {' '.join(parallel)}")

    def train_replay_problem(self) -> str | None:
        """:meth:`replay_routes_problem`, and full recompute: megatron-core recomputes a layer block in the
        backward pass, outside the forward that sets the replayed routes, so the recomputed routers would choose
        their own experts."""
        problem = self.replay_routes_problem()
        if problem is None and self.recompute_granularity == "full":
            problem = ("--recompute-granularity full recomputes layer blocks in the backward pass, where replayed "
                       "routes are not set (use --recompute-granularity selective, or none)")
        return problem

    def _not_implemented(self) -> list[str]:
        """This backend's own flags set to something the native model does not do, each with the reason
        (context parallelism is the model's layout rule, :meth:`check_model_layout`)."""
        refused = []
        if self.qkv_format != "thd":
            refused.append(f"--qkv-format {self.qkv_format} (micro-batches are packed THD sequences)")
        if self.attention_backend == "fused":
            refused.append("--attention-backend fused (TransformerEngine's fused attention is not installed; "
                           "flash runs torch's varlen FlashAttention, local / unfused SDPA)")
        if self.moe_token_dispatcher_type == "flex":
            refused.append("--moe-token-dispatcher-type flex (DeepEP / HybridEP are not installed; use alltoall or "
                           "allgather)")
        if self.attention_dropout > 0:
            refused.append(f"--attention-dropout {self.attention_dropout} (the gated attention has no dropout)")
        if self.megatron_to_hf_mode != "raw":
            refused.append(f"--megatron-to-hf-mode {self.megatron_to_hf_mode} (Megatron-Bridge is not supported; "
                           "raw converts with slime.models.qwen3_5.weights)")
        return refused

    def check_model_layout(self, model: ModelConfig, hf_checkpoint: str) -> None:
        """The native Qwen3.5 model's layout rules at parse time, on the sizes of ``<hf_checkpoint>/config.json``
        when it exists, else on those MODEL_ARGS give (sizes neither gives are not checked).

        Raises:
            ConfigError: from :func:`slime.models.qwen3_5.config.check_parallel_layout`.
            CheckpointError: an unreadable ``config.json``.
        """
        from slime.checkpoints.hf import read_config
        from slime.models.qwen3_5.config import Qwen35ConfigError, ShardedSizes, check_parallel_layout

        config = read_config(hf_checkpoint)
        if config is not None:
            sizes = ShardedSizes.from_hf_config(config, f"--hf-checkpoint {hf_checkpoint}/config.json")
        else:
            sizes = ShardedSizes(
                **{size: getattr(model, field) for size, field in SIZES_FROM_MODEL_ARGS.items()},
                names={size: "--" + field.replace("_", "-") for size, field in SIZES_FROM_MODEL_ARGS.items()},
            )
        try:
            check_parallel_layout(sizes, self.layout())
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
        # megatron.core MoELayer.forward (0.16.1) raises in training when the attention TP group has more than one
        # rank and sequence parallelism is off; every decoder layer of the native Qwen3.5 model is an MoE layer.
        if tp > 1 and not self.sequence_parallel:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} needs --sequence-parallel: megatron-core's MoE layer (every layer "
                "of Qwen3.5) refuses to train with TP > 1 without it; add --sequence-parallel"
            )
