"""The one record that crosses process boundaries: a :class:`Sample`.

A sample is one response to one prompt.  It is created by the data pipeline
(prompt fields), filled in by a rollout engine (response fields), scored by a
reward function (``reward``), given an advantage by the GRPO math, and consumed by a
training backend.  Samples of the same prompt share ``group_index``; there are
``--n-samples-per-prompt`` of them per group.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np
import torch


class SampleStatus(str, enum.Enum):
    """How generation of a sample ended."""

    PENDING = "pending"
    """Not generated yet."""
    COMPLETED = "completed"
    """Stopped at an EOS / stop token."""
    TRUNCATED = "truncated"
    """Cut at ``--rollout-max-response-len`` tokens (SGLang ``finish_reason.type == "length"``)."""
    ABORTED = "aborted"
    """Aborted by the engine (``finish_reason "abort"``, e.g. generation paused in abort mode): the response
    is cut off wherever the engine stopped.  Not scored, left out of the step's metrics; its whole group is
    left out of the loss (:func:`slime.rollout.manager._drop_unusable_groups`)."""
    FAILED = "failed"
    """The engine's response is unusable: it reported another prompt length than the data pipeline
    computed (:func:`slime.rollout.outputs.check_prompt_lengths`), so it conditioned on other tokens
    than the trainer would feed (also when the engine aborted it).  Not scored, left out of the step's
    metrics; its whole group is left out of the loss."""


@dataclasses.dataclass
class Sample:
    """One prompt and one response, with everything the trainer needs.

    Prompt fields come from :mod:`slime.data.dataset`; response fields from a rollout engine.

    Attributes:
        index: position of the dataset row this prompt came from (stable id used in logs).
        group_index: index of the prompt within its rollout batch; the samples of one group
            share it and are contiguous in a batch.
        prompt: the chat-templated prompt text (with one image placeholder span per image).
        images: base64-encoded PNG images, already resized to the processor's pixel bounds,
            in placeholder order (what is sent to SGLang as ``image_data``).
        label: the ground-truth answer string.
        prompt_token_ids: prompt token ids after image-token expansion, ``list[int]`` of
            length P (the same ids the engine must see).
        multimodal_inputs: processor outputs for the prompt: ``pixel_values`` (float32
            ``[num_patches, C * T * patch * patch]``) and ``image_grid_thw`` (int64
            ``[num_images, 3]``); empty for text-only prompts.
        response: the generated text.
        response_token_ids: generated token ids, ``list[int]`` of length R.
        rollout_log_probs: the engine's per-token log-probs of ``response_token_ids``
            under the sampling distribution (logits / temperature), ``list[float]`` of length R, nats.
        rollout_routed_experts: the engine's routed experts of an MoE model, uint8 ``[P + R - 1, layers, top_k]``
            (:mod:`slime.routing_replay`): position ``t``'s top-k experts in each layer, for every position the
            engine ran a forward for; None when the engine was not asked for them.
        loss_mask: 1 for response tokens that enter the loss, ``list[int]`` of length R.
        reward: scalar reward (binary 0/1 for the math reward model).
        advantage: scalar group advantage, broadcast to every response token by the trainer.
        status: how generation ended.
        metadata: free-form extras from the dataset row (e.g. ``split``, ``id``).
    """

    index: int
    prompt: str
    label: str
    group_index: int = -1
    images: list[str] = dataclasses.field(default_factory=list)
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    multimodal_inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    response: str = ""
    response_token_ids: list[int] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] = dataclasses.field(default_factory=list)
    rollout_routed_experts: np.ndarray | None = None
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    reward: float | None = None
    advantage: float = 0.0
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def response_length(self) -> int:
        """Number of generated tokens R."""
        return len(self.response_token_ids)

    @property
    def has_images(self) -> bool:
        """Whether the prompt carries at least one image."""
        return bool(self.images)

    def clone_prompt(self) -> "Sample":
        """A fresh sample with this sample's prompt fields and no response (one per n-sample).

        Multimodal tensors are shared, not copied (they are read-only).
        """
        return Sample(
            index=self.index,
            prompt=self.prompt,
            label=self.label,
            group_index=self.group_index,
            images=list(self.images),
            prompt_token_ids=list(self.prompt_token_ids),
            multimodal_inputs=dict(self.multimodal_inputs),
            metadata=dict(self.metadata),
        )
