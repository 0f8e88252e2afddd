"""Multimodal rotary position embedding (MRoPE) of Qwen3.5's gated full-attention layers.

Positions (Qwen2-VL, Wang et al. 2024, sec. 2.1; transformers ``Qwen3_5MoeModel.get_rope_index``): a text
token has three equal ids (temporal, height, width) from a running counter; the merged cell ``(ti, hi, wi)``
of an image of ``(t, h, w)`` patches gets ``counter + (ti, hi, wi)``, and the counter then moves on by
``max(h, w) / m`` (``m`` the merge size).  Positions restart at 0 in every packed document.

Frequencies: ``inv_freq[i] = theta ** (-2 i / rotary_dim)``; frequency ``i`` reads one axis.  Interleaved
(Qwen3-VL / Qwen3.5): ``i % 3 == 1`` and ``i < 3 * section[1]`` -> height, ``i % 3 == 2`` and
``i < 3 * section[2]`` -> width, else temporal.  Non-interleaved (Qwen2-VL): consecutive blocks of
``section[0]``, ``section[1]``, ``section[2]``.  Rotation: "rotate half" on ``cat(freqs, freqs)``
(transformers' ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PositionError(ValueError):
    """Image placeholders of a sample do not match its image grids (message names the sample)."""


def text_position_ids(length: int, device=None) -> torch.Tensor:
    """``[3, length]`` int64 positions of a text-only document: ``0 .. length-1`` on all three axes."""
    return torch.arange(length, device=device).view(1, -1).expand(3, -1).clone()


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
    sample: int | str = 0,
) -> torch.Tensor:
    """Three-axis positions ``[3, L]`` int64 of one document (see the module docstring), on ``input_ids.device``.

    Args:
        input_ids: ``[L]`` int64 token ids of one document.
        image_grid_thw: ``[num_images, 3]`` int64 patch grids of its images in order, or ``None``.
        image_token_id, video_token_id: the placeholder ids.
        spatial_merge_size: ``m``, the vision merger's side.
        sample: how errors name the document.

    Raises:
        PositionError: a run of image tokens whose length differs from its grid's merged token
            count, more or fewer runs than grids, or video tokens.
    """
    ids = input_ids.tolist()
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    if video_token_id is not None and video_token_id in ids:
        raise PositionError(f"sample {sample}: video tokens are not supported by the native Qwen3.5 model")
    pieces: list[torch.Tensor] = []
    counter, i, image = 0, 0, 0
    n = len(ids)
    while i < n:
        j = i
        is_image = ids[i] == image_token_id
        while j < n and (ids[j] == image_token_id) == is_image:
            j += 1
        if not is_image:
            pieces.append(torch.arange(counter, counter + j - i).view(1, -1).expand(3, -1))
            counter += j - i
        else:
            if image >= len(grids):
                raise PositionError(
                    f"sample {sample}: image-token run {image} at positions {i}..{j - 1} has no image_grid_thw "
                    f"row ({len(grids)} images given)"
                )
            t, h, w = grids[image]
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            if t * gh * gw != j - i:
                raise PositionError(
                    f"sample {sample}: image {image} has grid (t={t}, h={h}, w={w}) = {t * gh * gw} merged tokens "
                    f"but {j - i} image tokens at positions {i}..{j - 1}"
                )
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + counter)
            counter += max(h, w) // spatial_merge_size
            image += 1
        i = j
    if image != len(grids):
        raise PositionError(f"sample {sample}: {len(grids)} images given but {image} runs of image tokens found")
    out = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return out.to(device=input_ids.device, dtype=torch.long)


def packed_position_ids(
    documents: Sequence[torch.Tensor],
    image_grids: Sequence[torch.Tensor | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
    num_padding: int = 0,
) -> torch.Tensor:
    """``[3, T]`` positions of packed documents; ``num_padding`` trailing tokens get text positions from 0.

    Raises:
        PositionError: as :func:`mrope_position_ids`, naming the document index.
        ValueError: ``documents`` and ``image_grids`` differ in length.
    """
    if len(documents) != len(image_grids):
        raise ValueError(f"{len(documents)} documents but {len(image_grids)} image-grid entries")
    parts = [
        mrope_position_ids(doc, grids, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                           video_token_id=video_token_id, sample=i)
        for i, (doc, grids) in enumerate(zip(documents, image_grids))
    ]
    if num_padding:
        parts.append(text_position_ids(num_padding, device=parts[0].device if parts else None))
    return torch.cat(parts, dim=1)


def inv_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """``[rotary_dim / 2]`` fp32 ``theta ** (-arange(0, rotary_dim, 2) / rotary_dim)`` (transformers' default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


def mrope_axis_of_frequency(num_freqs: int, section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """``[num_freqs]`` int64: which position axis (0 = T, 1 = H, 2 = W) drives each frequency."""
    if sum(section) != num_freqs:
        raise ValueError(f"mrope_section {list(section)} must sum to the {num_freqs} rotary frequencies")
    axis = torch.zeros(num_freqs, dtype=torch.long)
    if interleaved:
        i = torch.arange(num_freqs)
        axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    else:
        axis[section[0]: section[0] + section[1]] = 1
        axis[section[0] + section[1]:] = 2
    return axis


def mrope_frequencies(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int], interleaved: bool = True
) -> torch.Tensor:
    """Rotation angles of every token: ``[T, rotary_dim]`` fp32, radians, ``cat(f, f)`` layout.

    ``position_ids``: ``[3, T]`` (a ``[T]`` tensor means text positions); ``inv_freq``: ``[rotary_dim / 2]``.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.view(1, -1).expand(3, -1)
    axis = mrope_axis_of_frequency(inv_freq.numel(), section, interleaved).to(position_ids.device)
    pos = position_ids.float().index_select(0, axis)  # [F, T]: each frequency's position axis
    freqs = pos.t() * inv_freq.float().view(1, -1)  # [T, F]
    return torch.cat([freqs, freqs], dim=-1)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of every head of ``x [T, heads, head_dim]`` by ``freqs [T, rotary_dim]``.

    Returns ``x``'s shape and dtype; the rotation itself runs in fp32.
    """
    rot = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = (x_rot * cos + rotated * sin).to(x.dtype)
    return torch.cat([out, x_pass], dim=-1)
