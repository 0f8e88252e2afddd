"""Start-up checks of the GPU software stack that cannot be expressed as flags.

The one known hazard: since torch 2.9, PyTorch runs the vision tower's ``Conv3d`` patch embedding
(Qwen3-VL / Qwen3.5) in bf16/fp16 on a slow non-cuDNN kernel with some cuDNN versions, which makes
every image forward pass many times slower and uses far more memory (pytorch/pytorch#168167,
#166122, #166643).  Upstream's geo3k_vlm recipe therefore asks for cuDNN 9.16.0.29:
``pip install nvidia-cudnn-cu12==9.16.0.29``.

What the pytorch threads and source establish (read for facts, 2025-09 to 2026-02):

- torch 2.9.0 bypasses cuDNN for bf16/fp16 3-D convolutions when cuDNN >= 9.8 (pytorch PR
  163581, a workaround for wrong results, #163539) and decides from the cuDNN version it was
  *built* with, so installing another cuDNN does not help: torch 2.9.1 or later is needed too.
- from torch 2.9.1 on, ``ConvParams::use_cudnn`` (``aten/src/ATen/native/Convolution.cpp``) checks
  the cuDNN loaded at run time and bypasses it only for 9.8 <= cuDNN < 9.15 (PRs 166480, 167111;
  SGLang refuses to start a multimodal server on torch 2.9.1 with cuDNN < 9.15).  The check is
  still in later releases: torch 2.10 and newer only *ship* a fixed cuDNN (2.10 bumps its pin to
  9.15.1, PR 169412), so they are affected again whenever a cuDNN 9.8 - 9.14 is installed next to
  them.  (9.10.2-9.15 also run fp32 3-D convolutions without TF32, PR 167024; bf16 is unaffected.)
- torch 2.8 and older never bypass cuDNN for this.

So the warning fires for torch 2.9.0 with cuDNN >= 9.8, and for every torch >= 2.9.1 (the pinned
range included) with 9.8 <= cuDNN < 9.15; its fix installs the recipe's cuDNN.
``torch.backends.cudnn.version()`` does not carry the build number, so 9.16.0.29 and any other
9.16.0 build look the same.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

FIRST_FIXED_CUDNN = (9, 15, 0)
"""From this cuDNN on, torch >= 2.9.1 runs Conv3d on cuDNN again (pytorch PRs 166480 / 167111; SGLang's
start-up check, sgl-project/sglang PR 14119, uses the same bound)."""

RECOMMENDED_CUDNN = "9.16.0.29"
"""The cuDNN that upstream's geo3k_vlm recipe pins for torch 2.9."""

_TORCH_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?[^+]*(?:\+(.*))?$")


def decode_cudnn_version(version: int) -> tuple[int, int, int]:
    """Split ``torch.backends.cudnn.version()`` into ``(major, minor, patch)``.

    cuDNN encodes its version as ``CUDNN_VERSION`` in ``cudnn_version.h``: from cuDNN 9 on it is
    ``major * 10000 + minor * 100 + patch`` (9.16.0 -> 91600); before, ``major * 1000 + minor *
    100 + patch`` (8.9.7 -> 8907).  The build number (the ``.29`` of 9.16.0.29) is not included.

    Raises:
        ValueError: ``version`` is not a positive integer.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(f"cuDNN version must be a positive integer such as 91600, got {version!r}")
    if version >= 10000:
        return version // 10000, version // 100 % 100, version % 100
    return version // 1000, version // 100 % 10, version % 100


def cudnn_conv3d_warning(torch_version: str, cudnn_version: int | None) -> str | None:
    """The warning (with its fix) when this torch / cuDNN pair runs Conv3d on the slow path.

    Args:
        torch_version: ``torch.__version__``, e.g. ``"2.11.0+cu130"``.
        cudnn_version: ``torch.backends.cudnn.version()``, e.g. ``91002`` for 9.10.2; ``None``
            when cuDNN is unavailable (nothing to judge).

    Returns:
        ``None`` when the pair is not affected: torch older than 2.9, cuDNN older than 9.8 (torch
        keeps using it), or torch >= 2.9.1 with cuDNN >= 9.15. Otherwise a warning naming both
        versions, the slowdown and the fix (see the module docstring).
    """
    match = _TORCH_VERSION.match(torch_version)
    if match is None or cudnn_version is None:
        return None
    major, minor, patch, local = int(match[1]), int(match[2]), int(match[3] or 0), match[4] or ""
    cudnn = decode_cudnn_version(cudnn_version)
    if (major, minor) < (2, 9) or cudnn < (9, 8, 0):
        return None
    first_runtime_check = (major, minor, patch) >= (2, 9, 1)
    if first_runtime_check and cudnn >= FIRST_FIXED_CUDNN:
        return None
    package = "nvidia-cudnn-cu13" if local.startswith("cu13") else "nvidia-cudnn-cu12"
    fix = f"pip install {package}=={RECOMMENDED_CUDNN}"
    if not first_runtime_check:
        fix = f"upgrade to torch 2.9.1 or later (2.9.0 ignores the installed cuDNN for this) and {fix}"
    return (
        f"torch {torch_version} with cuDNN {'.'.join(map(str, cudnn))} runs Conv3d (the vision tower's patch "
        f"embedding) on a slow non-cuDNN kernel: image forward passes become many times slower and use much more "
        f"memory (https://github.com/pytorch/pytorch/issues/168167). Fix: {fix}"
    )


def check_environment() -> str | None:
    """Log (and return) :func:`cudnn_conv3d_warning` for the running torch when CUDA is available.

    The driver calls this once at start-up on GPU machines; on a machine without CUDA it
    returns ``None`` without checking anything.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    warning = cudnn_conv3d_warning(torch.__version__, torch.backends.cudnn.version())
    if warning is not None:
        logger.warning(warning)
    return warning
