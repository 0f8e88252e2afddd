"""CPU checks of the pieces of ``scripts/bench/sglang_rollout_bench.py`` that decide what the H200 measures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "sglang_rollout_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sglang_rollout_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_bench_backend_times_each_bucket_the_transport_holds(bench):
    backend = bench.BenchWeightsBackend(None, "unused")
    backend.tensors = {f"t{i}": torch.zeros(100 * (i + 1), dtype=torch.bfloat16) for i in range(5)}  # 200..1000 B
    seen = [[name for name, _ in bucket] for bucket in backend.iter_weight_buckets(700)]
    assert seen == [["t0", "t1", "t2"], ["t3"], ["t4"]]  # 1200 B >= 700, then 800, then the rest
    stats = backend.take_stats()
    assert stats["buckets"] == 3 and stats["tensors"] == 5
    assert backend.take_stats()["buckets"] == 0  # reset
