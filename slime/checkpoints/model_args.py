"""MODEL_ARGS (Megatron's names) against the Hugging Face config of ``--hf-checkpoint``.

The Megatron backend builds the language model from MODEL_ARGS; the FSDP backend builds it
from ``--hf-checkpoint`` and never reads them.  A given MODEL_ARGS value that disagrees with the
checkpoint is therefore a mistake either way (the wrong ``scripts/models/*.sh`` sourced, a
stale override), so :func:`check_model_args` refuses it at parse time.

Fields are read from the config's ``text_config`` (vision-language models such as
Qwen3.5-MoE), then from its top level.  The mapping, Megatron flag -> Hugging Face field of
``Qwen3_5MoeTextConfig`` (transformers):

==========================================  ==================================================
``--num-layers``                            ``num_hidden_layers``
``--hidden-size``                           ``hidden_size``
``--num-attention-heads``                   ``num_attention_heads``
``--num-query-groups``                      ``num_key_value_heads``
``--kv-channels``                           ``head_dim`` (absent: hidden_size // heads, as HF)
``--num-experts``                           ``num_experts``
``--moe-router-topk``                       ``num_experts_per_tok``
``--moe-ffn-hidden-size``                   ``moe_intermediate_size``
``--moe-shared-expert-intermediate-size``   ``shared_expert_intermediate_size``
``--rotary-percent``                        ``rope_parameters.partial_rotary_factor`` (absent: 1)
``--rotary-base``                           ``rope_parameters.rope_theta``
``--vocab-size``                            ``vocab_size`` (the embedding rows, padding included)
``--norm-epsilon``                          ``rms_norm_eps``
``--max-position-embeddings``               ``max_position_embeddings``
``--linear-conv-kernel-dim`` ...            ``linear_conv_kernel_dim``, ``linear_key_head_dim``,
                                            ``linear_value_head_dim``, ``linear_num_key_heads``,
                                            ``linear_num_value_heads`` (same names)
``--linear-attention-freq``                 ``layer_types``: 1 per ``linear_attention`` layer
                                            (absent: every layer full attention); an integer
                                            N is expanded over ``num_hidden_layers``
``--untie-embeddings-and-output-weights``   not ``tie_word_embeddings`` (absent: tied, as HF)
==========================================  ==================================================

``--vocab-size`` must equal the checkpoint's ``vocab_size`` exactly: that is the number of
embedding rows, which for Qwen3.5 already includes padding beyond the tokenizer's ids
(248320 rows), and Megatron's embedding must hold the same rows to load the weights.

``--untie-embeddings-and-output-weights`` is a switch, so "not given" and "off" look the same;
it is compared when it is given, and also when any other mapped flag is given (the command
line then describes the architecture, and Megatron ties the weights without the switch).

Not compared: ``--ffn-hidden-size`` (Qwen3.5-MoE has no dense MLP layer), ``--moe-layer-freq``
(no Hugging Face field: every Qwen3.5-MoE layer is MoE) and the other switches.
"""

from __future__ import annotations

import math
from typing import Any

from slime.backends.config import ModelConfig, read_hf_config
from slime.utils.config import ConfigError

MODEL_ARGS_TO_HF: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (ModelConfig field, Hugging Face field paths tried in order; dots go into nested dicts)
    ("num_layers", ("num_hidden_layers",)),
    ("hidden_size", ("hidden_size",)),
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
"""The numeric MODEL_ARGS and their Hugging Face fields (see the module docstring)."""

_ABSENT = object()


def _sections(config: dict) -> list[tuple[str, dict]]:
    """(name prefix, dict) of the config parts searched: ``text_config`` first, then the top level."""
    text = config.get("text_config")
    return ([("text_config.", text)] if isinstance(text, dict) else []) + [("", config)]


def _lookup(config: dict, paths: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``paths`` present in the config: ``(qualified name, value)``, or ``(paths[0], _ABSENT)``."""
    for prefix, section in _sections(config):
        for path in paths:
            value: Any = section
            for key in path.split("."):
                value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
            if value is not _ABSENT:
                return prefix + path, value
    return paths[0], _ABSENT


def _implied(attr: str, config: dict) -> Any:
    """Hugging Face's value for a field the config leaves out, or ``_ABSENT`` when it has none."""
    if attr == "rotary_percent":
        return 1.0  # no partial_rotary_factor: the whole head dimension is rotated
    if attr == "kv_channels":
        _, hidden = _lookup(config, ("hidden_size",))
        _, heads = _lookup(config, ("num_attention_heads",))
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            return hidden // heads  # PretrainedConfig subclasses' default head_dim
    return _ABSENT


def _same(given: Any, found: Any) -> bool:
    """Equal values; floats (epsilons, RoPE theta) up to their decimal spelling."""
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        return given == found
    return math.isclose(given, found, rel_tol=1e-9, abs_tol=0.0)


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value) if isinstance(value, str) else str(value)


def _layer_type_pattern(config: dict) -> tuple[str, list[int] | None]:
    """The checkpoint's layers as ``--linear-attention-freq`` list: 1 per ``linear_attention`` layer."""
    name, layer_types = _lookup(config, ("layer_types",))
    if isinstance(layer_types, list):
        return name, [int(kind == "linear_attention") for kind in layer_types]
    _, num_layers = _lookup(config, ("num_hidden_layers",))
    if not isinstance(num_layers, int):
        return name, None
    return f"{name} (absent: all full_attention)", [0] * num_layers


def model_args_mismatches(model: ModelConfig, config: dict) -> list[str]:
    """Every given MODEL_ARGS value that disagrees with a Hugging Face config (see the module docstring).

    Args:
        model: the parsed MODEL_ARGS.
        config: the checkpoint's ``config.json`` as a dict.

    Returns:
        One ``"--flag VALUE vs field VALUE"`` line per mismatch, in :data:`MODEL_ARGS_TO_HF` order,
        then ``--linear-attention-freq`` and ``--untie-embeddings-and-output-weights``; empty when all agree.
    """
    mismatches = []
    any_given = False
    for attr, paths in MODEL_ARGS_TO_HF:
        given = getattr(model, attr)
        if given is None:
            continue
        any_given = True
        name, found = _lookup(config, paths)
        if found is _ABSENT:
            found = _implied(attr, config)
            name += " (absent; implied)" if found is not _ABSENT else ""
        if found is _ABSENT or not _same(given, found):
            mismatches.append(f"--{attr.replace('_', '-')} {given} vs {name} {_show(found)}")
    if model.linear_attention_freq is not None:
        any_given = True
        name, want = _layer_type_pattern(config)
        # The integer form is expanded over the checkpoint's layers: a different --num-layers is its own mismatch.
        _, num_layers = _lookup(config, ("num_hidden_layers",))
        got = model.linear_attention_layers(num_layers if isinstance(num_layers, int) else model.num_layers)
        if want is None or got != want:
            shown = "absent" if want is None else f"{want} (1 = linear_attention)"
            given = model.linear_attention_freq.strip()
            given += "" if given.startswith("[") or got is None else f" = {got}"  # the integer form, expanded
            mismatches.append(f"--linear-attention-freq {given} vs {name} {shown}")
    if model.untie_embeddings_and_output_weights or any_given:
        name, tied = _lookup(config, ("tie_word_embeddings",))
        if tied is _ABSENT:
            name, tied = name + " (absent; implied)", True
        if bool(tied) == model.untie_embeddings_and_output_weights:
            given = "given" if model.untie_embeddings_and_output_weights else "not given (tied)"
            mismatches.append(f"--untie-embeddings-and-output-weights {given} vs {name} {str(bool(tied)).lower()}")
    return mismatches


def check_model_args(model: ModelConfig, hf_checkpoint: str) -> None:
    """Refuse MODEL_ARGS that disagree with ``<hf_checkpoint>/config.json``.

    Nothing is checked when ``hf_checkpoint`` is not a local folder with a ``config.json`` (a
    hub name, or a folder made later) or when no MODEL_ARGS are given.

    Raises:
        ConfigError: listing each mismatch (flag, value, checkpoint field, checkpoint value), or
            an unreadable ``config.json``.
    """
    config = read_hf_config(hf_checkpoint)
    if config is None:
        return
    mismatches = model_args_mismatches(model, config)
    if mismatches:
        raise ConfigError(
            f"MODEL_ARGS disagree with --hf-checkpoint {hf_checkpoint} (config.json): {'; '.join(mismatches)}. "
            "Fix these flags (e.g. source the scripts/models/*.sh file of this checkpoint) or drop them: "
            "unset MODEL_ARGS are taken from the checkpoint"
        )
