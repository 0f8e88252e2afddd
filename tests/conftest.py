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
