"""End to end (real Ray, 2 FSDP trainer ranks over gloo, 1 transformers engine, CPU fp32):
after a weight sync, the engine's log-probs of a greedy response to a prompt with an image
equal the trainer's log-probs of the same tokens.

The reference is the trainer's own forward over the full sequence (prompt + response,
one pass), while the engine's log-probs come from a KV-cached prefill + decode loop in
another process; the two agree only if every trained tensor reached the engine under
the right name.  The test also shows it can fail: after a real GRPO step and before the
sync, the same comparison is off by far more than the tolerance.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import pytest
import ray

from slime.arguments import parse_args
from slime.data.processor import load_processor
from slime.driver import resolve_components, start_workers
from slime.ray.placement import create_placement_groups, init_ray
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.manager import RolloutManager

DATA_DIR = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
TOLERANCE = 1e-4
"""Max |engine - trainer| log-prob (nats): both fp32 on CPU, only the kernels' summation order differs."""
RESPONSE_TOKENS = 12

_calls = itertools.count()


def alternating_reward(response: str, label: str, cfg) -> float:
    """1.0 for every other response scored by this process (0, 1, 0, 1, ...).

    With one scorer worker (``--rm-num-workers 1``), which scores a batch in order, the two
    samples of every group get different rewards, so every GRPO advantage is +-1 and the
    train step moves the weights whatever the tiny random model writes.
    """
    return float(next(_calls) % 2)


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    return parse_args([
        "--hf-checkpoint", str(tiny_ckpt),
        "--prompt-data", str(DATA_DIR),
        "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
        "--apply-chat-template",
        "--custom-rm-path", f"{__name__}:alternating_reward", "--rm-num-workers", "1",
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--global-batch-size", "4", "--micro-batch-size", "1",
        # Adam's first step moves every parameter with a gradient by about lr: 1e-3 shifts the log-probs
        # of the tiny model by ~1e-2 nats or more, two orders of magnitude above TOLERANCE.
        "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0",
        "--train-backend", "fsdp", "--rollout-backend", "transformers",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def workers(cfg):
    """(engines, trainers, rollout manager), started as ``slime.driver.setup`` does, on a local Ray."""
    started_ray = init_ray(cfg.cluster)
    manager = None
    cleanup = contextlib.ExitStack()  # stops the engines and trainers, then frees the bundles
    try:
        placement = create_placement_groups(cfg.cluster, use_gpu=False)
        cleanup.callback(placement.remove)
        engines, trainers = start_workers(cfg, placement, resolve_components(cfg), cleanup)
        assert trainers.init() == 0
        processor = load_processor(
            cfg.checkpoint.hf_checkpoint, min_pixels=cfg.data.image_min_pixels, max_pixels=cfg.data.image_max_pixels
        )
        manager = RolloutManager(
            rollout=cfg.rollout, data=cfg.data, reward=cfg.reward, grpo=cfg.grpo, evaluation=cfg.eval,
            processor=processor, engines=engines, seed=cfg.rollout.rollout_seed,
        )  # fmt: skip
        yield engines, trainers, manager
    finally:
        if manager is not None:
            manager.close()
        cleanup.close()
        if started_ray:
            ray.shutdown()


def _greedy_gap(engines, trainers, prompt) -> tuple[float, list[int]]:
    """Generate greedily (top_k=1) for ``prompt`` on the engine; return the largest
    |engine log-prob - trainer log-prob| over the response tokens, and the tokens."""
    params = SamplingParams(max_new_tokens=RESPONSE_TOKENS, temperature=1.0, top_k=1)
    [out] = engines.generate([GenerateRequest(prompt.prompt, prompt.images, params)])
    assert out.prompt_tokens == len(prompt.prompt_token_ids)
    assert len(out.output_ids) >= 4, out  # enough tokens to compare (an early EOS would leave too few)
    sample = prompt.clone_prompt()
    sample.response_token_ids = list(out.output_ids)
    sample.loss_mask = [1] * len(out.output_ids)
    sample.rollout_log_probs = list(out.output_log_probs)
    [trainer_log_probs] = trainers.compute_log_probs([sample])
    assert len(trainer_log_probs) == len(out.output_log_probs)
    gap = max(abs(a - b) for a, b in zip(out.output_log_probs, trainer_log_probs))
    return gap, list(out.output_ids)


@pytest.mark.slow
def test_engine_log_probs_match_trainer_only_after_sync(workers):
    engines, trainers, manager = workers
    prompt = manager.dataset.make_sample(0)
    assert prompt is not None and prompt.images and "pixel_values" in prompt.multimodal_inputs

    # Both start from --hf-checkpoint: the comparison itself is sound.
    gap_initial, _ = _greedy_gap(engines, trainers, prompt)
    assert gap_initial < TOLERANCE, gap_initial

    # One real GRPO step (rollout, mixed rewards, non-zero advantages) changes only the trainer.
    batch = manager.generate(0)
    advantages = [s.advantage for s in batch.samples]
    rewards = [s.reward for s in batch.samples]
    assert rewards == [0.0, 1.0, 0.0, 1.0], f"{rewards}: does the scorer still score a batch in order, one at a time?"
    assert all(abs(a) > 0.5 for a in advantages), advantages
    metrics = trainers.train(0, batch.samples)
    assert metrics["train/grad_norm"] > 0, metrics

    gap_stale, _ = _greedy_gap(engines, trainers, prompt)
    assert gap_stale > 100 * TOLERANCE, f"the train step barely moved the log-probs ({gap_stale}): no test of the sync"

    trainers.update_weights(engines)
    gap_synced, tokens = _greedy_gap(engines, trainers, prompt)
    assert gap_synced < TOLERANCE, (gap_synced, gap_stale, tokens)
