"""The project's Qwen3.5 prompt processor: chat template, image resizing, pixel patches, token ids.

It does what transformers' ``Qwen3VLProcessor`` does for images, without needing
torchvision (which the stock processor requires through its video processor):

- pixels come from transformers' PIL-backend ``Qwen2VLImageProcessorPil`` (the class that
  ``AutoImageProcessor`` picks for ``qwen3_5`` / ``qwen3_5_moe`` without torchvision), so
  ``pixel_values`` and ``image_grid_thw`` are the stock ones;
- each ``<|image_pad|>`` of the prompt is expanded to ``image_grid_thw.prod() //
  merge_size**2`` copies, as ``Qwen3VLProcessor.replace_image_token`` does;
- :meth:`VLProcessor.resize_image` applies the image processor's "smart resize" (sides
  multiples of ``patch_size * merge_size``, area within ``[min_pixels, max_pixels]``,
  ``transformers.models.qwen2_vl`` ``smart_resize``) with the same PIL bicubic filter, so
  the result is a fixed point: processing it again, here or in an SGLang server with the
  checkpoint's bounds, neither resizes it nor changes the token count.

Pixel bounds: :func:`load_processor` may narrow the checkpoint's
``preprocessor_config.json`` bounds but not widen them.  The rollout engine (SGLang)
re-processes each image with the checkpoint's bounds; an image resized to an area outside
them would be resized again there and the engine's prompt would no longer match the
token ids kept on the sample.  Such an override raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from PIL import Image

from slime.utils.config import ConfigError

REQUIRED_FILES = ("tokenizer_config.json", "preprocessor_config.json")
"""Files a checkpoint folder needs for :func:`load_processor` (plus a tokenizer model file and a chat template)."""

TOKENIZER_MODEL_FILES = ("tokenizer.json", "vocab.json")
"""At least one of these holds the tokenizer's vocabulary."""

IMAGE_TOKEN = "<|image_pad|>"


class ImageSizeError(ValueError):
    """An image cannot be resized to a fixed point within the pixel bounds (the message gives its size).

    The data pipeline may catch it to skip the row (logged with the row id and counted).
    """


@dataclasses.dataclass
class ProcessedPrompt:
    """One processed prompt.

    Attributes:
        input_ids: prompt token ids, each image's ``<|image_pad|>`` expanded to its token
            count, ``list[int]`` of length P.
        pixel_values: float32 ``[num_patches, C * T * patch * patch]`` (``C = 3``,
            ``T = temporal_patch_size``), the images' patches in prompt order, normalised
            with the checkpoint's mean/std; ``None`` without images.
        image_grid_thw: int64 ``[num_images, 3]``, the patch grid (t, h, w) of each image;
            ``num_patches = image_grid_thw.prod(-1).sum()``; ``None`` without images.
    """

    input_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


class VLProcessor:
    """Chat template, image resizing and prompt processing for a Qwen3.5 checkpoint.

    Build it with :func:`load_processor`.

    Attributes:
        tokenizer: the Hugging Face tokenizer of the checkpoint.
        image_processor: the ``Qwen2VLImageProcessorPil`` with the effective pixel bounds.
        image_token, image_token_id: ``"<|image_pad|>"`` and its id.
        min_pixels, max_pixels: effective bounds on an image's area after resizing, pixels.
        patch_size: ViT patch side, pixels (16 for Qwen3.5).
        merge_size: patches merged per side into one LLM token (2: one token per 2x2 patches).
        temporal_patch_size: frames per patch (2; an image is repeated to fill them).
    """

    def __init__(self, tokenizer, image_processor):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = IMAGE_TOKEN
        self.image_token_id = _token_id(tokenizer, IMAGE_TOKEN)
        self.min_pixels = int(image_processor.size.shortest_edge)
        self.max_pixels = int(image_processor.size.longest_edge)
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.temporal_patch_size = int(image_processor.temporal_patch_size)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's chat template, as text (not token ids).

        Images are content items ``{"type": "image"}``; each renders as one
        ``<|vision_start|><|image_pad|><|vision_end|>`` span that :meth:`__call__` expands.
        ``kwargs`` go to the template (e.g. ``enable_thinking=False``).
        """
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) in pixels that an image of this size is resized to.

        Upstream ``smart_resize`` (transformers ``qwen2_vl``; Qwen2-VL's preprocessing):
        sides rounded to multiples of ``patch_size * merge_size``, then scaled down/up
        keeping the aspect ratio when the area leaves ``[min_pixels, max_pixels]``.

        Raises:
            ImageSizeError: the aspect ratio is above 200 (upstream limit), or so extreme that
                the rounded result leaves ``[min_pixels, max_pixels]`` (it would not be a
                fixed point); the message gives the size and the bounds.
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        try:
            new_h, new_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise ImageSizeError(f"image of {width}x{height} pixels (width x height) cannot be processed: {e}") from e
        if not self.min_pixels <= new_h * new_w <= self.max_pixels:
            raise ImageSizeError(
                f"image of {width}x{height} pixels (width x height) has too extreme an aspect ratio for the pixel "
                f"bounds [{self.min_pixels}, {self.max_pixels}]: it resizes to {new_w}x{new_h} = {new_w * new_h} "
                "pixels, outside the bounds; crop or pad the image, or widen the bounds"
            )
        return new_w, new_h

    def resize_image(self, image: Image.Image) -> Image.Image:
        """Convert to RGB and resize to :meth:`resized_size` with PIL bicubic, as the image processor does.

        The returned image is a fixed point: its size is its own :meth:`resized_size`, so
        processing it (here, or in an engine with the checkpoint's bounds) does not resize it.

        Raises:
            ImageSizeError: see :meth:`resized_size`.
        """
        if image.mode != "RGB":
            image = image.convert("RGB")
        new_size = self.resized_size(*image.size)
        if new_size == image.size:
            return image
        return image.resize(new_size, resample=Image.Resampling.BICUBIC)

    def num_image_tokens(self, image: Image.Image) -> int:
        """Number of ``<|image_pad|>`` tokens the image takes in the prompt: ``(h / patch) * (w / patch) / merge**2``.

        Raises:
            ImageSizeError: see :meth:`resized_size`.
        """
        width, height = self.resized_size(*image.size)
        return (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2

    def __call__(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        """Tokenize a chat-templated prompt and process its images.

        Args:
            text: prompt text from :meth:`apply_chat_template`, with one ``<|image_pad|>`` per image.
            images: the images in placeholder order (resized or not: resizing is idempotent).

        Returns:
            :class:`ProcessedPrompt`; the number of ``image_token_id`` in ``input_ids``
            equals ``sum(image_grid_thw.prod(-1)) // merge_size**2``.

        Raises:
            ValueError: the number of ``<|image_pad|>`` in ``text`` differs from ``len(images)``,
                or an image cannot be resized (:class:`ImageSizeError`, see :meth:`resized_size`).
        """
        n_placeholders = text.count(self.image_token)
        if n_placeholders != len(images):
            raise ValueError(
                f"the prompt has {n_placeholders} {self.image_token} placeholder(s) but {len(images)} image(s) were "
                "given; render each image as one {'type': 'image'} content item"
            )
        if not images:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return ProcessedPrompt(input_ids=ids, pixel_values=None, image_grid_thw=None)

        resized = [self.resize_image(image) for image in images]
        out = self.image_processor(images=resized, return_tensors="pt")
        grid_thw = out["image_grid_thw"]
        counts = (grid_thw.prod(-1) // self.merge_size**2).tolist()
        pieces = text.split(self.image_token)
        expanded = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return ProcessedPrompt(
            input_ids=ids,
            pixel_values=out["pixel_values"].to(torch.float32),
            image_grid_thw=grid_thw.to(torch.int64),
        )


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int | None = None) -> torch.Tensor:
    """Per-token modality of a (prompt + response) sequence: 0 text, 1 image pad, 2 video pad.

    transformers' Qwen3.5 ``forward`` needs this tensor (``mm_token_type_ids``) next to
    ``pixel_values`` to build the 3-D mRoPE positions; ``Qwen3VLProcessor`` returns it with
    the same values.

    Args:
        input_ids: int64 ``[..., L]`` token ids.
        image_token_id, video_token_id: ``config.image_token_id`` / ``config.video_token_id``.

    Returns:
        int64 tensor of the shape of ``input_ids``.
    """
    types = (input_ids == image_token_id).long()
    if video_token_id is not None:
        types = types + 2 * (input_ids == video_token_id).long()
    return types


def load_processor(
    hf_checkpoint: str | os.PathLike, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> VLProcessor:
    """Load the tokenizer and the PIL image processor of a Qwen3.5 checkpoint folder (no torchvision needed).

    Args:
        hf_checkpoint: a local checkpoint folder (``--hf-checkpoint``).
        min_pixels, max_pixels: narrower pixel bounds than the checkpoint's
            ``preprocessor_config.json`` ``size.shortest_edge`` / ``size.longest_edge``;
            ``None`` keeps the checkpoint's.

    Returns:
        The :class:`VLProcessor`.

    Raises:
        FileNotFoundError: the folder, a file of :data:`REQUIRED_FILES`, a tokenizer model
            file or a chat template is missing; the message names it.
        ConfigError: ``min_pixels`` / ``max_pixels`` widen the checkpoint's bounds, or
            ``min_pixels > max_pixels`` (see the module docstring).
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(hf_checkpoint)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"--hf-checkpoint {str(hf_checkpoint)!r} is not a folder; give a local checkpoint folder"
        )
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"--hf-checkpoint {str(folder)!r} has no {name}; it is not a complete HF checkpoint"
            )
    if not any((folder / name).is_file() for name in TOKENIZER_MODEL_FILES):
        raise FileNotFoundError(
            f"--hf-checkpoint {str(folder)!r} has none of {' / '.join(TOKENIZER_MODEL_FILES)}; "
            "copy the tokenizer files of the checkpoint"
        )

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise FileNotFoundError(
            f"--hf-checkpoint {str(folder)!r} has no chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json); copy it from the released checkpoint"
        )

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    ckpt_min, ckpt_max = int(image_processor.size.shortest_edge), int(image_processor.size.longest_edge)
    new_min = ckpt_min if min_pixels is None else min_pixels
    new_max = ckpt_max if max_pixels is None else max_pixels
    if new_min < ckpt_min:
        raise ConfigError(
            f"--image-min-pixels {new_min} is below the checkpoint's {ckpt_min} (preprocessor_config.json "
            f"size.shortest_edge): the engine would enlarge such images again; use a value >= {ckpt_min}"
        )
    if new_max > ckpt_max:
        raise ConfigError(
            f"--image-max-pixels {new_max} is above the checkpoint's {ckpt_max} (preprocessor_config.json "
            f"size.longest_edge): the engine would shrink such images again; use a value <= {ckpt_max}"
        )
    if new_min > new_max:
        raise ConfigError(f"--image-min-pixels {new_min} is above --image-max-pixels {new_max} (after defaults from "
            "preprocessor_config.json); make min <= max")
    if (new_min, new_max) != (ckpt_min, ckpt_max):
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(
            folder, size={"shortest_edge": new_min, "longest_edge": new_max}
        )
    return VLProcessor(tokenizer, image_processor)


def _token_id(tokenizer, token: str) -> int:
    """The single id of ``token``.

    Raises:
        ValueError: the tokenizer does not have ``token`` as one token.
    """
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise ValueError(f"the tokenizer has no {token} token; is this a Qwen3.5 / Qwen3-VL checkpoint?")
    return token_id
