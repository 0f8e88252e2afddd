"""The project's Qwen3.5 prompt processor: chat template, image resizing, pixel patches, token ids.

What transformers' ``Qwen3VLProcessor`` does for images, without torchvision: pixels from the
PIL-backend ``Qwen2VLImageProcessorPil`` (the stock ``pixel_values`` and ``image_grid_thw``), each
``<|image_pad|>`` expanded to ``image_grid_thw.prod() // merge_size**2`` copies
(``Qwen3VLProcessor.replace_image_token``), and :meth:`VLProcessor.resize_image`, transformers'
``smart_resize`` with the same bicubic filter, whose result is a fixed point: an SGLang server with
the checkpoint's bounds neither resizes it again nor changes its token count.  So the pixel bounds
may be narrowed but not widened (:func:`load_processor`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from PIL import Image

from slime.checkpoints.hf import HFFolderError, check_hf_folder
from slime.errors import SlimeError
from slime.utils.config import ConfigError

IMAGE_TOKEN = "<|image_pad|>"


VISION_SPAN = "<|vision_start|>{image_token}<|vision_end|>"
"""What replaces a placeholder without ``--apply-chat-template``: the span that the
Qwen2-VL / Qwen3-VL / Qwen3.5 chat templates render for an ``{"type": "image"}`` item,
formatted with ``processor.image_token``."""


class ImageSizeError(SlimeError, ValueError):
    """An image cannot be resized to a fixed point within the pixel bounds (the message gives its size)."""


@dataclasses.dataclass
class ProcessedPrompt:
    """One processed prompt.

    Attributes:
        input_ids: ``list[int]`` token ids, each image's ``<|image_pad|>`` expanded.
        pixel_values: float32 ``[num_patches, C * T * patch * patch]`` (``C = 3``, ``T = temporal_patch_size``),
            the images' patches in prompt order, normalised; ``None`` without images.
        image_grid_thw: int64 ``[num_images, 3]`` patch grids (t, h, w); ``None`` without images.
    """

    input_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    text: str = ""
    """The rendered prompt (set by :meth:`VLProcessor.prompt`)."""
    images: list[Image.Image] = dataclasses.field(default_factory=list)
    """The images as processed: RGB, resized (set by :meth:`VLProcessor.prompt`)."""


class VLProcessor:
    """Chat template, image resizing and prompt processing of a Qwen3.5 checkpoint; built by :func:`load_processor`.

    Sizes in pixels: ``min_pixels`` / ``max_pixels`` (the effective bounds on an image's area),
    ``patch_size`` (16), ``merge_size`` (2: one token per 2x2 patches), ``temporal_patch_size`` (2).
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
        """``messages`` rendered as text by the chat template; ``{"type": "image"}`` items become vision spans."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) in pixels an image of this size is resized to (transformers ``smart_resize``).

        Raises:
            ImageSizeError: the aspect ratio is above 200, or so extreme that the result leaves
                ``[min_pixels, max_pixels]`` (not a fixed point); the message gives the size and the bounds.
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
        """``image`` in RGB, resized (PIL bicubic) to :meth:`resized_size`: a fixed point of it.

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
        """``<|image_pad|>`` tokens the image takes in the prompt: ``(h / patch) * (w / patch) / merge**2``.

        Raises:
            ImageSizeError: see :meth:`resized_size`.
        """
        width, height = self.resized_size(*image.size)
        return (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2

    def prompt(self, pieces: list[str], images: list[Image.Image], *, chat_template: bool = True,
               template_kwargs: dict | None = None) -> ProcessedPrompt:
        """A prompt of text ``pieces`` with an image between each two (``len(pieces) == len(images) + 1``), in one
        call: the images resized (:meth:`resize_image`), the text rendered (with ``chat_template``, one user message
        of text and ``{"type": "image"}`` items through the chat template with ``template_kwargs``; else the pieces
        joined by :data:`VISION_SPAN`), then tokenized and processed (:meth:`__call__`).

        Returns:
            The processed prompt with :attr:`ProcessedPrompt.text` and :attr:`ProcessedPrompt.images` set.

        Raises:
            ImageSizeError: an image cannot be resized (the message names it: ``image k``, from 0).
        """
        resized = []
        for k, image in enumerate(images):
            try:
                resized.append(self.resize_image(image))
            except ImageSizeError as e:
                raise ImageSizeError(f"image {k}: {e}") from e
        if chat_template:
            content: list[dict[str, str]] = []
            for k, piece in enumerate(pieces):
                if k > 0:
                    content.append({"type": "image"})
                if piece:
                    content.append({"type": "text", "text": piece})
            text = self.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            **(template_kwargs or {}))
        else:
            text = VISION_SPAN.format(image_token=self.image_token).join(pieces)
        processed = self(text, resized)
        processed.text, processed.images = text, resized
        return processed

    def __call__(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        """Tokenize a chat-templated prompt (one ``<|image_pad|>`` per image) and process its images, in order.

        Raises:
            ValueError: the placeholders differ from ``len(images)``, or an image cannot be resized
                (:class:`ImageSizeError`).
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
    """Per-token modality, int64 of ``input_ids``' shape: 0 text, 1 image pad, 2 video pad.

    transformers' Qwen3.5 ``forward`` needs it (``mm_token_type_ids``) with ``pixel_values``, as
    ``Qwen3VLProcessor`` returns it.
    """
    types = (input_ids == image_token_id).long()
    if video_token_id is not None:
        types = types + 2 * (input_ids == video_token_id).long()
    return types


def load_processor(
    hf_checkpoint: str | os.PathLike, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> VLProcessor:
    """The :class:`VLProcessor` (tokenizer, PIL image processor) of a local Qwen3.5 checkpoint folder.

    ``min_pixels`` / ``max_pixels`` narrow the checkpoint's ``preprocessor_config.json`` bounds (``None``
    keeps them).

    Raises:
        HFFolderError: the folder, ``config.json``, a processor file or a tokenizer model file
            (:func:`slime.checkpoints.hf.check_hf_folder`) or the chat template is missing; the message names it.
        ConfigError: the bounds widen the checkpoint's (the engine would resize such images again), or
            ``min_pixels > max_pixels``.
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = check_hf_folder(hf_checkpoint, "--hf-checkpoint", weights=False, processor=True)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise HFFolderError(
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
    """The single id of ``token``; ``ValueError`` when the tokenizer does not have it as one token."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise ValueError(f"the tokenizer has no {token} token; is this a Qwen3.5 / Qwen3-VL checkpoint?")
    return token_id
