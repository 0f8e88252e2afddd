"""Real SGLang (0.5.17) through the engine interface on one GPU, on the real-width scaled Qwen3.5-35B-A3B at SGLang's
defaults: geo3k prompts with their image and as text alone, the engine parity gate with the engine's routes replayed
(it passes the server as slime starts it and refuses one with the multimodal-RoPE bug), one batched call, the per-run
key, CUDA-IPC weight updates, and memory release/resume with CUDA graphs.  Needs CUDA and an installed sglang.

Checkpoint: :mod:`slime.checkpoints.scaled_qwen35` (the ``scaled_ckpt`` fixture: 4 layers, 128 experts, built once
per machine).  Two servers share the GPU, both with the launcher's flags (:data:`LAUNCHER_FLAGS`: FA3, CUDA graphs,
flashinfer sampling) and ``--enable-return-routed-experts``: ``fixed`` as slime starts it, and ``bug`` with
``SLIME_SGLANG_MROPE_FIX=0`` and ``--disable-cuda-graph`` (the fix-off configuration measured in
docs/results/h200_real_width.md; it starts in half the time).  The gate's trainer is the HF model in bf16 replaying
the engine's routes, its floor the same with one rounding step on its embeddings, judged with the flags' defaults
(docs/design/parity_gate.md); the HF model in float32 is the reference of the figures.  Expected from the H200
findings (issue 24): engine vs fp32 with the routes forced 0.015-0.018 image / 0.022-0.027 text with the fix, 0.038
image without.  ``SLIME_SGLANG_RECORD=FILE`` records the fixed server's exchanges (the CPU tests' fixture
``tests/fixtures/sglang_0.5.17_h200.jsonl``); ``SLIME_GPU_FIGURES=FILE`` collects the figures.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import os
from pathlib import Path

import pytest
import torch

from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.parity import GAP_FLOOR, EngineParityError, ParityGaps, verdict
from slime.weight_sync.fused_experts import checkpoint_num_experts
from scripts.harness.sglang_gpu import (
    HAVE_SGLANG,
    LAUNCHER_FLAGS,
    figure,
    hf_log_probs,
    load_checkpoint_tensors,
    route_agreement,
    start_engine,
    wait_healthy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang (the GPU profile)"),
]
DATA = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
TEMPERATURE = 1.0
MEM_FRACTION = 0.25
"""Of the GPU, per server: two servers, the HF model in float32 and bf16 and the checkpoint's tensors fit an H200."""
IPC_BUCKET_BYTES = 1 << 30
"""Buckets of about 1 GiB: some hold a whole MoE layer (805 MB of experts), sent fused as slime's transport sends
them, others split one, sent per expert."""


@pytest.fixture(scope="module")
def parity(scaled_ckpt):
    """(the run's parity flags, :class:`~slime.rollout.parity.EngineParityCheck` over geo3k's first rows with an
    image): the flags' defaults, 8 prompts with their image and the same 8 as text alone, 64 response tokens each."""
    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor
    from slime.rollout.parity import EngineParityCheck

    cfg = parse_args(["--hf-checkpoint", str(scaled_ckpt), "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "transformers", "--rollout-num-gpus", "1", "--input-key", "problem",
                      "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    dataset = PromptDataset(cfg.data, load_processor(str(scaled_ckpt)), seed=0)
    return cfg.parity, EngineParityCheck(cfg.parity, dataset, TEMPERATURE, enabled=True)


@pytest.fixture(scope="module")
def servers(scaled_ckpt, tmp_path_factory):
    """{"fixed": engine as slime starts it, "bug": engine with SLIME_SGLANG_MROPE_FIX=0}, both on GPU 0."""
    root = tmp_path_factory.mktemp("sglang")
    fixed = start_engine(scaled_ckpt, root / "fixed", mem_fraction=MEM_FRACTION, return_routed_experts=True)
    bug = start_engine(scaled_ckpt, root / "bug", mem_fraction=MEM_FRACTION, env={"SLIME_SGLANG_MROPE_FIX": "0"},
                       extra=("--disable-cuda-graph",), return_routed_experts=True)
    try:
        seconds = wait_healthy(fixed, bug)
        figure(check="sglang_start", seconds=round(seconds, 1), version=fixed.version, flags=list(LAUNCHER_FLAGS))
        if os.environ.get("SLIME_SGLANG_RECORD"):
            fixed.client.record = os.environ["SLIME_SGLANG_RECORD"]
        yield {"fixed": fixed, "bug": bug}
    finally:
        fixed.shutdown()
        bug.shutdown()


@pytest.fixture(scope="module")
def hf(scaled_ckpt):
    """{"fp32": the reference, "bf16": the gate's trainer}: the HF model on the GPU, its Gated DeltaNet on
    transformers' exact torch path (as in the findings' figures) unless this process imported it with fla before."""
    from slime.models.qwen3_5.build import transformers_qwen35_without_fla

    try:
        transformers_qwen35_without_fla()
        gdn = "torch"
    except RuntimeError:  # another test module of this session imported transformers' Qwen3.5 with fla first
        gdn = "fla"
    from transformers import AutoModelForImageTextToText

    models = {name: AutoModelForImageTextToText.from_pretrained(str(scaled_ckpt), dtype=dtype).cuda().eval()
              for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    figure(check="hf_models", gdn=gdn)
    return models


class _HfTrainer:
    """The gate's trainer side in this process: :meth:`slime.ray.trainer_group.TrainerGroup.compute_log_probs`'s
    signature over :func:`~scripts.harness.sglang_gpu.hf_log_probs` of one HF model."""

    def __init__(self, model):
        self.model = model

    def compute_log_probs(self, samples, rounding_noise: bool = False, replay_routes: bool = False):
        return hf_log_probs(self.model, samples, TEMPERATURE, replay_routes=replay_routes, rounding_noise=rounding_noise)


@dataclasses.dataclass
class _Gate:
    samples: list
    gaps: ParityGaps
    why: str | None
    free: ParityGaps  # the engine against HF float32 choosing its own routes
    forced: ParityGaps  # the engine against HF float32 with the engine's routes forced


def _gate(name: str, parity, hf, samples) -> _Gate:
    """The gate's verdict on ``samples`` (the image prompts' first, as the check's ``generate`` returns them) with the
    HF bf16 trainer replaying the engine's routes, and the figures: gaps, floors, each in units of its scale, the
    engine against HF float32 with and without its routes, the trainer against float32 (both replaying), and the
    share of positions per layer where the engine's top-8 equals float32's own choice."""
    cfg, check = parity
    assert check.replays_routes(samples, 0), f"{name}: the engine returned no routed experts"
    trainer = _HfTrainer(hf["bf16"])
    plain = trainer.compute_log_probs(samples, replay_routes=True)
    noisy = trainer.compute_log_probs(samples, rounding_noise=True, replay_routes=True)
    gaps, skipped = check.gaps(samples, plain, noisy)
    why = verdict(gaps, cfg.engine_parity_max_gap, cfg.engine_parity_max_ratio, cfg.engine_parity_floor_factor)
    own_routes = []
    free = hf_log_probs(hf["fp32"], samples, TEMPERATURE, routes_out=own_routes)
    forced = hf_log_probs(hf["fp32"], samples, TEMPERATURE, replay_routes=True)
    free_gaps, _ = check.gaps(samples, free, free)
    forced_gaps, _ = check.gaps(samples, forced, plain)  # floors: |bf16 trainer - fp32|, both replaying

    def units(gap: float, floor: float) -> float:
        return round(gap / max(floor, GAP_FLOOR), 3)

    figure(check="parity_gate", engine=name, verdict=why or "pass", **{k: round(v, 5) for k, v in gaps.metrics().items()},
           image_units=units(gaps.image, gaps.floor_image), text_units=units(gaps.text, gaps.floor_text),
           skipped_vision_token_responses=skipped,
           engine_vs_hf_fp32=dict(image=round(free_gaps.image, 5), text=round(free_gaps.text, 5)),
           engine_vs_hf_fp32_routes_forced=dict(image=round(forced_gaps.image, 5), text=round(forced_gaps.text, 5)),
           hf_bf16_vs_fp32_routes_forced=dict(image=round(forced_gaps.floor_image, 5),
                                              text=round(forced_gaps.floor_text, 5)),
           route_same_per_layer=route_agreement([s.rollout_routed_experts for s in samples], own_routes))
    return _Gate(samples, gaps, why, free_gaps, forced_gaps)


def test_the_parity_gate_with_routes_replayed_passes_the_fix_and_refuses_the_bug(servers, parity, hf):
    _, check = parity
    gates = {}
    for name, engine in servers.items():
        assert engine.version == "0.5.17"
        assert {r["mrope_fix"] for r in engine.reports if not r["main"]} == {"applied" if name == "fixed" else "disabled"}
        samples = check.generate(engine, 0)  # refuses a prompt length other than the data pipeline's
        assert all(s.response_length > 0 for s in samples)
        gates[name] = _gate(name, parity, hf, samples)
    fixed, bug = gates["fixed"], gates["bug"]
    assert fixed.why is None, fixed.gaps
    assert bug.why is not None and "multimodal-RoPE" in bug.why, bug.gaps
    # replaying the engine's routes takes the route flips out of its distance to the fp32 reference
    assert fixed.forced.image < fixed.free.image and fixed.forced.text < fixed.free.text, (fixed.forced, fixed.free)
    # the check's own comparison with this trainer: the same verdicts, routes replayed
    assert check.compare(_HfTrainer(hf["bf16"]), fixed.samples, 0)["parity/routes_replayed"] == 1.0
    with pytest.raises(EngineParityError, match="multimodal-RoPE"):
        check.compare(_HfTrainer(hf["bf16"]), bug.samples, 0)


def _with_response(sample, out):
    """A copy of ``sample`` with ``out``'s response tokens, log-probs and routed experts (every token trained on)."""
    s = sample.clone_prompt()
    s.response_token_ids, s.rollout_log_probs = list(out.output_ids), list(out.output_log_probs)
    s.rollout_routed_experts = out.routed_experts
    s.loss_mask = [1] * len(out.output_ids)
    return s


def _mixed_requests(images, texts, max_new_tokens: int, temperature: float):
    """(samples, requests): the image and text problems interleaved (image 0, text 0, image 1, ...), request ``i``
    with rid ``mixed-<i>``, each asking for its routed experts."""
    samples = [s for pair in zip(images, texts, strict=True) for s in pair]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    return samples, [GenerateRequest(s.prompt, s.images, params, rid=f"mixed-{i}", return_routed_experts=True)
                     for i, s in enumerate(samples)]


def test_one_batched_call_of_image_and_text_prompts_answers_each_request_in_order(servers, parity, hf, tmp_path):
    """The engine group's form since run 7: the gate's 8 image and 8 text problems interleaved in one batched
    ``/generate`` call (SGLang's list form, :func:`~slime.rollout.engines.sglang.generation.generate_batch_payload`).
    One output per request in request order (SGLang's ``meta_info.id`` names each), each prompt as long as the
    data pipeline made it, one log-prob per output token (read from SGLang's raw answer), and the parity gate
    passing on them as on single calls (the fixed server)."""
    cfg, check = parity
    engine = servers["fixed"]
    samples, requests = _mixed_requests(check.image_prompts, check.text_prompts, cfg.engine_parity_response_len,
                                        TEMPERATURE)
    assert len(requests) <= engine.max_requests_per_call, "the test needs the requests in one call"
    kept, engine.client.record = engine.client.record, tmp_path / "batched.jsonl"
    try:
        outputs = engine.generate(requests)
    finally:
        engine.client.record = kept
    lines = (tmp_path / "batched.jsonl").read_text().splitlines()
    if kept:  # the CPU tests' recording gets the batched exchange too
        with open(kept, "a") as f:
            f.writelines(line + "\n" for line in lines)
    exchanges = [json.loads(line) for line in lines]
    assert [(x["endpoint"], x["status"]) for x in exchanges] == [("/generate", 200)], "not one successful call"
    sent, answers = exchanges[0]["request"], exchanges[0]["response"]
    assert sent["text"] == [s.prompt for s in samples] and len(answers) == len(requests)
    assert sent["image_data"] == [list(s.images) for s in samples]  # [] for each text prompt
    assert [o.rid for o in outputs] == [r.rid for r in requests]
    assert [a["meta_info"]["id"].partition("#")[0] for a in answers] == [r.rid for r in requests]
    assert [o.prompt_tokens for o in outputs] == [len(s.prompt_token_ids) for s in samples], \
        "SGLang saw another prompt than the data pipeline"
    for out, answer in zip(outputs, answers):
        raw = answer["meta_info"]["output_token_logprobs"]  # [[log-prob, token id, text], ...]
        assert 0 < len(out.output_ids) <= cfg.engine_parity_response_len and out.finish_reason in ("stop", "length")
        assert [entry[1] for entry in raw] == answer["output_ids"] == out.output_ids
        assert out.output_log_probs == [entry[0] for entry in raw]
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.output_log_probs)
    done = [_with_response(s, o) for s, o in zip(samples, outputs)]
    gate = _gate("fixed_batched", parity, hf, done[0::2] + done[1::2])
    figure(check="batched_call", requests=len(requests), output_tokens=sum(len(o.output_ids) for o in outputs))
    assert gate.why is None, gate.gaps


def _greedy(engine, prompt: str) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of a 16-token greedy answer, the prefix cache flushed first: each answer computes its
    prompt afresh (at real width a prompt read from the cache can route a near-tie otherwise, which moves log-probs
    by up to ~0.1 nats)."""
    engine.flush_cache()
    out = engine.generate([GenerateRequest(prompt, [], SamplingParams(max_new_tokens=16, temperature=0.0, top_k=1))])[0]
    return out.output_ids, out.output_log_probs


def _max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def _status(engine, method: str, endpoint: str, body=None, key: str | None = None) -> int:
    conn = http.client.HTTPConnection(engine.client.host, engine.client.port, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request(method, endpoint, body=None if body is None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status


def test_requests_without_the_runs_key_are_refused_and_the_weights_stay(servers, scaled_ckpt):
    engine = servers["fixed"]
    before = _greedy(engine, "the area of a triangle is")
    from slime.weight_sync.flattened import flatten, serialize_bucket_by_value

    # The final norm scales by (1 + weight): -1 would zero every logit, so an accepted update changes the answer.
    hidden = json.loads((Path(scaled_ckpt) / "config.json").read_text())["text_config"]["hidden_size"]
    norm = flatten([("model.language_model.norm.weight", torch.full((hidden,), -1.0, dtype=torch.bfloat16))])
    update = {"serialized_named_tensors": [serialize_bucket_by_value(norm)], "load_format": "flattened_bucket"}
    statuses = {}
    for key in (None, "not-the-key"):
        statuses[str(key)] = [
            _status(engine, "POST", "/update_weights_from_tensor", update, key),
            _status(engine, "POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}, key),
            _status(engine, "POST", "/release_memory_occupation", {"tags": ["weights"]}, key),
            _status(engine, "GET", "/server_info", None, key),
        ]
    figure(check="wrong_key", statuses=statuses)
    assert all(s == 401 for codes in statuses.values() for s in codes), statuses
    assert _greedy(engine, "the area of a triangle is") == before  # nothing changed


def _push_ipc(engine, named, bucket_bytes: int, num_experts: int | None = None) -> int:
    """Push ``named`` over CUDA IPC in buckets of about ``bucket_bytes`` (a fresh buffer each), the MoE layers a
    bucket holds whole as their two fused expert tensors when ``num_experts`` is given (as slime's transport
    sends them, :mod:`slime.weight_sync.fused_experts`); returns the buckets."""
    from slime.weight_sync.flattened import FlatBucket, flatten, serialize_ipc_bucket
    from slime.weight_sync.fused_experts import fused_layout

    buckets, current, size = [], [], 0
    for name, tensor in named.items():
        current.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        ordered, metadata, _ = fused_layout(bucket, num_experts)
        flat = FlatBucket(flatten(ordered, device="cuda").buffer, metadata)
        torch.cuda.synchronize()
        engine.update_weights_from_ipc([serialize_ipc_bucket(flat)])
        del flat
    torch.cuda.empty_cache()  # the buckets' memory back to the GPU (free-memory figures read the whole GPU)
    return len(buckets)


@pytest.fixture(scope="module")
def weights(scaled_ckpt):
    """The checkpoint's tensors in bf16 on the GPU (6.4 GB), but the MTP layer's."""
    return load_checkpoint_tensors(scaled_ckpt)


def test_cuda_ipc_buckets_change_the_weights_and_bring_them_back(servers, scaled_ckpt, weights):
    engine = servers["fixed"]
    prompt = "find the length of the side"
    before = _greedy(engine, prompt)
    _push_ipc(engine, {"lm_head.weight": weights["lm_head.weight"].flip(0)}, IPC_BUCKET_BYTES)
    changed = _greedy(engine, prompt)
    # the whole model again, experts fused where a bucket holds a whole layer (slime's form), per expert elsewhere
    buckets = _push_ipc(engine, weights, IPC_BUCKET_BYTES, checkpoint_num_experts(scaled_ckpt))
    after = _greedy(engine, prompt)
    figure(check="ipc_update", buckets=buckets, changed=changed[0] != before[0], restored=after[0] == before[0],
           logprob_max_diff=_max_diff(after[1], before[1]))
    assert changed[0] != before[0] and after[0] == before[0]
    # the same tokens; their log-probs agree to bf16 noise
    assert _max_diff(after[1], before[1]) <= 2e-2


def test_release_and_resume_give_memory_back_and_weights_must_be_pushed_again(servers, scaled_ckpt, weights):
    engine = servers["fixed"]
    prompt = "the angle measures"
    before = _greedy(engine, prompt)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0] / 2**30
    engine.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    free_released = torch.cuda.mem_get_info()[0] / 2**30
    engine.resume_memory_occupation(["weights"])
    _push_ipc(engine, weights, IPC_BUCKET_BYTES, checkpoint_num_experts(scaled_ckpt))
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    free_resumed = torch.cuda.mem_get_info()[0] / 2**30
    after = _greedy(engine, prompt)
    info = engine.memory_info()
    figure(check="memory", free_gib_before=free_before, free_gib_released=free_released,
           free_gib_resumed=free_resumed, nvidia_smi=info, tags=list(engine.memory_tags))
    assert "cuda_graph" in engine.memory_tags  # SGLang's defaults capture CUDA graphs: released and resumed too
    assert free_released - free_before > 10, "the release gave back less than 10 GiB (mem fraction 0.25 of the GPU)"
    assert abs(free_resumed - free_before) < 2
    assert after[0] == before[0] and _max_diff(after[1], before[1]) <= 2e-2
