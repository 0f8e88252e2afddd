"""The Hugging Face vision tower of Qwen3.5 inside the native model, and the scatter of its features.

transformers' ``Qwen3_5MoeVisionModel`` is kept as is: Hugging Face parameter names (``model.visual.*``),
first pipeline stage only, replicated over TP.  Its output rows (one per merged image token) replace the
``<|image_pad|>`` embeddings (transformers ``Qwen3_5MoeModel.forward``, ``masked_scatter``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


class ImageTokenMismatch(ValueError):
    """A document's ``<|image_pad|>`` count differs from its images' merged token count."""


def build_vision_tower(vision_config: dict, *, dtype: torch.dtype = torch.bfloat16, device=None,
                       attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' ``Qwen3_5MoeVisionModel`` for a ``vision_config`` dict, on ``device`` or the ambient device."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    config = Qwen3_5MoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    config._attn_implementation = attn_implementation
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        model = Qwen3_5MoeVisionModel._from_config(config, dtype=dtype)
    return model


def image_features(visual: torch.nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Merged image features ``[sum_i t_i h_i w_i / m**2, out_hidden]`` of all images, in order.

    ``pixel_values``: ``[sum_i t_i h_i w_i, C * temporal_patch * patch**2]``; ``image_grid_thw``: ``[num_images, 3]``.
    """
    out = visual(pixel_values.to(next(visual.parameters()).dtype), grid_thw=image_grid_thw, return_dict=True)
    return out.pooler_output


def scatter_image_features(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    *,
    image_token_id: int,
    cu_seqlens: torch.Tensor,
    tokens_per_document: Sequence[int],
) -> torch.Tensor:
    """Put the image features into the placeholder rows of packed embeddings (differentiable).

    Args:
        embeddings: ``[T, hidden]``; input_ids: ``[T]``; cu_seqlens: ``[n + 1]`` document boundaries.
        features: ``[N, hidden]`` merged image features, documents' images in order.
        tokens_per_document: ``n`` merged image-token counts (0 for text-only and padding documents).

    Returns:
        ``[T, hidden]``: ``embeddings`` with placeholder rows replaced, in order, by ``features``.

    Raises:
        ImageTokenMismatch: naming the first document whose placeholder count differs from its
            images' token count, or the totals when ``features`` does not hold their sum.
    """
    is_image = input_ids == image_token_id
    bounds = cu_seqlens.tolist()
    if len(tokens_per_document) != len(bounds) - 1:
        raise ImageTokenMismatch(
            f"{len(tokens_per_document)} per-document image-token counts for {len(bounds) - 1} documents"
        )
    per_doc = torch.stack([is_image[s:e].sum() for s, e in zip(bounds[:-1], bounds[1:])]).tolist()
    for i, (found, want) in enumerate(zip(per_doc, tokens_per_document)):
        if found != want:
            raise ImageTokenMismatch(
                f"sample {i}: {found} <|image_pad|> tokens (id {image_token_id}) but its images give {want} "
                "merged tokens; the prompt's image placeholders and the images disagree"
            )
    if features.shape[0] != sum(tokens_per_document):
        raise ImageTokenMismatch(
            f"{features.shape[0]} image feature rows for {sum(tokens_per_document)} image tokens in the micro-batch"
        )
    if features.shape[0] == 0:
        return embeddings
    index = is_image.nonzero().squeeze(-1)
    return embeddings.index_put((index,), features.to(embeddings.dtype))
