"""Qwen3.5's multi-token-prediction (MTP) layer in a Hugging Face checkpoint: its tensors, a random one, a check.

Released Qwen3.5 MoE checkpoints carry one MTP layer (``text_config.mtp_num_hidden_layers`` 1) as ``mtp.*``
tensors that no trainer loads or syncs; SGLang 0.5.17 drafts with it (``--speculative-algorithm EAGLE``:
``Qwen3_5ForCausalLMMTP`` of ``sglang/srt/models/qwen3_5_mtp.py``, which loads the names holding ``mtp``):
``mtp.fc [h, 2h]``, three RMSNorms and ``mtp.layers.0.*``, one gated full-attention decoder layer with the model's
MoE block named as the model's layers, experts per expert; the embedding and LM head are the target's.  That is
``17 + 3 E`` tensors (785 in Qwen3.5-35B-A3B).  How SGLang picks and feeds it: docs/results/h200_real_width.md,
item 5.  Imports neither torch nor safetensors at module level (the flag parser uses :func:`mtp_problem`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime.checkpoints.hf import CONFIG_FILE, lookup, read_config, require_config

MTP_PREFIX = "mtp."
MTP_FILE = "mtp.safetensors"
MTP_CONFIG_FIELDS = {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
"""The ``text_config`` fields of a released Qwen3.5 checkpoint with its MTP layer."""
INDEX_FILE = "model.safetensors.index.json"


def mtp_tensor_shapes(text_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of one MTP layer for ``text_config`` (``config.json``'s, as a dict); q_proj
    holds [query; gate] per head unless ``attn_output_gate`` is false.

    Raises:
        ValueError: a field is missing (naming it).
    """
    def field(name: str) -> int:
        if name not in text_config:
            raise ValueError(f"text_config has no {name}: not a Qwen3.5-MoE text config")
        return int(text_config[name])

    h, heads, kv = field("hidden_size"), field("num_attention_heads"), field("num_key_value_heads")
    d = int(text_config.get("head_dim") or h // heads)
    q_rows = (2 if text_config.get("attn_output_gate", True) else 1) * heads * d
    experts, inter, shared = field("num_experts"), field("moe_intermediate_size"), field(
        "shared_expert_intermediate_size")
    layer = f"{MTP_PREFIX}layers.0."
    shapes = {
        f"{MTP_PREFIX}fc.weight": (h, 2 * h),
        f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (h,),
        f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (h,),
        f"{MTP_PREFIX}norm.weight": (h,),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
        f"{layer}self_attn.q_proj.weight": (q_rows, h),
        f"{layer}self_attn.k_proj.weight": (kv * d, h),
        f"{layer}self_attn.v_proj.weight": (kv * d, h),
        f"{layer}self_attn.o_proj.weight": (h, heads * d),
        f"{layer}self_attn.q_norm.weight": (d,),
        f"{layer}self_attn.k_norm.weight": (d,),
        f"{layer}mlp.gate.weight": (experts, h),
        f"{layer}mlp.shared_expert.gate_proj.weight": (shared, h),
        f"{layer}mlp.shared_expert.up_proj.weight": (shared, h),
        f"{layer}mlp.shared_expert.down_proj.weight": (h, shared),
        f"{layer}mlp.shared_expert_gate.weight": (1, h),
    }
    for e in range(experts):
        shapes[f"{layer}mlp.experts.{e}.gate_proj.weight"] = (inter, h)
        shapes[f"{layer}mlp.experts.{e}.up_proj.weight"] = (inter, h)
        shapes[f"{layer}mlp.experts.{e}.down_proj.weight"] = (h, inter)
    return shapes


def safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` from a safetensors file's header (an 8-byte little-endian
    length, then JSON), without loading a tensor.

    Raises:
        ValueError: not a safetensors file (naming it).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def weight_map(folder: str | os.PathLike) -> dict[str, str] | None:
    """Tensor name -> file of a Hugging Face folder (its index, else its safetensors headers); None without
    safetensors weights."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    return {name: f.name for f in files for name in safetensors_header(f)}


def write_mtp_layer(folder: str | os.PathLike, *, seed: int = 0, dtype=None, device: str = "cpu",
                    std: float | None = None) -> dict[str, tuple[int, ...]]:
    """Add a random MTP layer of :func:`mtp_tensor_shapes` to a checkpoint folder: ``mtp.safetensors`` (``dtype``,
    default bf16; matrices ~ N(0, ``std``), default ``initializer_range``; RMSNorm weights 0, i.e. scale 1), its
    entries in ``model.safetensors.index.json`` (made when absent) and :data:`MTP_CONFIG_FIELDS`.  Same seed, dtype
    and ``device`` (where the numbers are drawn) -> same weights.  Returns the names and shapes written.

    Raises:
        FileExistsError: the folder already has ``mtp.*`` tensors.
        ValueError: no safetensors weights, or a field missing from ``config.json`` (naming it).
    """
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    config = require_config(folder, "the checkpoint")
    text = config.get("text_config", config)
    shapes = mtp_tensor_shapes(text)
    existing = weight_map(folder)
    if existing is None:
        raise ValueError(f"{folder}: no safetensors weights (model.safetensors or {INDEX_FILE}) to add an MTP layer to")
    if any(name.startswith(MTP_PREFIX) for name in existing):
        raise FileExistsError(f"{folder} already has {MTP_PREFIX}* tensors; use a checkpoint without an MTP layer")
    dtype = dtype or torch.bfloat16
    std = float(std if std is not None else text.get("initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            drawn = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            tensors[name] = drawn.mul_(std).to(dtype).cpu()
    save_file(tensors, str(folder / MTP_FILE), metadata={"format": "pt"})
    index_path = folder / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"metadata": {}, "weight_map": existing}
    total = index.get("metadata", {}).get("total_size")
    if total is None:
        total = _tensor_bytes(folder, set(existing.values()))
    index["metadata"] = {**index.get("metadata", {}),
                         "total_size": int(total) + sum(t.numel() * t.element_size() for t in tensors.values())}
    index["weight_map"] = dict(sorted({**index["weight_map"], **dict.fromkeys(tensors, MTP_FILE)}.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    text.update(MTP_CONFIG_FIELDS)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return shapes


def _tensor_bytes(folder: Path, files: set[str]) -> int:
    """Bytes of the tensors in ``files`` (from their headers)."""
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0]
               for name in files for entry in safetensors_header(folder / name).values())


def mtp_problem(hf_checkpoint: str | os.PathLike) -> str | None:
    """Why ``hf_checkpoint`` cannot serve MTP drafts: no ``mtp_num_hidden_layers`` >= 1 in ``config.json``, or no
    ``mtp.*`` tensor in its safetensors; None when it can, or cannot be told (no local ``config.json``).

    Raises:
        CheckpointError: ``config.json`` is unreadable (naming the file).
        ValueError: a safetensors header is unreadable (naming the file).
    """
    config = read_config(hf_checkpoint)
    if config is None:
        return None
    _, layers = lookup(config, "mtp_num_hidden_layers")
    problems = []
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        problems.append(f"config.json has no mtp_num_hidden_layers >= 1 (text_config.mtp_num_hidden_layers = "
                        f"{layers!r})")
    names = weight_map(hf_checkpoint)
    if names is not None and not any(name.startswith(MTP_PREFIX) for name in names):
        problems.append(f"its safetensors weights hold no {MTP_PREFIX}* tensor (the MTP layer)")
    return "; ".join(problems) or None
