"""Ablations of the learning task (:mod:`scripts.harness.colour_task`), each removing one link of the loop.

Used through ``--rollout-backend`` / ``--train-backend`` import paths, the way users plug
in their own engine or trainer:

- :class:`BlindEngine`: the rollout engine sees a grey image instead of the real one;
- :class:`BlindTrainer`: the trainer sees grey pixels instead of the real ones;
- :class:`FrozenEngine`: the engine ignores weight updates (weight sync skipped).
"""

from __future__ import annotations

import base64
import dataclasses
import io

import torch
from PIL import Image

from slime.backends.fsdp.backend import FSDPBackend
from slime.rollout.engines.hf_engine import TransformersEngine
from scripts.harness.colour_task import GREY


def _grey_like(image_b64: str) -> str:
    size = Image.open(io.BytesIO(base64.b64decode(image_b64))).size
    buf = io.BytesIO()
    Image.new("RGB", size, GREY).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class BlindEngine(TransformersEngine):
    """Rollout without pixels: every image is replaced by a grey one of the same size
    (same image-token count, so the prompt-length check still passes)."""

    def generate(self, requests):
        blind = [dataclasses.replace(r, image_data=[_grey_like(image) for image in r.image_data]) for r in requests]
        return super().generate(blind)


class BlindTrainer(FSDPBackend):
    """Training without pixels: every sample's ``pixel_values`` become 0, a uniform mid-grey
    image after the processor's ``(x - 0.5) / 0.5`` normalisation (same patch grid), for the
    old log-probs and for every optimizer step."""

    def pack(self, samples):
        """Every micro-batch is packed before the step's first forward (:func:`slime.backends.step.train_step`)."""
        for sample in samples:
            pixels = sample.multimodal_inputs.get("pixel_values")
            if pixels is not None:
                sample.multimodal_inputs = {**sample.multimodal_inputs, "pixel_values": torch.zeros_like(pixels)}
        return super().pack(samples)


class FrozenEngine(TransformersEngine):
    """An engine that drops every weight update: the policy it samples never changes."""

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        return None
