"""Real SGLang (0.5.17) through the engine interface on one GPU: text and geo3k image prompts, the multimodal-RoPE
bug and slime's fix measured as log-prob gaps against the Hugging Face model in float32, the per-run key, CUDA-IPC
weight updates, and memory release/resume.  Needs CUDA and an installed sglang (the GPU profile).

Checkpoint: the tiny Qwen3.5-MoE with Qwen3.5-35B-A3B's attention geometry (``real_geometry=True``: head_dim 256,
25 % rotary, interleaved ``mrope_section`` [11, 11, 10]) and images of up to 512 x 512 pixels, where the bug is
visible (issue 11: image gap 6.0e-3 against text 9.9e-4 with the bug, 9.9e-4 against 1.07e-3 with the fix).
Two servers run side by side on the GPU: one as slime starts it (fix applied) and one with
``SLIME_SGLANG_MROPE_FIX=0``.  ``SLIME_SGLANG_RECORD=FILE`` records the fixed server's exchanges (the CPU tests'
fixture ``tests/fixtures/sglang_0.5.17_h200.jsonl``); ``SLIME_GPU_FIGURES=FILE`` collects the figures.
"""

from __future__ import annotations

import http.client
import json
import math
import os
from pathlib import Path

import pytest
import torch

from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.parity import GAP_FLOOR, ParityGaps, verdict
from slime.weight_sync.fused_experts import checkpoint_num_experts
from tests.sglang_gpu_helpers import (
    HAVE_SGLANG,
    figure,
    load_checkpoint_tensors,
    mean_abs_gap,
    reference_log_probs,
    start_engine,
    wait_healthy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang (the GPU profile)"),
]
DATA = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
PROBLEMS = 12
RESPONSE_TOKENS = 32
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def checkpoint():
    from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(real_geometry=True, max_pixels=512 * 512)


@pytest.fixture(scope="module")
def prompts(checkpoint):
    """12 geo3k problems with their image, and the same problems as text only."""
    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor
    from slime.rollout.parity import probe_prompts

    cfg = parse_args(["--hf-checkpoint", str(checkpoint), "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "transformers", "--rollout-num-gpus", "1", "--input-key", "problem",
                      "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    return probe_prompts(PromptDataset(cfg.data, load_processor(str(checkpoint)), seed=0), PROBLEMS)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """{"fixed": engine as slime starts it, "bug": engine with SLIME_SGLANG_MROPE_FIX=0}, both on GPU 0."""
    root = tmp_path_factory.mktemp("sglang")
    fixed = start_engine(checkpoint, root / "fixed", mem_fraction=0.25)
    bug = start_engine(checkpoint, root / "bug", mem_fraction=0.25, env={"SLIME_SGLANG_MROPE_FIX": "0"})
    try:
        seconds = wait_healthy(fixed, bug)
        figure(check="sglang_start", seconds=round(seconds, 1), version=fixed.version)
        if os.environ.get("SLIME_SGLANG_RECORD"):
            fixed.client.record = os.environ["SLIME_SGLANG_RECORD"]
        yield {"fixed": fixed, "bug": bug}
    finally:
        fixed.shutdown()
        bug.shutdown()


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).cuda().eval()


def _with_response(sample, out):
    """A copy of ``sample`` with ``out``'s response tokens and log-probs (every token trained on)."""
    s = sample.clone_prompt()
    s.response_token_ids, s.rollout_log_probs = list(out.output_ids), list(out.output_log_probs)
    s.loss_mask = [1] * len(out.output_ids)
    return s


def _generate(engine, samples, seed: int = 0):
    """Each prompt through ``engine.generate``, one request per call (the batched call has its own test)."""
    params = SamplingParams(max_new_tokens=RESPONSE_TOKENS, temperature=TEMPERATURE)
    done = []
    for sample in samples:
        out = engine.generate([GenerateRequest(sample.prompt, sample.images, params)])[0]
        assert out.prompt_tokens == len(sample.prompt_token_ids), "SGLang saw another prompt than the data pipeline"
        done.append(_with_response(sample, out))
    return done


def _gaps(hf_model, image_samples, text_samples) -> ParityGaps:
    """Mean and max ``|engine - HF float32|`` log-prob gaps of image and of text responses (vision placeholder
    tokens sampled into a response leave that response out: the reference feeds them replaced)."""
    skip = {hf_model.config.image_token_id, hf_model.config.video_token_id}
    image = mean_abs_gap(image_samples, reference_log_probs(hf_model, image_samples, TEMPERATURE), skip)
    text = mean_abs_gap(text_samples, reference_log_probs(hf_model, text_samples, TEMPERATURE), skip)
    return ParityGaps(image[0], text[0], image[1], text[1], image[2], text[2])


def test_text_and_image_prompts_and_the_mrope_fix(servers, prompts, hf_model):
    images, texts = prompts
    gaps = {}
    for name, engine in servers.items():
        assert engine.version == "0.5.17"
        assert {r["mrope_fix"] for r in engine.reports if not r["main"]} == {"applied" if name == "fixed" else "disabled"}
        image_samples, text_samples = _generate(engine, images), _generate(engine, texts)
        assert all(s.response_length > 0 for s in image_samples + text_samples)
        g = gaps[name] = _gaps(hf_model, image_samples, text_samples)
        figure(check="mrope_gap", engine=name, image_gap=g.image, image_max=g.image_max, image_tokens=g.image_tokens,
               text_gap=g.text, text_max=g.text_max, text_tokens=g.text_tokens)
    assert verdict(gaps["fixed"], max_gap=0.1, max_ratio=3.0) is None, gaps["fixed"]
    assert gaps["bug"].image > 3.0 * max(gaps["bug"].text, GAP_FLOOR), gaps["bug"]  # the bug, visible
    assert "multimodal-RoPE" in verdict(gaps["bug"], max_gap=0.1, max_ratio=3.0)


def _mixed_requests(images, texts, max_new_tokens: int, temperature: float):
    """(samples, requests): the image and text problems interleaved (image 0, text 0, image 1, ...), request ``i``
    with rid ``mixed-<i>``."""
    samples = [s for pair in zip(images, texts, strict=True) for s in pair]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    return samples, [GenerateRequest(s.prompt, s.images, params, rid=f"mixed-{i}") for i, s in enumerate(samples)]


def test_one_batched_call_of_image_and_text_prompts_answers_each_request_in_order(servers, prompts, hf_model,
                                                                                  tmp_path):
    """The engine group's form since run 7: the 12 image and 12 text problems interleaved in one batched
    ``/generate`` call (SGLang's list form, :func:`~slime.rollout.engines.sglang.generation.generate_batch_payload`).
    One output per request in request order (SGLang's ``meta_info.id`` names each), each prompt as long as the
    data pipeline made it, one log-prob per output token (read from SGLang's raw answer), and log-probs as close
    to the HF model's as single calls give (the fixed server)."""
    engine = servers["fixed"]
    samples, requests = _mixed_requests(*prompts, RESPONSE_TOKENS, TEMPERATURE)
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
        assert 0 < len(out.output_ids) <= RESPONSE_TOKENS and out.finish_reason in ("stop", "length")
        assert [entry[1] for entry in raw] == answer["output_ids"] == out.output_ids
        assert out.output_log_probs == [entry[0] for entry in raw]
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.output_log_probs)
    done = [_with_response(s, o) for s, o in zip(samples, outputs)]
    gaps = _gaps(hf_model, done[0::2], done[1::2])
    figure(check="batched_call", requests=len(requests), image_gap=gaps.image, text_gap=gaps.text,
           image_tokens=gaps.image_tokens, text_tokens=gaps.text_tokens,
           output_tokens=sum(len(o.output_ids) for o in outputs))
    assert verdict(gaps, max_gap=0.1, max_ratio=3.0) is None, gaps


def _greedy(engine, prompt: str) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of a 16-token greedy answer."""
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


def test_requests_without_the_runs_key_are_refused_and_the_weights_stay(servers, checkpoint):
    engine = servers["fixed"]
    before = _greedy(engine, "the area of a triangle is")
    from slime.weight_sync.flattened import flatten, serialize_bucket_by_value

    zeros = flatten([("lm_head.weight", torch.zeros(load_checkpoint_tensors(checkpoint, "cpu")["lm_head.weight"].shape))])
    update = {"serialized_named_tensors": [serialize_bucket_by_value(zeros)], "load_format": "flattened_bucket"}
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
    return len(buckets)


def test_cuda_ipc_buckets_change_the_weights_and_bring_them_back(servers, checkpoint):
    engine = servers["fixed"]
    prompt = "find the length of the side"
    before = _greedy(engine, prompt)
    weights = load_checkpoint_tensors(checkpoint)
    _push_ipc(engine, {"lm_head.weight": weights["lm_head.weight"].flip(0)}, 1 << 30)
    changed = _greedy(engine, prompt)
    # the whole model again, in ~2 MB buckets, experts fused where a bucket holds a whole layer (slime's form)
    buckets = _push_ipc(engine, weights, 2 << 20, checkpoint_num_experts(checkpoint))
    after = _greedy(engine, prompt)
    figure(check="ipc_update", buckets=buckets, changed=changed[0] != before[0], restored=after[0] == before[0],
           logprob_max_diff=_max_diff(after[1], before[1]))
    assert changed[0] != before[0] and after[0] == before[0]
    # the same tokens; their log-probs agree to bf16 noise (the prompt's KV may now come from the prefix cache)
    assert _max_diff(after[1], before[1]) <= 2e-2


def test_release_and_resume_give_memory_back_and_weights_must_be_pushed_again(servers, checkpoint):
    engine = servers["fixed"]
    prompt = "the angle measures"
    before = _greedy(engine, prompt)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0] / 2**30
    engine.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    free_released = torch.cuda.mem_get_info()[0] / 2**30
    engine.resume_memory_occupation(["weights"])
    _push_ipc(engine, load_checkpoint_tensors(checkpoint), 64 << 20, checkpoint_num_experts(checkpoint))
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    free_resumed = torch.cuda.mem_get_info()[0] / 2**30
    after = _greedy(engine, prompt)
    info = engine.memory_info()
    figure(check="memory", free_gib_before=free_before, free_gib_released=free_released,
           free_gib_resumed=free_resumed, nvidia_smi=info, tags=list(engine.memory_tags))
    assert free_released - free_before > 10, "the release gave back less than 10 GiB (mem fraction 0.25 of the GPU)"
    assert abs(free_resumed - free_before) < 2
    assert after[0] == before[0] and _max_diff(after[1], before[1]) <= 2e-2
