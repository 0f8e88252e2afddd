"""The Hugging Face vision tower of Qwen3.5 inside the native model, and the scatter of its features.

The recipe keeps transformers' ``Qwen3_5MoeVisionModel`` (the ViT plus the 2x2 patch merger that
projects to the language model's width) as is: its parameters keep their Hugging Face names
(``model.visual.*``), are loaded and exported unchanged, and the module is built on the first
pipeline stage only and replicated over tensor-parallel ranks (every TP rank runs the same images;
its gradients are then equal across TP ranks, because the language model's input gradient is).

Its output rows (one per merged image token, images in order) replace the embeddings of the
``<|image_pad|>`` placeholders of the packed sequence (transformers ``Qwen3_5MoeModel.forward``,
``masked_scatter``).  :func:`scatter_image_features` also checks each document's count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


class ImageTokenMismatch(ValueError):
    """A document's ``<|image_pad|>`` count differs from its images' merged token count."""


def build_vision_tower(vision_config: dict, *, dtype: torch.dtype = torch.bfloat16, device=None,
                       attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' ``Qwen3_5MoeVisionModel`` for a checkpoint's ``vision_config`` dict.

    Built under ``torch.device(device)`` when given, else on the ambient default device (``meta``
    inside ``with torch.device("meta")`` for a large model, then loaded); weights are transformers'
    initialisation until loaded.
    """
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

    Args:
        visual: the vision tower.
        pixel_values: ``[sum_i t_i h_i w_i, C * temporal_patch * patch**2]`` from the image processor.
        image_grid_thw: ``[num_images, 3]`` patch grids.
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
        embeddings: ``[T, hidden]`` token embeddings of the packed micro-batch.
        input_ids: ``[T]`` token ids.
        features: ``[N, hidden]`` merged image features, documents' images in order.
        image_token_id: the placeholder id.
        cu_seqlens: ``[n + 1]`` document boundaries.
        tokens_per_document: ``n`` counts, the merged image tokens each document's images make
            (0 for text-only and padding documents).

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
