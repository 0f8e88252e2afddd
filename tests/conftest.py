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


@pytest.fixture(scope="session")
def realgeo() -> Path:
    """Folder of the tiny Qwen3.5-MoE checkpoint with the real model's geometry (head dims, vision patching), image
    bounds ``tests.helpers.REALGEO_PIXELS``; built once like :func:`tiny_ckpt`.  Read-only."""
    from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint
    from tests.helpers import REALGEO_PIXELS

    return ensure_tiny_checkpoint(real_geometry=True, min_pixels=REALGEO_PIXELS[0], max_pixels=REALGEO_PIXELS[1])


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    """The tiny checkpoint's processor (:func:`slime.data.processor.load_processor`), one per test module."""
    from slime.data.processor import load_processor

    return load_processor(tiny_ckpt)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray started as the driver starts it (:func:`slime.ray.placement.init_ray`) for one module's tests, with
    logical CPUs for 1 trainer and 4 engine bundles and one to spare; stopped after them (kept if it was running)."""
    import ray

    from slime.ray.config import ClusterConfig
    from slime.ray.placement import init_ray

    started = init_ray(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=4))
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def driver_joins_local_ray(local_ray):
    """In-process ``slime.driver.train`` runs of one module join :func:`local_ray`, as a run given ``--ray-address``
    joins a cluster, instead of each starting and stopping a local Ray instance of its own (seconds each on 2
    cores).  The driver's clean-up of a joined cluster (what ``tests/test_external_ray.py`` checks) stops each run's
    actors and placement groups, so the runs do not see each other's."""
    from slime import driver

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "init_ray", lambda cluster, **kwargs: False)
        yield


def pytest_configure(config):
    """The preloads of the process's one fork server, for the CPU ranks
    (:data:`scripts.harness.spawn_ranks.PRELOAD`) and the reward scorer's workers
    (:data:`slime.rollout.rm_hub.scorer.PRELOADED_MODULES`), set before anything in the session starts it: whichever
    starts it first decides what it has imported (:mod:`slime.utils.forkserver`)."""
    from scripts.harness.spawn_ranks import PRELOAD
    from slime.rollout.rm_hub.scorer import PRELOADED_MODULES
    from slime.utils.forkserver import forkserver_context

    forkserver_context((*PRELOAD, *PRELOADED_MODULES))
