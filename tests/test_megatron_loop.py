"""End to end on CPU (real Ray, ``python -m slime.train`` in a subprocess): ``--train-backend megatron`` with
2 data-parallel ranks over gloo and one transformers engine, 3 rollouts with a checkpoint, then a resume
with ``--load`` for 1 more.

Rewards alternate 0 / 1 within every group (:func:`tests.rewards.alternating_reward`), so every step moves the
weights.
Checked against what the code under test does not compute itself: the engine's log-probs of every
rollout equal the trainer's recomputed ones (``train/logprob_abs_diff`` at float32 rounding, so every
weight reached the engine under the right name after each sync, vision tower included); the metrics
hold each rollout once; the checkpoint holds the parts the backend names; the resumed run starts at
the rollout after the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.backends.megatron.config import MegatronConfig
from slime.checkpoints import layout as ckpt
from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "examples" / "geo3k_vlm" / "data"
GAP_MAX = 1e-3
"""Mean |rollout - trainer| log-prob: both fp32 on CPU, only the kernels' summation order differs."""

def _run(tiny_ckpt: Path, root: Path, num_rollout: int, log: Path) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "slime.train",
        "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(DATA_DIR),
        "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
        "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", "2",
        "--custom-rm-path", "tests.rewards:alternating_reward", "--rm-num-workers", "1",
        "--num-rollout", str(num_rollout), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--global-batch-size", "4",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048", "--skip-eval-before-train",
        "--lr", "1e-3", "--train-backend", "megatron", "--rollout-backend", "transformers",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
        "--save", str(root / "ckpt"), "--load", str(root / "ckpt"), "--save-interval", "3",
        "--output-dir", str(root / "run"), "--no-progress-bar",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def test_three_rollouts_save_then_resume_one_more(tiny_ckpt, tmp_path):
    """Slow (about 60 s on 2 cores): two ``python -m slime.train`` processes, each starting Ray, two Megatron
    ranks (megatron-core and the native model built in each) and an engine, with a checkpoint write and read."""
    first = _run(tiny_ckpt, tmp_path, 3, tmp_path / "first.log")
    assert first.returncode == 0, first.stderr[-4000:]
    assert ckpt.latest_iteration(tmp_path / "ckpt") == 2
    ckpt.check_complete(tmp_path / "ckpt", 2, MegatronConfig().checkpoint_parts())

    second = _run(tiny_ckpt, tmp_path, 4, tmp_path / "second.log")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout + second.stderr

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r["step"] for r in records if "rollout/reward_mean" in r]
    assert steps == [0, 1, 2, 3]
    gaps = [r["train/logprob_abs_diff"] for r in records if "train/logprob_abs_diff" in r]
    assert len(gaps) == 4 and max(gaps) < GAP_MAX, gaps
    assert all(r["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6) for r in records if "train/ppo_kl" in r)
    assert all(r["train/grad_norm"] > 0 for r in records if "train/grad_norm" in r)  # the weights moved
