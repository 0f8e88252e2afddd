"""What slime needs to know about SGLang releases, as pure functions of the version string.

Imports no SGLang, so the engine and the server plugin (inside SGLang's processes) share one answer.  The Qwen3.5
multimodal-RoPE bug of SGLang 0.5.17 and 0.5.18 (image tokens get wrong rotary positions; fixed in 0.5.19 by SGLang
PR 34446) and slime's fix: ``docs/design/sglang_engine.md``.
"""

from __future__ import annotations

import re

MROPE_BUG_FIRST = (0, 5, 17)
"""First release known to carry the bug (the fused kernel path of 0.5.17)."""
MROPE_BUG_FIXED = (0, 5, 19)
"""First release with SGLang PR 34446 (2-D positions around the fused kernel)."""

MROPE_FIX_TARGET = "sglang.srt.models.qwen3_5.Qwen3_5AttentionDecoderLayer"
"""The class whose ``forward_prepare_cuda_fused`` the fix routes to ``forward_prepare_native``."""

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def release_tuple(version: str) -> tuple[int, int, int]:
    """``"0.5.17.post1"`` -> ``(0, 5, 17)``: the release numbers, without pre/post/dev/local parts.

    Raises:
        ValueError: not a version string (the message quotes it).
    """
    match = _RELEASE.match(version or "")
    if not match:
        raise ValueError(f"not an SGLang version string: {version!r} (expected e.g. '0.5.17')")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def needs_mrope_fix(version: str) -> bool:
    """Whether SGLang ``version`` carries the multimodal-RoPE bug: every 0.5.17.x and 0.5.18.x build; not before
    0.5.17 (not known to be affected), not from 0.5.19 on.

    Raises:
        ValueError: ``version`` is not a version string.
    """
    return MROPE_BUG_FIRST <= release_tuple(version) < MROPE_BUG_FIXED


def memory_tags_supported(all_types: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The tags slime may name on a server whose ``GPU_MEMORY_ALL_TYPES`` is ``all_types`` (older releases lack
    ``cuda_graph``; an unknown tag fails the call); None (no report): 0.5.17's three."""
    known = ("weights", "kv_cache", "cuda_graph")
    if all_types is None:
        return known
    return tuple(tag for tag in known if tag in all_types)
