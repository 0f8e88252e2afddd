"""Load a Hugging Face Qwen3.5-MoE checkpoint into the native Megatron model and export it back, per rank.

Loading reads only the rank's slices (``safetensors`` ``get_slice``); exporting gathers a parameter's
shards within its TP / ETP group and yields each Hugging Face tensor once across the job.  What maps to
what is :mod:`slime.models.qwen3_5.hf_mapping`; ``mtp.*`` tensors (multi-token prediction) are not part
of the model and are skipped (counted in :class:`LoadReport`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from slime.checkpoints.mtp import MTP_PREFIX
from slime.models.qwen3_5.hf_mapping import (
    ModelLayout,
    ParamRule,
    Ranks,
    TensorReader,
    WeightMappingError,
    checkpoint_has_fused_experts,
    param_rules,
)


class StateDictReader(TensorReader):
    """A ``{name: tensor}`` mapping (e.g. a transformers model's on-disk state) as a reader."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name, rows=None, cols=None):
        t = self.tensors[name]
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t


class SafetensorsReader(TensorReader):
    """A Hugging Face checkpoint folder (``model.safetensors`` or a sharded index); reads only the requested slice.

    Raises:
        WeightMappingError: no safetensors file in the folder.
    """

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").is_file():
            with safe_open(self.folder / "model.safetensors", framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise WeightMappingError(f"{self.folder}: no model.safetensors or model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, object] = {}
        self._safe_open = safe_open

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._open:
            self._open[fname] = self._safe_open(self.folder / fname, framework="pt")
        return self._open[fname]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name):
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name, rows=None, cols=None):
        sl = self._file(name).get_slice(name)
        if rows is None and cols is None:
            return sl[:]
        rows = rows if rows is not None else slice(None)
        return sl[rows, cols] if cols is not None else sl[rows]



@dataclasses.dataclass
class LoadReport:
    """What a load read: parameters filled, checkpoint tensors skipped by prefix (e.g. ``mtp.``)."""

    loaded: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)


SKIPPED_PREFIXES = (MTP_PREFIX,)
"""Checkpoint tensors that are not part of the model (Qwen3.5's MTP layer, :mod:`slime.checkpoints.mtp`)."""


def read_rank_state(reader: TensorReader, rules: Mapping[str, ParamRule]) -> dict[str, torch.Tensor]:
    """``{native name: local tensor}`` read through ``rules`` (only the rank's slices are read).

    Raises:
        WeightMappingError: a Hugging Face tensor is missing (naming it and the parameter), or a
            read tensor's shape differs from the rule's local shape.
    """
    names = reader.names()
    out = {}
    for name, rule in rules.items():
        missing = [hf for hf in rule.hf_names if hf not in names]
        if missing:
            raise WeightMappingError(f"{name}: checkpoint has no {missing[0]}" +
                                     (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        tensor = rule.load(reader)
        if tuple(tensor.shape) != rule.local_shape:
            raise WeightMappingError(f"{name}: read {tuple(tensor.shape)} from {rule.hf_names[0]}, "
                                     f"the model holds {rule.local_shape}")
        out[name] = tensor
    return out


def vision_param_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    visual = getattr(model, "visual", None)
    return [] if visual is None else [(n, tuple(p.shape)) for n, p in visual.named_parameters()]


def model_rules(model, ranks: Ranks | None = None, *, fused_experts: bool = False) -> dict[str, ParamRule]:
    """The rules of a built ``Qwen35Model`` on this rank (ranks from megatron-core by default)."""
    ranks = ranks if ranks is not None else Ranks.from_parallel_state()
    return param_rules(model.qwen_config.arch, ModelLayout.of_model(model), ranks, fused_experts=fused_experts,
                       vision_names=vision_param_shapes(model))


@torch.no_grad()
def load_hf_checkpoint(model, hf_checkpoint: str | Path | TensorReader, ranks: Ranks | None = None) -> LoadReport:
    """Fill a built ``Qwen35Model`` (one stage) from a checkpoint folder or reader, reading only this rank's slices.

    A meta-device model is materialised first (CUDA when available); tensors are cast to each parameter's
    dtype.  ``ranks`` defaults to megatron-core's current ones.

    Raises:
        WeightMappingError: a model parameter without a rule, a missing checkpoint tensor, a shape
            mismatch (each naming the parameter and the tensor).
    """
    reader = hf_checkpoint if isinstance(hf_checkpoint, TensorReader) else SafetensorsReader(hf_checkpoint)
    rules = model_rules(model, ranks, fused_experts=checkpoint_has_fused_experts(reader))
    params = dict(model.named_parameters())
    unmapped = [n for n in params if n not in rules]
    if unmapped:
        raise WeightMappingError(f"model parameters without a checkpoint rule: {unmapped[:5]}")
    if any(p.is_meta for p in params.values()):
        materialize(model, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        params = dict(model.named_parameters())
    state = read_rank_state(reader, rules)
    for name, tensor in state.items():
        params[name].copy_(tensor.to(params[name].dtype))
    used = {hf for rule in rules.values() for hf in rule.hf_names}
    report = LoadReport(loaded=len(state))
    for name in reader.names() - used:
        prefix = next((p for p in SKIPPED_PREFIXES if name.startswith(p)), "other")
        report.skipped[prefix] = report.skipped.get(prefix, 0) + 1
    return report


def materialize(model, device) -> None:
    """Give a meta-device ``Qwen35Model`` uninitialised storage on ``device``; the vision tower is rebuilt there."""
    from slime.models.qwen3_5.vision import build_vision_tower

    # to_empty replaces a meta parameter by a new Parameter object: keep the attributes megatron-core
    # reads from it (tensor_model_parallel, partition_dim, sequence_parallel, allreduce, keep_fp32).
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for name, child in model.named_children():
        if name == "visual":
            continue
        if any(t.is_meta for t in (*child.parameters(), *child.buffers())):
            child.to_empty(device=device)
    for buffer_name, buffer in list(model.named_buffers(recurse=False)):
        if buffer.is_meta:
            setattr(model, buffer_name, torch.empty_like(buffer, device=device))
    visual = getattr(model, "visual", None)
    if visual is not None and any(p.is_meta for p in visual.parameters()):
        arch, dtype = model.qwen_config.arch, next(visual.parameters()).dtype
        model.visual = build_vision_tower(arch.vision_config, dtype=dtype, device=device,
                                          attn_implementation=visual.config._attn_implementation)
    for name, p in model.named_parameters():
        if not name.startswith("visual."):
            p.__dict__.update(attributes.get(name, {}))
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


@dataclasses.dataclass(frozen=True)
class ExportGroups:
    """Who gathers and who yields each parameter's Hugging Face tensors (see :func:`export_hf_weights`).

    ``dense_source``: data-parallel rank 0 (with CP), whose dense and vision tensors are sent;
    ``expert_source``: expert-data-parallel rank 0, whose experts are sent.
    """

    ranks: Ranks
    tp_group: object
    etp_group: object
    dense_source: bool
    expert_source: bool

    @classmethod
    def current(cls, ranks: Ranks | None = None) -> "ExportGroups":
        """From megatron-core's parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            ranks=ranks if ranks is not None else Ranks.from_parallel_state(),
            tp_group=ps.get_tensor_model_parallel_group(), etp_group=ps.get_expert_tensor_parallel_group(),
            dense_source=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
            expert_source=ps.get_expert_data_parallel_rank() == 0,
        )

    def gathers(self, rule: ParamRule) -> bool:
        """This rank takes part in the rule's gather (its replica is the one sent)."""
        return self.expert_source if rule.group == "etp" else self.dense_source

    def yields(self, rule: ParamRule) -> bool:
        """This rank is the single source of the rule's Hugging Face tensors."""
        group_rank = self.ranks.etp_rank if rule.group == "etp" else self.ranks.tp_rank
        return self.gathers(rule) and (rule.group == "none" or group_rank == 0)


def export_rule(rule: ParamRule, tensor: torch.Tensor, groups: ExportGroups) -> dict[str, torch.Tensor] | None:
    """One parameter (or a tensor of its local shape, e.g. an optimizer moment) as Hugging Face tensors, or ``None``.

    Collective within the rule's TP / ETP group when :meth:`ExportGroups.gathers`; the tensors come back
    on the source rank (:meth:`ExportGroups.yields`) only.
    """
    if not groups.gathers(rule):
        return None
    if rule.group == "tp":
        shards = _gather(tensor, groups.tp_group)
    elif rule.group == "etp":
        shards = _gather(tensor, groups.etp_group)
    else:
        shards = [tensor]
    return rule.export(shards) if groups.yields(rule) else None


def export_hf_weights(model, *, ranks: Ranks | None = None, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the Hugging Face ``(name, tensor)`` pairs this rank is the single source of.

    Across the job every tensor is yielded exactly once (TP / ETP group rank 0 of DP rank 0, or of
    expert-DP rank 0 for experts; each PP stage its layers, each EP rank its experts).  Every rank of a
    TP / ETP group must exhaust the iterator, since the gathers are collective.  ``dtype`` casts the
    tensors (default: the parameters' dtypes); they stay on the parameters' device.
    """
    groups = ExportGroups.current(ranks)
    rules = model_rules(model, groups.ranks)
    params = dict(model.named_parameters())
    for name, rule in rules.items():
        out = export_rule(rule, params[name].detach(), groups)
        for hf_name, value in (out or {}).items():
            yield hf_name, value if dtype is None else value.to(dtype)
