"""The GRPO loop learns a task that only the image can solve; three ablations show that
this test fails when pixels stop reaching the policy (in rollout or in training) or when
the weight sync is skipped.

Task (:mod:`scripts.harness.colour_task`): a solid red, green or blue 64x64 image and the word
``colour``; the reward is 1 when the first word of the one-token answer names the colour.
The prompt text is the same for every colour, so a policy that cannot see the pixels
scores at most 1/3 on average over a batch that holds each colour equally often (the
batches here always do: no shuffle, rows in the order red, green, blue, and
``--rollout-batch-size`` a multiple of 3).

Every run is the real driver, ``python -m slime.train`` in a subprocess: a local Ray, one
transformers engine, two trainer ranks over gloo (FSDP2; Megatron, packed, for the Megatron main run and the
engine ablations; on a GPU machine also: one GPU, engine and
trainer colocated, for each of ``--train-backend megatron`` and ``fsdp``); the per-step reward is read back
from ``<output-dir>/metrics.jsonl`` (``rollout/reward_mean`` at ``step`` = rollout id).
Ablations plug in through the same import-path flags that users use for their own engines
and trainers (:mod:`tests.learning_ablations`).

Starting policy: the word-level tiny checkpoint with a *colour prior*
(:func:`colour_prior_checkpoint`): the three colour words' logits are raised by
:data:`PRIOR_NATS` in every answer context, equally for the three words, so the policy
starts by naming a colour at random: reward about 1/3, the best a text-only policy can
do, and every gain above it has to come from the pixels.  From the bare random checkpoint
(each colour word about 5 %) learning first has to find the colour words at all; in that
phase one colour word often drifts to probability ~0 before the image pathway forms, and
GRPO then never sees a correct answer for that colour again (zero-variance groups).  In a
single-process replica of this loop that took 2x the rollouts and still stalled at 2/3
reward on 2-3 of 8 seeds; with the prior, every seed converged.

Criterion (:func:`first_window_reaching`): the mean reward of ``WINDOW`` consecutive
rollouts reaches :data:`TARGET` (0.9) within :data:`NUM_ROLLOUT` rollouts, and the first
rollout scores below 0.5.  A window of 3 rollouts (144 samples) is not met by luck: a
text-only policy would need 0.9 where its expectation is <= 1/3 (more than 10 standard
deviations).  A window rather than "the last K rollouts" because GRPO gives no gradient
to groups it has solved, so near 1.0 the reward may dip for a rollout while the policy
learns the remaining colour; the ablations are judged by the same window.

Hyper-parameters, and why (see :data:`TRAIN_FLAGS`):

- 6 prompts x 8 samples = 48 samples per rollout; ``--global-batch-size 24`` gives two
  optimizer steps per rollout, and since a step takes a contiguous slice of the groups,
  each step holds one group of every colour.  Steps that see a single colour push that
  word up for every image (the text-only part of the gradient does not cancel), which
  made the policy collapse onto one word in trials.
- Adam at ``--lr 2e-3`` (the weights are initialised with std 0.02) with 4 warm-up steps:
  Adam's first steps move every weight by about ``lr`` whatever the gradient's size, so a
  noisy first step at the full rate would otherwise undo the prior.
- ``--rollout-temperature 0.5``: a sharper policy needs half the logit margin for the same
  reward, which halves the steps to 0.9; lower temperatures made runs unstable.
- ``--eps-clip 0.5 --eps-clip-high 1.0``: the second step of a rollout is slightly
  off-policy; the wider range lets it use its samples instead of clipping them.

Cost: about 30 s a run on an idle 2-core machine (five runs), each a real driver starting its own engine
and trainer processes for 12 rollouts.  The runs share the colour-prior checkpoint and one Ray head
(:func:`ray_address`), and the five independent ones run up to three at a time (:func:`cpu_runs`).  The
ablations keep the main runs' full budget: they must show that the main criterion cannot be met without
their link, and a shorter budget would let through a leak that learns as slowly as the real loop does (the
main runs first reach the window at rollout 8 of 0..11).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint
from slime.utils.metrics import read_metrics
from slime.utils.timer import TRAIN_SUB_PHASES
from scripts.harness.colour_task import COLOURS, VOCAB_WORDS, write_colour_dataset
from tests.ray_head import ray_env, ray_head

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]

TARGET = 0.9
"""Mean reward of a window of rollouts that counts as learned."""
WINDOW = 3
"""Consecutive rollouts whose mean reward must reach :data:`TARGET`."""
NUM_ROLLOUT = 12
"""The budget, for the main run and every ablation alike."""
START_MAX = 0.5
"""The first rollout's reward must be below this (the policy starts near 1/3)."""
PRIOR_NATS = 3.0
"""Logit boost of every colour word in the starting checkpoint (see the module docstring)."""
PROMPTS_PER_ROLLOUT = 6
"""``--rollout-batch-size``: a multiple of 3, so every colour is equally frequent."""
LOGPROB_GAP_MAX = 1e-3
"""Largest ``train/logprob_abs_diff`` (mean |rollout - trainer| log-prob, nats) in the main
run: both sides use float32 on CPU, so anything above rounding means that the engine and
the trainer did not see the same weights or the same pixels."""

TRAIN_FLAGS = [
    "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
    "--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}',
    "--custom-rm-path", "scripts.harness.colour_task:colour_reward",
    "--num-rollout", str(NUM_ROLLOUT),
    "--rollout-batch-size", str(PROMPTS_PER_ROLLOUT), "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "1", "--rollout-temperature", "0.5",
    "--global-batch-size", "24", "--micro-batch-size", "1",
    "--advantage-estimator", "grpo", "--eps-clip", "0.5", "--eps-clip-high", "1.0",
    "--optimizer", "adam", "--lr", "2e-3", "--lr-warmup-iters", "4", "--lr-decay-style", "constant",
    "--weight-decay", "0",
    "--train-backend", "fsdp", "--rollout-backend", "transformers",
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
    "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
    "--rollout-seed", "1", "--seed", "1",
    "--skip-eval-before-train", "--no-progress-bar",
]  # fmt: skip

MEGATRON_PACKED = ["--train-backend", "megatron", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024"]
"""The Megatron main run packs each optimizer step's samples of a rank (12 of about 22 tokens) into one micro-batch, as
the launcher packs on a GPU; the FSDP run keeps one sample per micro-batch (its Gated DeltaNet layers train one
sequence at a time).  The same seed gives both runs the same rewards up to rounding, and the packed run's train phase
takes a third of the unpacked one's on 2 cores."""

ABLATIONS = {
    "blind_rollout": ["--rollout-backend", "tests.learning_ablations:BlindEngine", *MEGATRON_PACKED],
    "blind_training": ["--train-backend", "tests.learning_ablations:BlindTrainer"],
    "no_weight_sync": ["--rollout-backend", "tests.learning_ablations:FrozenEngine", *MEGATRON_PACKED],
}
"""Each replaces one link of the loop of a main run; later flags override :data:`TRAIN_FLAGS`.  The two engine
ablations train as the Megatron main run does (packed: a third of the FSDP run's train phase), the trainer ablation
is the FSDP main run's trainer with grey pixels."""


def first_window_reaching(rewards: list[float], target: float = TARGET, window: int = WINDOW) -> int | None:
    """Index of the last rollout of the first ``window`` consecutive rollouts whose mean
    reward is ``>= target``; None if no window reaches it."""
    for end in range(window - 1, len(rewards)):
        if sum(rewards[end - window + 1 : end + 1]) / window >= target:
            return end
    return None


def test_first_window_reaching_by_hand():
    assert first_window_reaching([0.3, 0.9, 0.9, 0.9]) == 3
    assert first_window_reaching([0.3, 0.8, 1.0, 0.9, 0.2]) == 3  # (0.8 + 1.0 + 0.9) / 3 = 0.9
    assert first_window_reaching([0.3, 1.0, 1.0, 0.6, 1.0]) is None  # best window 0.867
    assert first_window_reaching([1.0, 1.0]) is None  # shorter than a window


@pytest.fixture(scope="module")
def colour_prior_checkpoint(tmp_path_factory) -> Path:
    """The word-level tiny checkpoint whose answer distribution starts on the colour words.

    Row ``c`` of ``lm_head`` (the logits are ``W @ h``, ``h`` the final normed hidden state)
    becomes ``W[c] + PRIOR_NATS * h_mean / |h_mean|^2`` for the three colour words, where
    ``h_mean`` is the mean ``h`` at the answer position of the three training prompts
    (built by the data pipeline with this test's flags, so the same tokens and pixels).
    Every colour word's logit thus rises by ``PRIOR_NATS * (h . h_mean) / |h_mean|^2``, the
    same amount for all three words in a given context: which colour the policy prefers
    for which image is left as random as the initialisation made it.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor, mm_token_type_ids

    src = ensure_tiny_checkpoint(vocab_words=VOCAB_WORDS)
    work = tmp_path_factory.mktemp("colour_prior")
    data = work / "colours.parquet"
    write_colour_dataset(data, rows_per_colour=1)
    cfg = parse_args(["--hf-checkpoint", str(src), "--prompt-data", str(data), *TRAIN_FLAGS])
    processor = load_processor(src)
    prompts = PromptDataset(cfg.data, processor, seed=0).next_batch(len(COLOURS))

    # With flash-linear-attention installed (the GPU profile), transformers' Gated DeltaNet takes fla's Triton
    # kernels, which cannot run on CPU tensors: there the forward runs on the GPU.
    device = "cuda" if torch.cuda.is_available() and importlib.util.find_spec("fla") else "cpu"
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(src, dtype=torch.float32).to(device).eval()
    last_hidden = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p.prompt_token_ids])
            out = model(
                input_ids=ids.to(device),
                pixel_values=p.multimodal_inputs["pixel_values"].to(device),
                image_grid_thw=p.multimodal_inputs["image_grid_thw"].to(device),
                mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id).to(device),
                output_hidden_states=True,
            )
            last_hidden.append(out.hidden_states[-1][0, -1].cpu())
    del model
    h_mean = torch.stack(last_hidden).mean(0)

    dst = work / "checkpoint"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    colour_ids = [processor.tokenizer.convert_tokens_to_ids(word) for word in COLOURS]
    weights["lm_head.weight"][colour_ids] += PRIOR_NATS * h_mean / h_mean.dot(h_mean)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


RUNS_AT_ONCE = 3
"""CPU runs of this module that run at the same time on the shared head (:func:`cpu_runs`); each is a driver, an
engine, two trainer ranks and a scorer (about 2.5 GB).  The runs are seeded, so running side by side changes their
wall time only (much of a run's time is start-up and hand-overs between its processes, which overlap)."""
CPUS_PER_RUN = 4
"""Logical CPUs a run takes on the head: 2 trainer bundles, 1 engine bundle and one to spare (what a local instance
gets, :func:`slime.ray.placement.init_ray`)."""


@pytest.fixture(scope="module")
def ray_address() -> str:
    """One Ray head that the CPU runs of this module join (``--ray-address``, as ``SLIME_SCRIPT_EXTERNAL_RAY=1``
    does): each run is spared a local Ray instance's start and stop.  Logical CPUs for :data:`RUNS_AT_ONCE` runs
    and the dynamic-sampling run beside them."""
    with ray_head(ray_env(), num_cpus=CPUS_PER_RUN * (RUNS_AT_ONCE + 1)) as (_, address):
        yield address


def _selected_cpu_runs(request) -> list[str]:
    """Names of the independent CPU runs (``main-<backend>``, ``ablation-<name>``) that this session's selected
    tests of this module read, in test order (the dynamic-sampling test reads the Megatron main run)."""
    names = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname == "test_grpo_learns_colour_from_pixels":
            names.append(f"main-{params['backend']}")
        elif item.originalname == "test_dynamic_sampling_learns_in_no_more_rollouts":
            names.append("main-megatron")
        elif item.originalname == "test_ablation_does_not_learn":
            names.append(f"ablation-{params['ablation']}")
    return list(dict.fromkeys(names))


@pytest.fixture(scope="module")
def cpu_runs(request, colour_prior_checkpoint, ray_address, tmp_path_factory) -> dict[str, Future]:
    """The module's independent CPU runs, each :func:`run_training` with the full budget exactly as a test would
    run it alone, started when the first test needs one, :data:`RUNS_AT_ONCE` at a time, all joining the one head:
    run name -> future of ``(rewards, records)``.  Only the runs of the selected tests start.  Each test then
    reads its run's result; a failed run fails the tests that read it, with the driver's output."""
    artifacts = os.environ.get("SLIME_TEST_ARTIFACTS")

    def run_dir(name: str) -> Path:
        if artifacts and name.startswith("main-"):  # kept for ``python -m slime.utils.plot_runs``
            path = Path(artifacts) / f"colour-cpu-{name.removeprefix('main-')}"
            shutil.rmtree(path, ignore_errors=True)
            return path
        return tmp_path_factory.mktemp(name) / "run"

    def flags(name: str) -> list[str]:
        kind, _, which = name.partition("-")
        if kind != "main":
            return ABLATIONS[which]
        return MEGATRON_PACKED if which == "megatron" else ["--train-backend", which]

    pool = ThreadPoolExecutor(max_workers=RUNS_AT_ONCE, thread_name_prefix="colour-run")
    try:
        yield {
            name: pool.submit(run_training, colour_prior_checkpoint, run_dir(name), flags(name),
                              ray_address=ray_address)
            for name in _selected_cpu_runs(request)
        }  # fmt: skip
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_training(checkpoint: Path, run_dir: Path, extra_flags: list[str] = (), num_rollout: int = NUM_ROLLOUT,
                 ray_address: str | None = None) -> tuple[list[float], list[dict]]:
    """Run ``python -m slime.train`` on the colour task for ``num_rollout`` rollouts, joining the Ray cluster at
    ``ray_address`` (None: the driver starts a local one); returns (reward per rollout, all metrics records).

    Fails the test (with the end of the driver's output) if the driver fails or does not
    log a reward for every rollout, so that an ablation can never pass by crashing.
    """
    run_dir.mkdir(parents=True)
    data = run_dir / "colours.parquet"
    write_colour_dataset(data, rows_per_colour=PROMPTS_PER_ROLLOUT // len(COLOURS))
    output_dir = run_dir / "out"
    argv = [
        sys.executable, "-m", "slime.train",
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data), "--output-dir", str(output_dir),
        *TRAIN_FLAGS, *extra_flags, "--num-rollout", str(num_rollout),
        *(["--ray-address", ray_address] if ray_address else []),
    ]  # fmt: skip
    env = {**ray_env(), "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (run_dir / "driver.log").write_text(log)
    assert proc.returncode == 0, f"slime.train exited with {proc.returncode}:\n{log[-4000:]}"
    records = read_metrics(output_dir / "metrics.jsonl")
    rewards = {r["step"]: r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r}
    assert sorted(rewards) == list(range(num_rollout)), f"rewards logged for steps {sorted(rewards)}:\n{log[-4000:]}"
    return [rewards[step] for step in range(num_rollout)], records


def _curve(rewards: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in rewards)


DYNAMIC_SAMPLING_FLAGS = ["--dynamic-sampling-filter-path", "nonzero_std_with_fallback",
                          "--dynamic-sampling-max-rounds", "3"]
"""DAPO dynamic sampling: rounds of 6 prompts until 6 groups whose rewards vary, at most 3 rounds, then the
first constant groups fill the batch (once the policy is right on every colour, every group is constant)."""


def _generation_s(records: list[dict]) -> float:
    return sum(r.get("perf/rollout_time_s", 0.0) for r in records)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_grpo_learns_colour_from_pixels(backend, cpu_runs):
    """Two trainer ranks on CPU per trainer (``--train-backend``; Megatron packs, :data:`MEGATRON_PACKED`);
    ``SLIME_TEST_ARTIFACTS=DIR`` keeps each run in ``DIR/colour-cpu-<backend>`` (for ``python -m
    slime.utils.plot_runs``)."""
    rewards, records = cpu_runs[f"main-{backend}"].result()
    print(f"main run ({backend}) rewards per rollout: {_curve(rewards)}; generation {_generation_s(records):.1f} s")
    assert rewards[0] < START_MAX, f"the policy starts too good: {_curve(rewards)}"
    end = first_window_reaching(rewards)
    assert end is not None, (
        f"no {WINDOW} consecutive rollouts reached a mean reward of {TARGET} in {NUM_ROLLOUT} rollouts: "
        f"{_curve(rewards)}"
    )
    gaps = [r["train/logprob_abs_diff"] for r in records if "train/logprob_abs_diff" in r]
    assert len(gaps) == NUM_ROLLOUT and max(gaps) < LOGPROB_GAP_MAX, (
        f"rollout and trainer log-probs differ (mean |diff| per rollout: {gaps}): the engine and the trainer "
        "do not see the same weights or the same pixels"
    )
    if backend == "megatron":  # MEGATRON_PACKED: one micro-batch per optimizer step and rank
        assert {r["train/micro_batches"] for r in records if "train/micro_batches" in r} == {1}, records[-1]
    for r in records:  # the real trainer group over Ray: its sub-phases account for the train phase
        if "perf/train_time_s" in r:
            parts = {sub: r[f"perf/train_{sub}_s"] for sub in TRAIN_SUB_PHASES if f"perf/train_{sub}_s" in r}
            assert sum(parts.values()) == pytest.approx(r["perf/train_time_s"], rel=0.05), (r["step"], parts)


def test_dynamic_sampling_learns_in_no_more_rollouts(colour_prior_checkpoint, ray_address, cpu_runs, tmp_path):
    """The Megatron main run (packed) with DAPO dynamic sampling reaches the criterion in no more rollout steps than
    without.

    The baseline is the Megatron main run of this session (:func:`cpu_runs`: one run for both tests); the
    dynamic-sampling run stops at the rollout where the baseline met the criterion (it has to meet it by then).
    Dynamic sampling trains only on groups whose rewards vary, so its ``rollout/reward_mean`` (of the kept
    groups) is not the policy's accuracy; the criterion reads ``rollout/dynamic_sampling/generated_reward_mean``,
    the reward of every group generated in the step (the rounds hold every colour equally often).
    """
    rewards, records = cpu_runs["main-megatron"].result()
    base_end = first_window_reaching(rewards)
    assert base_end is not None, f"the baseline did not learn: {_curve(rewards)}"
    _, ds_records = run_training(colour_prior_checkpoint, tmp_path / "dynamic_sampling",
                                 [*MEGATRON_PACKED, *DYNAMIC_SAMPLING_FLAGS],
                                 num_rollout=base_end + 1, ray_address=ray_address)
    generated = {r["step"]: r["rollout/dynamic_sampling/generated_reward_mean"] for r in ds_records
                 if "rollout/dynamic_sampling/generated_reward_mean" in r}
    ds_rewards = [generated[step] for step in range(base_end + 1)]
    rounds = [r["rollout/dynamic_sampling/rounds"] for r in ds_records if "rollout/dynamic_sampling/rounds" in r]
    ds_end = first_window_reaching(ds_rewards)
    base_s = sum(r.get("perf/rollout_time_s", 0.0) for r in records if r.get("step", NUM_ROLLOUT) <= base_end)
    print(f"without dynamic sampling: criterion at rollout {base_end}, generation {base_s:.1f} s to there, "
          f"rewards {_curve(rewards)}")
    print(f"with dynamic sampling: criterion at rollout {ds_end}, generation {_generation_s(ds_records):.1f} s to "
          f"rollout {base_end}, rewards of all generated groups {_curve(ds_rewards)}, rounds per step {rounds}")
    assert ds_rewards[0] < START_MAX, f"the policy starts too good: {_curve(ds_rewards)}"
    assert ds_end is not None and ds_end <= base_end, (base_end, ds_end)


GPU_FLAGS = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--colocate", "--bf16"]
"""One GPU, trainer and engine colocated, both computing in bf16 as the launcher trains on a GPU (``--bf16``:
fp32 master weights); the bf16 kernels (fla's Gated DeltaNet among them) are those the H200 runs proved."""
GPU_LOGPROB_GAP_MAX = 5e-2
"""Engine and trainer both compute in bf16 on the GPU, in different kernels: the gap is bf16 rounding, not 1e-3."""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_grpo_learns_colour_from_pixels_on_one_gpu(backend, colour_prior_checkpoint, tmp_path):
    """The same task, seed and flags on one GPU, per trainer.  ``SLIME_TEST_ARTIFACTS=DIR`` keeps each run in
    ``DIR/colour-<backend>`` (for ``python -m slime.utils.plot_runs``: ``docs/results/fsdp_vs_megatron.png``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    artifacts = os.environ.get("SLIME_TEST_ARTIFACTS")
    run_dir = Path(artifacts) / f"colour-{backend}" if artifacts else tmp_path / backend
    shutil.rmtree(run_dir, ignore_errors=True)
    rewards, records = run_training(colour_prior_checkpoint, run_dir, ["--train-backend", backend, *GPU_FLAGS])
    gaps = [r["train/logprob_abs_diff"] for r in records if "train/logprob_abs_diff" in r]
    print(f"{backend} on one GPU, rewards per rollout: {_curve(rewards)}; log-prob gaps {gaps}")
    assert rewards[0] < START_MAX, f"the policy starts too good: {_curve(rewards)}"
    assert first_window_reaching(rewards) is not None, (
        f"{backend}: no {WINDOW} consecutive rollouts reached a mean reward of {TARGET} in {NUM_ROLLOUT} rollouts: "
        f"{_curve(rewards)}"
    )
    assert len(gaps) == NUM_ROLLOUT and max(gaps) < GPU_LOGPROB_GAP_MAX, gaps


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_ablation_does_not_learn(ablation, cpu_runs):
    rewards, _ = cpu_runs[f"ablation-{ablation}"].result()
    print(f"{ablation} rewards per rollout: {_curve(rewards)}")
    assert first_window_reaching(rewards) is None, (
        f"{ablation}: reached a {WINDOW}-rollout mean reward of {TARGET} without pixels or weight sync, so "
        f"the main test cannot tell these links apart: {_curve(rewards)}"
    )
