"""Shared pytest fixtures (CPU-only, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    """Folder of the default tiny random Qwen3.5-MoE checkpoint (BPE tokenizer, seed 0).

    Built once into ``<repo>/.cache/tiny-qwen35/`` by ``slime.checkpoints.tiny_qwen35`` and reused
    across sessions; a changed recipe rebuilds it.  Read-only: copy it before modifying files.
    """
    from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()


@pytest.fixture(scope="session")
def scaled_ckpt() -> Path:
    """Folder of the real-width scaled Qwen3.5-35B-A3B (4 layers, 128 experts, an MTP layer; 7.3 GB): the GPU
    acceptance tests' checkpoint, built once per machine into ``<repo>/.cache/scaled-qwen35/`` by
    ``slime.checkpoints.scaled_qwen35`` (about 40 s on an H200; minutes on a CPU, so CPU tests build a smaller
    one themselves).  Read-only."""
    from slime.checkpoints.scaled_qwen35 import ensure_scaled_checkpoint

    return ensure_scaled_checkpoint()
