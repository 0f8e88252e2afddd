"""Dataset rows -> prompts: loading, images, chat template, limits, skips, shuffling, cursor.

(To be completed.)
"""

from __future__ import annotations

import dataclasses
import json

from slime.utils.config import ConfigError, flag


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"expected a JSON object, got {text!r}")
    return value


@dataclasses.dataclass
class DataConfig:
    """Prompt data (part of ROLLOUT_ARGS): where rows come from and how they become prompts."""

    prompt_data: str | None = flag(
        None,
        help="Training prompts: a .parquet/.jsonl file, a folder with train.parquet, or a Hugging Face dataset "
        "name (optionally NAME@split).",
    )
    input_key: str = flag("input", help="Column holding the prompt text (may contain <image> placeholders).")
    label_key: str | None = flag("label", help="Column holding the ground-truth answer.")
    multimodal_keys: dict | None = flag(
        None, type=_json_dict, help='JSON map of modality -> column, e.g. \'{"image": "images"}\'.'
    )
    apply_chat_template: bool = flag(False, help="Wrap the prompt in the model's chat template.")
    apply_chat_template_kwargs: dict = flag(
        default_factory=dict, type=_json_dict, help="JSON kwargs for apply_chat_template, e.g. '{\"enable_thinking\": false}'."
    )
    rollout_shuffle: bool = flag(False, help="Shuffle prompts each epoch (deterministic in --seed and the epoch).")
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
