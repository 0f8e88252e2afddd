"""CPU checks of the pieces of ``scripts/harness/sglang_gpu.py`` that the GPU tests' parity gate rests on: the HF
scorer's routing replay and rounding noise (on the tiny checkpoint), the route agreement, and the
server flags against the launcher's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts.harness.sglang_gpu import (
    EAGER_FLAGS, LAUNCHER_FLAGS, hf_log_probs, route_agreement, server_flags, sglang_argv,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "geo3k_vlm" / "data"


@pytest.fixture(scope="module")
def model_and_samples(tiny_ckpt):
    """The tiny model in float32 and two geo3k samples (with their image, and as text) with random
    12-token responses."""
    from transformers import AutoModelForImageTextToText

    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor
    from slime.rollout.parity import probe_prompts

    ckpt = tiny_ckpt
    cfg = parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "transformers", "--rollout-num-gpus", "1", "--input-key", "problem",
                      "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    images, texts = probe_prompts(PromptDataset(cfg.data, load_processor(str(ckpt)), seed=0), 1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for prompt in images + texts:
        s = prompt.clone_prompt()
        s.response_token_ids = torch.randint(0, 1500, (12,), generator=gen).tolist()
        s.loss_mask = [1] * 12
        samples.append(s)
    model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return model, samples


def test_replaying_the_models_own_routes_gives_its_own_log_probs_and_other_routes_do_not(model_and_samples):
    model, samples = model_and_samples
    own = []
    free = hf_log_probs(model, samples, 1.0, routes_out=own)
    # every position, 4 layers, top-2; the text sample's forward (no image) gets one dummy image token appended, as
    # the FSDP trainer feeds it (slime.backends.fsdp.backend.build_model_inputs)
    total = [len(s.prompt_token_ids) + s.response_length + (not s.images) for s in samples]
    assert [tuple(r.shape) for r in own] == [(t, 4, 2) for t in total]
    for sample, routes in zip(samples, own):
        sample.rollout_routed_experts = routes[:-1].numpy().astype(np.uint8)  # as an engine reports them
    replayed = hf_log_probs(model, samples, 1.0, replay_routes=True)
    assert replayed == free  # the same experts, the same gate weights: bit for bit in float32
    assert route_agreement([s.rollout_routed_experts for s in samples], own) == [1.0] * 4
    for sample in samples:  # every route moved to the next expert
        sample.rollout_routed_experts = ((sample.rollout_routed_experts + 1) % 8).astype(np.uint8)
    moved = hf_log_probs(model, samples, 1.0, replay_routes=True)
    assert all(max(abs(a - b) for a, b in zip(m, f)) > 1e-4 for m, f in zip(moved, free))
    assert route_agreement([s.rollout_routed_experts for s in samples], own) == [0.0] * 4


def test_rounding_noise_moves_the_log_probs_repeatably(model_and_samples):
    # One float32 ulp on the token embeddings moves this tiny model's response logits by at most about 1e-7 on a CPU,
    # well under the float32 spacing of its log-probs (4.8e-7 near -7.5, the log of its vocabulary), so most tokens'
    # log-probs round back to the same float32 value (all 12 of each fixture sample do); each sample's 128 tokens
    # here hold dozens that move.
    model, samples = model_and_samples
    gen = torch.Generator().manual_seed(1)
    longer = []
    for sample in samples:
        s = sample.clone_prompt()
        s.response_token_ids = torch.randint(0, 1500, (128,), generator=gen).tolist()
        s.loss_mask = [1] * 128
        longer.append(s)
    plain = hf_log_probs(model, longer, 1.0)
    noisy = hf_log_probs(model, longer, 1.0, rounding_noise=True)
    assert noisy == hf_log_probs(model, longer, 1.0, rounding_noise=True)  # seeded per forward
    for n, p in zip(noisy, plain, strict=True):  # the image sample and the text one
        gaps = [abs(a - b) for a, b in zip(n, p, strict=True)]
        assert 0 < max(gaps) < 1e-3  # one float32 ulp on the embeddings of a tiny model


def test_replay_refuses_a_sample_without_routes(model_and_samples):
    model, samples = model_and_samples
    bare = samples[0].clone_prompt()
    bare.response_token_ids, bare.loss_mask = [5, 6], [1, 1]
    with pytest.raises(ValueError, match=f"sample {bare.index} has no routed experts"):
        hf_log_probs(model, [bare], 1.0, replay_routes=True)


def test_route_agreement_ignores_the_order_within_a_position_and_counts_per_layer():
    a = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # 2 positions, 2 layers, top-2
    b = np.array([[[1, 0], [2, 4]], [[5, 4], [6, 7]], [[0, 0], [0, 0]]])  # a third position only here
    assert route_agreement([a], [b]) == [1.0, 0.5]


def test_the_default_server_flags_are_the_launchers():
    launcher = (REPO / "examples" / "geo3k_vlm" / "run_geo3k_qwen35.sh").read_text()
    block = re.search(r"ROLLOUT_ENGINE_ARGS=\(--rollout-backend sglang(.*?)\)", launcher, re.S).group(1)
    flags = [t for t in block.split() if t.startswith("--sglang-")]
    given = [t for t in flags if t not in ("--sglang-mem-fraction-static", "--sglang-ep-size")]  # set per test
    assert ["--sglang-" + t[2:] for t in LAUNCHER_FLAGS if t.startswith("--")] == given
    assert server_flags(0.3) == ("--mem-fraction-static", "0.3", *LAUNCHER_FLAGS)
    assert "--disable-cuda-graph" not in server_flags(0.3) and "--disable-cuda-graph" in server_flags(0.3, eager=True)
    assert sglang_argv(0.3, "--enable-return-routed-experts") == [
        "--sglang-mem-fraction-static", "0.3", "--sglang-max-running-requests", "512",
        "--sglang-disable-custom-all-reduce", "--sglang-enable-return-routed-experts"]
    assert sglang_argv(0.3, eager=True)[: len(EAGER_FLAGS)] == ["--sglang-" + t[2:] if t.startswith("--") else t
                                                                for t in EAGER_FLAGS]
