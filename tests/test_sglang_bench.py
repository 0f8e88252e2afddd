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


def test_bench_backend_buckets_hold_whole_layers_as_the_real_backends_do(bench):
    """A layer split between buckets would be sent per expert (``fused_layout`` fuses whole layers only), so the
    bench's fused figures would measure the old form."""
    names = ["model.visual.patch_embed.proj.weight", "model.visual.blocks.0.attn.qkv.weight",
             "model.visual.blocks.0.mlp.fc1.weight", "model.language_model.embed_tokens.weight",
             *[f"model.language_model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")],
             "model.language_model.layers.1.input_layernorm.weight", "lm_head.weight"]
    backend = bench.BenchWeightsBackend(None, "unused")
    backend.tensors = {n: torch.zeros(50, dtype=torch.bfloat16) for n in names}  # 100 B each
    groups = [[n for n, _ in g] for g in bench.weight_groups(list(backend.tensors.items()))]
    assert [len(g) for g in groups] == [1, 2, 1, 6, 1, 1]
    buckets = [[n for n, _ in b] for b in backend.iter_weight_buckets(250)]
    # a bucket closes at the first group boundary at or past 250 B: 100 + 200, then the embedding + the layer
    assert [len(b) for b in buckets] == [3, 7, 2]
    assert all(any(n in b for b in buckets) for n in names) and sum(map(len, buckets)) == len(names)
    assert backend.take_stats()["buckets"] == 3


def test_timed_passes_report_the_median_pass(bench, monkeypatch):
    clock = iter([0.0, 2.0, 10.0, 11.0, 20.0, 24.0])  # passes of 2, 1 and 4 s
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    flushes = []
    result = bench.timed_passes(lambda: 512, 3, lambda: flushes.append(1))
    assert result == {"tokens": 512, "seconds": 2.0, "tokens_per_s": 256.0, "passes_s": [2.0, 1.0, 4.0]}
    assert len(flushes) == 3  # the prefix cache flushed before every pass


@pytest.mark.parametrize("repeats", ["0", "-1", "two"])
def test_repeats_below_one_are_refused_before_any_engine_starts(bench, monkeypatch, capsys, repeats):
    """No median of no pass: the flag is refused by name before the (minutes-long) engine starts."""
    monkeypatch.setattr(bench, "throughput", lambda args: pytest.fail("the bench ran with --repeats " + repeats))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["throughput", "--model", "unused", "--repeats", repeats])
    assert exit_info.value.code == 2 and "--repeats" in capsys.readouterr().err
