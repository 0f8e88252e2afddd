"""Start-up checks of the GPU software stack that cannot be expressed as flags.

The one known hazard: torch 2.9 runs the vision tower's ``Conv3d`` patch embedding (Qwen3-VL /
Qwen3.5) on a slow non-cuDNN kernel unless a fixed cuDNN is installed, which makes every
image forward pass many times slower and uses far more memory (pytorch/pytorch#168167,
#166122, #166643).  Upstream's geo3k_vlm recipe therefore asks for cuDNN 9.16.0.29:
``pip install nvidia-cudnn-cu12==9.16.0.29``.

What the pytorch threads establish (read for facts, 2025-09 to 2025-12):

- torch 2.9.0 bypasses cuDNN for bf16/fp16 3-D convolutions when cuDNN >= 9.8 (pytorch PR
  163581, a workaround for wrong results) and decides from the cuDNN version it was *built*
  with, so installing another cuDNN does not help: torch 2.9.1 is needed as well.
- torch 2.9.1 checks the cuDNN loaded at run time and uses it again from 9.15 (PRs 166480,
  167111; SGLang refuses to start a multimodal server on torch 2.9.1 with cuDNN < 9.15).
  (9.10.2-9.15 also run fp32 3-D convolutions without TF32, PR 167024; bf16 is unaffected.)

So the warning fires for torch 2.9.0 with cuDNN >= 9.8, and for torch 2.9.x (x >= 1) with
9.8 <= cuDNN < 9.15; its fix installs the recipe's cuDNN.  ``torch.backends.cudnn.version()``
does not carry the build number, so 9.16.0.29 and any other 9.16.0 build look the same.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

FIRST_FIXED_CUDNN = (9, 15, 0)
"""From this cuDNN on, torch 2.9.1 runs Conv3d on cuDNN again (pytorch PRs 166480 / 167111; SGLang's
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
        torch_version: ``torch.__version__``, e.g. ``"2.9.1+cu128"``.
        cudnn_version: ``torch.backends.cudnn.version()``, e.g. ``91002`` for 9.10.2; ``None``
            when cuDNN is unavailable (nothing to judge).

    Returns:
        ``None`` when the pair is not known to be affected: torch other than 2.9.x, cuDNN older
        than 9.8 (torch keeps using it), or torch >= 2.9.1 with cuDNN >= 9.15. Otherwise a
        warning naming both versions, the slowdown and the fix (see the module docstring).
    """
    match = _TORCH_VERSION.match(torch_version)
    if match is None or cudnn_version is None:
        return None
    major, minor, patch, local = int(match[1]), int(match[2]), int(match[3] or 0), match[4] or ""
    cudnn = decode_cudnn_version(cudnn_version)
    if (major, minor) != (2, 9) or cudnn < (9, 8, 0):
        return None
    if patch >= 1 and cudnn >= FIRST_FIXED_CUDNN:
        return None
    package = "nvidia-cudnn-cu13" if local.startswith("cu13") else "nvidia-cudnn-cu12"
    fix = f"pip install {package}=={RECOMMENDED_CUDNN}"
    if patch == 0:
        fix = f"upgrade to torch 2.9.1 (2.9.0 ignores the installed cuDNN for this) and {fix}"
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
