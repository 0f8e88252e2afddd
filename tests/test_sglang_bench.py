"""CPU checks of the pieces of ``scripts/bench/sglang_rollout_bench.py`` that decide what the H200 measures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.sglang_gpu_helpers import load_checkpoint_tensors

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "sglang_rollout_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sglang_rollout_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_fused_experts_are_transformers_own_fused_parameters(bench, tiny_ckpt):
    """The weight-sync bench's fused expert form must be exactly what transformers 5 holds in memory
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), the layout SGLang's loader splits."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    per_expert = load_checkpoint_tensors(tiny_ckpt, device="cpu", dtype=torch.float32)
    fused = bench.fuse_expert_tensors(per_expert)
    reference = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).state_dict()
    assert set(fused) == set(reference)
    layers = [k for k in fused if k.endswith(".experts.gate_up_proj")]
    experts = reference[layers[0]].shape[0]
    assert len(per_expert) - len(fused) == len(layers) * (3 * experts - 2)  # 3 x E tensors -> 2, per layer
    for name, tensor in fused.items():
        assert torch.equal(tensor, reference[name]), name


def test_fusing_refuses_a_layer_with_a_missing_expert(bench):
    tensors = {f"m.layers.0.mlp.experts.{e}.{p}.weight": torch.zeros(2, 2)
               for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    del tensors["m.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="m.layers.0.mlp.experts: expert ids"):
        bench.fuse_expert_tensors(tensors)


def test_bench_backend_times_each_bucket_the_transport_holds(bench):
    backend = bench.BenchWeightsBackend(None, "unused")
    backend.tensors = {f"t{i}": torch.zeros(100 * (i + 1), dtype=torch.bfloat16) for i in range(5)}  # 200..1000 B
    seen = [[name for name, _ in bucket] for bucket in backend.iter_weight_buckets(700)]
    assert seen == [["t0", "t1", "t2"], ["t3"], ["t4"]]  # 1200 B >= 700, then 800, then the rest
    stats = backend.take_stats()
    assert stats["buckets"] == 3 and stats["tensors"] == 5
    assert backend.take_stats()["buckets"] == 0  # reset
