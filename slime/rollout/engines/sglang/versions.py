"""What slime needs to know about SGLang releases, as pure functions of the version string.

Imports nothing from SGLang, so the engine side (which runs in slime's environment) and the
server side (:mod:`slime.rollout.engines.sglang.server_plugin`, inside SGLang's processes) share
one answer, and CPU tests can check it.

**The multimodal-RoPE bug (SGLang 0.5.17 and 0.5.18).**  In ``sglang/srt/models/qwen3_5.py`` the
full-attention layer of Qwen3.5 (``Qwen3_5AttentionDecoderLayer.self_attention``) always takes the
fused Triton kernel ``fused_qk_gemma_rmsnorm_rope_gate`` on CUDA when the layer has an attention
output gate (every Qwen3.5 checkpoint has one), through ``forward_prepare_cuda_fused``.  That kernel
indexes ``positions`` as a 1-D ``[T]`` tensor, but a vision-language request carries M-RoPE
positions of shape ``[3, T]`` (temporal, height, width rows): only the temporal row is applied, so
image tokens get wrong rotary positions while text tokens (whose three rows are equal) look right.
Reported as SGLang issues 35345 and 36762 and slime issue 2336 (grounding accuracy of
Qwen3.5-35B-A3B from 81.7 % to 26.7 %); fixed by SGLang PR 34446, first released in 0.5.19, which
routes 2-D positions to the unfused path.  For RL it means the engine's and the trainer's log-probs
disagree on image prompts.  slime's fix does the same routing inside the server processes
(:func:`slime.rollout.engines.sglang.server_plugin.apply_rope_fix`) only where
:func:`needs_mrope_fix` says so; it is dropped by this function for SGLang >= 0.5.19.
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
    """Whether an installed SGLang ``version`` carries the Qwen3.5 multimodal-RoPE bug (module docstring).

    True for every 0.5.17.x and 0.5.18.x build (pre-, post- and local releases included), False
    from 0.5.19 on, and False before 0.5.17 (not known to be affected; the engine parity check,
    :mod:`slime.rollout.parity`, is what would show it there).

    Raises:
        ValueError: ``version`` is not a version string.
    """
    return MROPE_BUG_FIRST <= release_tuple(version) < MROPE_BUG_FIXED


def memory_tags_supported(all_types: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The memory tags slime may name in ``/release_memory_occupation`` on a server whose
    ``sglang.srt.constants.GPU_MEMORY_ALL_TYPES`` is ``all_types`` (reported by the server plugin).

    Older SGLang releases have no ``cuda_graph`` tag (CUDA graphs are then released with the KV
    cache); naming a tag the server does not know makes it fail, so the engine drops the tags the
    server lacks.  ``None`` (a server that did not report) is taken as the three tags of 0.5.17.
    """
    known = ("weights", "kv_cache", "cuda_graph")
    if all_types is None:
        return known
    return tuple(tag for tag in known if tag in all_types)
