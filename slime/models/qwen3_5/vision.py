"""The Hugging Face vision tower of Qwen3.5 inside the native model, and the scatter of its features.

transformers' ``Qwen3_5MoeVisionModel`` is kept as is: Hugging Face parameter names (``model.visual.*``),
first pipeline stage only, replicated over TP.  Its output rows (one per merged image token) replace the
``<|image_pad|>`` embeddings (transformers ``Qwen3_5MoeModel.forward``, ``masked_scatter``).

Its attention runs through transformers' attention interface.  With ``"sdpa"`` transformers splits the packed
patches per image (``cu_seqlens.tolist()``, a host sync a block) and calls SDPA once per image and block: 27 x
images calls a forward.  :data:`VARLEN_VISION_ATTENTION` registers torch's ``varlen_attn`` (FlashAttention-2 over
all images of the call at once, bidirectional) under a name containing ``flash``, which makes transformers hand
it the images' ``cu_seqlens`` instead: one call a block, no per-image split.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence

import torch


class ImageTokenMismatch(ValueError):
    """A document's ``<|image_pad|>`` count differs from its images' merged token count."""


VARLEN_VISION_ATTENTION = "slime_flash_varlen"
"""transformers attention implementation name of :func:`varlen_vision_attention` (``flash`` in it: transformers'
``is_flash_attention_requested`` then passes ``cu_seq_lens_q`` / ``max_length_q`` instead of splitting per image)."""


def varlen_vision_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, *, scaling: float | None = None, dropout: float = 0.0,
                            cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor | None = None,
                            max_length_q: int, max_length_k: int | None = None, is_causal: bool = False,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """Bidirectional attention within each image of a packed call, torch's ``varlen_attn`` (transformers'
    attention-interface signature, as its ``flash_attention_forward``).

    Args:
        query, key, value: ``[1, H, P, d]`` (P: the patches of all images), bf16/fp16 on CUDA.
        cu_seq_lens_q / cu_seq_lens_k: ``[images + 1]`` patch offsets of the images (transformers'
            ``get_vision_cu_seqlens``); max_length_q / max_length_k: the largest image's patch count.
        scaling: softmax scale (transformers passes ``head_dim ** -0.5``).

    Returns:
        ``([1, P, H, d], None)``, the layout transformers' flash path reshapes to ``[P, H * d]``.

    Raises:
        ValueError: dropout, an attention mask or a causal call (the vision tower uses none of them), or a
            ``scaling`` other than ``1/sqrt(d)`` where this torch's ``varlen_attn`` takes no scale.
    """
    from torch.nn.attention.varlen import varlen_attn

    if dropout or attention_mask is not None or is_causal:
        raise ValueError("varlen_vision_attention runs bidirectional attention without dropout or mask only "
                         f"(dropout={dropout}, mask={attention_mask is not None}, causal={is_causal})")
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [P, H, d]
    cu_q = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_q if cu_seq_lens_k is None else cu_seq_lens_k.to(device=q.device, dtype=torch.int32)
    max_q = _host_int(max_length_q, cu_seq_lens_q)
    max_k = max_q if max_length_k is None else _host_int(max_length_k, cu_seq_lens_k)
    options = {}
    if scaling is not None and _takes_scale(varlen_attn):
        options["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument; scaling {scaling} is not 1/sqrt(d)")
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)  # window (-1, -1): no mask
    return out.unsqueeze(0), None


@functools.cache
def _takes_scale(varlen_attn) -> bool:
    return "scale" in inspect.signature(varlen_attn).parameters


def _host_int(max_length, cu_seqlens: torch.Tensor | None) -> int:
    """``max_length`` as a Python int.  transformers 5.12 passes it as a device tensor, recomputed in every block from
    the one ``cu_seqlens`` tensor of the tower call: read it on the host once per call (one sync, not one a block),
    kept on that tensor object.  This assumes a ``cu_seqlens`` tensor is not changed in place once attended over
    (transformers builds a new one for every tower call from ``grid_thw``)."""
    if not isinstance(max_length, torch.Tensor):
        return int(max_length)
    if cu_seqlens is None:
        return int(max_length.item())
    cached = getattr(cu_seqlens, "_slime_max_length", None)
    if cached is None:
        cached = int(max_length.item())
        cu_seqlens._slime_max_length = cached
    return cached


def vision_attention_for(kernel: str) -> str:
    """The vision tower's transformers attention implementation for the language model's attention kernel
    (:class:`slime.models.qwen3_5.config.Qwen35Kernels`'s ``attention``): ``"varlen"`` -> :data:`VARLEN_VISION_ATTENTION`,
    ``"sdpa"`` -> ``"sdpa"``."""
    return VARLEN_VISION_ATTENTION if kernel == "varlen" else "sdpa"


def use_vision_attention(visual: torch.nn.Module, implementation: str) -> None:
    """Switch ``visual``'s attention to ``implementation`` (``"sdpa"``, ``"eager"`` or :data:`VARLEN_VISION_ATTENTION`,
    registered with transformers on first use); every block reads its config's ``_attn_implementation`` per call."""
    if implementation == VARLEN_VISION_ATTENTION:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN_VISION_ATTENTION, varlen_vision_attention)
    visual.config._attn_implementation = implementation


def build_vision_tower(vision_config: dict, *, dtype: torch.dtype = torch.bfloat16, device=None,
                       attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' ``Qwen3_5MoeVisionModel`` for a ``vision_config`` dict, on ``device`` or the ambient device;
    ``attn_implementation``: as :func:`use_vision_attention`."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    config = Qwen3_5MoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        model = Qwen3_5MoeVisionModel._from_config(config, dtype=dtype)
    use_vision_attention(model, attn_implementation)
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
