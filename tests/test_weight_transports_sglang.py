"""The SGLang engine's weight transports on CPU.

Fast: the flattened-bucket format (SGLang's ``buffer[start_idx:end_idx].view(dtype).reshape(shape)``, only
classes SGLang's ``SafeUnpickler`` takes), which trainer rank feeds which engine TP rank over CUDA IPC, the
NCCL group ranks.  Slow (real Ray, CPU): the NCCL transport's protocol over gloo from 2 FSDP ranks into 2
receiving engines: every Hugging Face checkpoint name arrives, the vision tower's included (the names
upstream once dropped for VLMs, slime issue 1673), with the checkpoint's values, from both ranks.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import pickletools
import types
from pathlib import Path

import pytest
import ray
import torch
from safetensors import safe_open

from slime.rollout.engines.base import BundleResources, EngineResources
from slime.weight_sync.cuda_ipc import EngineSlot, ipc_plan, locate
from slime.weight_sync.flattened import (
    flatten,
    layout,
    serialize_bucket_by_value,
    serialize_ipc_bucket,
    unflatten,
)
from slime.weight_sync.nccl import rank_offsets, split_by_dtype

DATA_DIR = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
SAFE_PREFIXES = ("builtins.", "collections.", "copyreg.", "types.", "torch.")


def test_flatten_aligns_each_tensor_and_rebuilds_them_as_sglang_does():
    bucket = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.arange(6.0).reshape(3, 2).t()),
              ("c", torch.tensor([7], dtype=torch.int64))]
    meta, total = layout(bucket)
    assert [(m.start, m.nbytes) for m in meta] == [(0, 6), (16, 24), (48, 8)] and total == 56
    flat = flatten(bucket)
    assert flat.buffer.dtype == torch.uint8 and flat.nbytes == 56
    for (name, original), (name2, rebuilt) in zip(bucket, unflatten(flat.buffer, flat.metadata)):
        assert name == name2 and torch.equal(original, rebuilt)
    packed, total = layout(bucket, align=1)
    assert [m.start for m in packed] == [0, 6, 30] and total == 38
    with pytest.raises(ValueError, match="appears twice"):
        layout([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="empty bucket"):
        flatten([])
    with pytest.raises(ValueError, match="CUDA device"):
        serialize_ipc_bucket(flat)


def test_by_value_payload_uses_only_classes_sglangs_safe_unpickler_accepts():
    bucket = [("model.visual.blocks.0.norm1.weight", torch.randn(4)), ("lm_head.weight", torch.randn(2, 2))]
    data = base64.b64decode(serialize_bucket_by_value(flatten(bucket)))
    strings = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    globals_ = [(strings[i], strings[i + 1]) for i in range(len(strings) - 1) if strings[i].split(".")[0] in
                ("torch", "types", "collections", "builtins", "copyreg")]
    assert ("types", "SimpleNamespace") in globals_ and ("torch._utils", "_rebuild_tensor_v2") in globals_

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            assert any((module + ".").startswith(p) for p in SAFE_PREFIXES), (module, name)
            return super().find_class(module, name)

    payload = Restricted(io.BytesIO(data)).load()
    flat = payload["flattened_tensor"]
    for meta, (name, tensor) in zip(payload["metadata"], bucket):  # SGLang's reconstruction, attribute by attribute
        assert isinstance(meta, types.SimpleNamespace) and meta.name == name and meta.numel == tensor.numel() * 4
        assert torch.equal(flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape), tensor)


def _resources(index, node, gpus, bundle0):
    return EngineResources(index, tuple(BundleResources(bundle0 + k, f"10.0.0.{node}", f"node{node}", (g,), 1.0)
                                        for k, g in enumerate(gpus)), use_gpu=True, colocated=True)


def test_cuda_ipc_send_makes_the_next_bucket_while_the_engine_loads_one(monkeypatch, tmp_path):
    """One trainer rank, one engine (CPU stand-ins for CUDA and Ray): each update goes out only after the
    previous one was answered, the next buffer is made in between, and every buffer the engine is given
    still holds its bucket's bytes when the engine's answer is awaited (no buffer freed or reused early)."""
    import torch.distributed as dist

    from slime.backends.config import RankInfo
    from slime.weight_sync import cuda_ipc
    from slime.weight_sync.cuda_ipc import CudaIpcTransport

    events, given = [], {}

    def fake_flatten(named, device):
        events.append(f"flatten {named[0][0]}")
        return flatten(named, device="cpu")

    def fake_handle(bucket):
        key = f"h{len(given)}"
        given[key] = (bucket.buffer, bucket.buffer.clone())  # the buffer, and its bytes when handed over
        return key

    class Ref:
        def __init__(self, handles):
            self.handles = handles

    class FakeRay:
        @staticmethod
        def get(ref):
            events.append(f"answer {ref.handles[0]}")
            buffer, bytes_then = given[ref.handles[0]]
            assert torch.equal(buffer, bytes_then), "a buffer changed before the engine had loaded it"

    class Engine:
        class update_weights_from_ipc:  # noqa: N801 - an actor method's .remote
            @staticmethod
            def remote(handles):
                events.append(f"update {handles[0]}")
                return Ref(handles)

    monkeypatch.setattr(cuda_ipc, "flatten", fake_flatten)
    monkeypatch.setattr(cuda_ipc, "serialize_ipc_bucket", fake_handle)
    monkeypatch.setattr(cuda_ipc, "ray", FakeRay)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        transport = CudaIpcTransport(bucket_bytes=1 << 20)
        transport._group, transport._plan = dist.new_group(backend="gloo"), {0: [0]}
        buckets = [[(f"w{i}", torch.full((5,), float(i)))] for i in range(3)]
        sent = transport.send(iter(buckets), RankInfo(0, 1, "127.0.0.1", 0, "cpu"), [Engine()])
    finally:
        dist.destroy_process_group()
    assert sent == ["w0", "w1", "w2"]
    assert events == ["flatten w0", "update h0", "flatten w1", "answer h0", "update h1", "flatten w2", "answer h1",
                      "update h2", "answer h2"]
    for i, (buffer, _) in enumerate(given.values()):
        assert torch.equal(unflatten(buffer, flatten(buckets[i]).metadata)[0][1], buckets[i][0][1])


def test_each_trainer_rank_feeds_the_engine_tp_rank_on_its_gpu():
    engines = [_resources(0, 1, ("0", "1"), 0), _resources(1, 1, ("2", "3"), 2), _resources(2, 2, ("0", "1"), 4)]
    assert locate("node1", "3", engines) == EngineSlot(1, 1) and locate("node2", "0", engines) == EngineSlot(2, 0)
    assert locate("node1", "7", engines) is None
    # trainer ranks 0..5 on node1 GPUs 0..3 and node2 GPUs 0..1, in another order than the engines
    slots = [locate(n, g, engines) for n, g in [("node2", "1"), ("node1", "0"), ("node1", "1"), ("node1", "3"),
                                                 ("node1", "2"), ("node2", "0")]]
    assert ipc_plan(slots, engines) == {0: [1, 2], 1: [4, 3], 2: [5, 0]}
    with pytest.raises(ValueError, match="engine 2 .* TP rank\\(s\\) \\[0\\]"):
        ipc_plan(slots[:-1] + [None], engines)
    with pytest.raises(ValueError, match="share the GPU"):
        ipc_plan(slots + [slots[0]], engines)


def test_nccl_group_ranks_and_dtype_runs():
    assert rank_offsets([2, 2, 4]) == [1, 3, 5]  # the trainer is rank 0 of each group; world = 1 + 8
    bucket = [("a", torch.zeros(1)), ("b", torch.zeros(1)), ("c", torch.zeros(1, dtype=torch.bfloat16)),
              ("d", torch.zeros(1))]
    assert [[n for n, _ in run] for run in split_by_dtype(bucket)] == [["a", "b"], ["c"], ["d"]]


@pytest.mark.slow
def test_nccl_protocol_over_gloo_moves_every_checkpoint_name_vision_tower_included(tiny_ckpt):
    from slime.arguments import parse_args
    from slime.driver import resolve_components, start_workers
    from slime.ray.placement import create_placement_groups, init_ray
    from slime.weight_sync.nccl import NcclTransport

    cfg = parse_args([
        "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(DATA_DIR), "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--global-batch-size", "4", "--train-backend", "fsdp", "--rollout-backend", "tests.receiver_engines:ReceiverEngine",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--update-weight-buffer-size", "1",  # every FSDP unit a bucket of its own, spread over both ranks
    ])  # fmt: skip
    started_ray = init_ray(cfg.cluster)
    cleanup = contextlib.ExitStack()
    try:
        placement = create_placement_groups(cfg.cluster, use_gpu=False)
        cleanup.callback(placement.remove)
        engines, trainers = start_workers(cfg, placement, resolve_components(cfg), cleanup)
        trainers.transport = NcclTransport(cfg.weight_sync.update_weight_buffer_size, backend="gloo")
        trainers.init()
        sources = trainers.update_weights(engines)
        with safe_open(next(Path(tiny_ckpt).glob("*.safetensors")), "pt") as f:
            expected = {name: f.get_tensor(name) for name in f.keys()}
        assert set(sources) == set(expected) and set(sources.values()) == {0, 1}
        assert any(name.startswith("model.visual.") for name in sources)
        for actor in engines.actors:
            received, calls = ray.get(actor.__ray_call__.remote(lambda a: a.engine.received()))
            assert set(received) == set(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(received[name], tensor.to(received[name].dtype), rtol=0, atol=0, msg=name)
            assert [c for c in calls if c[0] == "init"] == [("init", "slime-weights-r0"), ("init", "slime-weights-r1")]
    finally:
        cleanup.close()
        if started_ray:
            ray.shutdown()
