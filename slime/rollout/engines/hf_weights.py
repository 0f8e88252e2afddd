"""Weights pushed into the transformers engine under their Hugging Face *checkpoint* names."""

from __future__ import annotations

import copy

import torch


class CheckpointWeights:
    """Writes checkpoint-named tensors (per-expert ``...mlp.experts.{e}.gate_proj.weight``, ...) into the model's
    in-memory layout (transformers 5's fused ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and
    ``down_proj`` ``[E, H, I]``) with transformers' own conversions (``model._weight_conversions``).

    A fused group is buffered until complete, so buckets may end mid-group and come from several ranks in any order;
    a tensor sent twice before its group completes replaces the first.  How: ``docs/design/rollout_engines.md``.
    """

    def __init__(self, model: torch.nn.Module):
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )

        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            raise RuntimeError("the model carries no _weight_conversions; load it with from_pretrained")
        conversions = copy.deepcopy(conversions)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._model = model
        targets = model.state_dict(keep_vars=True)
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in targets.items()}
        self._shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, meta).items()}
        self._route: dict[str, tuple[str, str | None]] = {}
        self._members: dict[str, list[str]] = {}
        for name in sorted(self._shapes, key=dot_natural_key):
            target, pattern = rename_source_key(name, renamings, converters)
            if target not in targets:
                raise RuntimeError(
                    f"transformers maps checkpoint name {name!r} to {target!r}, which the model does not have; "
                    "its conversion mapping for this model is not invertible"
                )
            self._route[name] = (target, pattern)
            if pattern is not None:
                self._members.setdefault(target, []).append(name)
        self._converters = {pattern: c for c in converters for pattern in c.source_patterns}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def names(self) -> list[str]:
        """Every checkpoint name, in natural order."""
        return list(self._route)

    def incomplete_parameters(self) -> list[str]:
        """Fused parameters with some, not all, of their checkpoint tensors received."""
        return sorted(self._pending)

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket into the model (any device and float dtype; cast to the parameter's).

        The whole bucket is checked before anything is written, so a bad bucket changes nothing.

        Raises:
            KeyError: a name that is not a checkpoint tensor of this model.
            ValueError: a tensor whose shape differs from the checkpoint's.
        """
        for name, tensor in named_tensors:
            if name not in self._route:
                raise KeyError(
                    f"{name!r} is not a checkpoint tensor of this model (names look like {self.names()[0]!r}); "
                    "send Hugging Face checkpoint names, e.g. from transformers' revert_weight_conversion"
                )
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(
                    f"{name!r} has shape {tuple(tensor.shape)} but the checkpoint's is {self._shapes[name]}; "
                    "check that trainer and engine use the same model config"
                )
        targets = self._model.state_dict(keep_vars=True)  # looked up per call: moving the model replaces buffers
        for name, tensor in named_tensors:
            target, pattern = self._route[name]
            if pattern is None:
                targets[target].copy_(tensor)
                continue
            group = self._pending.setdefault(target, {})
            group[name] = tensor
            if len(group) == len(self._members[target]):
                targets[target].copy_(self._fuse(target, self._pending.pop(target)))

    def _fuse(self, target: str, group: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run transformers' converter of ``target`` on its complete group (members in natural order)."""
        converter = copy.deepcopy(self._converters[self._route[self._members[target][0]][1]])
        for name in self._members[target]:
            converter.add_tensor(target, name, self._route[name][1], group[name])
        (fused,) = converter.convert(target, model=self._model, config=self._model.config).values()
        return fused[0] if isinstance(fused, list) else fused
