"""The Megatron backend's weights (and optimizer moments) as Hugging Face tensors, in lockstep buckets.

Every native parameter has a :class:`~slime.models.qwen3_5.weights.ParamRule` (Hugging Face names, the TP / ETP
group its shards are gathered in) and one source rank (:class:`~slime.models.qwen3_5.weights.ExportGroups`).  The
model is cut into *export groups* in one global order, the same on every rank (:func:`group_index`: embedding, vision
patch embedding, each vision block, merger, each decoder layer with its experts, final norm with the LM head).  One
all-reduce of each group's bytes lets every rank cut the same buckets of whole groups (:func:`bucket_plan`); each
rank then gathers its parameters' shards (within its TP / ETP group) and yields, per bucket, the tensors it is the
source of (``[]`` if none), so pipeline stages, expert ranks and data-parallel replicas share the boundaries.
"""

from __future__ import annotations

import re
from typing import Callable, Collection, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from slime.models.qwen3_5.config import Qwen35Arch
from slime.models.qwen3_5.hf_mapping import LM, VISUAL, ParamRule
from slime.models.qwen3_5.weights import ExportGroups, export_rule, model_rules
from slime.weight_sync.buckets import weight_rounds

_LAYER = re.compile(re.escape(LM) + r"\.layers\.(\d+)\.")
_BLOCK = re.compile(re.escape(VISUAL) + r"blocks\.(\d+)\.")


def vision_depth(arch: Qwen35Arch) -> int:
    """Vision blocks of the checkpoint (0 without a vision tower)."""
    return int((arch.vision_config or {}).get("depth", 0))


def num_groups(arch: Qwen35Arch) -> int:
    """Export groups of the whole model: embedding, vision (patch embedding, blocks, merger), layers, head."""
    return 1 + vision_depth(arch) + 2 + arch.num_layers + 1


def group_index(hf_name: str, arch: Qwen35Arch) -> int:
    """The export group of a Hugging Face tensor (module docstring), ``0 .. num_groups(arch) - 1``."""
    depth = vision_depth(arch)
    if hf_name.startswith(VISUAL):
        block = _BLOCK.match(hf_name)
        if block:
            return 2 + int(block.group(1))
        return 2 + depth if hf_name.startswith(VISUAL + "merger.") else 1
    layer = _LAYER.match(hf_name)
    if layer:
        return 3 + depth + int(layer.group(1))
    return 0 if "embed_tokens" in hf_name else num_groups(arch) - 1


def _export_bytes(rule: ParamRule, groups: ExportGroups, element_size: int) -> int:
    """Bytes of the Hugging Face tensors this rank sends for ``rule`` (0 when it is not their source)."""
    if not groups.yields(rule):
        return 0
    numel = 1
    for n in rule.local_shape:
        numel *= n
    size = {"tp": groups.ranks.tp_size, "etp": groups.ranks.etp_size}.get(rule.group, 1)
    return numel * size * element_size


def ordered_rules(model, groups: ExportGroups, skip: Collection[str] = ()) -> list[tuple[int, str, ParamRule]]:
    """``(group index, native name, rule)`` of this rank's parameters in the global export order, those named in
    ``skip`` left out."""
    arch = model.qwen_config.arch
    rules = model_rules(model, groups.ranks)
    keyed = [(group_index(rule.hf_names[0], arch), order, name, rule)
             for order, (name, rule) in enumerate(rules.items()) if name not in skip]
    return [(g, name, rule) for g, _, name, rule in sorted(keyed)]


def bucket_plan(model, groups: ExportGroups, bucket_bytes: int, dtype: torch.dtype | None = None,
                skip: Collection[str] = ()) -> list[int]:
    """The export-group index that closes each bucket, identical on every rank (collective over the world).

    Sizes count the tensors in ``dtype`` (default: each parameter's own).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    arch = model.qwen_config.arch
    params = dict(model.named_parameters())
    sizes = torch.zeros(num_groups(arch), dtype=torch.float64)
    for g, name, rule in ordered_rules(model, groups, skip):
        sizes[g] += _export_bytes(rule, groups, (dtype or params[name].dtype).itemsize)
    if dist.is_initialized():
        dist.all_reduce(sizes)
    present = [g for g in range(len(sizes)) if sizes[g] > 0]
    return [present[r[-1]] for r in weight_rounds([int(sizes[g].item()) for g in present], bucket_bytes)]


def iter_buckets(
    model,
    bucket_bytes: int,
    *,
    tensor_of: Callable[[str, Tensor], Tensor] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    groups: ExportGroups | None = None,
    skip: Collection[str] = (),
) -> Iterator[list[tuple[str, Tensor]]]:
    """This rank's share of the model as lockstep buckets of ``(Hugging Face name, tensor)`` (module docstring), the
    same number on every rank (collective: exhaust it everywhere).  ``tensor_of(native name, parameter)``: a tensor of
    the parameter's local shape to export instead (e.g. an optimizer moment; may be collective); ``device``, ``dtype``:
    move and cast (default: as they are; ``A_log`` stays fp32); ``groups``: default megatron-core's state; ``skip``:
    native names left out (the same parameters on every rank of their TP / ETP group).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    groups = groups or ExportGroups.current()
    params: Mapping[str, Tensor] = dict(model.named_parameters())
    closes = bucket_plan(model, groups, bucket_bytes, dtype, skip)
    rules = ordered_rules(model, groups, skip)
    position = 0
    for close in closes:
        bucket: list[tuple[str, Tensor]] = []
        while position < len(rules) and rules[position][0] <= close:
            _, name, rule = rules[position]
            position += 1
            param = params[name]
            tensor = tensor_of(name, param) if tensor_of is not None else param.detach()
            for hf_name, value in (export_rule(rule, tensor, groups) or {}).items():
                if dtype is not None:
                    value = value.to(dtype)
                bucket.append((hf_name, value if device is None else value.to(device)))
        yield bucket
    for _, name, rule in rules[position:]:  # groups of no bytes anywhere (none in practice): keep the gathers
        param = params[name]
        export_rule(rule, tensor_of(name, param) if tensor_of is not None else param.detach(), groups)
