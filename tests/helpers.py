"""What the tests share (not a test module, so no test module imports another): samples on the tiny checkpoint,
backends built the same way on both sides, spawned ranks, the plain Hugging Face reference, the geo3k rows the
repository bundles and a run's flags on them (:func:`geo3k_cfg`).

``make_backend`` (FSDP) and ``make_megatron`` build a backend on the tiny checkpoint with the same settings (float32,
micro-batch 1, AdamW lr 1e-3, wd 0.1, clip 1.0), each from a :class:`slime.backends.config.TrainerSpec`; a test
overrides fields of the groups by dict.  :func:`spawn` runs a function on fresh ranks
(:mod:`scripts.harness.spawn_ranks`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from slime.backends.config import CheckpointConfig, OptimizerConfig, RankInfo, TrainConfig, TrainerSpec
from slime.data.image import encode_image_base64
from slime.data.processor import load_processor
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from scripts.harness.spawn_ranks import spawn_ranks

WORLD = 2
TEMPERATURE = 0.8
GEO3K_DATA = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
"""The 64 + 16 geo3k rows the repository bundles (``train.parquet``, ``test.parquet``)."""
LENS = [9, 7, 2, 3, 8, 6, 3, 2]
"""Response lengths of the backend tests' 8 samples; :data:`IMAGES` says which prompts have an image."""
IMAGES = [True, False, True, False, False, True, True, False]
REALGEO_PIXELS = (256 * 32 * 32, 400 * 32 * 32)
"""Image bounds of the real-geometry tiny checkpoint (conftest's ``realgeo``): 256..400 merged image tokens."""


def make_samples(ckpt_dir: Path, response_lens: list[int], images: list[bool], seed: int = 0) -> list[Sample]:
    """Samples with real processed prompts (random images where asked) and random responses."""
    processor = load_processor(ckpt_dir)
    vocab = processor.tokenizer.vocab_size
    rng = np.random.default_rng(seed)
    samples = []
    for i, (length, with_image) in enumerate(zip(response_lens, images)):
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": f"Find x in figure {i}."}]
        text = processor.apply_chat_template([{"role": "user", "content": content}])
        pics = [Image.fromarray(rng.integers(0, 256, (32 + 16 * (i % 3), 64, 3), dtype=np.uint8))] if with_image else []
        prompt = processor(text, pics)
        mm = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw} if with_image else {}
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                prompt=text,
                label="3",
                images=[encode_image_base64(p) for p in pics],
                prompt_token_ids=prompt.input_ids,
                multimodal_inputs=mm,
                response_token_ids=rng.integers(0, vocab - 16, length).tolist(),  # plain text ids
                loss_mask=[int(b) for b in rng.random(length) < 0.85] if length > 2 else [1] * length,
                rollout_log_probs=(-2.0 - rng.random(length)).tolist(),
                reward=float(i % 2),
                advantage=float(rng.normal()),
            )
        )
    return samples


def geo3k_cfg(hf_checkpoint, *extra: str):
    """The parsed flags of a small run on ``hf_checkpoint`` and the bundled geo3k rows (5 prompts x 2 samples, 4
    response tokens, one engine), with ``extra`` flags."""
    from slime.arguments import parse_args

    return parse_args([
        "--hf-checkpoint", str(hf_checkpoint), "--prompt-data", str(GEO3K_DATA), "--rollout-batch-size", "5",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--rollout-num-gpus", "1", *extra,
    ])


def _entry(rank: int, fn, world: int, device: str, args: tuple) -> None:
    # The process group already exists (spawn_ranks), so the backend joins it and never uses
    # the rendezvous address of its RankInfo.
    fn(RankInfo(rank, world, "127.0.0.1", 0, device), *args)


def spawn(fn, *args, world: int = WORLD, device: str = "cpu") -> None:
    """Run ``fn(rank_info, *args)`` on ``world`` ranks (``device`` "cpu" or "cuda"); re-raises a rank's exception."""
    spawn_ranks(_entry, fn, world, device, args, world_size=world, device=device)


def trainer_spec(ckpt_dir, *, backend: str, train=None, optimizer=None, checkpoint=None, **kwargs) -> TrainerSpec:
    """The tests' :class:`TrainerSpec` on ``ckpt_dir``; ``train`` / ``optimizer`` / ``checkpoint``: dicts of fields to
    override, ``kwargs`` its other fields (``grpo``, ``rollout_temperature``, ``num_rollout``,
    ``steps_per_rollout``)."""
    fields = dict(grpo=GRPOConfig(), rollout_temperature=TEMPERATURE, num_rollout=4, steps_per_rollout=2)
    return TrainerSpec(
        train=TrainConfig(**{"train_backend": backend, "micro_batch_size": 1, "bf16": False, **(train or {})}),
        optimizer=OptimizerConfig(**{"lr": 1e-3, "weight_decay": 0.1, "clip_grad": 1.0, **(optimizer or {})}),
        checkpoint=CheckpointConfig(**{"hf_checkpoint": str(ckpt_dir), **(checkpoint or {})}),
        **{**fields, **kwargs},
    )


def make_backend(rank_info: RankInfo, ckpt_dir, *, fsdp=None, **spec):
    """An FSDPBackend on the tiny checkpoint; ``fsdp``: its own fields to override; ``spec``: :func:`trainer_spec`'s."""
    from slime.backends.fsdp.backend import FSDPBackend
    from slime.backends.fsdp.config import FSDPConfig

    return FSDPBackend(rank_info, trainer_spec(ckpt_dir, backend="fsdp", **spec), FSDPConfig(**(fsdp or {})))


def make_megatron(rank_info: RankInfo, ckpt_dir, *, megatron=None, **spec):
    """A MegatronBackend on the tiny checkpoint: the same settings as :func:`make_backend`."""
    from slime.backends.megatron.backend import MegatronBackend
    from slime.backends.megatron.config import MegatronConfig

    return MegatronBackend(rank_info, trainer_spec(ckpt_dir, backend="megatron", **spec),
                           MegatronConfig(**(megatron or {})))


def rank_share(samples: list[Sample], rank: int, num_steps: int) -> list[Sample]:
    """What the trainer group sends to ``rank``: its slice of every optimizer step, in order."""
    per_step = len(samples) // num_steps
    per_rank = per_step // WORLD
    return [s for k in range(num_steps) for s in samples[k * per_step + rank * per_rank :][:per_rank]]


def full_params(model) -> dict[str, torch.Tensor]:
    """Unsharded parameters by in-memory name (collective)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def hf_model(ckpt_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt_dir, dtype=torch.float32)


def reference_log_probs(model, sample: Sample, temperature: float = TEMPERATURE) -> torch.Tensor:
    """Plain HF forward of one sample; float64 log_softmax of the logits predicting its response, ``[R]``."""
    ids = torch.tensor([sample.prompt_token_ids + sample.response_token_ids])
    kwargs = {}
    if sample.multimodal_inputs:
        kwargs = dict(sample.multimodal_inputs, mm_token_type_ids=(ids == model.config.image_token_id).long())
    logits = model(input_ids=ids, **kwargs).logits[0]
    p, r = len(sample.prompt_token_ids), sample.response_length
    log_p = torch.log_softmax(logits[p - 1 : p + r - 1].double() / temperature, dim=-1)
    return log_p.gather(1, torch.tensor(sample.response_token_ids)[:, None]).squeeze(1)


def exported(backend, bucket_bytes: int = 1 << 16) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """This rank's buckets (names) and tensors from ``iter_weight_buckets`` (CPU)."""
    names, tensors = [], {}
    for bucket in backend.iter_weight_buckets(bucket_bytes, "cpu"):
        names.append([n for n, _ in bucket])
        tensors.update({n: t.clone() for n, t in bucket})
    return names, tensors


def without_timings(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics without its ``perf/`` timings (each rank's and run's own clock), for comparing the values that
    are reduced over ranks or reproduced by a resume."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}
