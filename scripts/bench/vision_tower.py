"""The Qwen3.5 vision tower's forward + backward at the launcher's shapes, by attention implementation (one GPU).

The tower is the scaled checkpoint's (``slime.checkpoints.scaled_qwen35.scaled_config``: the released model's 27
blocks of width 1152, 16 heads of 72), random bf16 weights.  A step is ``--images`` images of ``--image-grid`` patches
in calls of ``--images-per-call`` images (the launcher packs 4096 tokens a micro-batch on an 80 GB card, about 6 geo3k
samples, so 6 images a call), each call's features summed into a loss and backpropagated, as the training step does.

Variants, side by side in one process on the same inputs and weights:

- ``sdpa``: transformers' SDPA path, one call per image and block (the per-image split reads ``cu_seqlens`` on the
  host each block);
- ``varlen``: :data:`slime.models.qwen3_5.vision.VARLEN_VISION_ATTENTION`, all images of a call in one torch
  ``varlen_attn`` a block (the native model's default on CUDA);
- ``varlen-compiled``: ``varlen`` with each block under ``torch.compile`` (not used by the trainer).  The compiled
  regions are split wherever the block reads a value on the host (with transformers 5.12, the attention's
  ``max_length_q`` once per call), so this is partial fusion, not the whole block in one graph.

Reported per variant (one JSON line each, ``--json``): the median step seconds over ``--steps`` timed steps after
``--warmup`` (each variant warmed up, then the timed steps in rounds of one step per variant), patches/s, the tower's model TFLOP/s
(``qwen35_shapes.vision_flops``, the count the Megatron bench uses, x 3 for forward + backward) and the largest
|difference| of its features from the ``sdpa`` variant's relative to their largest |value|.

Usage: ``python scripts/bench/vision_tower.py --json OUT/vision.jsonl`` (``--device cpu --depth 2`` is a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen35_shapes import vision_flops  # noqa: E402

from slime.checkpoints.scaled_qwen35 import scaled_config  # noqa: E402
from slime.models.qwen3_5 import vision as V  # noqa: E402

VARIANTS = ("sdpa", "varlen", "varlen-compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128, help="Images a step (the launcher's 128 samples).")
    parser.add_argument("--images-per-call", type=int, default=6, help="Images a tower call (a packed micro-batch).")
    parser.add_argument("--image-grid", type=int, nargs=3, default=[1, 36, 36], metavar=("T", "H", "W"))
    parser.add_argument("--depth", type=int, default=None, help="Blocks (default: the checkpoint's 27).")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps first (compilation happens here).")
    parser.add_argument("--steps", type=int, default=3, help="Timed steps (median reported).")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (the bench's).")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (fp32, no varlen).")
    parser.add_argument("--json", type=Path, default=None, help="Append one JSON line per variant here.")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = scaled_config().vision_config.to_dict()
    if args.depth is not None:
        config["depth"] = args.depth
    torch.manual_seed(0)
    tower = V.build_vision_tower(config, dtype=dtype, device=device)
    width = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    calls = []
    for start in range(0, args.images, args.images_per_call):
        n = min(args.images_per_call, args.images - start)
        grid = torch.tensor([args.image_grid] * n, device=device)
        calls.append((torch.randn(int(grid.prod(-1).sum()), width, device=device, dtype=dtype), grid))
    patches = [int(torch.tensor(args.image_grid).prod())] * args.images
    flops = 3 * vision_flops(config, patches)

    def step() -> torch.Tensor:
        first = None
        for pixels, grid in calls:
            features = V.image_features(tower, pixels, grid)
            features.float().square().mean().backward()
            first = features.detach() if first is None else first
        tower.zero_grad(set_to_none=True)
        return first

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    blocks = torch.nn.ModuleList(tower.blocks)
    compiled = None

    def use(variant: str) -> None:
        nonlocal compiled
        V.use_vision_attention(tower, "sdpa" if variant == "sdpa" else V.VARLEN_VISION_ATTENTION)
        if variant == "varlen-compiled" and compiled is None:
            compiled = torch.nn.ModuleList([torch.compile(b) for b in blocks])
        tower.blocks = compiled if variant == "varlen-compiled" else blocks

    rows, features, times = {}, {}, {}
    for variant in args.variants:  # warm-up (compilation) per variant; a variant that cannot run here is reported
        rows[variant] = {"variant": variant, "images": args.images, "images_per_call": args.images_per_call,
                         "patches": sum(patches), "depth": config["depth"],
                         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        try:
            use(variant)
            start = time.perf_counter()
            for _ in range(args.warmup):
                features[variant] = step()
            sync()
            rows[variant]["warmup_s"] = round(time.perf_counter() - start, 2)
            times[variant] = []
        except Exception as error:
            rows[variant]["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    running = [v for v in args.variants if v in times]
    for _ in range(args.steps):  # timed steps interleaved: each round runs every variant once
        for variant in running:
            use(variant)
            start = time.perf_counter()
            features[variant] = step()
            sync()
            times[variant].append(time.perf_counter() - start)
    reference = features.get("sdpa")
    for variant in args.variants:
        row = rows[variant]
        if variant in times:
            seconds = statistics.median(times[variant])
            row.update(step_s=round(seconds, 4), steps_s=[round(t, 4) for t in times[variant]],
                       patches_per_s=round(sum(patches) / seconds), tflops=round(flops / seconds / 1e12, 1),
                       mfu=round(flops / seconds / 1e12 / args.peak_tflops, 3))
            if reference is not None:
                diff = (features[variant].float() - reference.float()).abs().max() / reference.float().abs().max()
                row["max_rel_diff_vs_sdpa"] = float(diff)
        emit(row)


if __name__ == "__main__":
    main()
