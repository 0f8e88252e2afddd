"""The training step of every backend (:func:`slime.backends.step.train_step`), with a stand-in backend.

The stand-in (``tests/standin_backend.py``) implements only the step's protocol: a float64 "policy" on the CPU whose
log-probability of token ``y`` is ``log sigmoid(F[y] . w)`` (``F`` a fixed feature table, ``w`` the 3 weights), plain
SGD as its update, and a record of what the step asked of it.  Every expected value is computed here independently in
float64: the clipped GRPO loss with a k3 KL term and an entropy bonus written out by hand, its gradient by autograd
of that hand-written loss, the learning rate of the warm-up, ``--clip-grad``'s factor, the averages over
optimizer steps and the train-vs-rollout log-prob gap.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from slime.backends.config import TrainConfig
from slime.backends.samples import SampleError
from slime.backends.step import TRAINER_TOTAL_KEY, NonFiniteGradNorm, train_step
from slime.backends.train_metrics import LogprobGapError
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.grpo.loss import loss_metric_names
from tests.standin_backend import (
    ENTROPY_COEF, EPS, EPS_HIGH, FEATURES, GRPO, KL_COEF, LR, W0, W_REF, WARMUP, StandIn, hand_samples,
)

# ---------------------------------------------------------------------------------------
# the independent reference: the loss by hand, autograd of it, SGD
# ---------------------------------------------------------------------------------------


def log_probs(w: torch.Tensor, sample: Sample) -> torch.Tensor:
    return -torch.log1p(torch.exp(-(FEATURES[sample.response_token_ids] @ w)))  # log sigmoid


def hand_step(w, samples, old, per_token):
    """The step's loss and metrics (float64, tensors with grad through ``w``) over its samples."""
    w_ref = torch.tensor(W_REF, dtype=torch.float64)
    per_sample = {name: [] for name in ("pg", "clipped", "kl_old", "kl_ref", "entropy")}
    masks = []
    for sample, old_lp in zip(samples, old):
        lp = log_probs(w, sample)
        ratio = torch.exp(lp - old_lp)
        a = sample.advantage
        unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH)
        per_sample["pg"].append(torch.maximum(unclipped, clipped))
        per_sample["clipped"].append((clipped > unclipped).double())
        per_sample["kl_old"].append(old_lp - lp)
        x = lp - log_probs(w_ref, sample)
        per_sample["kl_ref"].append(torch.exp(-x) - 1 + x)  # k3
        p = torch.exp(lp)
        per_sample["entropy"].append(-(p * lp + (1 - p) * torch.log1p(-p)))
        masks.append(torch.tensor(sample.loss_mask, dtype=torch.float64))

    def mean(values):
        if per_token:
            return sum((v * m).sum() for v, m in zip(values, masks)) / sum(m.sum() for m in masks)
        return sum((v * m).sum() / m.sum() for v, m in zip(values, masks)) / len(values)

    pg, kl, entropy = mean(per_sample["pg"]), mean(per_sample["kl_ref"]), mean(per_sample["entropy"])
    loss = pg + KL_COEF * kl - ENTROPY_COEF * entropy
    metrics = {"loss": loss, "pg_loss": pg, "pg_clipfrac": mean(per_sample["clipped"]),
               "ppo_kl": mean(per_sample["kl_old"]), "kl_loss": kl, "entropy": entropy}
    return loss, {k: float(v.detach()) for k, v in metrics.items()}


def hand_run(samples, per_token, clip_grad, steps=2):
    w = torch.tensor(W0, dtype=torch.float64)
    with torch.no_grad():
        old = [log_probs(w, s) for s in samples]
    size = len(samples) // steps
    record = []
    for k in range(steps):
        chunk = slice(k * size, (k + 1) * size)
        w_grad = w.clone().requires_grad_()
        loss, metrics = hand_step(w_grad, samples[chunk], old[chunk], per_token)
        (grad,) = torch.autograd.grad(loss, w_grad)
        norm = float(grad.norm())
        scale = min(1.0, clip_grad / (norm + 1e-6)) if clip_grad > 0 else 1.0
        lr = LR * min(k + 1, WARMUP) / WARMUP  # warm-up: step k runs at lr (k + 1) / W
        w = w - lr * scale * grad
        record.append({**metrics, "grad_norm": norm, "lr": lr, "grad_scale": scale})
    return record, w, old




@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_two_optimizer_steps_match_the_loss_lr_clipping_and_metrics_by_hand(per_token):
    samples = hand_samples()
    backend = StandIn(GRPOConfig(calculate_per_token_loss=per_token, **GRPO), clip_grad=0.05)
    assert backend.init() == 0
    metrics = train_step(backend, 0, samples, num_steps=2)
    want, w_after, old = hand_run(samples, per_token, clip_grad=0.05)

    # What the skeleton asked of the backend: one policy and one reference pass over every micro-batch
    # (steps of 3 samples, micro-batches of 2 and 1), then 2 optimizer steps.
    plan = [[0, 1], [2], [3, 4], [5]]
    assert backend.forward_passes == [("policy", plan), ("ref", plan)]
    assert backend.optimizer_steps == 2 and len(backend.steps) == 2
    for k, step in enumerate(backend.steps):
        masked = sum(sum(s.loss_mask) for s in samples[3 * k : 3 * k + 3])
        assert step["micro_batches"] == [2, 1]
        assert step["normalizer"] == (masked if per_token else 3)
        assert step["lr"] == want[k]["lr"]  # 0.25 then 0.5: the warm-up
        assert step["grad_scale"] == pytest.approx(want[k]["grad_scale"], rel=1e-6)  # float32 factor
    assert [step["lr"] for step in backend.steps] == [0.25, 0.5]
    assert all(w["grad_norm"] > 0.05 for w in want), "the test should exercise clipping"
    torch.testing.assert_close(backend.model.w.detach(), w_after, rtol=1e-6, atol=1e-9)

    # Averages over the 2 steps; step 0's ratio is exactly 1 (old log-probs from the same weights).
    assert want[0]["ppo_kl"] == 0.0 and want[1]["ppo_kl"] != 0.0
    for name in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy", "grad_norm", "lr"):
        expected = (want[0][name] + want[1][name]) / 2
        assert metrics[f"train/{name}"] == pytest.approx(expected, rel=1e-6, abs=1e-12), name

    # The monitor over loss-masked tokens, by prompt kind, token-weighted, with d = old - rollout:
    # mean |d|, mean k3 = e^d - 1 - d, share of |e^d - 1| > 0.2 (math.exp on Python floats).
    gaps = {"image": [], "text": []}
    for sample, old_lp in zip(samples, old):
        diff = old_lp - torch.tensor(sample.rollout_log_probs, dtype=torch.float64)
        gaps["image" if sample.images else "text"] += [float(d) for d, m in zip(diff, sample.loss_mask) if m]
    gaps["all"] = gaps["image"] + gaps["text"]
    for kind, ds in gaps.items():
        suffix = "" if kind == "all" else f"_{kind}"
        assert metrics[f"train/logprob_abs_diff{suffix}"] == pytest.approx(sum(abs(d) for d in ds) / len(ds))
        k3 = sum(math.exp(d) - 1 - d for d in ds) / len(ds)
        assert metrics[f"train/logprob_k3_kl{suffix}"] == pytest.approx(k3, rel=1e-9)
        off = sum(abs(math.exp(d) - 1) > 0.2 for d in ds) / len(ds)
        assert metrics[f"train/logprob_ratio_off_frac{suffix}"] == pytest.approx(off)
    assert 0 < metrics["train/logprob_ratio_off_frac"] < 1, "the samples should have tokens on both sides of 0.2"
    assert metrics["train/logprob_gap_altered_tokens"] == 0.0
    monitor = [f"{name}{suffix}" for name in ("logprob_abs_diff", "logprob_k3_kl", "logprob_ratio_off_frac")
               for suffix in ("", "_image", "_text")]
    assert {k for k in metrics if not k.startswith("perf/")} == {f"train/{name}" for name in (
        "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy", "grad_norm", "lr",
        "logprob_gap_altered_tokens", *monitor)}  # no router agreement: the stand-in has no MoE routes
    assert {k for k in metrics if k.startswith("perf/")} == {TRAINER_TOTAL_KEY, *(
        f"perf/train_{sub}_s" for sub in ("checks", "pack", "old_log_probs", "ref_log_probs", "forward_backward",
                                          "optimizer", "metrics"))}


def test_no_clipping_below_the_threshold_or_with_clip_grad_zero():
    samples = hand_samples()
    for clip_grad in (1e6, 0.0):
        backend = StandIn(GRPOConfig(**GRPO), clip_grad=clip_grad)
        backend.init()
        train_step(backend, 0, samples, num_steps=2)
        assert [step["grad_scale"] for step in backend.steps] == [1.0, 1.0]
        _, w_after, _ = hand_run(samples, per_token=False, clip_grad=clip_grad)
        torch.testing.assert_close(backend.model.w.detach(), w_after, rtol=1e-12, atol=1e-15)


def test_rollout_log_probs_as_old_log_probs_and_no_reference_without_a_kl_term():
    samples = hand_samples()
    backend = StandIn(GRPOConfig(eps_clip=EPS, eps_clip_high=EPS_HIGH), use_rollout_logprobs=True)
    backend.init()
    metrics = train_step(backend, 3, samples, num_steps=1)
    assert backend.forward_passes == []  # neither an old-log-prob nor a reference pass
    assert backend.steps[0]["micro_batches"] == [2, 2, 2] and backend.steps[0]["normalizer"] == 6
    assert not any(name.startswith("train/logprob") for name in metrics) and "train/kl_loss" not in metrics
    # ppo_kl is the sample-mean of the masked mean of (rollout - current) log-probs; the rollout's are float32
    w = torch.tensor(W0, dtype=torch.float64)
    kl = []
    for s in samples:
        mask = torch.tensor(s.loss_mask, dtype=torch.float64)
        diff = torch.tensor(s.rollout_log_probs, dtype=torch.float32).double() - log_probs(w, s)
        kl.append(float((diff * mask).sum() / mask.sum()))
    assert metrics["train/ppo_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-12)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_skipping_the_old_log_prob_pass_takes_them_from_the_training_forward(per_token):
    # --skip-actor-forward-only, one optimizer step: no policy pass before the update, and the step equals the
    # hand computation whose old log-probs come from the same weights (ratio 1: no clipping, ppo_kl 0); the monitor
    # compares the training forward's log-probs with the rollout's exactly as the pass's.
    samples = hand_samples()
    train = TrainConfig(train_backend="fsdp", micro_batch_size=2, skip_actor_forward_only=True)
    backend = StandIn(GRPOConfig(calculate_per_token_loss=per_token, **GRPO), clip_grad=0.05, train=train)
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=1)
    want, w_after, old = hand_run(samples, per_token, clip_grad=0.05, steps=1)
    assert backend.forward_passes == [("ref", [[0, 1], [2, 3], [4, 5]])]  # the reference pass only
    torch.testing.assert_close(backend.model.w.detach(), w_after, rtol=1e-6, atol=1e-9)
    assert metrics["train/pg_clipfrac"] == 0.0 and metrics["train/ppo_kl"] == 0.0
    for name in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert metrics[f"train/{name}"] == pytest.approx(want[0][name], rel=1e-6, abs=1e-12), name
    diffs = [float(d) for sample, old_lp in zip(samples, old) for d, m in zip(
        old_lp - torch.tensor(sample.rollout_log_probs, dtype=torch.float64), sample.loss_mask) if m]
    assert metrics["train/logprob_abs_diff"] == pytest.approx(sum(abs(d) for d in diffs) / len(diffs))

    # The same flags with the pass: the same update and metrics (float64; the pass's values are the forward's).
    with_pass = StandIn(GRPOConfig(calculate_per_token_loss=per_token, **GRPO), clip_grad=0.05)
    with_pass.init()
    reference = train_step(with_pass, 0, hand_samples(), num_steps=1)
    torch.testing.assert_close(backend.model.w.detach(), with_pass.model.w.detach(), rtol=1e-12, atol=1e-15)
    for name, value in reference.items():
        if not name.startswith("perf/"):
            assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_skipping_the_pass_the_gate_stops_before_the_update_and_two_steps_are_refused():
    train = TrainConfig(train_backend="fsdp", micro_batch_size=2, skip_actor_forward_only=True,
                        ci_train_rollout_logprob_abs_diff_threshold=0.01)
    backend = StandIn(GRPOConfig(**GRPO), train=train)
    backend.init()
    with pytest.raises(LogprobGapError, match="rollout step 4"):
        train_step(backend, 4, hand_samples(), num_steps=1)
    assert backend.optimizer_steps == 0 and "lr" not in backend.steps[0]  # gradients made, no update applied
    assert backend.model.w.tolist() == W0
    with pytest.raises(ValueError, match="--skip-actor-forward-only needs one optimizer step"):
        train_step(backend, 5, hand_samples(), num_steps=2)


def test_skipping_the_pass_with_kl_shaped_whitened_advantages_is_refused_before_any_forward():
    # validate refuses the flags together; a step handed them anyway must not whiten without the old log-probs
    train = TrainConfig(train_backend="fsdp", micro_batch_size=2, skip_actor_forward_only=True)
    backend = StandIn(GRPOConfig(kl_coef=0.1, normalize_advantages=True, **GRPO), train=train)
    backend.init()
    with pytest.raises(ValueError, match="--kl-coef and --normalize-advantages"):
        train_step(backend, 0, hand_samples(), num_steps=1)
    assert backend.forward_passes == [] and backend.steps == []


@pytest.mark.parametrize("computes_loss", [True, False])
def test_a_rank_that_computes_no_loss_adds_nothing_to_the_whitening(monkeypatch, computes_loss):
    # Megatron's earlier pipeline stages: their share of --normalize-advantages' sums over the world must be zeros,
    # with the old-log-prob pass (their old log-probs None) and without it alike.
    import slime.backends.step as step

    seen, real = [], step.rollout_whitening
    monkeypatch.setattr(step, "rollout_whitening", lambda samples, *a: seen.append(len(samples)) or real(samples, *a))
    for skip in (False, True):
        train = TrainConfig(train_backend="fsdp", micro_batch_size=2, skip_actor_forward_only=skip)
        backend = StandIn(GRPOConfig(normalize_advantages=True, **GRPO), train=train)
        backend.dp = dataclasses.replace(backend.dp, computes_loss=computes_loss)
        backend.init()
        train_step(backend, 0, hand_samples(), num_steps=1)
    assert seen == [6, 6] if computes_loss else seen == [0, 0]


def test_a_non_finite_gradient_norm_stops_before_any_update():
    samples = hand_samples()
    samples[4].advantage = math.nan
    backend = StandIn(GRPOConfig(**GRPO))
    backend.init()
    with pytest.raises(NonFiniteGradNorm, match=r"rollout 5, optimizer step 1: gradient norm is nan"):
        train_step(backend, 5, samples, num_steps=2)
    assert backend.optimizer_steps == 1 and "lr" not in backend.steps[1]  # step 0 ran, step 1 did not update
    assert isinstance(NonFiniteGradNorm("x"), FloatingPointError)


def test_bad_input_is_refused_before_any_forward_pass():
    backend = StandIn(GRPOConfig(**GRPO))
    with pytest.raises(RuntimeError, match=r"StandIn.init\(\) must run before train"):
        train_step(backend, 0, hand_samples(), num_steps=2)
    backend.init()
    with pytest.raises(ValueError, match="cannot be cut into 4 equal optimizer steps"):
        train_step(backend, 0, hand_samples(), num_steps=4)
    bad = hand_samples()
    bad[2].loss_mask = [1]
    with pytest.raises(SampleError, match="sample 2"):
        train_step(backend, 0, bad, num_steps=2)
    assert backend.forward_passes == [] and backend.steps == []


def test_normalize_advantages_whitens_over_the_whole_rollout_not_a_step_or_micro_batch():
    # --normalize-advantages: every loss-masked token's advantage over the 6 samples of the rollout (both optimizer
    # steps, every micro-batch), mean and Bessel-corrected variance, eps 1e-8; the same run by hand on samples whose
    # advantage is the whitened one (without a --kl-coef every token of a sample keeps one advantage).
    samples = hand_samples()
    tokens = [s.advantage for s in samples for m in s.loss_mask if m]
    mean = math.fsum(tokens) / len(tokens)
    rstd = 1 / math.sqrt(math.fsum((a - mean) ** 2 for a in tokens) / (len(tokens) - 1) + 1e-8)
    whitened = hand_samples()
    for s in whitened:
        s.advantage = (s.advantage - mean) * rstd
    backend = StandIn(GRPOConfig(normalize_advantages=True, **GRPO), clip_grad=0.05)
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=2)
    want, w_after, _ = hand_run(whitened, per_token=False, clip_grad=0.05)
    torch.testing.assert_close(backend.model.w.detach(), w_after, rtol=1e-6, atol=1e-9)
    assert metrics["train/pg_loss"] == pytest.approx((want[0]["pg_loss"] + want[1]["pg_loss"]) / 2, rel=1e-6)


def test_mismatch_metrics_reach_the_step_metrics():
    # --get-mismatch-metrics hands the engine's log-probs to the loss; mis_kl is the sample mean of the masked mean of
    # (rollout - old) log-probs, averaged over the 2 steps (every sample once): the mean over the 6 samples.
    samples = hand_samples()
    backend = StandIn(GRPOConfig(get_mismatch_metrics=True, **GRPO))
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=2)
    w = torch.tensor(W0, dtype=torch.float64)
    kl = []
    for s in samples:
        on = [t for t, m in enumerate(s.loss_mask) if m]
        old = log_probs(w, s)
        roll = torch.tensor(s.rollout_log_probs, dtype=torch.float32).double()
        kl.append(math.fsum(float(roll[t] - old[t]) for t in on) / len(on))
    step = [sum(kl[:3]) / 3, sum(kl[3:]) / 3]
    assert metrics["train/mis_kl"] == pytest.approx(sum(step) / 2, rel=1e-9)
    names, _ = loss_metric_names(GRPOConfig(get_mismatch_metrics=True), with_kl_loss=False)
    assert {f"train/{name}" for name in names} <= set(metrics)


class Sleepy(StandIn):
    """The stand-in with known waits in its hooks on a fake clock (``now``, seconds, which only the hooks move): 0.04 s
    per log-prob pass, 0.05 s per forward-backward, 0.03 s per gradient norm."""

    def __init__(self, grpo, now: list[float]):
        super().__init__(grpo)
        self.now = now

    def log_probs(self, model, batches, **kw):
        self.now[0] += 0.04
        return super().log_probs(model, batches, **kw)

    def forward_backward(self, batches, normalizer):
        self.now[0] += 0.05
        return super().forward_backward(batches, normalizer)

    def grad_norm(self):
        self.now[0] += 0.03
        return super().grad_norm()


def test_the_trainer_sub_phases_add_up_to_its_time_and_hold_each_hook(monkeypatch):
    """``perf/train_<sub>_s`` of the trainer's step: each hook's wait lands in its own sub-phase (2 log-prob passes,
    policy and reference; 2 optimizer steps), nothing else, and the sub-phases add up to the step's own time.  The
    clock is a fake one that only the hooks move (``time.perf_counter``, which the step and its clock read), so the
    figures are exact and the test holds on a loaded machine; the real loop's add-up is ``tests/test_learning.py``'s."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    backend = Sleepy(GRPOConfig(**GRPO), now)
    backend.init()
    metrics = train_step(backend, 0, hand_samples(), num_steps=2)
    sub = {k.removeprefix("perf/train_").removesuffix("_s"): v for k, v in metrics.items()
           if k.startswith("perf/train_") and k != TRAINER_TOTAL_KEY}
    expected = {"old_log_probs": 0.04, "ref_log_probs": 0.04, "forward_backward": 2 * 0.05, "optimizer": 2 * 0.03}
    assert {k: v for k, v in sub.items() if v} == pytest.approx(expected, abs=1e-9)
    assert set(sub) >= {"checks", "pack", "metrics"}  # entered, with no hook inside
    assert metrics[TRAINER_TOTAL_KEY] == pytest.approx(sum(expected.values()), abs=1e-9) == sum(sub.values())


def test_the_step_reports_its_own_peak_memory_on_cuda_and_the_group_the_largest_rank(monkeypatch):
    """On a CUDA rank the step resets the allocator's peaks as it starts and reports, in GiB, the peak allocated
    (``perf/train_peak_gib``) and reserved (``perf/train_reserved_peak_gib``), and the allocator's retries during
    the step (``perf/train_alloc_retries``: the increase of ``num_alloc_retries``) and its device allocations
    (``perf/train_device_allocs``: of ``num_device_alloc``); the trainer group reports the largest of its ranks' for
    each; on CPU the keys are absent.  The allocator is a stand-in here (no GPU): it records the reset and answers
    3 GiB allocated, 5 GiB reserved, 4 then 6 retries (so 2 in the step) and 10 then 17 device allocations (7)."""
    from slime.backends.step import ALLOC_RETRIES_KEY, DEVICE_ALLOCS_KEY, PEAK_MEMORY_KEY, RESERVED_PEAK_KEY
    from slime.ray import trainer_group

    backend = StandIn(GRPOConfig(**GRPO))
    backend.init()
    cpu = train_step(backend, 0, hand_samples(), num_steps=2)
    assert not {PEAK_MEMORY_KEY, RESERVED_PEAK_KEY, ALLOC_RETRIES_KEY, DEVICE_ALLOCS_KEY} & set(cpu)
    calls, stats = [], iter([{"num_alloc_retries": 4, "num_device_alloc": 10},
                             {"num_alloc_retries": 6, "num_device_alloc": 17}])
    import slime.utils.timer

    monkeypatch.setattr(slime.utils.timer, "synchronize_current_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: calls.append(("peak", device)) or 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda device=None: calls.append(("reserved", device)) or 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: next(stats))
    backend.device = torch.device("cuda", 0)
    metrics = train_step(backend, 1, hand_samples(), num_steps=2)
    assert (metrics[PEAK_MEMORY_KEY], metrics[RESERVED_PEAK_KEY], metrics[ALLOC_RETRIES_KEY],
            metrics[DEVICE_ALLOCS_KEY]) == (3.0, 5.0, 2.0, 7.0)
    assert calls == [("reset", backend.device), ("peak", backend.device), ("reserved", backend.device)]

    class Actor:  # a rank's Ray handle: .train.remote(...) answers that rank's metrics
        def __init__(self, peak, retries):
            answer = {PEAK_MEMORY_KEY: peak, RESERVED_PEAK_KEY: peak + 1, ALLOC_RETRIES_KEY: retries,
                      DEVICE_ALLOCS_KEY: 10 * peak, "x": peak}
            self.train = type("Remote", (), {"remote": staticmethod(lambda *a: answer)})

    group = object.__new__(trainer_group.TrainerGroup)
    group.actors = [Actor(2.5, 3.0), Actor(7.0, 0.0)]
    monkeypatch.setattr(group, "split_by_rank", lambda samples: ([[], []], 1), raising=False)
    monkeypatch.setattr(trainer_group.ray, "get", lambda refs: list(refs))
    merged = group.train(0, [])
    assert (merged[RESERVED_PEAK_KEY], merged[ALLOC_RETRIES_KEY], merged[DEVICE_ALLOCS_KEY]) == (8.0, 3.0, 70.0)
    assert merged[PEAK_MEMORY_KEY] == 7.0 and merged["x"] == 2.5  # the peak: the largest; the rest: rank 0's
