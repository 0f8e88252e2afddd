"""Per-rank random-number-generator state of a trainer, for exact resumes (every backend's ``trainer/rng_rank*.pt``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """This process's RNG states: torch CPU, CUDA (when available), Python ``random``, NumPy, and
    megatron-core's model-parallel CUDA RNG tracker when one is seeded (its named states, e.g. the
    tensor-parallel dropout stream)."""
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    tracker = _megatron_tracker()
    if tracker is not None and tracker.get_states():
        state["megatron_cuda"] = tracker.get_states()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("megatron_cuda"):
        tracker = _megatron_tracker()
        if tracker is not None:
            tracker.set_states(state["megatron_cuda"])


def _megatron_tracker():
    """megatron-core's CUDA RNG tracker, if megatron-core is imported already (never imported from here)."""
    import sys

    random_module = sys.modules.get("megatron.core.tensor_parallel.random")
    return None if random_module is None or not torch.cuda.is_available() else random_module.get_cuda_rng_tracker()
