"""slime.data.processor against transformers' own Qwen2-VL image processor / Qwen3VLProcessor
and against token counts worked out by hand."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from slime.data.processor import ImageSizeError, load_processor, mm_token_type_ids
from slime.utils.config import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

USER_IMAGE_PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


# Default tiny bounds: min 32*32 = 1024 and max 128*128 = 16384 pixels, factor = patch 16 * merge 2 = 32.
# (width, height) -> resized (width, height) -> image tokens = (h/16)*(w/16)/4, worked out by hand:
HAND_CASES = [
    # 150x100: sides round to 160x96 (150/32 = 4.69 -> 5; 100/32 = 3.1 -> 3), 15360 px in bounds; grid 6x10 -> 15.
    ((150, 100), (160, 96), 15),
    # 512x512 = 262144 px > max: beta = sqrt(262144/16384) = 4, sides floor(512/4/32)*32 = 128; grid 8x8 -> 16.
    ((512, 512), (128, 128), 16),
    # 20x10 rounds to 32x0 < min: beta = sqrt(1024/200) = 2.263, h = ceil(22.6/32)*32 = 32, w = ceil(45.3/32)*32 = 64.
    ((20, 10), (64, 32), 2),
    # exactly one merged patch.
    ((32, 32), (32, 32), 1),
    # 300x200 = 60000 px > max: beta = sqrt(60000/16384) = 1.914;
    # w = floor(156.7/32)*32 = 128, h = floor(104.5/32)*32 = 96; grid 6x8 -> 12.
    ((300, 200), (128, 96), 12),
]


@pytest.mark.parametrize("size, resized, n_tokens", HAND_CASES)
def test_token_count_matches_hand_computed_grid(tiny_ckpt, size, resized, n_tokens):
    processor = load_processor(tiny_ckpt)
    image = _image(*size)
    assert processor.resize_image(image).size == resized
    assert processor.num_image_tokens(image) == n_tokens
    out = processor(processor.apply_chat_template(USER_IMAGE_PROMPT), [image])
    assert out.image_grid_thw.tolist() == [[1, resized[1] // 16, resized[0] // 16]]
    assert out.input_ids.count(processor.image_token_id) == n_tokens
    assert out.pixel_values.shape == (resized[0] * resized[1] // 256, 3 * 2 * 16 * 16)
    assert out.pixel_values.dtype == torch.float32 and out.image_grid_thw.dtype == torch.int64


@pytest.mark.parametrize("size", [(150, 100), (512, 512), (20, 10), (333, 97), (97, 333)])
def test_resize_is_a_fixed_point_and_matches_hf_pixels(tiny_ckpt, size):
    """HF's processor on the original image == on our resized image (same grid, bit-identical pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = load_processor(tiny_ckpt)
    hf = Qwen2VLImageProcessorPil.from_pretrained(tiny_ckpt)
    image = _image(*size, mode="RGBA")
    resized = processor.resize_image(image)
    assert resized.mode == "RGB"
    assert processor.resize_image(resized).size == resized.size
    original_out = hf(images=[image], return_tensors="pt")
    resized_out = hf(images=[resized], return_tensors="pt")
    assert torch.equal(original_out["image_grid_thw"], resized_out["image_grid_thw"])
    assert torch.equal(original_out["pixel_values"], resized_out["pixel_values"])


def test_matches_stock_qwen3vl_processor(tiny_ckpt, monkeypatch):
    """Same input_ids, pixel_values, image_grid_thw and mm_token_type_ids as transformers' Qwen3VLProcessor.

    The stock processor insists on a torchvision video processor; images do not use it, so the
    class check is switched off for this test and None is passed.
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    stock = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(tiny_ckpt),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
    processor = load_processor(tiny_ckpt)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare the red triangle with"},
                {"type": "image"},
                {"type": "text", "text": "and find $x$."},
            ],
        }
    ]
    text = processor.apply_chat_template(messages)
    assert text == stock.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [_image(150, 100, seed=1), _image(600, 300, mode="RGBA", seed=2)]
    ours = processor(text, images)
    ref = stock(text=[text], images=images, return_tensors="pt")
    assert ours.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    got_types = mm_token_type_ids(torch.tensor([ours.input_ids]), processor.image_token_id)
    assert torch.equal(got_types, ref["mm_token_type_ids"].long())


def test_text_only_prompt(tiny_ckpt):
    processor = load_processor(tiny_ckpt)
    text = processor.apply_chat_template([{"role": "user", "content": "Find x."}], enable_thinking=False)
    out = processor(text, [])
    assert out.pixel_values is None and out.image_grid_thw is None
    assert out.input_ids == processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert processor.tokenizer.decode(out.input_ids) == text


def test_mm_token_type_ids_marks_image_and_video_pads():
    ids = torch.tensor([[5, 7, 7, 9, 8, 5]])
    assert mm_token_type_ids(ids, image_token_id=7, video_token_id=8).tolist() == [[0, 1, 1, 0, 2, 0]]


def test_narrower_bounds_override_the_checkpoint(tiny_ckpt):
    processor = load_processor(tiny_ckpt, min_pixels=64 * 64, max_pixels=64 * 64)
    assert (processor.min_pixels, processor.max_pixels) == (4096, 4096)
    # 512x512 -> beta = sqrt(262144/4096) = 8 -> 64x64: grid 4x4 -> 4 tokens.
    assert processor.num_image_tokens(_image(512, 512)) == 4
    out = processor(processor.apply_chat_template(USER_IMAGE_PROMPT), [_image(512, 512)])
    assert out.image_grid_thw.tolist() == [[1, 4, 4]]
    # 32x32 < min 4096 px: beta = sqrt(4096/1024) = 2 -> 64x64.
    assert processor.resize_image(_image(32, 32)).size == (64, 64)


@pytest.mark.parametrize(
    "bounds, match",
    [
        (dict(max_pixels=256 * 256), "--image-max-pixels 65536 is above the checkpoint's 16384"),
        (dict(min_pixels=16 * 16), "--image-min-pixels 256 is below the checkpoint's 1024"),
        (dict(min_pixels=100 * 100, max_pixels=64 * 64), "--image-min-pixels 10000 is above --image-max-pixels 4096"),
    ],
)
def test_widening_or_inverted_bounds_raise(tiny_ckpt, bounds, match):
    with pytest.raises(ConfigError, match=match):
        load_processor(tiny_ckpt, **bounds)


def test_placeholder_count_mismatch_raises(tiny_ckpt):
    processor = load_processor(tiny_ckpt)
    text = processor.apply_chat_template(USER_IMAGE_PROMPT)
    with pytest.raises(ValueError, match=r"1 <\|image_pad\|> placeholder\(s\) but 2 image\(s\)"):
        processor(text, [_image(64, 64), _image(64, 64)])


def test_extreme_aspect_ratio_raises_image_size_error(tiny_ckpt):
    processor = load_processor(tiny_ckpt)
    # 1000x40: smart resize gives 640x32 = 20480 px > 16384 (the side cannot go below 32), not a fixed point.
    with pytest.raises(ImageSizeError, match="1000x40"):
        processor.resize_image(_image(1000, 40))
    with pytest.raises(ImageSizeError, match="aspect ratio must be smaller than 200"):
        processor.num_image_tokens(_image(2010, 10))


@pytest.mark.parametrize(
    "missing", ["preprocessor_config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"]
)
def test_missing_file_raises_naming_it(tiny_ckpt, tmp_path, missing):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    (folder / missing).unlink()
    expected = {"tokenizer.json": "tokenizer.json / vocab.json", "chat_template.jinja": "no chat template"}
    with pytest.raises(FileNotFoundError, match=expected.get(missing, f"has no {missing}")):
        load_processor(folder)


def test_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_processor(tmp_path / "nope")
