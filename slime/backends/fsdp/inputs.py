"""One micro-batch of samples -> Hugging Face model inputs -> per-token log-probs of the responses.

Right-padded ``[B, T]`` rows, row ``b`` = ``prompt_token_ids + response_token_ids`` of sample ``b``.  The logit at
``t`` predicts token ``t + 1``, so the response (positions ``P .. P+R-1``) is predicted at ``P-1 .. P+R-2``; only the
positions from the first sample's ``P-1`` to the last response token reach the LM head (``logits_to_keep``).  Images
are concatenated in sample order and ``mm_token_type_ids`` marks image tokens; a micro-batch without images gets one
blank image after row 0 (why: ``docs/design/training_step.md``); generated placeholders are fed as
:data:`~slime.backends.samples.PAD_TOKEN_ID`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor, nn

from slime.backends.samples import PAD_TOKEN_ID, check_image_inputs, response_input_ids
from slime.data.processor import mm_token_type_ids
from slime.data.sample import Sample
from slime.grpo.log_probs import entropy_from_logits, gather_log_probs


@dataclasses.dataclass
class ModelInputs:
    """A micro-batch ready for ``model(**model_kwargs)``.

    Attributes:
        model_kwargs: int64 ``input_ids`` ``[B, T]``, ``attention_mask`` ``[B, T]`` (only when ``B > 1``) and
            ``logits_to_keep`` ``[K]``; for a vision-language model also float32 ``pixel_values`` ``[patches,
            C*T*P*P]``, int64 ``image_grid_thw`` ``[images, 3]`` and ``mm_token_type_ids`` ``[B, T]``.
        response_index: int64 ``[B, R_max]``, the kept logit that predicts each response token (0 on padding).
        response_tokens: int64 ``[B, R_max]``, the response token ids (0 on padding).
    """

    model_kwargs: dict[str, Tensor]
    response_index: Tensor
    response_tokens: Tensor


def dummy_image(vision_config) -> tuple[Tensor, Tensor]:
    """A blank image of one merged token: ``(pixel_values [m*m, C*T*P*P] zeros, image_grid_thw [[1, m, m]])``,
    ``m`` the spatial merge size, ``C, T, P`` channels, temporal patch and patch size of ``vision_config``."""
    m = vision_config.spatial_merge_size
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.zeros(m * m, patch_dim), torch.tensor([[1, m, m]], dtype=torch.int64)


def build_model_inputs(samples: Sequence[Sample], config, device: torch.device | str) -> ModelInputs:
    """Pad checked ``samples`` into one micro-batch for a Hugging Face causal (vision-)language model with ``config``
    (``vision_config``, ``image_token_id``, ``video_token_id`` mark a vision-language model), on ``device``.

    Raises:
        ValueError: a sample with ``pixel_values`` but no ``image_grid_thw``, or the reverse.
    """
    placeholders = vision_placeholder_ids(config)
    rows = [list(s.prompt_token_ids) + response_input_ids(s, placeholders) for s in samples]
    prompt_lens = [len(s.prompt_token_ids) for s in samples]
    response_lens = [s.response_length for s in samples]
    model_kwargs: dict[str, Tensor] = {}

    if getattr(config, "vision_config", None) is not None:
        pixel_values, grids = [], []
        for s in samples:
            check_image_inputs(s)
            mm = s.multimodal_inputs
            if "pixel_values" in mm:
                pixel_values.append(mm["pixel_values"])
                grids.append(mm["image_grid_thw"])
        if not pixel_values:
            pixels, grid = dummy_image(config.vision_config)
            pixel_values, grids = [pixels], [grid]
            rows[0] = rows[0] + [config.image_token_id]
        model_kwargs["pixel_values"] = torch.cat(pixel_values).to(device=device, dtype=torch.float32)
        model_kwargs["image_grid_thw"] = torch.cat(grids).to(device=device, dtype=torch.int64)

    input_ids = pad_per_token(rows, torch.int64, device, pad=PAD_TOKEN_ID)
    attention_mask = pad_per_token([[1] * len(row) for row in rows], torch.int64, device)
    model_kwargs["input_ids"] = input_ids
    if len(rows) > 1:
        model_kwargs["attention_mask"] = attention_mask
    if "pixel_values" in model_kwargs:
        model_kwargs["mm_token_type_ids"] = mm_token_type_ids(
            input_ids, config.image_token_id, getattr(config, "video_token_id", None)
        ) * attention_mask

    first = min(p - 1 for p in prompt_lens)
    last = max(p + r - 1 for p, r in zip(prompt_lens, response_lens))
    model_kwargs["logits_to_keep"] = torch.arange(first, last, device=device)
    response_index = pad_per_token(
        [range(p - 1 - first, p - 1 - first + r) for p, r in zip(prompt_lens, response_lens)], torch.int64, device
    )
    return ModelInputs(
        model_kwargs=model_kwargs,
        response_index=response_index,
        response_tokens=pad_per_token([s.response_token_ids for s in samples], torch.int64, device),
    )


def pad_per_token(rows: Sequence[Sequence[float] | Tensor], dtype: torch.dtype, device=None, pad: float = 0) -> Tensor:
    """Right-pad B per-token rows (lists or 1-D tensors) into one ``[B, max_len]`` tensor of ``dtype`` on ``device``,
    padding with ``pad`` (``max_len = 0`` when every row is empty)."""
    max_len = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), max_len), pad, dtype=dtype, device=device)
    for b, row in enumerate(rows):
        if len(row):
            out[b, : len(row)] = torch.as_tensor(row, dtype=dtype, device=device)
    return out


def vision_placeholder_ids(config) -> set[int]:
    """The model's image / video placeholder ids (``image_token_id``, ``video_token_id``); empty for text models."""
    return {getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)} - {None}


def response_log_probs(
    model: nn.Module, inputs: ModelInputs, temperature: float, *, with_entropy: bool = False, entropy_grad: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and with ``with_entropy`` entropies, nats) of the response tokens under ``softmax(logits /
    temperature)`` (:func:`slime.grpo.log_probs.gather_log_probs`, :func:`~slime.grpo.log_probs.entropy_from_logits`),
    differentiable in grad mode; ``entropy_grad`` False computes the entropy without autograd (a metric only).
    ``model`` takes ``logits_to_keep`` (plain or FSDP-sharded).

    Returns:
        ``(log_probs, entropy)``: float32 ``[B, R_max]`` each, row ``b`` valid in its first ``R_b`` entries;
        ``entropy`` is None unless asked for.
    """
    logits = model(**inputs.model_kwargs, use_cache=False).logits  # [B, K, V]
    batch = logits.shape[0]
    if batch > 1:
        logits = logits[torch.arange(batch, device=logits.device)[:, None], inputs.response_index]
    log_probs = gather_log_probs(logits, inputs.response_tokens, temperature)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = entropy_from_logits(logits.float() / temperature)
    return log_probs, entropy
