"""Samples -> one packed (THD) micro-batch of the native Qwen3.5 model, with the per-token tensors of the loss.

A micro-batch of ``S`` samples is one token axis (:class:`slime.models.qwen3_5.model.Qwen35Inputs`): each sample's
prompt and response ids end to end, ``cu_seqlens`` at the boundaries, MRoPE positions restarting per sample, images in
sample order; under sequence parallelism one padding document brings the total to a multiple of TP.  Sample ``s`` at
offset ``o_s`` has its response predicted at ``o_s + P_s - 1 .. o_s + P_s + R_s - 2``; those ``K = sum R_s``
positions are the model's ``logit_index``, and every per-token loss tensor is ``[K]`` on them, with response
boundaries ``cu_seqlens`` ``[S + 1]`` (the layout of :func:`slime.grpo.loss.grpo_micro_batch_loss`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from slime.backends.steps import check_image_inputs, response_input_ids
from slime.data.routes import RouteShape, sample_routes, token_routes
from slime.data.sample import Sample
from slime.models.qwen3_5.config import Qwen35Arch
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs


@dataclasses.dataclass
class PackedBatch:
    """One packed micro-batch and its loss tensors (module docstring): ``indices`` of its samples in the planned list,
    ``inputs`` (``logit_index`` set), int64 ``targets`` ``[K]``, float32 ``loss_mask`` ``[K]``, int64 ``cu_seqlens``
    ``[S + 1]``, float32 ``advantages`` ``[S]``, ``response_lengths`` (``R_s``), and float32 ``old_log_probs`` /
    ``ref_log_probs`` / ``rollout_log_probs`` ``[K]``, filled before the update."""

    indices: list[int]
    inputs: Qwen35Inputs
    targets: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    advantages: Tensor
    response_lengths: list[int]
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    rollout_log_probs: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed axis (padding included)."""
        return self.inputs.input_ids.numel()

    def to(self, device: torch.device) -> "PackedBatch":
        """The same micro-batch with every tensor on ``device`` (micro-batches wait on the CPU until run)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(
            self, inputs=self.inputs.to(device), targets=move(self.targets), loss_mask=move(self.loss_mask),
            cu_seqlens=move(self.cu_seqlens), advantages=move(self.advantages),
            old_log_probs=move(self.old_log_probs), ref_log_probs=move(self.ref_log_probs),
            rollout_log_probs=move(self.rollout_log_probs),
        )

    def split(self, per_token: Tensor) -> list[Tensor]:
        """A ``[K]`` tensor as one ``[R_s]`` tensor per sample."""
        return list(per_token.split(self.response_lengths))


def pack_micro_batch(
    samples: Sequence[Sample], indices: Sequence[int], arch: Qwen35Arch, device: torch.device,
    *, pad_to_multiple_of: int = 1,
) -> PackedBatch:
    """Pack checked ``samples`` (``indices``: their indices in the caller's list) into one micro-batch on ``device``
    (``arch``: placeholder ids, merge size), its total tokens a multiple of ``pad_to_multiple_of``.

    Raises:
        ValueError: a sample with ``pixel_values`` but no ``image_grid_thw``, or the reverse (naming it).
        slime.models.qwen3_5.rope.PositionError: a prompt's image placeholders and grids disagree.
    """
    placeholders = {arch.image_token_id, arch.video_token_id} - {None}
    documents, logit_index, offset = [], [], 0
    for sample in samples:
        check_image_inputs(sample)
        mm = sample.multimodal_inputs
        ids = list(sample.prompt_token_ids) + response_input_ids(sample, placeholders)
        documents.append(Qwen35Document(
            torch.tensor(ids, dtype=torch.int64), mm.get("pixel_values"),
            None if mm.get("image_grid_thw") is None else torch.as_tensor(mm["image_grid_thw"], dtype=torch.int64),
        ))
        start = offset + len(sample.prompt_token_ids) - 1
        logit_index.extend(range(start, start + sample.response_length))
        offset += len(ids)
    inputs = Qwen35Inputs.pack(documents, arch, pad_to_multiple_of=pad_to_multiple_of)
    if inputs.pixel_values is not None:
        inputs.pixel_values = inputs.pixel_values.float()
    lengths = [s.response_length for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    inputs.logit_index = torch.tensor(logit_index, dtype=torch.int64)
    return PackedBatch(
        indices=list(indices),
        inputs=inputs.to(device),
        targets=torch.tensor([t for s in samples for t in s.response_token_ids], dtype=torch.int64, device=device),
        loss_mask=torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32, device=device),
        cu_seqlens=cu.to(device),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        response_lengths=lengths,
    )


def with_routes(batch: PackedBatch, routes: Sequence[np.ndarray], shape: RouteShape) -> PackedBatch:
    """``batch`` with its samples' routed experts (``routes``, uint8 ``[P + R - 1, layers, top_k]`` per sample) on
    its token axis (:func:`slime.data.routes.token_routes`: from each sample's first token; the model's own choice
    at its last token and on the padding)."""
    starts = batch.inputs.cu_seqlens[: len(routes)].tolist()
    token_axis = token_routes(routes, starts, batch.num_tokens, shape)
    device = batch.inputs.input_ids.device
    inputs = dataclasses.replace(batch.inputs, routed_experts=torch.from_numpy(token_axis).to(device))
    return dataclasses.replace(batch, inputs=inputs)


def split_routes(batch: PackedBatch, token_axis: np.ndarray, shape: RouteShape) -> list[np.ndarray]:
    """The inverse of :func:`with_routes`: per sample uint8 ``[P + R - 1, layers, top_k]`` from ``token_axis``
    ``[T, layers, top_k]`` (:func:`slime.data.routes.sample_routes`)."""
    bounds = batch.inputs.cu_seqlens.tolist()
    starts = bounds[: len(batch.response_lengths)]
    lengths = [end - start - 1 for start, end in zip(starts, bounds[1:])]
    return sample_routes(token_axis, starts, lengths, shape)


def packed_per_token(rows: Sequence[Tensor], device: torch.device) -> Tensor:
    """Per-sample ``[R_s]`` tensors concatenated into the packed ``[K]`` layout (float32)."""
    return torch.cat([torch.as_tensor(r, dtype=torch.float32) for r in rows]).to(device)
