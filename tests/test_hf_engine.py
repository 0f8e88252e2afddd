"""TransformersEngine against a plain transformers forward pass, against one-prompt-at-a-time
generation, and against SGLang's sampling / stopping rules worked out by hand."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from slime.data.image import decode_image, encode_image_base64
from slime.data.processor import mm_token_type_ids
from slime.rollout.engines.base import BundleResources, EngineResources, GenerateRequest, SamplingParams
from slime.rollout.engines.hf_engine import TransformersEngine
from slime.rollout.engines.hf_sampling import sample_next_tokens
from slime.rollout.seeds import sampling_seed, uniform

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4  # fp32 log-probs: batched vs alone, engine vs plain forward


def _image_b64(width: int, height: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return encode_image_base64(Image.fromarray(pixels))


def _request(
    processor, text: str, n_images: int = 0, *, seed: int = 0, rid: str | None = None, **sampling
) -> GenerateRequest:
    """A chat-templated user turn with ``n_images`` random images (sizes vary with ``seed``)."""
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}])
    images = [_image_b64(32 * (2 + (seed + i) % 3), 32 * (2 + i % 2), seed=seed * 10 + i) for i in range(n_images)]
    return GenerateRequest(prompt, images, SamplingParams(**{"max_new_tokens": 8, **sampling}), rid=rid)


def _mixed_requests(processor, **sampling) -> list[GenerateRequest]:
    """Prompts of different lengths, with 0, 1 and 2 images."""
    return [
        _request(processor, "Find x.", 0, seed=0, **sampling),
        _request(processor, "In the figure, find the area of the triangle ABC to tenths.", 1, seed=1, **sampling),
        _request(processor, "Which angle is larger?", 2, seed=2, **sampling),
        _request(processor, "Solve for y if 2y + 3 = 11 and explain each step carefully.", 0, seed=3, **sampling),
        _request(processor, "Area?", 1, seed=4, **sampling),
    ]


def _reference_log_probs(model, processor, request: GenerateRequest, output_ids: list[int], temperature: float):
    """float64 ``log_softmax(logits / T)`` of ``output_ids`` from one plain forward pass over prompt + response,
    plus the argmax token at each response position (no cache, no padding, positions computed by the model)."""
    processed = processor(request.text, [decode_image(b) for b in request.image_data])
    full = torch.tensor(processed.input_ids + output_ids).unsqueeze(0)
    with torch.no_grad():
        logits = model(
            input_ids=full,
            pixel_values=processed.pixel_values,
            image_grid_thw=processed.image_grid_thw,
            mm_token_type_ids=mm_token_type_ids(full, model.config.image_token_id),
        ).logits[0]
    prompt_len = len(processed.input_ids)
    scores = logits[prompt_len - 1 : -1].double() / (temperature or 1.0)
    log_probs = torch.log_softmax(scores, dim=-1).gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1)
    return log_probs, scores.argmax(-1), prompt_len


@pytest.fixture(scope="module")
def reference_model(tiny_ckpt):
    from transformers import Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_engine(tiny_ckpt):
    """Shared by tests that only run greedy generation (no weight change, no RNG use)."""
    return TransformersEngine(str(tiny_ckpt))


@pytest.fixture(scope="module")
def full_then_linear_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with 8 layers (3 linear, 1 full attention, twice), random weights: unlike the
    4-layer tiny model, Gated DeltaNet layers here read the output of a full-attention layer, as in
    the released 3:1 pattern (padding rows must stay finite for them)."""
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny-8-layers")
    for name in os.listdir(tiny_ckpt):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(tiny_ckpt / name, folder / name)
    config = AutoConfig.from_pretrained(tiny_ckpt)
    config.text_config.num_hidden_layers = 8
    config.text_config.layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    torch.manual_seed(1)
    Qwen3_5MoeForConditionalGeneration(config).to(torch.float32).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("which", ["tiny", "full_then_linear"])
def test_batched_greedy_equals_one_prompt_at_a_time(request, which, processor):
    ckpt = request.getfixturevalue("tiny_ckpt" if which == "tiny" else "full_then_linear_ckpt")
    engine = TransformersEngine(str(ckpt), max_batch_size=3)  # 5 requests -> batches of 3 and 2
    requests = _mixed_requests(processor, max_new_tokens=12, temperature=0.0)
    batched = engine.generate(requests)
    for req, out in zip(requests, batched):
        (alone,) = engine.generate([req])
        assert out.output_ids == alone.output_ids
        assert out.prompt_tokens == alone.prompt_tokens
        np.testing.assert_allclose(out.output_log_probs, alone.output_log_probs, atol=ATOL, rtol=0)
        assert all(math.isfinite(x) for x in out.output_log_probs)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_log_probs_match_plain_forward(temperature, tiny_ckpt, processor, reference_model):
    engine = TransformersEngine(str(tiny_ckpt), seed=5)
    requests = _mixed_requests(processor, max_new_tokens=10, temperature=temperature, top_p=0.95, top_k=50)
    for req, out in zip(requests, engine.generate(requests)):
        ref_log_probs, ref_argmax, prompt_len = _reference_log_probs(
            reference_model, processor, req, out.output_ids, temperature
        )
        assert out.prompt_tokens == prompt_len
        np.testing.assert_allclose(out.output_log_probs, ref_log_probs.numpy(), atol=ATOL, rtol=0)
        if temperature == 0:
            assert out.output_ids == ref_argmax.tolist()


def _kept_by_hand(probs: torch.Tensor, top_k: int, top_p: float) -> dict[int, float]:
    """SGLang's filter, written out: walk tokens by decreasing probability, keep while rank < k and
    the mass before the token <= top_p; renormalise what is kept."""
    kept, mass_before = {}, 0.0
    for rank, token in enumerate(torch.argsort(probs, descending=True).tolist()):
        if (top_k != -1 and rank >= top_k) or mass_before > top_p:
            break
        kept[token] = probs[token].item()
        mass_before += probs[token].item()
    total = sum(kept.values())
    return {t: p / total for t, p in kept.items()}


@pytest.mark.parametrize("top_k, n_by_top_p", [(3, None), (-1, 2), (5, 2)])
def test_first_token_distribution_follows_temperature_top_k_top_p(
    top_k, n_by_top_p, tiny_ckpt, processor, reference_model
):
    temperature, n = 0.5, 1500
    req = _request(processor, "Find the measure of angle B.", max_new_tokens=1, temperature=temperature)
    with torch.no_grad():
        ids = torch.tensor(processor(req.text, []).input_ids).unsqueeze(0)
        logits = reference_model(input_ids=ids).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, dim=-1)
    top_p = 1.0
    if n_by_top_p is not None:  # a threshold between the mass of the top n-1 and top n tokens: top-p keeps n
        sorted_probs = probs.sort(descending=True).values
        top_p = (sorted_probs[: n_by_top_p - 1].sum() + sorted_probs[n_by_top_p - 1] / 2).item()
    expected = _kept_by_hand(probs, top_k, top_p)
    assert len(expected) == (n_by_top_p or top_k)

    engine = TransformersEngine(str(tiny_ckpt), seed=11)
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k)
    outs = engine.generate([GenerateRequest(req.text, [], sampling)] * n)
    tokens = [o.output_ids[0] for o in outs]
    assert set(tokens) <= set(expected)
    for token, q in expected.items():
        freq = tokens.count(token) / n
        assert abs(freq - q) < 5 * math.sqrt(q * (1 - q) / n), (token, freq, q)
    log_probs = torch.tensor([o.output_log_probs[0] for o in outs], dtype=torch.float64)
    np.testing.assert_allclose(log_probs, torch.log(probs[tokens]), atol=ATOL, rtol=0)


def test_same_seed_same_samples_other_seed_other_samples(tiny_ckpt, processor):
    requests = _mixed_requests(processor, max_new_tokens=6, temperature=1.0)
    first = TransformersEngine(str(tiny_ckpt), seed=7).generate(requests)
    again = TransformersEngine(str(tiny_ckpt), seed=7).generate(requests)
    other = TransformersEngine(str(tiny_ckpt), seed=8).generate(requests)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert [o.output_log_probs for o in first] == [o.output_log_probs for o in again]
    assert [o.output_ids for o in first] != [o.output_ids for o in other]


# ----------------------------------------------------------------------------- per-request seeds


class _SplitMix64:
    """SplitMix64 as a stateful generator (Steele, Lea and Flood 2014; Vigna's reference C code)."""

    def __init__(self, seed: int):
        self.state = seed % 2**64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) % 2**64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)


def test_uniform_is_the_nth_splitmix64_output_in_53_bits():
    assert _SplitMix64(0).next() == 0xE220A8397B1DCDAF  # the published first output for seed 0
    for seed in (0, 1, 12345, 2**63 - 1):
        generator = _SplitMix64(seed)
        for position in range(50):
            assert uniform(seed, position) == (generator.next() >> 11) / 2**53
    values = [uniform(7, t) for t in range(20000)]
    assert all(0 <= v < 1 for v in values)
    assert abs(np.mean(values) - 0.5) < 5 * math.sqrt(1 / 12 / len(values))


def test_sampling_seeds_are_stable_non_negative_int64_and_distinct():
    seeds = {
        (rollout_id, index, stream): sampling_seed(42, rollout_id, index, stream)
        for rollout_id in range(5) for index in range(40) for stream in ("train", "eval/geo3k")
    }  # fmt: skip
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds.values())
    assert len(set(seeds.values())) == len(seeds)  # (1, 0) vs (0, 1), train vs eval: no collision
    assert sampling_seed(42, 3, 7) == sampling_seed(42, 3, 7, "train") != sampling_seed(43, 3, 7)
    # The same in a fresh interpreter (no per-process hash salt).
    code = "from slime.rollout.seeds import sampling_seed; print(sampling_seed(42, 3, 7))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert int(out.stdout) == sampling_seed(42, 3, 7)


def test_inverse_cdf_sampling_by_hand():
    """p = (0.5, 0.3, 0.2) over tokens (2, 0, 1): the kept tokens, most likely first, split [0, 1)."""
    logits = torch.log(torch.tensor([[0.3, 0.2, 0.5]])).float()
    one = torch.ones(1)

    def draw(u, top_k=-1, top_p=1.0, temperature=1.0):
        tokens, log_probs = sample_next_tokens(
            logits, one * temperature, one * top_p, torch.tensor([top_k]), torch.tensor([u], dtype=torch.float64)
        )
        return tokens.item(), log_probs.item()

    # cdf (0.5, 0.8, 1.0): u < 0.5 -> token 2, 0.5 <= u < 0.8 -> token 0, else token 1.
    assert [draw(u)[0] for u in (0.0, 0.49, 0.51, 0.79, 0.81, 1 - 2**-53)] == [2, 2, 0, 0, 1, 1]
    # top-k 2 keeps (0.5, 0.3): threshold u * 0.8, so u = 0.7 -> 0.56 -> token 0; u = 0.6 -> 0.48 -> token 2.
    assert draw(0.7, top_k=2)[0] == 0 and draw(0.6, top_k=2)[0] == 2
    # top-p keeps a token while the mass before it is <= top_p: 0.55 keeps (2, 0), 0.4 keeps (2,).
    assert [draw(u, top_p=0.55)[0] for u in (0.1, 0.7, 0.99)] == [2, 0, 0]
    assert [draw(u, top_p=0.4)[0] for u in (0.1, 0.99)] == [2, 2]
    # Greedy ignores u, top-k and top-p; its log-prob is under T = 1.
    assert draw(0.99, top_k=3, top_p=0.3, temperature=0.0) == pytest.approx((2, math.log(0.5)), abs=1e-6)
    # The log-prob is the unfiltered one (0.3, not 0.3 / 0.8 after top-k), under the temperature.
    assert draw(0.9, top_k=2) == pytest.approx((0, math.log(0.3)), abs=1e-6)
    at_t2 = 0.2**0.5 / sum(p**0.5 for p in (0.5, 0.3, 0.2))  # p^(1/T), renormalised
    assert draw(0.9, temperature=2.0) == pytest.approx((1, math.log(at_t2)), abs=1e-6)


def _seeded(requests: list[GenerateRequest], seeds: list[int]) -> list[GenerateRequest]:
    return [
        dataclasses.replace(r, sampling_params=dataclasses.replace(r.sampling_params, sampling_seed=s))
        for r, s in zip(requests, seeds)
    ]


def test_a_seeded_request_draws_the_same_response_on_any_engine_in_any_batch(tiny_ckpt, processor):
    """What exact resume and per-request balancing rely on: a response depends on its seed only,
    not on the engine (seed), the batch it shares, its position in it, or earlier calls."""
    requests = _seeded(_mixed_requests(processor, max_new_tokens=8, temperature=1.0), [11, 12, 13, 14, 15])
    first = TransformersEngine(str(tiny_ckpt), seed=1).generate(requests)
    other_engine = TransformersEngine(str(tiny_ckpt), seed=2, max_batch_size=2)
    other_engine.generate(_mixed_requests(processor, max_new_tokens=3, temperature=1.0))  # some history
    shuffled = [4, 2, 0, 3, 1]
    again = other_engine.generate([requests[i] for i in shuffled])
    for position, i in enumerate(shuffled):
        assert again[position].output_ids == first[i].output_ids, i
        np.testing.assert_allclose(again[position].output_log_probs, first[i].output_log_probs, atol=ATOL, rtol=0)
    for i, req in enumerate(requests):
        (alone,) = other_engine.generate([req])
        assert alone.output_ids == first[i].output_ids, i
    reseeded = other_engine.generate(_seeded(requests, [21, 22, 23, 24, 25]))
    assert [o.output_ids for o in reseeded] != [o.output_ids for o in first]


def test_greedy_generation_is_deterministic_and_ignores_seeds(tiny_ckpt, processor, reference_model):
    """``--eval-temperature 0``: the same response whatever the seeds, top-k and top-p, and it is
    the argmax continuation of a plain forward pass."""
    requests = _mixed_requests(processor, max_new_tokens=6, temperature=0.0, top_p=0.5, top_k=3)
    a = TransformersEngine(str(tiny_ckpt), seed=1).generate(_seeded(requests, [1, 2, 3, 4, 5]))
    b = TransformersEngine(str(tiny_ckpt), seed=9, max_batch_size=1).generate(requests)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    for req, out in zip(requests, a):
        _, argmax, _ = _reference_log_probs(reference_model, processor, req, out.output_ids, 0.0)
        assert out.output_ids == argmax.tolist()


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_bad_sampling_seed_names_the_request(seed, greedy_engine, processor):
    (req,) = _seeded([_request(processor, "Find x.", 0, rid="geo3k-3", max_new_tokens=2)], [seed])
    req.rid = "geo3k-3"
    with pytest.raises(ValueError, match=r"request 0 \(rid 'geo3k-3'\): sampling_seed = "):
        greedy_engine.generate([req])


def _greedy_ids(engine, req: GenerateRequest, max_new_tokens: int) -> list[int]:
    free = GenerateRequest(req.text, req.image_data, SamplingParams(max_new_tokens, temperature=0.0, stop_token_ids=[]))
    return engine.generate([free])[0].output_ids


def test_stop_token_ids_and_length_follow_sglang_order(greedy_engine, processor):
    """Length is checked before stop tokens (SGLang ``Req.check_finished``); the stop token is kept."""
    req = _request(processor, "Find x.", 1, seed=3)
    free = _greedy_ids(greedy_engine, req, 10)
    eos = greedy_engine.eos_token_ids
    for stop_at, max_new in [(3, 10), (1, 2), (4, 3)]:
        stop_token = free[min(stop_at, len(free) - 1)]
        sampling = SamplingParams(max_new, temperature=0.0, stop_token_ids=[stop_token])
        (out,) = greedy_engine.generate([GenerateRequest(req.text, req.image_data, sampling)])
        # by hand: walk the unconstrained greedy tokens and apply the rules in SGLang's order
        for i, token in enumerate(free):
            if i + 1 >= max_new:
                expected_len, expected_reason = i + 1, "length"
                break
            if token in eos or token == stop_token:
                expected_len, expected_reason = i + 1, "stop"
                break
        assert out.output_ids == free[:expected_len]
        assert out.finish_reason == expected_reason


@pytest.mark.parametrize("eos_source", ["tokenizer", "generation_config"])
def test_checkpoint_eos_ids_stop_generation(eos_source, tiny_ckpt, processor):
    """An lm_head whose only non-zero row is the EOS row (copied from the first greedy token's row,
    whose logit is the largest, hence positive) makes EOS the first token: "stop", EOS kept."""
    from transformers import GenerationConfig

    eos_id = processor.tokenizer.eos_token_id
    if eos_source == "generation_config":
        (eos_id,) = set(GenerationConfig.from_pretrained(tiny_ckpt).eos_token_id) - {eos_id}
    engine = TransformersEngine(str(tiny_ckpt))
    req = _request(processor, "Find x.", 1, seed=1)
    first = _greedy_ids(engine, req, 1)[0]
    lm_head = engine.model.state_dict()["lm_head.weight"]
    only_eos = torch.zeros_like(lm_head)
    only_eos[eos_id] = lm_head[first]
    engine.update_weights_from_tensor([("lm_head.weight", only_eos)])
    sampling = SamplingParams(8, temperature=0.0, no_stop_trim=False)
    (out,) = engine.generate([GenerateRequest(req.text, req.image_data, sampling)])
    assert out.output_ids == [eos_id]
    assert out.finish_reason == "stop"
    assert out.text == ""


def test_stop_strings_end_and_trim_the_response(greedy_engine, processor):
    req = _request(processor, "Explain the theorem of Pythagoras.", 0, seed=0)
    free = _greedy_ids(greedy_engine, req, 12)
    decode = lambda ids: greedy_engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # a stop string straddling the boundary between response tokens 4 and 5
    boundary = len(decode(free[:4]))
    assert decode(free).startswith(decode(free[:4])) and len(decode(free[:5])) > boundary >= 2
    stop = decode(free)[boundary - 2 : boundary + 1]
    # by hand: the first prefix of the response whose text contains the stop string
    n = next(k for k in range(1, len(free) + 1) if stop in decode(free[:k]))
    text = decode(free[:n])
    for no_stop_trim, expected_text in [(True, text[: text.find(stop) + len(stop)]), (False, text[: text.find(stop)])]:
        sampling = SamplingParams(12, temperature=0.0, stop=[stop], stop_token_ids=[], no_stop_trim=no_stop_trim)
        (out,) = greedy_engine.generate([GenerateRequest(req.text, [], sampling)])
        assert out.output_ids == free[:n]
        assert out.finish_reason == "stop"
        assert out.text == expected_text


def test_engine_reports_the_prompt_length_it_saw(greedy_engine, processor):
    # The rollout manager checks it against the data pipeline's count (tests/test_rollout_manager.py).
    requests = [_request(processor, "Find x.", 1, seed=0), _request(processor, "Which angle is larger?", 2, seed=2)]
    expected = [len(processor(r.text, [decode_image(b) for b in r.image_data]).input_ids) for r in requests]
    assert [out.prompt_tokens for out in greedy_engine.generate(requests)] == expected
    assert greedy_engine.capacity == greedy_engine.max_batch_size == 32


def test_routed_experts_are_the_routers_choices_of_a_plain_forward(greedy_engine, processor, reference_model):
    """A batch of prompts of different lengths (left padded), with 0-2 images, sampled with a seed: each request that
    asks gets ``[P + R - 1, layers, top_k]`` uint8, the experts a plain forward over its prompt and response chooses at
    every position but the last, wherever that choice is at least 1e-4 (router logit) away from a tie; the request
    that does not ask gets none."""
    from qwen35_helpers import hf_forward_routes

    requests = [dataclasses.replace(r, return_routed_experts=i != 2, sampling_params=dataclasses.replace(
        r.sampling_params, temperature=1.0, sampling_seed=i)) for i, r in enumerate(_mixed_requests(processor))]
    outputs = greedy_engine.generate(requests)
    assert outputs[2].routed_experts is None
    checked = near_ties = 0
    for request, out in zip(requests, outputs):
        if not request.return_routed_experts:
            continue
        processed = processor(request.text, [decode_image(b) for b in request.image_data])
        routes, margin = hf_forward_routes(reference_model, processed.input_ids + out.output_ids,
                                           processed.pixel_values, processed.image_grid_thw)
        n = len(processed.input_ids) + len(out.output_ids) - 1
        assert out.routed_experts.dtype == np.uint8 and out.routed_experts.shape == (n, 4, 2)
        clear = (margin[:n] > 1e-4).numpy()
        got, want = np.sort(out.routed_experts, -1), np.sort(routes[:n].numpy(), -1)
        assert np.array_equal(got[clear], want[clear])
        checked, near_ties = checked + clear.sum(), near_ties + (~clear).sum()
    assert near_ties <= 0.01 * checked, (near_ties, checked)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("stop", [""]),
    ],
)
def test_invalid_sampling_params_raise(field, value, greedy_engine, processor):
    req = _request(processor, "Find x.", rid="r1")
    setattr(req.sampling_params, field, value)
    with pytest.raises(ValueError, match=rf"r1.*{field}"):
        greedy_engine.generate([req])


def test_image_count_mismatch_names_the_request(greedy_engine, processor):
    req = _request(processor, "Find x.", 1, seed=0, rid="geo3k-5")
    req.image_data = req.image_data * 2
    with pytest.raises(ValueError, match=r"geo3k-5.*1 <\|image_pad\|> placeholder.*2 image"):
        greedy_engine.generate([req])


def test_max_batch_size_below_one_raises(tiny_ckpt):
    with pytest.raises(ValueError, match="max_batch_size = 0"):
        TransformersEngine(str(tiny_ckpt), max_batch_size=0)


# ----------------------------------------------------------------------------- weights


def _checkpoint_state(engine) -> dict[str, torch.Tensor]:
    """The engine's weights under checkpoint names, by transformers' own reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return revert_weight_conversion(engine.model, state)


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


def _buckets(names: list[str], mode: str) -> list[list[str]]:
    if mode == "one_per_call_shuffled":
        shuffled = names[:]
        random.Random(0).shuffle(shuffled)
        return [[n] for n in shuffled]
    if mode == "sizes_1_5_17":  # natural order, bucket edges fall inside expert groups
        buckets, start, sizes = [], 0, [1, 5, 17]
        while start < len(names):
            size = sizes[len(buckets) % 3]
            buckets.append(names[start : start + size])
            start += size
        return buckets
    if mode == "by_layer":
        groups: dict[str, list[str]] = {}
        for n in names:
            key = ".".join(n.split(".")[:4]) if ".layers." in n or ".blocks." in n else n
            groups.setdefault(key, []).append(n)
        return list(groups.values())
    assert mode == "all_at_once"
    return [names]


@pytest.mark.parametrize("mode", ["one_per_call_shuffled", "sizes_1_5_17", "by_layer", "all_at_once"])
def test_checkpoint_named_buckets_round_trip_exactly(mode, tiny_ckpt):
    from safetensors import safe_open

    engine = TransformersEngine(str(tiny_ckpt))
    wire = _checkpoint_state(engine)
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        assert set(wire) == set(f.keys())  # the names on the wire are the checkpoint's
    target = _perturbed(wire, seed=1)
    names = sorted(target)
    for bucket in _buckets(names, mode):
        engine.update_weights_from_tensor([(n, target[n]) for n in bucket])

    after = _checkpoint_state(engine)
    assert all(torch.equal(after[n], target[n]) for n in names)
    # the fused layout, by hand: gate_up_proj[e] = [gate_e; up_e], down_proj[e] = down_e
    params = engine.model.state_dict()
    prefix = "model.language_model.layers.0.mlp.experts"
    for e in range(engine.model.config.text_config.num_experts):
        gate, up = target[f"{prefix}.{e}.gate_proj.weight"], target[f"{prefix}.{e}.up_proj.weight"]
        assert torch.equal(params[f"{prefix}.gate_up_proj"][e], torch.cat([gate, up]))
        assert torch.equal(params[f"{prefix}.down_proj"][e], target[f"{prefix}.{e}.down_proj.weight"])


def test_half_an_expert_group_is_buffered_until_complete(tiny_ckpt, processor):
    engine = TransformersEngine(str(tiny_ckpt))
    prefix = "model.language_model.layers.1.mlp.experts"
    n_experts = engine.model.config.text_config.num_experts
    target = _perturbed(_checkpoint_state(engine), seed=2)
    group = [f"{prefix}.{e}.{proj}.weight" for e in range(n_experts) for proj in ("gate_proj", "up_proj")]
    before = engine.model.state_dict()[f"{prefix}.gate_up_proj"].clone()

    engine.update_weights_from_tensor([(n, target[n]) for n in group[: n_experts // 2]])
    assert torch.equal(engine.model.state_dict()[f"{prefix}.gate_up_proj"], before)
    with pytest.raises(RuntimeError, match=r"incomplete.*gate_up_proj"):
        engine.generate([_request(processor, "Find x.", temperature=0.0)])

    engine.update_weights_from_tensor([(n, target[n]) for n in group[n_experts // 2 :]])
    fused = engine.model.state_dict()[f"{prefix}.gate_up_proj"]
    assert torch.equal(fused[n_experts - 1], torch.cat([target[group[-2]], target[group[-1]]]))
    assert len(engine.generate([_request(processor, "Find x.", temperature=0.0)])[0].output_ids) > 0


def test_bad_names_and_shapes_raise_and_change_nothing(tiny_ckpt):
    engine = TransformersEngine(str(tiny_ckpt))
    norm = "model.language_model.norm.weight"
    before = engine.model.state_dict()[norm].clone()
    good = (norm, before + 1)
    with pytest.raises(KeyError, match="model.language_model.layers.0.mlp.experts.gate_up_proj"):
        # the in-memory (fused) name is not a checkpoint name
        engine.update_weights_from_tensor([good, ("model.language_model.layers.0.mlp.experts.gate_up_proj", before)])
    with pytest.raises(ValueError, match=r"lm_head.weight.*shape \(3, 3\)"):
        engine.update_weights_from_tensor([good, ("lm_head.weight", torch.zeros(3, 3))])
    assert torch.equal(engine.model.state_dict()[norm], before)


def test_new_lm_head_changes_log_probs_as_expected(tiny_ckpt, processor):
    """Doubling lm_head doubles the logits exactly, so sampling at T = 2 afterwards reproduces T = 1
    before (same seed); a zero lm_head makes every log-prob -log(V)."""
    requests = _mixed_requests(processor, max_new_tokens=6, temperature=1.0)
    before = TransformersEngine(str(tiny_ckpt), seed=3).generate(requests)

    engine = TransformersEngine(str(tiny_ckpt), seed=3)
    lm_head = engine.model.state_dict()["lm_head.weight"].clone()
    engine.update_weights_from_tensor([("lm_head.weight", 2 * lm_head)])
    for r in requests:
        r.sampling_params.temperature = 2.0
    after = engine.generate(requests)
    assert [o.output_ids for o in after] == [o.output_ids for o in before]
    np.testing.assert_allclose(
        [x for o in after for x in o.output_log_probs], [x for o in before for x in o.output_log_probs], atol=1e-6
    )

    engine.update_weights_from_tensor([("lm_head.weight", torch.zeros_like(lm_head))])
    vocab = lm_head.shape[0]
    for out in engine.generate(requests):
        np.testing.assert_allclose(out.output_log_probs, -math.log(vocab), atol=1e-6)


# ----------------------------------------------------------------------------- lifecycle


def test_pause_refuses_generation_until_continue(tiny_ckpt, processor):
    engine = TransformersEngine(str(tiny_ckpt))
    req = _request(processor, "Find x.", temperature=0.0)
    engine.pause_generation()
    with pytest.raises(RuntimeError, match="continue_generation"):
        engine.generate([req])
    engine.continue_generation()
    assert engine.generate([req])[0].output_ids


def test_release_resume_keeps_weights_and_state(tiny_ckpt, processor):
    engine = TransformersEngine(str(tiny_ckpt))
    req = _request(processor, "Find x.", 1, temperature=0.0)
    (before,) = engine.generate([req])
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.generate([req])
    engine.update_weights_from_tensor([("lm_head.weight", engine.model.state_dict()["lm_head.weight"].clone())])
    engine.resume_memory_occupation()
    (after,) = engine.generate([req])
    assert after.output_ids == before.output_ids
    assert after.output_log_probs == before.output_log_probs


def test_shutdown_makes_the_engine_unhealthy(tiny_ckpt, processor):
    engine = TransformersEngine(str(tiny_ckpt))
    assert engine.health()
    engine.shutdown()
    assert not engine.health()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([_request(processor, "Find x.")])
    with pytest.raises(RuntimeError, match="shut down"):
        engine.update_weights_from_tensor([])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_release_frees_memory_and_resume_restores_it(tiny_ckpt, processor, reference_model):
    engine = TransformersEngine(str(tiny_ckpt), device="cuda", dtype=torch.bfloat16)
    requests = _mixed_requests(processor, max_new_tokens=8, temperature=0.0)
    before = engine.generate(requests)
    held = torch.cuda.memory_allocated()
    engine.release_memory_occupation()
    assert torch.cuda.memory_allocated() < held
    engine.resume_memory_occupation()
    assert torch.cuda.memory_allocated() == held
    after = engine.generate(requests)
    assert [o.output_ids for o in after] == [o.output_ids for o in before]
    # bf16 weights: log-probs follow the fp32 reference loosely
    for req, out in zip(requests, after):
        ref, _, _ = _reference_log_probs(reference_model, processor, req, out.output_ids, 0.0)
        np.testing.assert_allclose(out.output_log_probs, ref.numpy(), atol=0.1, rtol=0)


def test_from_spec_reads_the_run_flags(tiny_ckpt, processor):
    from slime.arguments import parse_args

    cfg = parse_args(
        f"--hf-checkpoint {tiny_ckpt} --num-rollout 1 --rollout-batch-size 2 --rollout-max-response-len 8 "
        "--rollout-seed 40 --image-max-pixels 4096 --colocate "
        "--train-backend fsdp --rollout-backend transformers".split()
    )
    engine = TransformersEngine.from_spec(cfg.engine_spec(TransformersEngine.parity_check), _resources(index=2))
    assert engine.device == torch.device("cpu") and engine.model.dtype == torch.float32
    assert engine.processor.max_pixels == 4096
    requests = _mixed_requests(processor, max_new_tokens=4, temperature=1.0)
    expected = TransformersEngine(str(tiny_ckpt), seed=42, max_pixels=4096).generate(requests)
    assert [o.output_ids for o in engine.generate(requests)] == [o.output_ids for o in expected]


def _resources(index: int, gpu_ids: tuple[str, ...] = ()) -> EngineResources:
    bundle = BundleResources(0, "127.0.0.1", "node", gpu_ids[:1], 1.0)
    more = [BundleResources(i, "127.0.0.1", "node", (gpu,), 1.0) for i, gpu in enumerate(gpu_ids[1:], start=1)]
    return EngineResources(index, (bundle, *more), use_gpu=bool(gpu_ids))


def test_from_spec_refuses_more_than_one_gpu(tiny_ckpt):
    from slime.arguments import parse_args

    cfg = parse_args(f"--hf-checkpoint {tiny_ckpt} --num-rollout 1 --rollout-batch-size 2 --rollout-max-response-len 8 "
                     "--colocate --train-backend fsdp --rollout-backend transformers".split())
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine 2: the transformers engine runs on one GPU"):
        TransformersEngine.from_spec(cfg.engine_spec(TransformersEngine.parity_check),
                                     _resources(0, gpu_ids=("0", "1")))


def test_registry_and_import_do_not_pull_sglang():
    from slime.rollout.engines import ENGINES

    assert ENGINES.get("transformers") is TransformersEngine
    code = "import sys, slime.rollout.engines; assert 'sglang' not in sys.modules, 'sglang was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
