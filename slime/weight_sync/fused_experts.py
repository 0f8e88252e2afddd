"""A MoE layer's routed experts as two fused tensors in a flattened weight-sync bucket, at no copy.

Checkpoints name each expert's ``gate_proj`` [I, H], ``up_proj`` [I, H] and ``down_proj`` [H, I] apart;
SGLang's Qwen3.5 ``load_weights`` also takes transformers 5's fused ``<layer>.mlp.experts.gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I], and loads those about 2.5 times faster.  Laid out as ``gate_0,
up_0, ..., gate_{E-1}, up_{E-1}, down_0, ..., down_{E-1}``, back to back, a flattened bucket's bytes
already are the fused tensors; only its metadata changes (``docs/design/weight_sync.md``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch

from slime.checkpoints.hf import lookup, read_config
from slime.checkpoints.layout import CheckpointError
from slime.weight_sync.flattened import IPC_ALIGN, TensorMeta, layout

EXPERT_WEIGHT = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
"""A checkpoint name of one expert's projection; ``layer`` is the prefix of the fused names."""

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def checkpoint_num_experts(hf_checkpoint: str | Path | None) -> int | None:
    """Routed experts per MoE layer of ``<hf_checkpoint>/config.json``; None for a dense model or no readable config."""
    if hf_checkpoint is None:
        return None
    try:
        config = read_config(hf_checkpoint)
    except CheckpointError:
        return None
    _, value = lookup(config or {}, "num_experts")
    return value if type(value) is int and value > 0 else None


def _complete_layers(bucket: Sequence[tuple[str, torch.Tensor]], num_experts: int,
                     align: int) -> dict[str, dict[str, list]]:
    """``{layer: {proj: [(name, tensor) by expert]}}`` of the layers of ``bucket`` that can be fused (all experts,
    one dtype, gate / up [I, H], down [H, I], each a multiple of ``align`` bytes).
    """
    found: dict[str, dict[str, dict[int, tuple[str, torch.Tensor]]]] = {}
    for name, tensor in bucket:
        match = EXPERT_WEIGHT.match(name)
        if match:
            found.setdefault(match["layer"], {p: {} for p in PROJECTIONS})[match["proj"]][int(match["expert"])] = (
                name, tensor)
    complete = {}
    for layer, projs in found.items():
        if any(sorted(projs[p]) != list(range(num_experts)) for p in PROJECTIONS):
            continue  # part of the layer (expert parallelism puts the rest on other ranks): sent per expert
        tensors = [t for p in PROJECTIONS for _, t in projs[p].values()]
        gate = projs["gate_proj"][0][1]
        if gate.dim() != 2 or len({t.dtype for t in tensors}) != 1 or (gate.numel() * gate.element_size()) % align:
            continue
        inter, hidden = gate.shape
        if any(t.shape != (inter, hidden) for p in ("gate_proj", "up_proj") for _, t in projs[p].values()) or any(
                t.shape != (hidden, inter) for _, t in projs["down_proj"].values()):
            continue
        complete[layer] = {p: [projs[p][e] for e in range(num_experts)] for p in PROJECTIONS}
    return complete


def fused_layout(bucket: Sequence[tuple[str, torch.Tensor]], num_experts: int | None,
                 align: int = IPC_ALIGN) -> tuple[list[tuple[str, torch.Tensor]], list[TensorMeta], int]:
    """Order ``bucket`` so that each complete MoE layer lies as its fused tensors, and describe it so.

    A fused layer's tensors move to where its first one was, in the order above; every other tensor
    keeps its name and place.  ``num_experts`` None or 0 fuses nothing.

    Returns:
        ``(ordered, metadata, total bytes)``: ``flatten(ordered, align=align)`` writes the buffer, and
        ``unflatten(buffer, metadata)`` reads the fused layers as ``<layer>.gate_up_proj`` [E, 2I, H] and
        ``<layer>.down_proj`` [E, H, I] (their entries last) and the rest by their own names.

    Raises:
        ValueError: an empty bucket or a repeated name (:func:`slime.weight_sync.flattened.layout`).
    """
    complete = _complete_layers(bucket, num_experts, align) if num_experts else {}
    if not complete:
        metadata, total = layout(bucket, align)
        return list(bucket), metadata, total
    ordered: list[tuple[str, torch.Tensor]] = []
    blocks: dict[int, str] = {}  # position in ordered -> the fused layer starting there
    placed = set()
    for name, tensor in bucket:
        match = EXPERT_WEIGHT.match(name)
        layer = match["layer"] if match else None
        if layer not in complete:
            ordered.append((name, tensor))
        elif layer not in placed:
            placed.add(layer)
            blocks[len(ordered)] = layer
            projs = complete[layer]
            ordered += [pair for e in range(num_experts) for pair in (projs["gate_proj"][e], projs["up_proj"][e])]
            ordered += projs["down_proj"]
    per_tensor, total = layout(ordered, align)
    metadata: list[TensorMeta] = []
    fused: list[TensorMeta] = []
    i = 0
    while i < len(per_tensor):
        layer = blocks.get(i)
        if layer is None:
            metadata.append(per_tensor[i])
            i += 1
            continue
        gate_up, down = per_tensor[i : i + 2 * num_experts], per_tensor[i + 2 * num_experts : i + 3 * num_experts]
        if all(a.end == b.start for run in (gate_up, down) for a, b in zip(run, run[1:])):
            inter, hidden = gate_up[0].shape
            dtype = gate_up[0].dtype
            fused.append(TensorMeta(f"{layer}.gate_up_proj", (num_experts, 2 * inter, hidden), dtype,
                                    gate_up[0].start, gate_up[-1].end - gate_up[0].start))
            fused.append(TensorMeta(f"{layer}.down_proj", (num_experts, hidden, inter), dtype,
                                    down[0].start, down[-1].end - down[0].start))
        else:  # cannot happen (_complete_layers checks the sizes); one by one is still a correct bucket
            metadata += gate_up + down
        i += 3 * num_experts
    # The fused entries last: SGLang 0.5.17's Qwen3.5 load_weights switches to its fused-expert name table at
    # the first fused name and keeps it for the rest of the call (one call per bucket), where a per-expert
    # name after it would match nothing and be skipped with a log line only (qwen3_5.py, load_weights).
    # The byte layout stays as it is: every entry carries its own offsets.
    return ordered, metadata + fused, total
