"""MODEL_ARGS (Megatron's names): their flag group (:class:`ModelConfig`) and its check against the checkpoint they
describe and the model slime builds from it.

No backend builds the model from MODEL_ARGS: the Megatron backend builds the native Qwen3.5-MoE model
from ``--hf-checkpoint``'s ``config.json`` (:mod:`slime.models.qwen3_5`), the FSDP backend the
transformers class it names.  Every MODEL_ARGS flag is therefore a statement about that model, and
:func:`check_model_args` refuses at parse time each one that is false or that nothing reads:

- numbers are compared with their ``config.json`` field (:data:`MODEL_ARGS_TO_HF`; the integer form
  of ``--linear-attention-freq`` / ``--moe-layer-freq`` is expanded over the checkpoint's layers);
- architecture switches and choices are compared with a ``config.json`` field where one decides them
  (``tie_word_embeddings``, ``hidden_act``, ``attention_bias``, the head counts), else with the
  Qwen3.5-MoE architecture's fixed behaviour (:data:`QWEN35_MOE_FIXED`; known only for a config whose
  ``model_type`` is Qwen3.5-MoE's);
- flags that choose something slime decides elsewhere are refused, naming what decides it
  (:data:`REFUSED`; also the Megatron backend's ``--attention-softmax-in-fp32``).

A switch given says "on".  When the command line describes the architecture (a number or a layer
pattern is given), a switch of :data:`SWITCHES` left out says "off", as in Megatron, and is compared
too.  Without a readable local ``config.json`` (a hub name, a folder made later) nothing is
checked; the driver stops at ``--hf-checkpoint`` before a run starts.  The flag-by-flag table and
the reasons: ``docs/design/model_args.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from typing import Any, Mapping

from slime.checkpoints.hf import MISSING, lookup, read_config
from slime.utils.config import ConfigError, check_at_least_one, flag


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


MODEL_ARGS_TO_HF: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (ModelConfig field, Hugging Face field paths tried in order; dots go into nested dicts)
    ("num_layers", ("num_hidden_layers",)),
    ("hidden_size", ("hidden_size",)),
    ("ffn_hidden_size", ("intermediate_size", "moe_intermediate_size")),
    ("num_attention_heads", ("num_attention_heads",)),
    ("num_query_groups", ("num_key_value_heads",)),
    ("kv_channels", ("head_dim",)),
    ("num_experts", ("num_experts",)),
    ("moe_router_topk", ("num_experts_per_tok",)),
    ("moe_ffn_hidden_size", ("moe_intermediate_size",)),
    ("moe_shared_expert_intermediate_size", ("shared_expert_intermediate_size",)),
    ("rotary_percent", ("rope_parameters.partial_rotary_factor", "partial_rotary_factor")),
    ("rotary_base", ("rope_parameters.rope_theta", "rope_theta")),
    ("vocab_size", ("vocab_size",)),
    ("norm_epsilon", ("rms_norm_eps",)),
    ("max_position_embeddings", ("max_position_embeddings",)),
    ("linear_conv_kernel_dim", ("linear_conv_kernel_dim",)),
    ("linear_key_head_dim", ("linear_key_head_dim",)),
    ("linear_value_head_dim", ("linear_value_head_dim",)),
    ("linear_num_key_heads", ("linear_num_key_heads",)),
    ("linear_num_value_heads", ("linear_num_value_heads",)),
)
"""The numeric MODEL_ARGS and their Hugging Face fields.  ``--ffn-hidden-size`` is the dense MLP width; a
Qwen3.5-MoE config has no ``intermediate_size`` (no dense MLP) and the native model sets it to the expert width."""

QWEN35_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
"""``model_type`` of a Qwen3.5-MoE ``config.json`` (top level, and its ``text_config``)."""

QWEN35_MOE_FIXED: dict[str, tuple[Any, str]] = {
    # field: (what the model does: True for a switch, the accepted values for a choice; in words)
    "swiglu": (True, "SwiGLU experts (hidden_act silu)"),
    "disable_bias_linear": (True, "no bias in any linear layer"),
    "qk_layernorm": (True, "queries and keys RMS-normalised per head"),
    "apply_layernorm_1p": (True, "every RMSNorm scales by (1 + weight)"),
    "attention_output_gate": (True, "full-attention output gated by a sigmoid of q_proj's gate half"),
    "moe_shared_expert_gate": (True, "the shared expert's output gated by a sigmoid"),
    "normalization": (("RMSNorm",), "RMSNorm"),
    "position_embedding_type": (("rope", "mrope"), "rotary embeddings (multimodal RoPE; rope on text positions)"),
    "moe_router_score_function": (("softmax",), "softmax over the experts, then top-k, renormalised"),
    "moe_layer_freq": (True, "every layer MoE (no dense MLP layer)"),
}
"""What the Qwen3.5-MoE architecture fixes (transformers' ``Qwen3_5MoeForConditionalGeneration`` and the native
model alike), for the flags no ``config.json`` field decides (``swiglu`` / ``disable_bias_linear``: when
``hidden_act`` / ``attention_bias`` are absent)."""

SWITCHES = ("untie_embeddings_and_output_weights", "group_query_attention", "swiglu", "disable_bias_linear",
            "qk_layernorm", "apply_layernorm_1p", "attention_output_gate", "moe_shared_expert_gate")
"""Architecture switches; ``--use-gated-attention`` is upstream slime's alias of ``--attention-output-gate``."""

REFUSED: dict[str, str] = {
    "spec": "the layer spec follows from --hf-checkpoint's architecture: the Megatron backend builds "
    "slime.models.qwen3_5.spec for a Qwen3.5-MoE config.json, the FSDP backend the transformers class it names",
    "moe_grouped_gemm": "the native model always runs each layer's experts as two grouped GEMMs, "
    "torch._grouped_mm in slime/models/qwen3_5/experts.py",
    "moe_permute_fusion": "tokens are permuted by megatron-core's unfused permutation (no TransformerEngine)",
    "moe_token_drop_policy": "the MoE layers are dropless (no expert capacity), so no token is ever dropped",
    "moe_router_dtype": "the native model's router computes its logits in the hidden states' dtype",
}
"""MODEL_ARGS that choose what slime decides elsewhere, with what decides it."""

SOFTMAX_IN_FP32 = ("--attention-softmax-in-fp32", "the attention kernels of --attention-backend (torch's varlen "
                   "FlashAttention, SDPA) compute the softmax themselves; no flag reaches them")
"""The Megatron backend's flag refused with :data:`REFUSED` (megatron-core's unfused softmax is never built)."""


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _same(given: Any, found: Any) -> bool:
    """Equal values; floats (epsilons, RoPE theta) up to their decimal spelling."""
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        return given == found
    return math.isclose(given, found, rel_tol=1e-9, abs_tol=0.0)


def _show(value: Any) -> str:
    return "absent" if value is MISSING else repr(value) if isinstance(value, str) else str(value)


def _implied(attr: str, config: Mapping) -> Any:
    """Hugging Face's value for a field the config leaves out, or ``MISSING`` when it has none."""
    if attr == "rotary_percent":
        return 1.0  # no partial_rotary_factor: the whole head dimension is rotated
    if attr == "kv_channels":
        _, hidden = lookup(config, "hidden_size")
        _, heads = lookup(config, "num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            return hidden // heads  # PretrainedConfig subclasses' default head_dim
    return MISSING


def _num_layers(config: Mapping, model: ModelConfig) -> int | None:
    """The checkpoint's layer count (integer layer patterns are expanded over it), else ``--num-layers``."""
    _, num_layers = lookup(config, "num_hidden_layers")
    return num_layers if isinstance(num_layers, int) else model.num_layers


def _architecture(config: Mapping) -> tuple[bool, str]:
    """Whether the config is a Qwen3.5-MoE one, and its ``model_type`` as messages show it."""
    name, model_type = lookup(config, "model_type")
    return model_type in QWEN35_MOE_TYPES, f"{name} {_show(model_type)}"


def _switch_truth(attr: str, config: Mapping, qwen35: bool, arch: str) -> tuple[Any, str]:
    """(whether the checkpoint's model does what switch ``attr`` says, how the message names the source);
    ``None`` when both values are true (grouped-query attention with one query head per KV head),
    ``MISSING`` when the config does not say."""
    if attr == "untie_embeddings_and_output_weights":
        name, tied = lookup(config, "tie_word_embeddings")
        if tied is MISSING:
            name, tied = name + " (absent; implied)", True
        return not tied, f"{name} {str(bool(tied)).lower()}"
    if attr == "group_query_attention":
        kv_name, kv = lookup(config, "num_key_value_heads")
        _, heads = lookup(config, "num_attention_heads")
        if not (isinstance(kv, int) and isinstance(heads, int)):
            return MISSING, f"{kv_name} absent"
        return (kv < heads if kv != heads else None), f"{kv_name} {kv} (num_attention_heads {heads})"
    field = {"swiglu": "hidden_act", "disable_bias_linear": "attention_bias"}.get(attr)
    if field is not None:
        name, value = lookup(config, field)
        if value is not MISSING:
            return (value == "silu" if field == "hidden_act" else not value), f"{name} {_show(value)}"
    if qwen35:
        return QWEN35_MOE_FIXED[attr][0], f"the Qwen3.5-MoE model ({arch}): {QWEN35_MOE_FIXED[attr][1]}"
    return MISSING, f"{arch} (only a Qwen3.5-MoE config.json's is known)"


def _compare_numbers(model: ModelConfig, config: Mapping) -> list[str]:
    mismatches = []
    for attr, paths in MODEL_ARGS_TO_HF:
        given = getattr(model, attr)
        if given is None:
            continue
        name, found = lookup(config, *paths)
        if found is MISSING:
            found = _implied(attr, config)
            name += " (absent; implied)" if found is not MISSING else ""
        if found is MISSING or not _same(given, found):
            mismatches.append(f"{_flag(attr)} {given} vs {name} {_show(found)}")
    if model.moe_aux_loss_coeff not in (None, 0):
        mismatches.append(f"--moe-aux-loss-coeff {model.moe_aux_loss_coeff} vs the trainers: no load-balancing "
                          "loss in RL (0; config.json's router_aux_loss_coef is a pre-training value)")
    return mismatches


def _compare_layer_patterns(model: ModelConfig, config: Mapping, qwen35: bool, arch: str) -> list[str]:
    """``--linear-attention-freq`` against ``layer_types``, ``--moe-layer-freq`` against every layer MoE."""
    mismatches = []
    num_layers = _num_layers(config, model)
    if model.linear_attention_freq is not None:
        name, layer_types = lookup(config, "layer_types")
        if isinstance(layer_types, list):
            want = [int(kind == "linear_attention") for kind in layer_types]
        else:
            _, hf_layers = lookup(config, "num_hidden_layers")
            want = [0] * hf_layers if isinstance(hf_layers, int) else None
            name += " (absent: all full_attention)" if want is not None else ""
        got = model.linear_attention_layers(num_layers)
        if want is None or got != want:
            shown = "absent" if want is None else f"{want} (1 = linear_attention)"
            given = model.linear_attention_freq.strip()
            given += "" if given.startswith("[") or got is None else f" = {got}"  # the integer form, expanded
            mismatches.append(f"--linear-attention-freq {given} vs {name} {shown}")
    if model.moe_layer_freq is not None:
        got = model.moe_layers(num_layers)
        if not qwen35:
            mismatches.append(f"--moe-layer-freq {model.moe_layer_freq.strip()} vs {arch} (only a Qwen3.5-MoE "
                              "config.json's MoE layers are known)")
        elif got is None or got != [1] * len(got):
            given = model.moe_layer_freq.strip()
            given += "" if given.startswith("[") or got is None else f" = {got}"
            mismatches.append(f"--moe-layer-freq {given} vs the Qwen3.5-MoE model ({arch}): "
                              f"{QWEN35_MOE_FIXED['moe_layer_freq'][1]}")
    return mismatches


def _compare_switches(model: ModelConfig, config: Mapping, qwen35: bool, arch: str, describes: bool) -> list[str]:
    mismatches = []
    for attr in SWITCHES:
        given = getattr(model, attr) or (attr == "attention_output_gate" and model.use_gated_attention)
        if not (given or describes):
            continue
        truth, source = _switch_truth(attr, config, qwen35, arch)
        if truth is None or (truth is MISSING and not given) or truth == given:
            continue
        if given:
            alias = attr == "attention_output_gate" and not model.attention_output_gate
            mismatches.append(f"{'--use-gated-attention' if alias else _flag(attr)} given vs {source}")
        else:
            off = "tied" if attr == "untie_embeddings_and_output_weights" else "off"
            mismatches.append(f"{_flag(attr)} not given ({off}) vs {source}")
    for attr in ("normalization", "position_embedding_type", "moe_router_score_function"):
        given = getattr(model, attr)
        if given is None:
            continue
        if not qwen35:
            mismatches.append(f"{_flag(attr)} {given} vs {arch} (only a Qwen3.5-MoE config.json's is known)")
        elif given not in QWEN35_MOE_FIXED[attr][0]:
            mismatches.append(f"{_flag(attr)} {given} vs the Qwen3.5-MoE model ({arch}): {QWEN35_MOE_FIXED[attr][1]}")
    return mismatches


def model_args_mismatches(model: ModelConfig, config: Mapping) -> list[str]:
    """One ``"--flag VALUE vs SOURCE VALUE"`` line per MODEL_ARGS value that disagrees with ``config`` (a
    ``config.json`` dict) or the model built from it: numbers, then layer patterns, then switches and choices."""
    qwen35, arch = _architecture(config)
    describes = (
        any(getattr(model, attr) is not None for attr, _ in MODEL_ARGS_TO_HF)
        or model.linear_attention_freq is not None or model.moe_layer_freq is not None
    )
    return (_compare_numbers(model, config) + _compare_layer_patterns(model, config, qwen35, arch)
            + _compare_switches(model, config, qwen35, arch, describes))


def refused_flags(model: ModelConfig, attention_softmax_in_fp32: bool = False) -> list[str]:
    """The given flags of :data:`REFUSED` (and the Megatron backend's ``--attention-softmax-in-fp32`` when set), each
    as ``"--flag VALUE (what decides it)"``."""
    refused = []
    for attr, instead in REFUSED.items():
        value = getattr(model, attr)
        if value not in (None, False):
            shown = "" if value is True else " " + " ".join(value) if isinstance(value, list) else f" {value}"
            refused.append(f"{_flag(attr)}{shown} ({instead})")
    if attention_softmax_in_fp32:
        refused.append(f"{SOFTMAX_IN_FP32[0]} ({SOFTMAX_IN_FP32[1]})")
    return refused


def check_model_args(model: ModelConfig, hf_checkpoint: str, *, attention_softmax_in_fp32: bool = False) -> None:
    """Refuse MODEL_ARGS that disagree with ``<hf_checkpoint>/config.json`` or the model built from it, and
    those that nothing reads (module docstring).

    Args:
        model: the parsed MODEL_ARGS.
        hf_checkpoint: ``--hf-checkpoint``; nothing is checked when it has no ``config.json``.
        attention_softmax_in_fp32: the selected Megatron backend's ``--attention-softmax-in-fp32``, refused with the
            MODEL_ARGS.

    Raises:
        ConfigError: listing each mismatch (flag, value, checkpoint field or fixed behaviour and its value)
            and each refused flag with what decides it instead.
        CheckpointError: ``config.json`` exists but is not readable.
    """
    config = read_config(hf_checkpoint)
    if config is None:
        return
    problems = []
    mismatches = model_args_mismatches(model, config)
    if mismatches:
        problems.append(
            f"MODEL_ARGS disagree with --hf-checkpoint {hf_checkpoint} (config.json): {'; '.join(mismatches)}. "
            "Fix these flags (e.g. source the scripts/models/*.sh file of this checkpoint) or drop them: "
            "unset MODEL_ARGS are taken from the checkpoint"
        )
    refused = refused_flags(model, attention_softmax_in_fp32)
    if refused:
        problems.append(f"these flags are read by nothing, so they could only say something false; drop them: "
                        f"{'; '.join(refused)}")
    if problems:
        raise ConfigError(". ".join(problems))
