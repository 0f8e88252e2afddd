"""End to end (real Ray, ``python -m slime.train`` in a subprocess): a run killed with SIGKILL
after a checkpoint resumes with ``--load`` as if it had never stopped: the same prompts, the
same sampled responses and rewards, and the same final weights as an uninterrupted run.

1. Run with ``--save DIR --load DIR --save-interval 2`` (``--load`` of a folder without a
   checkpoint starts from ``--hf-checkpoint``).  Once rollout 1 is checkpointed and rollout 2
   logged (so ``metrics.jsonl`` holds a record the checkpoint does not cover), SIGKILL the
   driver's process group.  Every process of the run (Ray's GCS, raylet, agents and workers
   included, which live in process groups of their own) must then die: the run is tracked
   by its session, which nothing outside it can join.
2. Run again with the same flags to ``--num-rollout``: it resumes at rollout 2.

3. Run the same flags uninterrupted into other folders: the reference (started with run 1 and running
   alongside runs 1 and 2, each run in a session and a Ray instance of its own).

The reward is ``tests.rewards:odd_length_reward`` (about half the responses score 1), so GRPO
groups have non-zero advantages and the weights really move between checkpoints.

Checked against references computed here, not by the code under test: the rollout ids in
``metrics.jsonl`` are exactly 0..N-1, once each; the prompts of every rollout (dataset ``index``
in the ``--save-debug-rollout-data`` dumps) follow the documented order,
``numpy.random.default_rng([--rollout-seed, epoch]).permutation(num_rows)``, before and
after the resume; the checkpoint's model folder loads with transformers and its trainer
and data-cursor state is there; every rollout's responses, rewards and advantages, and the
last checkpoint's weights (bit for bit), equal the uninterrupted run's (sampling seeds are per
request, :mod:`slime.rollout.seeds`, so the resumed engines draw what the killed ones would have).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from slime import driver
from slime.arguments import parse_args
from slime.checkpoints import layout as ckpt
from slime.rollout.manager import RolloutBatch
from slime.utils.metrics import MetricsLogger, read_metrics
from tests.process_tree import kill_session, session_members, wait_for, wait_session_gone

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "examples" / "geo3k_vlm" / "data"
NUM_ROLLOUT = 4
SAVE_INTERVAL = 2  # checkpoints of rollouts 1 and 3
PROMPTS, N_SAMPLES = 2, 2
SEED = 3
START_TIMEOUT_S = 600  # Ray start-up and model loading on a busy 2-core CI machine
EXIT_TIMEOUT_S = 30  # for the processes of a killed run to go


def _flags(tiny_ckpt: Path, root: Path, dump_dir: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(tiny_ckpt),
        "--prompt-data", str(DATA_DIR),
        "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
        "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", str(SEED),
        "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", str(PROMPTS),
        "--n-samples-per-prompt", str(N_SAMPLES), "--rollout-max-response-len", "8",
        "--global-batch-size", str(PROMPTS * N_SAMPLES), "--micro-batch-size", "1",
        "--skip-eval-before-train", "--custom-rm-path", "tests.rewards:odd_length_reward", "--lr", "1e-4",
        "--train-backend", "fsdp", "--rollout-backend", "transformers",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
        "--save", str(root / "ckpt"), "--load", str(root / "ckpt"), "--save-interval", str(SAVE_INTERVAL),
        "--output-dir", str(root / "run"), "--no-progress-bar",
        "--save-debug-rollout-data", str(dump_dir / "rollout_{rollout_id}.jsonl"),
    ]  # fmt: skip


def _start(flags: list[str], log: Path) -> subprocess.Popen:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "slime.train", *flags], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _latest(root: Path) -> int:
    marker = root / ckpt.LATEST_FILE
    return int(marker.read_text()) if marker.exists() else -1


def _dumped_rollouts(dump_dir: Path) -> list[int]:
    return sorted(int(path.stem.removeprefix("rollout_")) for path in dump_dir.glob("rollout_*.jsonl"))


def _dumped_indices(dump_dir: Path, rollout_id: int) -> list[int]:
    """Dataset indices of the samples of one rollout, in batch order."""
    records = [json.loads(line) for line in (dump_dir / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
    assert {r["rollout_id"] for r in records} == {rollout_id}
    return [r["index"] for r in records]


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a Hugging Face folder, by checkpoint name."""
    from safetensors.torch import load_file

    return {name: t for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}


def _dumped_records(dump_dir: Path, rollout_id: int) -> list[dict]:
    """The ``--save-debug-rollout-data`` records of one rollout, in batch order."""
    return [json.loads(line) for line in (dump_dir / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]


def _expected_indices(rollout_id: int, num_rows: int) -> list[int]:
    """The documented prompt order of epoch 0 (no skips), each prompt repeated for its n samples."""
    order = np.random.default_rng([SEED, 0]).permutation(num_rows)
    prompts = order[rollout_id * PROMPTS : (rollout_id + 1) * PROMPTS].tolist()
    return [index for index in prompts for _ in range(N_SAMPLES)]


@pytest.mark.slow
def test_sigkill_then_resume(tiny_ckpt, tmp_path):
    """Slow (about 45 s on 2 cores): three driver processes (killed, resumed, reference), each with a Ray
    instance of its own, since the test checks that exactly the killed run's Ray processes die; the reference
    runs alongside the other two."""
    num_rows = pq.read_metadata(DATA_DIR / "train.parquet").num_rows
    assert NUM_ROLLOUT * PROMPTS <= num_rows  # one epoch: the order below is the first permutation
    killed_dumps, resumed_dumps = tmp_path / "dumps_killed", tmp_path / "dumps_resumed"
    reference, reference_dumps = tmp_path / "reference", tmp_path / "dumps_reference"
    reference.mkdir()
    ckpt_root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    sessions = []
    try:
        # 3. (started first, runs meanwhile) The reference: the same run, never interrupted, in a session and a
        # Ray instance of its own, so it overlaps the two runs below instead of following them.
        reference_log = tmp_path / "reference.log"
        reference_run = _start(_flags(tiny_ckpt, reference, reference_dumps), reference_log)
        sessions.append(reference_run.pid)

        # 1. Run, and SIGKILL the driver's process group once rollout 1 is checkpointed and rollout 2 logged.
        log = tmp_path / "killed.log"
        driver = _start(_flags(tiny_ckpt, tmp_path, killed_dumps), log)
        sessions.append(driver.pid)
        wait_for(
            lambda: _latest(ckpt_root) >= 1 and 2 in {r["step"] for r in read_metrics(run_dir / "metrics.jsonl")},
            START_TIMEOUT_S, "the checkpoint of rollout 1 and the record of rollout 2", driver, interval_s=0.1,
        )  # fmt: skip
        run_processes = session_members(driver.pid)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        assert driver.returncode == -signal.SIGKILL, _tail(log)
        assert {"gcs_server", "raylet"} <= {p.comm for p in run_processes}, [str(p) for p in run_processes]
        assert any(p.comm.startswith("ray::TrainerAct") for p in run_processes), [str(p) for p in run_processes]
        survivors = wait_session_gone(driver.pid, EXIT_TIMEOUT_S)
        assert not survivors, "processes of the killed run survived:\n" + "\n".join(map(str, survivors))

        last = _latest(ckpt_root)
        assert last == 1, f"the run was not killed during rollout 3 (last checkpoint: rollout {last})"
        killed_steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
        assert killed_steps == [0, 1, 2], killed_steps  # rollout 2's record is past the checkpoint

        # 2. Resume with the same flags.
        log = tmp_path / "resumed.log"
        driver = _start(_flags(tiny_ckpt, tmp_path, resumed_dumps), log)
        sessions.append(driver.pid)
        assert driver.wait(timeout=START_TIMEOUT_S) == 0, _tail(log)
        assert f"resumed from {ckpt_root} at rollout 2" in log.read_text()
        assert not wait_session_gone(driver.pid, EXIT_TIMEOUT_S), "Ray processes outlived a finished run"

        # 3. The reference, started before step 1, has finished too.
        assert reference_run.wait(timeout=START_TIMEOUT_S) == 0, _tail(reference_log)
    finally:
        for sid in sessions:
            kill_session(sid)

    # (a) every rollout id logged exactly once, in order; nothing skipped by the data pipeline.
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(NUM_ROLLOUT)), [r["step"] for r in records]
    for record in records:
        assert record["rollout/num_samples"] == PROMPTS * N_SAMPLES
        assert all(record[f"data/skipped_{why}"] == 0 for why in ("bad_image", "empty_label", "prompt_too_long"))

    # (b) the prompts of every rollout, before the kill and after the resume, follow the documented order.
    assert _dumped_rollouts(resumed_dumps) == [2, 3]
    for rollout_id in range(NUM_ROLLOUT):
        got = _dumped_indices(killed_dumps if rollout_id < 2 else resumed_dumps, rollout_id)
        assert got == _expected_indices(rollout_id, num_rows), rollout_id

    # (c) exact resume: every rollout sampled the responses of the uninterrupted run, and the weights agree.
    for rollout_id in range(NUM_ROLLOUT):
        got = _dumped_records(killed_dumps if rollout_id < 2 else resumed_dumps, rollout_id)
        expected = _dumped_records(reference_dumps, rollout_id)
        assert [r["response"] for r in got] == [r["response"] for r in expected], rollout_id
        assert got == expected, rollout_id  # rewards, advantages, statuses, lengths too
    rewards = [r["reward"] for i in range(NUM_ROLLOUT) for r in _dumped_records(reference_dumps, i)]
    assert 0 < sum(rewards) < len(rewards)  # mixed rewards: non-zero advantages, so training moved the weights
    resumed = _safetensors(ckpt.model_dir(ckpt_root, NUM_ROLLOUT - 1))
    uninterrupted = _safetensors(ckpt.model_dir(reference / "ckpt", NUM_ROLLOUT - 1))
    initial = _safetensors(Path(tiny_ckpt))
    assert resumed.keys() == uninterrupted.keys() and resumed
    different = [k for k in resumed if not torch.equal(resumed[k], uninterrupted[k])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"
    moved = [k for k in resumed.keys() & initial.keys() if not torch.equal(initial[k], resumed[k])]
    assert len(moved) > len(resumed) // 2, len(moved)  # training did move the weights

    # Checkpoint contents: every --save-interval-th rollout and the last one, each complete.
    assert _latest(ckpt_root) == NUM_ROLLOUT - 1
    assert sorted(p.name for p in ckpt_root.glob("iter_*")) == ["iter_0000001", "iter_0000003"]
    from transformers import AutoModelForImageTextToText

    initial = AutoModelForImageTextToText.from_pretrained(tiny_ckpt)
    shapes = {name: tuple(t.shape) for name, t in initial.state_dict().items()}
    for rollout_id in (1, 3):
        model = AutoModelForImageTextToText.from_pretrained(ckpt.model_dir(ckpt_root, rollout_id))
        assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == shapes
        trainer = ckpt.trainer_dir(ckpt_root, rollout_id)
        assert (trainer / "scheduler.pt").is_file() and any((trainer / "optimizer").iterdir())
        assert sorted(p.name for p in trainer.glob("rng_rank*.pt")) == ["rng_rank00000.pt", "rng_rank00001.pt"]
        state = torch.load(ckpt.rollout_state_path(ckpt_root, rollout_id), weights_only=False)
        assert state["rollout_id"] == rollout_id
        cursor = state["dataset"]
        assert (cursor["epoch"], cursor["position"]) == (0, (rollout_id + 1) * PROMPTS), cursor


# ---------------------------------------------------------------------------------------
# The window between "checkpoint marked complete" and "step logged" (no Ray: stand-ins)
# ---------------------------------------------------------------------------------------


class _Manager:
    """Stand-in rollout manager: no samples, fixed metrics."""

    def generate(self, rollout_id):
        return RolloutBatch(samples=[], metrics={"rollout/reward_mean": 0.5})

    def evaluate(self, rollout_id):
        return {"eval/geo3k/accuracy": 0.25}

    def state_dict(self):
        return {"dataset": {}}


class _Trainers:
    def train(self, rollout_id, samples):
        return {"train/loss": 1.0}

    def update_weights(self, engines):
        pass

    def save(self, rollout_id, path):
        Path(path).mkdir(parents=True)


def test_step_records_are_logged_before_its_checkpoint_is_marked(tiny_ckpt, tmp_path, monkeypatch):
    """A SIGKILL right after ``latest_checkpointed_iteration.txt`` names rollout k must not lose
    rollout k's metrics record (nor the eval record after it): the resumed run starts at k + 1
    and never logs k again.  So each record must be on disk before the marker names its step."""
    cfg = parse_args([
        "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(DATA_DIR),
        "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--train-backend", "fsdp", "--rollout-backend", "transformers", "--rollout-num-gpus", "1",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
        "--eval-interval", "1", "--eval-prompt-data", "geo3k", str(DATA_DIR / "test.parquet"),
        "--skip-eval-before-train", "--no-progress-bar",
    ])  # fmt: skip
    on_disk_when_marked = {}

    def mark_latest(root, rollout_id):
        records = read_metrics(tmp_path / "metrics.jsonl")
        kinds = ["eval" if "eval/geo3k/accuracy" in r else "rollout" for r in records]
        on_disk_when_marked[rollout_id] = [(r["step"], kind) for r, kind in zip(records, kinds)]
        ckpt_mark_latest(root, rollout_id)

    ckpt_mark_latest = ckpt.mark_latest
    monkeypatch.setattr(ckpt, "mark_latest", mark_latest)
    run = driver.Run(  # engines: a stand-in (None is a train-only replay, which runs no eval)
        engines=object(), trainers=_Trainers(), rollout_manager=_Manager(),
        memory=driver.ColocatedMemory(None, None, enabled=False), start=0, num_rollout=3,
    )  # fmt: skip
    with MetricsLogger(tmp_path, cfg.wandb, run_name="order") as metrics_log:
        driver.loop(cfg, run, metrics_log)

    for k in range(3):
        assert on_disk_when_marked[k][-2:] == [(k, "rollout"), (k + 1, "eval")], on_disk_when_marked
    assert _latest(tmp_path / "ckpt") == 2
