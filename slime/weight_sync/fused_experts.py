"""A MoE layer's routed experts as two fused tensors in a flattened weight-sync bucket, at no copy.

Checkpoints, and so every backend's weight export, name each expert's projections apart:
``<layer>.mlp.experts.<e>.gate_proj.weight`` [I, H], ``...up_proj.weight`` [I, H] and
``...down_proj.weight`` [H, I], for ``e`` in ``0..E-1``.  transformers 5 holds a layer's experts fused,
``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (expert ``e``'s rows: its gate rows, then its up rows)
and ``<layer>.mlp.experts.down_proj`` [E, H, I], and SGLang's Qwen3.5 ``load_weights`` takes that form too.
Two names per layer instead of 3E matter there: SGLang looks every name up in its table of per-expert
names (3E entries), so a layer of 256 experts costs 768 scans of 768 entries.  On one H200 with a
real-width scaled Qwen3.5-35B-A3B (9.66 GB, SGLang 0.5.17, CUDA IPC) a full sync took 0.49 s per expert
and 0.20 s fused, in 2 GiB buckets (``docs/results/h200_sglang.md``, run 5).

The fused tensors need no copy: laid out as ``gate_0, up_0, gate_1, up_1, ..., gate_{E-1}, up_{E-1}``
then ``down_0, ..., down_{E-1}``, back to back, the bytes of a flattened bucket are already those of
``gate_up_proj`` and ``down_proj``; only the bucket's metadata changes (:func:`fused_layout`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import torch

from slime.weight_sync.flattened import IPC_ALIGN, TensorMeta, layout

EXPERT_WEIGHT = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
"""A checkpoint name of one expert's projection; ``layer`` is the prefix of the fused names."""

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def checkpoint_num_experts(hf_checkpoint: str | Path | None) -> int | None:
    """Routed experts per MoE layer from ``<hf_checkpoint>/config.json`` (``text_config.num_experts``, else the
    top-level ``num_experts``); None for a dense model, or when there is no readable local ``config.json``."""
    if hf_checkpoint is None:
        return None
    try:
        config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = (config.get("text_config") or {}).get("num_experts", config.get("num_experts"))
    return value if isinstance(value, int) and value > 0 else None


def _complete_layers(bucket: Sequence[tuple[str, torch.Tensor]], num_experts: int,
                     align: int) -> dict[str, dict[str, list]]:
    """The layers of ``bucket`` that hold all three projections of experts ``0..num_experts-1``, with one dtype,
    gate and up of one 2-D shape [I, H], down [H, I], each tensor a multiple of ``align`` bytes (so that they
    pack back to back): ``{layer: {proj: [(name, tensor) by expert]}}``."""
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
    """Order ``bucket`` so that each complete MoE layer's experts lie as their fused tensors, and describe it so.

    A layer is fused when the bucket holds its whole set of experts and the order above packs its tensors
    back to back (each a multiple of ``align`` bytes; see :func:`_complete_layers`).  Such a layer's tensors
    move to where its first one was, ordered ``gate_0, up_0, ..., gate_{E-1}, up_{E-1}, down_0, ...,
    down_{E-1}``; every other tensor keeps its name and its place.

    Args:
        bucket: ``(checkpoint name, tensor)`` pairs.
        num_experts: routed experts per layer (:func:`checkpoint_num_experts`); None or 0 fuses nothing.
        align: byte alignment of each tensor in the buffer (:func:`slime.weight_sync.flattened.layout`).

    Returns:
        ``(ordered, metadata, total bytes)``: ``flatten(ordered, align=align)`` writes the buffer, and
        ``unflatten(buffer, metadata)`` reads it as ``<layer>.gate_up_proj`` [E, 2I, H] and ``<layer>.down_proj``
        [E, H, I] for each fused layer and the other tensors by their own names; the fused entries come last
        in ``metadata`` (the order SGLang loads them in; see the comment at the end).

    Raises:
        ValueError: see :func:`slime.weight_sync.flattened.layout` (an empty bucket, a repeated name).
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
