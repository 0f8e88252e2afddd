"""One rounding step of noise on a model's token embeddings: how the trainer measures its own numerical floor.

Two correct low-precision computations of one model differ by their rounding.  In a mixture-of-experts model
the difference need not stay small: a token whose router scores two experts almost equally can be sent to
another expert, and the changed output changes the next layers' routes (docs/design/parity_gate.md has the
figures).  :func:`rounding_step_noise` moves every element of the embedding output by one unit in the last
place, up or down at random: the trainer's log-probs with and without it differ by what one rounding
difference costs this model on these tokens.  The engine parity check judges the engine against that floor
(:mod:`slime.rollout.parity`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}


def one_ulp_step(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` with every non-zero finite element moved one unit in the last place, up or down in magnitude with
    probability 1/2 each (zeros, and steps that would leave the finite range, keep their value).

    Args:
        x: a floating-point tensor (bf16, fp16, fp32 or fp64), any shape.
        generator: the random source, on ``x``'s device.

    Returns:
        A new tensor of ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` is not of one of those dtypes.
    """
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
