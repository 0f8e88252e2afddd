#!/usr/bin/env python
"""SGLang benchmarks on one GPU with a real-width scaled Qwen3.5-MoE (issue 11, acceptance 4 and 5).

  python scripts/bench/sglang_rollout_bench.py throughput --model DIR [--prompts 64 --max-new-tokens 256]
  python scripts/bench/sglang_rollout_bench.py weight-sync --model DIR [--bucket-mb 512 1024 2048 4096 --syncs 3]

``DIR``: the real-width scaled checkpoint (``python scripts/tools/make_scaled_qwen35.py`` prints its cached folder;
:mod:`slime.checkpoints.scaled_qwen35`).

``throughput``: the same geo3k prompts (text + image, one sample each, ``--max-new-tokens`` tokens sampled at
temperature 1 with ``ignore_eos``, output log-probs returned: the rollout's work) through

1. SGLang through slime's engine: Ray, :class:`slime.ray.engine_group.RolloutEngineGroup` over one
   :class:`slime.rollout.engines.sglang.engine.SGLangEngine` (HTTP, batched ``/generate`` calls of
   ``--requests-per-call`` requests, ``capacity`` at once); then, on the same warm server, for each ``N`` of
   ``--direct-requests-per-call`` (default 1 8 32), the requests in calls of ``N`` from a thread pool inside the
   engine's actor, every call of a pass in flight at once up to ``--capacity`` requests (no Ray call per call,
   no engine group): ``same_server_calls_of_<N>``, with ``tokens_per_s``, ``seconds``, ``passes_s``, ``calls``
   and ``calls_at_once``, and a summary line each (with ours / it).  ``N = 1`` is one HTTP call per request,
   the figure of runs 4 to 7, also written under its old name ``same_server_one_http_call_per_request`` (the
   same figures); ``N = --requests-per-call`` is the group's own calls without the group;
2. SGLang alone: ``sglang.Engine`` in this process, one batched ``generate`` call per pass, timed as
   ``sglang.bench_offline_throughput`` times it (its ``throughput_test_once``: wall time of the batch, output
   tokens from ``meta_info.completion_tokens``), with ``return_logprob=True`` (the same work as 1) and once
   without; the CLI itself takes no images, so the batch is made here.  It runs after Ray has stopped:
   ``sglang.Engine.shutdown`` kills every child process of its caller;
3. the transformers engine (:class:`slime.rollout.engines.hf_engine.TransformersEngine`, bf16, batches of 32);
4. with ``--official-cli``, last, ``python -m sglang.bench_offline_throughput`` itself (a subprocess) on its
   synthetic text dataset (``generated-shared-prefix``, 64 prompts, 256 output tokens) with the same server
   flags, for reference (text only, so not the same work);

and prints output tokens/s for each and the ratios ours / SGLang alone (goal >= 0.9) and SGLang / transformers.
``--speculative mtp`` adds upstream's four speculative flags (EAGLE drafting with the MTP layer) to every SGLang
contender and reports each one's acceptance (``spec``: :func:`spec_acceptance` of every request's ``meta_info``;
ours through :func:`record_spec_meta` in the engine's actor).
Every contender first runs the whole set once untimed (kernels compiled and autotuned for its batch shapes,
which the Triton cache on disk would otherwise hand to whichever runs second), then ``--repeats`` timed passes
(the median is reported, every pass's seconds beside it), SGLang's prefix cache flushed before each.  SGLang
alone runs without slime's server plugin, so without the multimodal-RoPE fix (its image positions are wrong;
the fix's cost is one native rotary path in the full-attention layers).
A contender that fails leaves ``{"error": ...}`` and the others' figures.

``weight-sync``: full colocated syncs of the model's weights into a running SGLang engine through slime's
CUDA-IPC transport and the real trainer group (one rank holding the checkpoint's tensors in bf16 on the GPU,
:class:`BenchWeightsBackend`): one sync to connect, then ``--syncs`` for each ``--bucket-mb`` size; prints
seconds and effective GB/s (bytes of the model / sync seconds; goal >= 50 GB/s), where the best sync's time went
on the trainer rank (flattening, IPC handles, the rest: the engine's load and the per-bucket collectives), and
checks that a greedy answer is the same after the syncs as before.  The transport sends each MoE layer's experts
as two fused tensors (:mod:`slime.weight_sync.fused_experts`; first proven to load: negated experts change the
answer, the originals bring it back), which slime's server plugin copies into each ``FusedMoE`` layer in a few
slice copies (:mod:`slime.rollout.engines.sglang.expert_load`); each figure carries what the engine's loader did
(``engine_expert_load``: fused tensors fast-loaded, SGLang ``load_weights`` calls and their Python seconds per
sync, the reasons SGLang's loader took a tensor).  With ``--per-expert`` (default) the sweep runs again with the
3 x E tensors per layer of the checkpoint's names, and with ``--compare-sglang-expert-load`` (default), last, the
server is restarted with ``SLIME_SGLANG_FAST_EXPERT_LOAD=0`` and the fused form timed at the largest bucket size
with SGLang's own per-expert loading of fused tensors (``fused_sglang_loader``), side by side.

Figures go to stdout and, with ``--json FILE``, as JSON lines into FILE.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from slime.backends.train_metrics import DataParallel  # noqa: E402
from slime.rollout.engines.base import GenerateRequest, SamplingParams  # noqa: E402
from scripts.harness.sglang_gpu import (  # noqa: E402
    START_TIMEOUT_S,
    SharedGpuPlacement,
    figure,
    generate_in_actor,
    load_checkpoint_tensors,
    server_flags,
)

DATA = ROOT / "examples" / "geo3k_vlm" / "data"


# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass
class BenchSamplingParams(SamplingParams):
    """The rollout's sampling params plus SGLang's ``ignore_eos`` (every response is ``max_new_tokens`` long)."""

    ignore_eos: bool = True


def geo3k_requests(model: str, prompts: int, max_new_tokens: int) -> list[GenerateRequest]:
    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor

    cfg = parse_args(["--hf-checkpoint", model, "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "transformers", "--rollout-num-gpus", "1", "--input-key", "problem",
                      "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    dataset = PromptDataset(cfg.data, load_processor(model), seed=0)
    params = BenchSamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    samples = [dataset.make_sample(row) for row in range(min(prompts, dataset.num_rows))]
    while len(samples) < prompts:  # more prompts than rows: repeat them
        samples.append(samples[len(samples) % dataset.num_rows])
    return [GenerateRequest(s.prompt, s.images, params, rid=f"p{i}") for i, s in enumerate(samples)]


# ----------------------------------------------------------------------------- throughput


def _start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False)


def timed_passes(run, repeats: int, flush=None) -> dict:
    """``repeats`` timed calls of ``run()`` (which returns its output token count), ``flush()`` before each:
    ``tokens``, the median wall ``seconds`` and its ``tokens_per_s``, and every pass's seconds (``passes_s``).
    One pass is too noisy to compare contenders (the H200s' decode rate moved by 30 % within one pass)."""
    times, tokens = [], 0
    for _ in range(repeats):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "passes_s": times}


ONE_CALL_PER_REQUEST = "same_server_one_http_call_per_request"
"""The name of the ``same_server_calls_of_1`` figures in runs 4 to 7, still written beside it (an alias)."""


def same_server_sweep(engines, requests, sizes: list[int], repeats: int,
                      group_tokens_per_s: float | None = None) -> dict:
    """On the warm server of ``engines``' engine 0, for each ``N`` of ``sizes``: ``repeats`` timed passes of the
    requests in calls of ``N`` from inside the engine's actor (:func:`scripts.harness.sglang_gpu.generate_in_actor`:
    all calls of a pass in flight at once, at most the engine's capacity of requests; one Ray call per pass), the
    prefix cache flushed before each.  No untimed pass per ``N``: the server is warm from the group's passes, and
    the median absorbs a first pass that meets new batch shapes.

    Returns:
        ``{"same_server_calls_of_<N>": {"tokens", "seconds", "tokens_per_s", "passes_s", "calls",
        "calls_at_once"}}`` (:func:`timed_passes`'s figures; ``tokens`` of the last pass), and
        :data:`ONE_CALL_PER_REQUEST` with the same figures as ``same_server_calls_of_1`` when 1 is in ``sizes``.
        Prints one summary line per ``N`` (with ours / it, given ``group_tokens_per_s``).

    Raises:
        ValueError: an ``N`` below 1 or above the engine's capacity (calls of ``N`` could not all be in flight).
    """
    import ray

    actor = engines.actors[0]
    capacity = engines.capacities[0]
    bad = [n for n in sizes if not 1 <= n <= capacity]
    if bad:
        raise ValueError(f"--direct-requests-per-call {bad}: each must be in 1..{capacity} (the engine's capacity, "
                         "--capacity)")
    figures = {}
    for n in dict.fromkeys(sizes):  # in the given order, once each
        last = {}

        def one_pass(n=n, last=last) -> int:
            last.update(ray.get(actor.__ray_call__.remote(generate_in_actor, requests, n)))
            return last["tokens"]

        engine_acceptance(engines)  # what came before
        result = timed_passes(one_pass, repeats, engines.flush_cache)
        result.update(calls=last["calls"], calls_at_once=last["calls_at_once"], spec=engine_acceptance(engines))
        figures[f"same_server_calls_of_{n}"] = result
        ratio = f"; ours / this {group_tokens_per_s / result['tokens_per_s']:.3f}" if group_tokens_per_s else ""
        print(f"same server, calls of {n} request(s) from the engine actor ({result['calls']} calls, "
              f"{result['calls_at_once']} at once): {result['tokens_per_s']:.0f} output tok/s, median "
              f"{result['seconds']:.2f} s of passes {', '.join(f'{t:.2f}' for t in result['passes_s'])} s{ratio}",
              flush=True)
    if "same_server_calls_of_1" in figures:
        figures[ONE_CALL_PER_REQUEST] = figures["same_server_calls_of_1"]
    return figures


SERVER_CONFIG = "eager"
"""``--server-config``: ``defaults`` (SGLang's defaults, :data:`~scripts.harness.sglang_gpu.LAUNCHER_FLAGS`) or
``eager`` (:data:`~scripts.harness.sglang_gpu.EAGER_FLAGS`: triton, no CUDA graph; the benchmarks' configuration
before issue 24)."""
SPECULATIVE = "none"
"""``--speculative``: ``none``, or ``mtp``: upstream's speculative decoding with the checkpoint's MTP layer
(:data:`slime.rollout.engines.sglang.config.MTP_SPECULATIVE_FLAGS`) on every SGLang contender."""


def bench_flags(mem_fraction: float) -> tuple[str, ...]:
    """SGLang server flags of every contender, by :data:`SERVER_CONFIG` and :data:`SPECULATIVE`."""
    from slime.rollout.engines.sglang.config import MTP_SPECULATIVE_FLAGS

    flags = server_flags(mem_fraction, eager=SERVER_CONFIG == "eager")
    return (*flags, *MTP_SPECULATIVE_FLAGS) if SPECULATIVE == "mtp" else tuple(flags)


def spec_acceptance(meta_infos: list[dict]) -> dict | None:
    """Speculative decoding's figures over requests, from SGLang 0.5.17's per-request ``meta_info``
    (``tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``: ``spec_verify_ct`` verify steps,
    ``spec_num_correct_drafts`` of ``spec_num_proposed_drafts`` draft tokens accepted), token-weighted:
    ``accept_length`` = output tokens / verify steps (the bonus token included, so 1 when no draft is accepted and
    at most ``--speculative-num-draft-tokens``), ``accept_rate`` = accepted / proposed drafts, ``verify_steps``.
    None when no request carries them (speculative decoding off)."""
    spec = [m for m in meta_infos if m.get("spec_verify_ct")]
    if not spec:
        return None
    verify = sum(m["spec_verify_ct"] for m in spec)
    proposed = sum(m.get("spec_num_proposed_drafts", 0) for m in spec)
    return {"accept_length": sum(m["completion_tokens"] for m in spec) / verify,
            "accept_rate": sum(m.get("spec_num_correct_drafts", 0) for m in spec) / proposed if proposed else None,
            "verify_steps": verify, "requests": len(spec)}


def record_spec_meta(actor) -> None:
    """On an SGLang engine's actor: from now on keep ``completion_tokens`` and the ``spec_*`` fields of the
    ``meta_info`` of every ``/generate`` answer (slime's engine drops them), for :func:`take_spec_meta`."""
    client = actor.engine.client
    if getattr(client, "bench_spec_meta", None) is not None:
        return
    client.bench_spec_meta = []
    original = client.generate

    def generate(payload):
        body = original(payload)
        for item in body if isinstance(body, list) else [body]:
            meta = item.get("meta_info") or {}
            client.bench_spec_meta.append({k: v for k, v in meta.items()
                                           if k.startswith("spec_") or k == "completion_tokens"})
        return body

    client.generate = generate


def take_spec_meta(actor) -> list[dict]:
    """On an SGLang engine's actor: the figures :func:`record_spec_meta` kept since the last call (and reset); [] when
    it was not called."""
    client = actor.engine.client
    meta = list(getattr(client, "bench_spec_meta", None) or [])
    if meta:
        client.bench_spec_meta = []
    return meta


def engine_acceptance(engines) -> dict | None:
    """:func:`spec_acceptance` of the requests engine 0 answered since the last call (after :func:`record_spec_meta`)."""
    import ray

    return spec_acceptance(ray.get(engines.actors[0].__ray_call__.remote(take_spec_meta)))


def ours(model: str, requests, mem_fraction: float, capacity: int, requests_per_call: int, out: Path,
         repeats: int, direct_requests_per_call: list[int]) -> dict:
    import ray

    from slime.arguments import parse_args
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.rollout.engines.sglang.engine import SGLangEngine
    _start_ray()
    cfg = parse_args(["--hf-checkpoint", model, "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--sglang-server-concurrency",
                      str(capacity), "--sglang-requests-per-call", str(requests_per_call), "--output-dir",
                      str(out / "ours"), *("--sglang-" + f[2:] if f.startswith("--") else f
                                           for f in bench_flags(mem_fraction))])  # the server's log there
    engines = RolloutEngineGroup(SharedGpuPlacement([["0"]]), functools.partial(SGLangEngine.from_spec,
                                                               cfg.engine_spec(SGLangEngine.parity_check)),
                                 SGLangEngine.max_concurrent_calls)
    try:
        t0 = time.monotonic()
        engines.wait_until_healthy(START_TIMEOUT_S)
        start_s = time.monotonic() - t0
        ray.get(engines.actors[0].__ray_call__.remote(record_spec_meta))
        engines.generate(requests)  # warm-up: every prompt once (Triton JIT and autotuning, the image cache)
        engine_acceptance(engines)  # not the warm-up's
        result = timed_passes(lambda: sum(len(o.output_ids) for o in engines.generate(requests)), repeats,
                              engines.flush_cache)
        result["spec"] = engine_acceptance(engines)  # over the timed passes (None without speculative decoding)
        direct = same_server_sweep(engines, requests, direct_requests_per_call, repeats, result["tokens_per_s"])
    finally:
        engines.shutdown()
        ray.shutdown()  # sglang.Engine's shutdown (sglang_alone) kills every child process of this one, Ray's too
    return {**result, "start_s": start_s, **direct}


def sglang_alone(model: str, requests, mem_fraction: float, repeats: int) -> dict:
    import sglang

    kwargs = {}
    flags = list(bench_flags(mem_fraction))
    while flags:  # the same server flags as keyword arguments of sglang.Engine
        name = flags.pop(0)[2:].replace("-", "_")
        kwargs[name] = True if not flags or flags[0].startswith("--") else _number(flags.pop(0))
    t0 = time.monotonic()
    # log_level "info": its decode-batch lines (running requests, tokens/s) sit beside our server's in the logs
    engine = sglang.Engine(model_path=model, random_seed=0, log_level="info", **kwargs)
    start_s = time.monotonic() - t0
    try:
        params = [r.sampling_params.to_sglang() for r in requests]
        engine.generate(prompt=[r.text for r in requests], image_data=[r.image_data for r in requests],
                        sampling_params=params, return_logprob=True)  # warm-up, as for our engine
        last: dict = {}

        def run(logprobs: bool) -> int:
            out = engine.generate(prompt=[r.text for r in requests], image_data=[r.image_data for r in requests],
                                  sampling_params=params, return_logprob=logprobs)
            last["spec"] = spec_acceptance([o["meta_info"] for o in out])
            return sum(o["meta_info"]["completion_tokens"] for o in out)

        runs = {}
        for logprobs in (True, False):
            runs[logprobs] = timed_passes(lambda: run(logprobs), repeats, engine.flush_cache)
            runs[logprobs]["spec"] = last.get("spec")  # the last pass's (None without speculative decoding)
    finally:
        engine.shutdown()
    return {**runs[True], "start_s": start_s, "without_log_probs": runs[False]}


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def transformers_engine(model: str, requests, batch: int) -> dict:
    from slime.rollout.engines.hf_engine import TransformersEngine

    engine = TransformersEngine(model, device="cuda", dtype=torch.bfloat16, max_batch_size=batch)
    plain = [dataclasses.replace(r, sampling_params=SamplingParams(
        max_new_tokens=r.sampling_params.max_new_tokens, temperature=1.0)) for r in requests]
    engine.generate(plain[:batch])  # warm-up: one full batch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = engine.generate(plain)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()
    tokens = sum(len(o.output_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def official_cli(model: str, mem_fraction: float, out_dir: Path) -> dict:
    import subprocess

    result = out_dir / "bench_offline_throughput.jsonl"
    # Its warm-up samples prompts from a ShareGPT file and downloads one when --dataset-path names none
    # (sglang/benchmark/datasets/random.py); offline, a small file of that format stands in.
    warmup = out_dir / "bench_offline_throughput_warmup_sharegpt.json"
    warmup.write_text(json.dumps([{"conversations": [
        {"value": f"Triangle {i} has sides {i + 3}, {i + 4} and {i + 5}. Find its area, showing each step."},
        {"value": "Heron's formula gives the area from the three sides."}]} for i in range(64)]))
    command = [sys.executable, "-m", "sglang.bench_offline_throughput", "--model-path", model,
               "--dataset-name", "generated-shared-prefix", "--dataset-path", str(warmup), "--gsp-num-groups", "8",
               "--gsp-prompts-per-group", "8", "--gsp-output-len", "256", "--result-filename", str(result),
               *bench_flags(mem_fraction)]
    done = subprocess.run(command, capture_output=True, text=True)
    (out_dir / "bench_offline_throughput.log").write_text(done.stdout + done.stderr)
    if done.returncode or not result.exists():
        return {"exit_code": done.returncode}
    return json.loads(result.read_text().splitlines()[-1])


def _attempt(name: str, run, *args) -> dict:
    """``run(*args)``, or ``{"error": ...}`` with the traceback printed: one failing contender (a device call is
    expensive) still leaves the others' figures."""
    import traceback

    try:
        result = run(*args)
        figure(check="throughput_part", contender=name, **result)  # on record even if a later contender hangs
        return result
    except Exception as e:  # noqa: BLE001 - reported in the figures and on stderr
        traceback.print_exc()
        print(f"{name}: FAILED ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def throughput(args) -> None:
    global SERVER_CONFIG, SPECULATIVE
    SERVER_CONFIG, SPECULATIVE = args.server_config, args.speculative
    requests = geo3k_requests(args.model, args.prompts, args.max_new_tokens)
    figures = {"prompts": len(requests), "max_new_tokens": args.max_new_tokens, "server_config": SERVER_CONFIG,
               "speculative": SPECULATIVE, "server_flags": list(bench_flags(args.mem_fraction))}
    if "ours" in args.contenders:
        figures["ours"] = _attempt("ours", ours, args.model, requests, args.mem_fraction, args.capacity,
                                   args.requests_per_call, Path(args.out), args.repeats, args.direct_requests_per_call)
    if "sglang_alone" in args.contenders:  # after Ray has stopped: sglang.Engine.shutdown() kills our children
        figures["sglang_alone"] = _attempt("sglang_alone", sglang_alone, args.model, requests, args.mem_fraction,
                                           args.repeats)
    if "transformers" in args.contenders:
        figures["transformers"] = _attempt("transformers", transformers_engine, args.model, requests, args.hf_batch)
    if args.official_cli:  # last: for reference only (text prompts, not the same work)
        figures["official_cli_text_only"] = _attempt("official_cli", official_cli, args.model, args.mem_fraction,
                                                     Path(args.out))
    speed = {name: figures.get(name, {}).get("tokens_per_s") for name in ("ours", "sglang_alone", "transformers")}
    if speed["ours"] and speed["sglang_alone"]:
        figures["ours_over_sglang"] = speed["ours"] / speed["sglang_alone"]
    if speed["sglang_alone"] and speed["transformers"]:
        figures["sglang_over_transformers"] = speed["sglang_alone"] / speed["transformers"]
    _emit(args, "throughput", figures)


# ----------------------------------------------------------------------------- weight sync


class BenchWeightsBackend:
    """A trainer rank that holds the checkpoint's tensors in bf16 on its GPU and yields them in buckets of about
    ``bucket_bytes`` (checkpoint order); nothing to train.  For the weight-sync benchmark only."""

    def __init__(self, rank_info, model: str):
        self.rank_info, self.model_path = rank_info, model
        self.tensors: dict[str, torch.Tensor] = {}
        self.phase_s: dict[str, float] = {}
        self.buckets: list[tuple[int, int, float]] = []  # (tensors, bytes, seconds the transport spent on it)
        self.sent = {"names": 0, "fused_names": 0}  # bucket metadata entries the engine got, fused ones among them

    def init(self) -> int:
        import torch.distributed as dist

        from slime.weight_sync import cuda_ipc

        info = self.rank_info
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                rank=info.rank, world_size=info.world_size)
        self.tensors = load_checkpoint_tensors(self.model_path)
        self.dp = DataParallel(info.rank, info.world_size)  # what the trainer group reads after init
        # where a sync's time goes, on this rank: the transport's own steps, timed in place (this process only)
        for name in ("flatten", "serialize_ipc_bucket"):
            setattr(cuda_ipc, name, self._timed(name, getattr(cuda_ipc, name)))
        cuda_ipc.fused_layout = self._counted(cuda_ipc.fused_layout)
        return 0

    def _counted(self, fused_layout):
        def counted(*args, **kwargs):
            ordered, metadata, total = fused_layout(*args, **kwargs)
            self.sent["names"] += len(metadata)
            self.sent["fused_names"] += sum(m.name.endswith((".gate_up_proj", ".down_proj")) for m in metadata)
            return ordered, metadata, total
        return counted

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if name == "flatten":
                torch.cuda.synchronize()
            self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0
            return out
        return timed

    def take_stats(self) -> dict:
        """The last sync's breakdown (and reset): per bucket, the seconds from handing it to the transport to
        being asked for the next; the flatten and IPC-handle parts of that; the rest is waiting for the engine's
        load (one ``/update_weights_from_tensor`` round trip per bucket, overlapped with making the next bucket)
        and the per-bucket collectives."""
        total = sum(b[2] for b in self.buckets)
        stats = {"buckets": len(self.buckets), "tensors": sum(b[0] for b in self.buckets),
                 "transport_s": total, **{f"{k}_s": v for k, v in self.phase_s.items()},
                 "engine_and_collectives_s": total - sum(self.phase_s.values()),
                 "slowest_bucket": max(self.buckets, key=lambda b: b[2], default=None),
                 "names_sent": self.sent["names"], "fused_names_sent": self.sent["fused_names"]}
        self.phase_s, self.buckets, self.sent = {}, [], {"names": 0, "fused_names": 0}
        return stats

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def iter_weight_buckets(self, bucket_bytes, device=None):
        """Buckets of whole layers, as the real backends cut them (``slime.weight_sync.buckets.bucket_by_bytes``'s
        rule over :func:`weight_groups`): a bucket closes at the first group boundary at or past ``bucket_bytes``."""
        from slime.weight_sync.buckets import bucket_by_bytes

        for bucket in bucket_by_bytes(weight_groups(list(self.tensors.items())), bucket_bytes):
            t0 = time.perf_counter()
            yield bucket
            self.buckets.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket),
                                 time.perf_counter() - t0))

    def train(self, rollout_id, samples, num_steps):
        raise NotImplementedError

    def compute_log_probs(self, samples):
        raise NotImplementedError

    def save(self, rollout_id, path):
        raise NotImplementedError


def weight_groups(named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one decoder layer or vision block (``...layers.<i>.`` / ``...blocks.<i>.``) as one
    group, every other tensor a group of its own: the units the real backends never split between buckets."""
    import re

    unit = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")
    groups, key = [], object()
    for name, tensor in named:
        match = unit.match(name)
        this = match.group(1) if match else None
        if this is None or this != key:
            groups.append([])
        groups[-1].append((name, tensor))
        key = this if this is not None else object()
    return groups


class _BenchPlacement(SharedGpuPlacement):
    """One colocated engine and one trainer rank on GPU 0 (the trainer takes Ray's GPU, so it sees its id)."""

    use_gpu, colocate, num_trainers, num_engines = True, True, 1, 1

    def __init__(self):
        super().__init__([["0"]], colocated=True)

    def trainer_options(self, rank: int) -> dict:
        return {"num_cpus": 0, "num_gpus": 0.5}


def weight_sync(args) -> None:
    import ray

    from slime.arguments import parse_args
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.ray.trainer_group import TrainerGroup
    from slime.rollout.engines.sglang.engine import SGLangEngine
    from slime.rollout.engines.sglang.server_plugin import FAST_EXPERT_LOAD_ENV
    from slime.weight_sync.cuda_ipc import CudaIpcTransport
    from slime.weight_sync.fused_experts import checkpoint_num_experts
    from scripts.harness.sglang_gpu import sglang_argv

    _start_ray()
    cfg = parse_args(["--hf-checkpoint", args.model, "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "sglang", "--colocate", "--output-dir", str(Path(args.out) / "weight-sync"),
                      *sglang_argv(args.mem_fraction, eager=True)])  # the server's log there
    placement = _BenchPlacement()
    engines = RolloutEngineGroup(placement, functools.partial(SGLangEngine.from_spec,
                                                               cfg.engine_spec(SGLangEngine.parity_check)),
                                 SGLangEngine.max_concurrent_calls)
    transport = CudaIpcTransport(args.bucket_mb[0] << 20, num_experts=checkpoint_num_experts(args.model))
    trainers = TrainerGroup(placement, functools.partial(BenchWeightsBackend, model=args.model), 1, transport)
    try:
        engines.wait_until_healthy(START_TIMEOUT_S)
        trainers.init()
        nbytes = ray.get(trainers.actors[0].__ray_call__.remote(lambda a: a.backend.nbytes()))
        prompt = [GenerateRequest("the area of the triangle is", [], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                                     top_k=1), rid="greedy")]
        before = engines.generate(prompt)[0]
        actor = trainers.actors[0]
        t0 = time.perf_counter()
        trainers.update_weights(engines)  # the first sync also connects the transport
        first_s = time.perf_counter() - t0
        ray.get(actor.__ray_call__.remote(lambda a: a.backend.take_stats()))
        variants = [("fused", mb) for mb in args.bucket_mb]  # what slime sends (the checkpoint's expert count)
        if args.per_expert:
            variants += [("per_expert", mb) for mb in args.bucket_mb]
        if args.compare_sglang_expert_load:  # last: SGLang's own per-expert loader of fused tensors, a new server
            variants.append(("fused_sglang_loader", max(args.bucket_mb)))
        fused_loads = None
        for expert_format, bucket_mb in variants:
            experts = checkpoint_num_experts(args.model) if expert_format != "per_expert" else None
            bucket_bytes = bucket_mb << 20
            transport.bucket_bytes, transport.num_experts = bucket_bytes, experts  # the driver's copy, and the rank's
            ray.get(actor.__ray_call__.remote(
                lambda a, n=bucket_bytes, e=experts: (setattr(a.transport, "bucket_bytes", n),
                                                      setattr(a.transport, "num_experts", e))))
            if expert_format == "fused_sglang_loader":  # the transport set first: the warm-up sync is this form
                _restart_engine(engines, {FAST_EXPERT_LOAD_ENV: "0"})
                trainers.update_weights(engines)  # one sync to warm the new server's load path, untimed
                ray.get(actor.__ray_call__.remote(lambda a: a.backend.take_stats()))  # not in the timed figures
            if expert_format == "fused" and fused_loads is None:
                ray.get(actor.__ray_call__.remote(lambda a: a.backend.take_stats()))  # count from here
                fused_loads = _fused_experts_load(trainers, engines, prompt, before)
                sent = ray.get(actor.__ray_call__.remote(lambda a: a.backend.take_stats()))["fused_names_sent"]
                fused_loads = fused_loads and sent > 0  # the transport really sent fused tensors in those syncs
            times, breakdown = [], []
            loads_before = _engine_expert_load(engines)
            for _ in range(args.syncs):
                t0 = time.perf_counter()
                trainers.update_weights(engines)
                times.append(time.perf_counter() - t0)
                breakdown.append(ray.get(actor.__ray_call__.remote(lambda a: a.backend.take_stats())))
            engine_load = _expert_load_delta(loads_before, _engine_expert_load(engines), args.syncs)
            after = engines.generate(prompt)[0]
            best = min(times)
            _emit(args, "weight_sync", {
                "expert_format": expert_format, "bytes": nbytes, "gb": nbytes / 1e9, "bucket_mb": bucket_mb,
                "sync_s": times, "best_s": best,
                "gb_per_s": nbytes / 1e9 / best, "first_sync_s_with_connect": first_s,
                "breakdown_of_best": breakdown[times.index(best)], "engine_expert_load": engine_load,
                "same_answer_after_sync": before.output_ids == after.output_ids,
                "same_log_probs_after_sync": before.output_log_probs == after.output_log_probs,
                **({"fused_experts_load": fused_loads} if expert_format == "fused" else {}),
            })  # fmt: skip
    finally:
        trainers.shutdown()
        engines.shutdown()


def _read_expert_loads(actor) -> list[dict]:
    """On the engine actor: the ``expert_load`` figures of the server plugin's scheduler reports, one per TP rank."""
    from slime.rollout.engines.sglang.server_plugin import read_reports

    return [r.get("expert_load") or {} for r in read_reports(actor.engine.report_dir) if not r.get("main")]


def _sum_expert_loads(loads: list[dict]) -> dict:
    """Per-rank ``expert_load`` figures (:class:`slime.rollout.engines.sglang.expert_load.ExpertLoadStats`) summed."""
    total = {"fast": 0, "load_weights_calls": 0, "load_weights_s": 0.0, "declined": {}, "disabled": None}
    for load in loads:
        for key in ("fast", "load_weights_calls", "load_weights_s"):
            total[key] += load.get(key, 0)
        for reason, count in (load.get("declined") or {}).items():
            total["declined"][reason] = total["declined"].get(reason, 0) + count
        total["disabled"] = total["disabled"] or load.get("disabled")
    return total


def _engine_expert_load(engines) -> dict:
    """The engine's expert-load figures now (:func:`_read_expert_loads`, :func:`_sum_expert_loads`)."""
    import ray

    return _sum_expert_loads(ray.get(engines.actors[0].__ray_call__.remote(_read_expert_loads)))


def _expert_load_delta(before: dict, after: dict, syncs: int) -> dict:
    """What the engine's loader did in ``syncs`` syncs, per sync: fused tensors fast-loaded, ``load_weights`` calls
    and their wall seconds (SGLang's Python loading; the GPU copies are waited for after it), the reasons
    SGLang's loader took a fused tensor, and whether the fast path switched itself off."""
    return {"fast_per_sync": (after["fast"] - before["fast"]) / syncs,
            "load_weights_calls_per_sync": (after["load_weights_calls"] - before["load_weights_calls"]) / syncs,
            "load_weights_s_per_sync": (after["load_weights_s"] - before["load_weights_s"]) / syncs,
            "declined": {r: n - before["declined"].get(r, 0) for r, n in after["declined"].items()
                         if n > before["declined"].get(r, 0)},
            "disabled": after["disabled"]}


def _restart_engine(engines, env: dict[str, str]) -> None:
    """Restart the engine's server with ``env`` on top of its environment, and wait until it is healthy."""
    import ray

    def restart(actor):
        actor.engine._env_overrides.update(env)
        actor.engine.restart()

    ray.get(engines.actors[0].__ray_call__.remote(restart))
    engines.wait_until_healthy(START_TIMEOUT_S)


def _negate_experts(actor) -> int:
    """On the trainer actor: negate every routed expert's tensor in place (twice is the identity)."""
    from slime.weight_sync.fused_experts import EXPERT_WEIGHT

    tensors = [t for n, t in actor.backend.tensors.items() if EXPERT_WEIGHT.match(n)]
    for tensor in tensors:
        tensor.neg_()
    return len(tensors)


def _fused_experts_load(trainers, engines, prompt, before) -> bool:
    """Whether the engine really loads the fused expert form: the greedy answer changes after a (fused) sync of
    negated experts, and is ``before`` again after the original ones (SGLang's fused loader skips a name it does
    not know without an error, so an unchanged answer alone would prove nothing)."""
    import ray

    actor = trainers.actors[0]
    ray.get(actor.__ray_call__.remote(_negate_experts))
    trainers.update_weights(engines)
    negated = engines.generate(prompt)[0]
    ray.get(actor.__ray_call__.remote(_negate_experts))
    trainers.update_weights(engines)
    restored = engines.generate(prompt)[0]
    return negated.output_ids != before.output_ids and restored.output_ids == before.output_ids


def _emit(args, check: str, figures: dict) -> None:
    figure(check=check, **figures)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"check": check, **figures}) + "\n")


def _at_least_one(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("throughput", "weight-sync"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--mem-fraction", type=float, default=0.6, help="SGLang --mem-fraction-static")
        p.add_argument("--json", default=None, help="append the figures to this JSON-lines file")
        p.add_argument("--out", default=".", help="folder for logs")
    tp = sub.choices["throughput"]
    tp.add_argument("--prompts", type=int, default=64)
    tp.add_argument("--max-new-tokens", type=int, default=256)
    tp.add_argument("--capacity", type=int, default=128, help="requests in flight at our engine")
    tp.add_argument("--requests-per-call", type=int, default=32,
                    help="our engine's --sglang-requests-per-call (requests in one batched /generate)")
    tp.add_argument("--direct-requests-per-call", type=_at_least_one, nargs="+", default=[1, 8, 32], metavar="N",
                    help="after ours, on the same server: calls of N requests from inside the engine's actor, all of a "
                    "pass at once (at most --capacity requests), --repeats passes each, for each N given (1 to "
                    "--capacity; 1: one HTTP call per request, reported also under its old name "
                    f"{ONE_CALL_PER_REQUEST})")
    tp.add_argument("--repeats", type=_at_least_one, default=3,
                    help="timed passes per SGLang contender (median reported), >= 1")
    tp.add_argument("--contenders", nargs="+", default=["ours", "sglang_alone", "transformers"],
                    choices=["ours", "sglang_alone", "transformers"],
                    help="which contenders run (always in the order ours, sglang_alone, transformers)")
    tp.add_argument("--hf-batch", type=int, default=32, help="the transformers engine's batch size")
    tp.add_argument("--official-cli", action="store_true", help="also run sglang.bench_offline_throughput (text)")
    tp.add_argument("--server-config", choices=["defaults", "eager"], default="defaults",
                    help="SGLang's defaults with the launcher's flags, or the triton eager flags of the GPU tests")
    tp.add_argument("--speculative", choices=["none", "mtp"], default="none",
                    help="mtp: upstream's speculative decoding with the checkpoint's MTP layer (--speculative-algorithm "
                    "EAGLE, 2 steps, top-1, 3 draft tokens) on every SGLang contender; acceptance lengths reported")
    ws = sub.choices["weight-sync"]
    ws.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                    help="--update-weight-buffer-size values to measure, MiB (one engine start for all)")
    ws.add_argument("--syncs", type=int, default=3)
    ws.add_argument("--compare-sglang-expert-load", action=argparse.BooleanOptionalAction, default=True,
                    help="last, restart the server with SLIME_SGLANG_FAST_EXPERT_LOAD=0 and time the fused form at the "
                         "largest --bucket-mb with SGLang's own per-expert loader (expert_format fused_sglang_loader)")
    ws.add_argument("--per-expert", action=argparse.BooleanOptionalAction, default=True,
                    help="also sync with every expert's tensors sent apart (3 per expert, the checkpoint's names: "
                    "slime's transport before it fused them), for comparison")
    args = parser.parse_args(argv)
    if args.command == "throughput":
        over = [n for n in args.direct_requests_per_call if n > args.capacity]
        if over:  # before the (minutes-long) engine start
            tp.error(f"--direct-requests-per-call {over}: at most --capacity {args.capacity} (a call's requests are "
                     "all in flight at the engine)")
    if args.command == "throughput" and args.speculative == "mtp":
        from slime.checkpoints.mtp import mtp_problem

        problem = mtp_problem(args.model)
        if problem:  # before the (minutes-long) engine start
            tp.error(f"--speculative mtp drafts with the checkpoint's MTP layer, but --model {args.model} has none: "
                     f"{problem} (scripts/tools/make_scaled_qwen35.py adds one unless --no-mtp)")
    if args.command == "throughput":
        throughput(args)
    else:
        weight_sync(args)


if __name__ == "__main__":
    main()
