"""Hugging Face ``config.json`` of a Qwen3.5-MoE checkpoint -> the native Megatron model's config.

:class:`Qwen35Arch` holds the architecture numbers (plain Python, no megatron-core), including what
megatron-core's ``TransformerConfig`` has no field for (per-layer attention kind, MRoPE sections, image
token ids, the vision config, the unpadded vocabulary); :func:`transformer_config` builds megatron-core's
config from it plus the parallel layout and precision; :class:`Qwen35Config` bundles both with the kernels.
The field mapping, what is fixed by the architecture and what is set for RL: ``docs/design/qwen35_native.md``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from slime.checkpoints.hf import require_config, text_fields
from slime.errors import SlimeError

LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen35ConfigError(SlimeError, ValueError):
    """A checkpoint config or a parallel layout that the native Qwen3.5 model cannot build."""


@dataclasses.dataclass(frozen=True)
class Qwen35Arch:
    """Architecture numbers of a Qwen3.5-MoE checkpoint, in its units (sizes in elements, ``rope_theta`` the RoPE base).

    ``vision_config`` is the raw ``vision_config`` dict (``None`` for a text-only checkpoint).
    """

    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rotary_percent: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    spatial_merge_size: int = 2
    vision_config: dict | None = None

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions per head: ``int(head_dim * rotary_percent)``."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def linear_attention_pattern(self) -> list[int]:
        """1 per Gated DeltaNet (``linear_attention``) layer, 0 per full-attention layer."""
        return [int(kind == "linear_attention") for kind in self.layer_types]

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of TP; the added rows are zero and their logits masked."""
        return math.ceil(self.vocab_size / tensor_parallel_size) * tensor_parallel_size

    def sharded_sizes(self, source: str = "") -> "ShardedSizes":
        """The sizes :func:`check_parallel_layout` checks, named by their ``config.json`` fields."""
        return ShardedSizes(**{field: getattr(self, field) for field in HF_SIZE_NAMES}, source=source)


@dataclasses.dataclass(frozen=True)
class Qwen35Kernels:
    """Which kernel runs each packed-sequence operator.

    Attributes:
        gdn: ``"fla"`` (flash-linear-attention's ``chunk_gated_delta_rule``; CUDA, fp32 via TF32) or ``"torch"``
            (:func:`slime.models.qwen3_5.gdn.chunk_gated_delta_rule_torch`; any device and dtype, exact fp32, slow).
        attention: ``"varlen"`` (torch's ``varlen_attn``; CUDA, bf16/fp16) or ``"sdpa"`` (one call per document);
            the vision tower follows it (:func:`slime.models.qwen3_5.vision.vision_attention_for`: all images of a
            micro-batch in one call a block, or one SDPA call per image).
        gdn_conv: ``"fla"`` (``causal_conv1d``) or ``"torch"`` (:func:`slime.models.qwen3_5.gdn.causal_conv1d_packed`);
            default: as ``gdn``.

    Raises:
        Qwen35ConfigError: a value outside these.
    """

    gdn: Literal["fla", "torch"] = "fla"
    attention: Literal["varlen", "sdpa"] = "varlen"
    gdn_conv: Literal["fla", "torch"] | None = None

    def __post_init__(self):
        if self.gdn not in ("fla", "torch"):
            raise Qwen35ConfigError(f"Qwen35Kernels.gdn must be 'fla' or 'torch', got {self.gdn!r}")
        if self.gdn_conv is None:
            object.__setattr__(self, "gdn_conv", self.gdn)
        if self.gdn_conv not in ("fla", "torch"):
            raise Qwen35ConfigError(f"Qwen35Kernels.gdn_conv must be 'fla' or 'torch', got {self.gdn_conv!r}")
        if self.attention not in ("varlen", "sdpa"):
            raise Qwen35ConfigError(f"Qwen35Kernels.attention must be 'varlen' or 'sdpa', got {self.attention!r}")

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, device_type: str = "cuda") -> "Qwen35Kernels":
        """fla + varlen for bf16/fp16 on CUDA; else torch + sdpa (fla's fp32 GDN backward is wrong on Hopper)."""
        if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return cls(gdn="torch", attention="sdpa")
        return cls(gdn="fla", attention="varlen")


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Everything the native model is built from: the arch, megatron-core's config and the kernels."""

    arch: Qwen35Arch
    transformer: Any  # megatron.core.transformer.TransformerConfig (imported lazily: CPU tools need none)
    kernels: Qwen35Kernels = Qwen35Kernels()

    @property
    def padded_vocab_size(self) -> int:
        return self.arch.padded_vocab_size(self.transformer.tensor_model_parallel_size)


def _field(section: Mapping, name: str, source: str) -> Any:
    if name not in section:
        raise Qwen35ConfigError(f"{source}: field {name!r} is missing; is this a Qwen3.5-MoE config.json?")
    return section[name]


def arch_from_hf_config(config: dict | Any, source: str = "config.json") -> Qwen35Arch:
    """The :class:`Qwen35Arch` of a Qwen3.5-MoE config (a ``config.json`` dict or a transformers ``PretrainedConfig``).

    Fields are read under ``text_config`` when present; ``source`` names the config in errors.

    Raises:
        Qwen35ConfigError: a field is missing, or a value the native model does not implement
            (naming the field and its value).
    """
    if not isinstance(config, dict):
        config = config.to_dict()
    text = text_fields(config)
    get = lambda name: _field(text, name, source)  # noqa: E731
    num_layers = int(get("num_hidden_layers"))
    layer_types = tuple(get("layer_types"))
    if len(layer_types) != num_layers or any(kind not in LAYER_TYPES for kind in layer_types):
        raise Qwen35ConfigError(
            f"{source}: layer_types must list {num_layers} entries of {LAYER_TYPES}, got {list(layer_types)}"
        )
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("tie_word_embeddings", False)):
        value = text.get(name, config.get(name))
        if name == "tie_word_embeddings":
            value = bool(config.get(name, False)) or bool(text.get(name, False))
        if value != want:
            raise Qwen35ConfigError(f"{source}: {name} = {value!r} is not implemented (need {want!r})")
    rope = text.get("rope_parameters") or {}
    head_dim = int(text.get("head_dim") or get("hidden_size") // get("num_attention_heads"))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    section = tuple(int(s) for s in rope.get("mrope_section", [11, 11, 10]))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise Qwen35ConfigError(
            f"{source}: rope_parameters.mrope_section {list(section)} must have 3 entries summing to "
            f"rotary_dim / 2 = {rotary_dim // 2} (head_dim {head_dim} x partial_rotary_factor {partial})"
        )
    if rope.get("rope_type", "default") != "default":
        raise Qwen35ConfigError(f"{source}: rope_parameters.rope_type {rope.get('rope_type')!r} is not implemented")
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    arch = Qwen35Arch(
        hidden_size=int(get("hidden_size")),
        num_layers=num_layers,
        layer_types=layer_types,
        vocab_size=int(get("vocab_size")),
        num_attention_heads=int(get("num_attention_heads")),
        num_query_groups=int(get("num_key_value_heads")),
        head_dim=head_dim,
        rotary_percent=partial,
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        num_experts=int(get("num_experts")),
        moe_router_topk=int(get("num_experts_per_tok")),
        moe_ffn_hidden_size=int(get("moe_intermediate_size")),
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
        image_token_id=config.get("image_token_id"),
        video_token_id=config.get("video_token_id"),
        vision_start_token_id=config.get("vision_start_token_id"),
        spatial_merge_size=int((vision or {}).get("spatial_merge_size", 2)),
        vision_config=vision,
    )
    if arch.linear_num_value_heads % arch.linear_num_key_heads:
        raise Qwen35ConfigError(
            f"{source}: linear_num_value_heads {arch.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {arch.linear_num_key_heads}"
        )
    if arch.num_attention_heads % arch.num_query_groups:
        raise Qwen35ConfigError(
            f"{source}: num_attention_heads {arch.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {arch.num_query_groups}"
        )
    return arch


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel sizes (the flags of the same names); ``expert_tensor_parallel_size`` ``None`` is TP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


HF_SIZE_NAMES: dict[str, str] = {
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "linear_num_key_heads": "linear_num_key_heads",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
}
""":class:`ShardedSizes` field -> the Hugging Face ``config.json`` field it comes from."""


@dataclasses.dataclass(frozen=True)
class ShardedSizes:
    """The sizes that a parallel layout splits, for :func:`check_parallel_layout`; ``None`` is unknown (rules skipped).

    From a checkpoint (:meth:`Qwen35Arch.sharded_sizes`, :meth:`from_hf_config`) or from MODEL_ARGS before
    the checkpoint is on disk.  ``names``: per field, how messages name it (default :data:`HF_SIZE_NAMES`);
    ``source``: where the sizes come from, for messages.
    """

    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    linear_num_key_heads: int | None = None
    shared_expert_intermediate_size: int | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(HF_SIZE_NAMES))
    source: str = ""

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> "ShardedSizes":
        """The integer sizes a ``config.json`` dict states; nothing else of the config is checked."""
        text = text_fields(config)
        values = {field: text.get(hf) for field, hf in HF_SIZE_NAMES.items()}
        return cls(**{f: v if type(v) is int else None for f, v in values.items()}, source=source)

    def text(self, field: str) -> str:
        """``"<name> <value>"`` of one size, e.g. ``"num_key_value_heads 2"``."""
        return f"{self.names[field]} {getattr(self, field)}"


def check_parallel_layout(arch: Qwen35Arch | ShardedSizes, layout: ParallelLayout) -> None:
    """Refuse a layout that cannot shard this model; the one place of these rules (GPU counts are the backend's).

    Raises:
        Qwen35ConfigError: TP does not divide the GDN key heads, the attention query or KV heads, or the
            shared-expert width; ETP does not divide the expert width; EP does not divide the experts; PP
            exceeds the layers; CP > 1.  Each message names the flag and the sizes.
    """
    sizes = arch.sharded_sizes() if isinstance(arch, Qwen35Arch) else arch
    tp, ep, etp, pp = (layout.tensor_model_parallel_size, layout.expert_model_parallel_size, layout.etp,
                       layout.pipeline_model_parallel_size)
    of = f" of {sizes.source}" if sizes.source else ""
    divides = [  # (size field, parallel size, its flag, why)
        ("linear_num_key_heads", tp, "--tensor-model-parallel-size", " (Gated DeltaNet is sharded by heads)"),
        ("num_attention_heads", tp, "--tensor-model-parallel-size", ""),
        ("num_query_groups", tp, "--tensor-model-parallel-size",
         " (replicating KV heads across TP is not implemented)"),
        ("shared_expert_intermediate_size", tp, "--tensor-model-parallel-size", ""),
        ("num_experts", ep, "--expert-model-parallel-size", " (each EP rank holds the same number of experts)"),
        ("moe_ffn_hidden_size", etp, "--expert-tensor-parallel-size", ""),
    ]
    for field, size, flag, why in divides:
        value = getattr(sizes, field)
        if value is not None and value % size:
            raise Qwen35ConfigError(f"{flag} {size} must divide {sizes.text(field)}{of}{why}")
    if sizes.num_layers is not None and pp > sizes.num_layers:
        raise Qwen35ConfigError(f"--pipeline-model-parallel-size {pp} exceeds {sizes.text('num_layers')}{of}")
    if layout.context_parallel_size != 1:
        raise Qwen35ConfigError(f"--context-parallel-size {layout.context_parallel_size}: context parallelism is "
                                "not implemented for the native Qwen3.5 model yet; use 1")


def transformer_config(
    arch: Qwen35Arch,
    layout: ParallelLayout = ParallelLayout(),
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    moe_token_dispatcher_type: str = "alltoall",
    **overrides: Any,
):
    """megatron-core's ``TransformerConfig`` for ``arch`` under ``layout`` (checked with :func:`check_parallel_layout`).

    ``moe_token_dispatcher_type``: ``"alltoall"`` or ``"allgather"``; ``overrides``: further fields, applied last.

    Raises:
        Qwen35ConfigError: see :func:`check_parallel_layout`.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_parallel_layout(arch, layout)
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=True,
        attention_output_gate=True,
        rotary_interleaved=False,
        mrope_section=list(arch.mrope_section),
        linear_attention_freq=arch.linear_attention_pattern,
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_router_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # softmax over the top-k logits == HF's softmax, top-k, renormalise
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=moe_token_dispatcher_type,
        moe_grouped_gemm=False,  # the experts module is ours (torch._grouped_mm), not TE's / grouped_gemm's
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        variable_seq_lengths=layout.pipeline_model_parallel_size > 1,  # packed micro-batches differ in length
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.etp,
        context_parallel_size=layout.context_parallel_size,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        init_method_std=0.02,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def qwen35_config_from_hf(
    hf_checkpoint: str | Path | dict,
    layout: ParallelLayout = ParallelLayout(),
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    kernels: Qwen35Kernels | None = None,
    **overrides: Any,
) -> Qwen35Config:
    """The :class:`Qwen35Config` of an HF checkpoint folder (or its ``config.json`` dict).

    ``kernels`` defaults to :meth:`Qwen35Kernels.for_dtype` (CUDA when available); the rest as in
    :func:`transformer_config`.

    Raises:
        Qwen35ConfigError: see :func:`arch_from_hf_config` and :func:`check_parallel_layout`.
        CheckpointError: no readable ``config.json`` in the folder (:func:`slime.checkpoints.hf.require_config`).
    """
    if isinstance(hf_checkpoint, dict):
        config, source = hf_checkpoint, "config.json"
    else:
        config, source = require_config(hf_checkpoint), str(Path(hf_checkpoint) / "config.json")
    arch = arch_from_hf_config(config, source)
    if kernels is None:
        kernels = Qwen35Kernels.for_dtype(params_dtype, "cuda" if torch.cuda.is_available() else "cpu")
    return Qwen35Config(arch=arch, transformer=transformer_config(arch, layout, params_dtype=params_dtype,
                                                                  **overrides), kernels=kernels)
