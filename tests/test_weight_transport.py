"""Weight sync as one transport per run (:mod:`slime.weight_sync`).

Fast: the transport choice, the one-source-per-tensor check, the bucket packing (rounds and named
buckets) and the object store's bucket limit, each against values worked out by hand.  Slow (real Ray, CPU): the
object-store transport from 2 FSDP ranks over gloo into a transformers engine, checked against
weights this test perturbed itself: every checkpoint name arrives once, both ranks are sources, and afterwards the engine
holds exactly the perturbed weights (before, it held the original ones).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import pytest
import ray
import torch
from safetensors import safe_open

from slime.utils.config import ConfigError
from slime.weight_sync import choose_transport
from slime.weight_sync.base import check_weight_sources
from slime.weight_sync.buckets import bucket_by_bytes, weight_rounds

DATA_DIR = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"


# ---------------------------------------------------------------------------------------------
# choosing the transport


@pytest.mark.parametrize(
    "supported, use_gpu, colocate, expected",
    [
        (("object_store",), False, False, "object_store"),  # the transformers engine on CPU
        (("object_store",), True, True, "object_store"),  # ... on GPU: no IPC path, the object store
        (("cuda_ipc", "nccl", "object_store"), True, True, "cuda_ipc"),  # an SGLang-like engine, colocated
        (("cuda_ipc", "nccl", "object_store"), True, False, "nccl"),  # ... disaggregated
        (("cuda_ipc", "nccl", "object_store"), False, True, "object_store"),  # CPU: only the object store
    ],
)
def test_transport_follows_the_engine_and_the_placement(supported, use_gpu, colocate, expected):
    assert choose_transport(supported, use_gpu=use_gpu, colocate=colocate) == expected


def test_an_engine_without_a_usable_transport_is_refused():
    with pytest.raises(ConfigError, match="takes weights by nccl, but a colocated CPU run needs one of object_store"):
        choose_transport(("nccl",), use_gpu=False, colocate=True)


# ---------------------------------------------------------------------------------------------
# one source per tensor


def test_sources_map_each_name_to_its_rank():
    assert check_weight_sources([["a", "b"], ["c"], []]) == {"a": 0, "b": 0, "c": 1}


def test_a_tensor_sent_by_two_ranks_is_refused():
    with pytest.raises(RuntimeError, match="'lm_head.weight' was sent by trainer ranks 0 and 2"):
        check_weight_sources([["lm_head.weight"], ["x"], ["lm_head.weight"]])


def test_a_sync_that_sends_nothing_is_refused():
    with pytest.raises(RuntimeError, match="sent no tensors"):
        check_weight_sources([[], []])


# ---------------------------------------------------------------------------------------------
# FSDP rounds


@pytest.mark.parametrize(
    "sizes, limit, rounds",
    [
        ([10, 10, 10, 10], 1, [[0], [1], [2], [3]]),  # every group over the target: one round each
        ([10, 10, 10, 10], 20, [[0, 1], [2, 3]]),  # a round closes once it holds >= 20 bytes
        ([10, 10, 10, 10], 25, [[0, 1, 2], [3]]),  # 20 < 25, 30 >= 25; the rest is the last round
        ([30, 5, 5, 40], 10, [[0], [1, 2], [3]]),  # a group larger than the target stays whole
        ([1, 2, 3], 1 << 30, [[0, 1, 2]]),  # all in one
    ],
)
def test_weight_rounds_pack_whole_groups(sizes, limit, rounds):
    assert weight_rounds(sizes, limit) == rounds


def test_weight_rounds_need_a_positive_size():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        weight_rounds([1], 0)


def test_bucket_by_bytes_never_splits_a_group():
    def group(name, n):
        return [(f"{name}.{i}", torch.zeros(n, dtype=torch.float32)) for i in range(2)]  # 8n bytes

    groups = [group("a", 10), group("b", 10), group("c", 100), group("d", 1)]  # 80, 80, 800, 8 bytes
    names = [[n.split(".")[0] for n, _ in bucket] for bucket in bucket_by_bytes(groups, 150)]
    assert names == [["a", "a", "b", "b"], ["c", "c"], ["d", "d"]]
    assert len(list(bucket_by_bytes(groups, 1))) == 4
    assert len(list(bucket_by_bytes(groups, 10**9))) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_bytes(groups, 0))


# ---------------------------------------------------------------------------------------------
# object store: the bucket fits the store, counting every rank that may hold one at once


def test_bucket_limit_shares_half_the_store_over_the_ranks():
    from slime.weight_sync.object_store import bucket_limit

    assert bucket_limit(1 << 30, 1) == 512 << 20  # 1 GiB store, one rank: half of it
    assert bucket_limit(1 << 30, 2) == 256 << 20  # two ranks may each hold a bucket at once
    assert bucket_limit(1 << 30, 8) == 64 << 20
    assert bucket_limit(100, 3) == 16  # floor(50 / 3)
    assert bucket_limit(1, 4) == 1  # never 0
    with pytest.raises(ValueError, match="need >= 1 trainer rank"):
        bucket_limit(1 << 30, 0)


def test_a_bucket_too_large_for_the_object_store_is_lowered_with_a_warning(caplog):
    from slime.weight_sync.object_store import ObjectStoreTransport

    assert ObjectStoreTransport().bucket_bytes == 512 << 20  # flag not given: upstream's 512 MiB
    given = ObjectStoreTransport(bucket_bytes=4 << 30)  # --update-weight-buffer-size 4294967296
    with caplog.at_level(logging.INFO, logger="slime.weight_sync.object_store"):
        assert given.fit_bucket(1 << 30, 2) == 256 << 20
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("--update-weight-buffer-size 4294967296 (4096 MiB) does not fit Ray's "
                                          "object store of 1024 MiB: 2 trainer ranks")
    assert given.bucket_bytes == 256 << 20  # what the ranks get (the transport is pickled to them at connect)

    caplog.clear()
    default = ObjectStoreTransport()
    with caplog.at_level(logging.INFO, logger="slime.weight_sync.object_store"):
        assert default.fit_bucket(1 << 30, 2) == 256 << 20  # 2 x 512 MiB would fill the whole store
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # the default is lowered quietly

    caplog.clear()
    fits = ObjectStoreTransport(bucket_bytes=1 << 20)
    with caplog.at_level(logging.INFO, logger="slime.weight_sync.object_store"):
        assert fits.fit_bucket(1 << 30, 2) == 1 << 20
    assert not caplog.records


# ---------------------------------------------------------------------------------------------
# object store: 2 FSDP ranks -> 1 transformers engine


@pytest.fixture(scope="module")
def perturbed(tiny_ckpt, tmp_path_factory):
    """A ``--load`` checkpoint whose weights are the tiny model's plus known noise; returns (root, the
    perturbed state dict in the model's in-memory layout, the original one)."""
    from transformers import AutoModelForImageTextToText

    from slime.checkpoints import layout as ckpt

    root = tmp_path_factory.mktemp("perturbed") / "ckpt"
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt, dtype=torch.float32)
    original = {name: t.detach().clone() for name, t in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(ckpt.model_dir(root, 0))
    ckpt.trainer_dir(root, 0).mkdir()  # no optimizer state: resumed with --no-load-optim
    ckpt.mark_latest(root, 0)
    expected = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return root, expected, original


def _engine_state(engines) -> dict[str, torch.Tensor]:
    """The engine's state dict, read inside its actor (in-memory names: fused experts)."""
    return ray.get(
        engines.actors[0].__ray_call__.remote(
            lambda actor: {name: t.detach().clone() for name, t in actor.engine.model.state_dict().items()}
        )
    )


@pytest.mark.slow
def test_object_store_sync_from_two_fsdp_ranks(tiny_ckpt, perturbed):
    from slime.arguments import parse_args
    from slime.checkpoints import layout as ckpt
    from slime.driver import resolve_components, start_workers
    from slime.ray.placement import create_placement_groups, init_ray

    root, expected, original = perturbed
    cfg = parse_args([
        "--hf-checkpoint", str(tiny_ckpt), "--load", str(root), "--no-load-optim", "--prompt-data", str(DATA_DIR),
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--global-batch-size", "4",
        "--train-backend", "fsdp", "--rollout-backend", "transformers",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--update-weight-buffer-size", "1",  # every FSDP unit is a bucket of its own: 7, over both ranks
    ])  # fmt: skip
    started_ray = init_ray(cfg.cluster)
    cleanup = contextlib.ExitStack()  # stops the engines and trainers, then frees the bundles
    try:
        placement = create_placement_groups(cfg.cluster, use_gpu=False)
        cleanup.callback(placement.remove)
        engines, trainers = start_workers(cfg, placement, resolve_components(cfg), cleanup)
        assert trainers.transport.name == "object_store"
        from slime.weight_sync.object_store import object_store_bytes

        assert object_store_bytes() == int(os.environ.get("SLIME_RAY_OBJECT_STORE_BYTES", 1 << 30))  # init_ray's store
        assert trainers.init() == 1  # resumed after the checkpoint of rollout 0
        before = _engine_state(engines)
        assert all(torch.equal(before[name], original[name]) for name in original)  # the engine has --hf-checkpoint

        sources = trainers.update_weights(engines)

        with safe_open(next(ckpt.model_dir(root, 0).glob("*.safetensors")), "pt") as f:
            checkpoint_names = set(f.keys())
        assert set(sources) == checkpoint_names  # every checkpoint name, each from one rank (a dict)
        assert set(sources.values()) == {0, 1}, "both ranks must be sources"
        after = _engine_state(engines)
        assert set(after) == set(expected)
        for name in expected:
            torch.testing.assert_close(after[name], expected[name], rtol=0, atol=0, msg=name)
        assert not torch.equal(after["lm_head.weight"], original["lm_head.weight"])

        assert trainers.update_weights(engines) == sources  # a second sync: the same tensors from the same ranks
    finally:
        cleanup.close()
        if started_ray:
            ray.shutdown()
