"""Start-up checks of the GPU software stack that cannot be expressed as flags.

The one known hazard: torch >= 2.9 runs the vision tower's bf16/fp16 ``Conv3d`` patch embedding on a slow
non-cuDNN kernel with some cuDNN versions (pytorch/pytorch#168167): torch 2.9.0 with cuDNN >= 9.8, and
torch >= 2.9.1 with 9.8 <= cuDNN < 9.15.  The fix installs the cuDNN of upstream's geo3k_vlm recipe.
The evidence (pytorch PRs and issues): ``docs/design/cudnn_conv3d.md``.
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
    """``torch.backends.cudnn.version()`` as ``(major, minor, patch)`` (``cudnn_version.h``'s ``CUDNN_VERSION``).

    cuDNN >= 9: ``major * 10000 + minor * 100 + patch`` (91600); before: ``major * 1000 + minor * 100 + patch``.

    Raises:
        ValueError: ``version`` is not a positive integer.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(f"cuDNN version must be a positive integer such as 91600, got {version!r}")
    if version >= 10000:
        return version // 10000, version // 100 % 100, version % 100
    return version // 1000, version // 100 % 10, version % 100


def cudnn_conv3d_warning(torch_version: str, cudnn_version: int | None) -> str | None:
    """The warning (naming both versions, the slowdown and the fix) when this pair runs Conv3d on the slow path.

    ``torch_version`` is ``torch.__version__``; ``cudnn_version`` is ``torch.backends.cudnn.version()``
    (``None``: no cuDNN, nothing to judge).  ``None`` when the pair is not affected.
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
    """Log (and return) :func:`cudnn_conv3d_warning` for the running torch; ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    warning = cudnn_conv3d_warning(torch.__version__, torch.backends.cudnn.version())
    if warning is not None:
        logger.warning(warning)
    return warning
