"""One rounding step of noise on a model's token embeddings: how the trainer measures its own numerical floor, which
the engine parity check judges the engine against (:mod:`slime.rollout.parity`, ``docs/design/parity_gate.md``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}


def one_ulp_step(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (bf16, fp16, fp32 or fp64, else ``TypeError``; any shape) with every non-zero finite element moved one unit
    in the last place, up or down in magnitude with probability 1/2 each (zeros, and steps that would leave the finite
    range, keep their value); a new tensor, its randomness from ``generator`` (on ``x``'s device)."""
    ints = _SAME_SIZE_INT.get(x.dtype)
    if ints is None:
        raise TypeError(f"one_ulp_step: no bit-level step for dtype {x.dtype}")
    step = torch.randint(0, 2, x.shape, generator=generator, device=x.device, dtype=ints) * 2 - 1
    moved = (x.contiguous().view(ints) + step).view(x.dtype)
    return torch.where((x != 0) & torch.isfinite(moved), moved, x)


@contextlib.contextmanager
def rounding_step_noise(embedding: torch.nn.Module | None, seed: int = 0) -> Iterator[None]:
    """Inside the block, every output of ``embedding`` gets :func:`one_ulp_step` (seeded: the ``n``-th forward
    of the block uses ``seed + n``, so a call with the same inputs is repeatable).  ``None`` changes nothing."""
    if embedding is None:
        yield
        return
    calls = [0]

    def hook(module, args, out):
        generator = torch.Generator(device=out.device)
        generator.manual_seed(seed + calls[0])
        calls[0] += 1
        return one_ulp_step(out, generator)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
