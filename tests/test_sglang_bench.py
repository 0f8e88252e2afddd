"""CPU checks of the pieces of ``scripts/bench/sglang_rollout_bench.py`` that decide what the H200 measures (the
in-actor calls of N requests against the fake SGLang server of :mod:`scripts.harness.fake_sglang_server`, in Ray)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import ray
import torch

from slime.rollout.engines.base import GenerateRequest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "sglang_rollout_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sglang_rollout_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    # Ray's workers cannot import it by this name: its objects (BenchSamplingParams) travel by value, as they do
    # from the script's __main__ on the H200
    ray.cloudpickle.register_pickle_by_value(module)
    yield module
    ray.cloudpickle.unregister_pickle_by_value(module)
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


@pytest.fixture(scope="module")
def fake_engines(tmp_path_factory):
    """One fake SGLang engine (capacity 8) in the real engine group, each request taking 0.05 s."""
    from slime.ray.config import ClusterConfig
    from slime.ray.placement import init_ray
    from scripts.harness.fake_sglang import start_engine_group

    started = init_ray(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    placement, engines = start_engine_group(tmp_path_factory.mktemp("bench"), "--sglang-fake-delay-s", "0.05",
                                            num_engines=1, capacity=8, timeout_s=300.0)
    yield engines
    engines.shutdown()
    placement.remove()
    if started:
        ray.shutdown()


def _server_info(engines) -> dict:
    return ray.get(engines.actors[0].__ray_call__.remote(lambda actor: actor.engine.client.server_info()))


def test_the_same_server_sweep_counts_every_token_of_calls_of_n_within_the_capacity(bench, fake_engines, capsys):
    """With ``ignore_eos`` (the bench's sampling params) every response is ``max_new_tokens`` long, so a pass's
    tokens are ``sum(max_new_tokens)`` over the requests whatever ``N`` (without it the echo model would stop
    after ``1 + words % 5`` tokens, fewer here); calls of ``N`` make ``ceil(12 / N)`` HTTP calls a pass."""
    params = bench.BenchSamplingParams(max_new_tokens=5, temperature=1.0)
    requests = [GenerateRequest(" ".join([f"p{i}"] + ["w"] * (i % 4)), [], params, rid=f"p{i}") for i in range(12)]
    expected = sum(r.sampling_params.max_new_tokens for r in requests)
    assert expected == 60
    before = _server_info(fake_engines)["generate_http_calls"]
    figures = bench.same_server_sweep(fake_engines, requests, [1, 3, 8, 3], repeats=2, group_tokens_per_s=100.0)
    assert list(figures) == ["same_server_calls_of_1", "same_server_calls_of_3", "same_server_calls_of_8",
                             "same_server_one_http_call_per_request"]  # each N once, and the old name of N = 1
    for n, calls, at_once in [(1, 12, 8), (3, 4, 2), (8, 2, 1)]:  # at most capacity 8 requests in flight
        result = figures[f"same_server_calls_of_{n}"]
        assert result["tokens"] == expected and (result["calls"], result["calls_at_once"]) == (calls, at_once)
        assert len(result["passes_s"]) == 2 and result["tokens_per_s"] == pytest.approx(expected / result["seconds"])
    assert figures["same_server_one_http_call_per_request"] is figures["same_server_calls_of_1"]
    info = _server_info(fake_engines)
    assert info["generate_http_calls"] - before == 2 * (12 + 4 + 2) and info["max_running"] <= 8
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("same server, calls of")]
    assert len(lines) == 3 and "calls of 3 request(s) from the engine actor (4 calls, 2 at once)" in lines[1]
    assert "ours / this" in lines[0]
    with pytest.raises(ValueError, match=r"--direct-requests-per-call \[9\]: each must be in 1..8"):
        bench.same_server_sweep(fake_engines, requests, [3, 9], repeats=1)


@pytest.mark.parametrize("sizes, refused", [(["129"], True), (["0"], True), (["1", "128"], False)])
def test_direct_requests_per_call_above_the_capacity_are_refused_before_any_engine_starts(bench, monkeypatch,
                                                                                          capsys, sizes, refused):
    ran = []
    monkeypatch.setattr(bench, "throughput", lambda args: ran.append(args.direct_requests_per_call))
    argv = ["throughput", "--model", "unused", "--capacity", "128", "--direct-requests-per-call", *sizes]
    if refused:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and "--direct-requests-per-call" in capsys.readouterr().err and not ran
    else:
        bench.main(argv)
        assert ran == [[1, 128]]
    bench.main(["throughput", "--model", "unused"])
    assert ran[-1] == [1, 8, 32]  # the default


def test_the_engines_expert_load_figures_are_read_summed_and_taken_per_sync(bench, tmp_path):
    import json
    import types

    reports = [{"pid": 1, "main": True, "expert_load": {"fast": 99}},  # the HTTP process: no model, left out
               {"pid": 2, "main": False, "expert_load": {"fast": 8, "load_weights_calls": 4, "load_weights_s": 0.5,
                                                         "declined": {"quantized experts": 1}, "disabled": None}},
               {"pid": 3, "main": False, "expert_load": {"fast": 8, "load_weights_calls": 4, "load_weights_s": 0.25,
                                                         "declined": {}, "disabled": "layer 0: differs"}}]
    for report in reports:
        (tmp_path / f"{report['pid']}.json").write_text(json.dumps(report))
    loads = bench._read_expert_loads(types.SimpleNamespace(engine=types.SimpleNamespace(report_dir=tmp_path)))
    assert [load["fast"] for load in loads] == [8, 8]
    before = bench._sum_expert_loads([])
    after = bench._sum_expert_loads(loads)
    assert after == {"fast": 16, "load_weights_calls": 8, "load_weights_s": 0.75, "declined": {"quantized experts": 1},
                     "disabled": "layer 0: differs"}
    delta = bench._expert_load_delta(before, after, syncs=2)
    assert delta == {"fast_per_sync": 8.0, "load_weights_calls_per_sync": 4.0, "load_weights_s_per_sync": 0.375,
                     "declined": {"quantized experts": 1}, "disabled": "layer 0: differs"}
    assert bench._expert_load_delta(after, after, syncs=2)["declined"] == {}


def test_spec_acceptance_is_token_weighted_over_the_requests_that_drafted(bench):
    """SGLang 0.5.17's per-request meta_info: 10 tokens in 4 verify steps (6 of 8 drafts accepted) and 5 tokens in 5
    steps (none of 10): (10 + 5) / (4 + 5) tokens per verify step, 6 / 18 drafts; a request without the fields (no
    speculative decoding) does not count, and none at all gives None."""
    metas = [{"completion_tokens": 10, "spec_verify_ct": 4, "spec_num_correct_drafts": 6, "spec_num_proposed_drafts": 8},
             {"completion_tokens": 5, "spec_verify_ct": 5, "spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 10},
             {"completion_tokens": 3}]
    assert bench.spec_acceptance(metas) == {"accept_length": pytest.approx(15 / 9), "accept_rate": pytest.approx(1 / 3),
                                            "verify_steps": 9, "requests": 2}
    assert bench.spec_acceptance([{"completion_tokens": 3}]) is None and bench.spec_acceptance([]) is None


def test_speculative_mtp_adds_upstreams_four_flags_to_every_contender(bench, monkeypatch):
    monkeypatch.setattr(bench, "SERVER_CONFIG", "defaults")
    monkeypatch.setattr(bench, "SPECULATIVE", "none")
    plain = bench.bench_flags(0.6)
    assert plain == ("--mem-fraction-static", "0.6", "--max-running-requests", "512", "--disable-custom-all-reduce")
    monkeypatch.setattr(bench, "SPECULATIVE", "mtp")
    assert bench.bench_flags(0.6) == (*plain, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                                      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
    monkeypatch.setattr(bench, "SERVER_CONFIG", "eager")
    assert bench.bench_flags(0.6)[-8:-6] == ("--speculative-algorithm", "EAGLE")


def test_speculative_mtp_without_an_mtp_layer_is_refused_before_any_engine_starts(bench, monkeypatch, capsys, tiny_ckpt,
                                                                                   tmp_path):
    import shutil

    from slime.checkpoints.mtp import write_mtp_layer

    ran = []
    monkeypatch.setattr(bench, "throughput", lambda args: ran.append(args.speculative))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["throughput", "--model", str(tiny_ckpt), "--speculative", "mtp"])
    assert exit_info.value.code == 2 and not ran
    assert "--speculative mtp" in capsys.readouterr().err
    with_mtp = tmp_path / "tiny-mtp"
    shutil.copytree(tiny_ckpt, with_mtp)
    write_mtp_layer(with_mtp)
    bench.main(["throughput", "--model", str(with_mtp), "--speculative", "mtp"])
    bench.main(["throughput", "--model", str(tiny_ckpt)])
    assert ran == ["mtp", "none"]


def test_the_engines_answers_meta_info_is_kept_for_the_acceptance_figures(bench, fake_engines):
    """record_spec_meta keeps every answer's completion_tokens (and spec_* fields: none without speculative
    decoding, so no acceptance figure), whichever way the requests reach the server, once each."""
    params = bench.BenchSamplingParams(max_new_tokens=4, temperature=1.0)
    requests = [GenerateRequest(f"p{i} w", [], params, rid=f"m{i}") for i in range(6)]
    actor = fake_engines.actors[0]
    ray.get(actor.__ray_call__.remote(bench.record_spec_meta))
    ray.get(actor.__ray_call__.remote(bench.record_spec_meta))  # idempotent: still one record per answer
    fake_engines.generate(requests)
    ray.get(actor.__ray_call__.remote(bench.generate_in_actor, requests, 3))
    kept = ray.get(actor.__ray_call__.remote(bench.take_spec_meta))
    assert [m["completion_tokens"] for m in kept] == [4] * 12
    assert ray.get(actor.__ray_call__.remote(bench.take_spec_meta)) == []  # taken
    fake_engines.generate(requests[:2])
    assert bench.engine_acceptance(fake_engines) is None  # answers without spec_* fields
