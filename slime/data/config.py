"""Prompt-data flags (part of ROLLOUT_ARGS): where rows come from and how they become prompts."""

from __future__ import annotations

import argparse
import dataclasses
import json

from slime.utils.config import ConfigError, flag


def _json_object(text: str) -> dict:
    """argparse ``type=`` for JSON-object flags; argparse prefixes the error with the flag name."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e}); quote it for the shell") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


@dataclasses.dataclass
class DataConfig:
    """Prompt data (part of ROLLOUT_ARGS): where rows come from and how they become prompts."""

    prompt_data: str | None = flag(
        None,
        help="Training prompts: a .parquet/.jsonl file, a folder with train.parquet (or train.jsonl), or a Hugging "
        "Face dataset name; NAME@split (or FOLDER@split) picks another split than 'train'.",
    )
    input_key: str = flag("input", help="Column holding the prompt text (may contain <image> placeholders).")
    label_key: str | None = flag(
        "label",
        help="Column holding the ground-truth answer; rows whose label is missing or empty are skipped. A .jsonl "
        "number keeps its text as written (3 -> '3', 1e-3 -> '1e-3').",
    )
    multimodal_keys: dict | None = flag(
        None,
        type=_json_object,
        help='JSON map of modality -> column, e.g. \'{"image": "images"}\'. Only "image" is supported; the column '
        "holds a list of images (HF Image structs, paths, URLs, base64 / data URIs), one per <image> placeholder.",
    )
    apply_chat_template: bool = flag(False, help="Wrap the prompt in the model's chat template.")
    apply_chat_template_kwargs: dict = flag(
        default_factory=dict, type=_json_object, help="JSON kwargs for apply_chat_template, e.g. '{\"enable_thinking\": false}'."
    )
    rollout_shuffle: bool = flag(
        False, help="Shuffle prompts each epoch (deterministic in --rollout-seed and the epoch)."
    )
    rollout_max_prompt_len: int | None = flag(
        None, help="Skip (and count) rows whose prompt, images expanded, is longer than this many tokens."
    )
    image_min_pixels: int | None = flag(
        None, help="Lower bound on image area, pixels (default: the checkpoint's preprocessor config)."
    )
    image_max_pixels: int | None = flag(
        None,
        help="Upper bound on image area, pixels (default: the checkpoint's preprocessor config). Images are resized "
        "once, before rollout, so rollout and training see the same image tokens.",
    )

    def __post_init__(self):
        for name in ("rollout_max_prompt_len", "image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.image_min_pixels and self.image_max_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ConfigError(
                f"--image-min-pixels ({self.image_min_pixels}) must be <= --image-max-pixels ({self.image_max_pixels})"
            )
        for name in ("multimodal_keys", "apply_chat_template_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"--{name.replace('_', '-')} must be a JSON object, got {value!r}")
        unknown = sorted(set(self.multimodal_keys or {}) - {"image"})
        if unknown:
            raise ConfigError(
                f"--multimodal-keys has unsupported modalities {unknown} ({self.multimodal_keys}); only 'image' is "
                "supported, e.g. '{\"image\": \"images\"}'"
            )
        if self.image_key is not None and (not isinstance(self.image_key, str) or not self.image_key):
            raise ConfigError(
                f"--multimodal-keys image must name a column, got {self.image_key!r}; e.g. '{{\"image\": \"images\"}}'"
            )
        if not self.input_key:
            raise ConfigError("--input-key must name the prompt column, got an empty string")

    @property
    def image_key(self) -> str | None:
        """The image column (``--multimodal-keys`` ``image``), or ``None`` for text-only data."""
        return (self.multimodal_keys or {}).get("image")
