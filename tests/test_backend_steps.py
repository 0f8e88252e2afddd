"""Backend-neutral trainer helpers: the sample checks (slime.backends.samples), the step's plan and normaliser
(slime.backends.step) and slime.backends.train_metrics (single process)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from slime.backends.samples import SampleError, check_train_sample, check_train_samples
from slime.backends.step import (
    balanced_bins,
    bins_for_budget,
    loss_normalizer,
    plan_micro_batches,
    sample_tokens,
    split_into_micro_batches,
    split_into_steps,
)
from slime.backends.train_metrics import all_reduce_sums, logprob_gap_metrics, logprob_gap_sums
from slime.data.sample import Sample
from slime.grpo.loss import aggregate_loss


def sample(index=0, response=(5, 6, 7), loss_mask=None, rollout=None, images=()) -> Sample:
    return Sample(
        index=index,
        prompt="p",
        label="1",
        images=list(images),
        prompt_token_ids=[1, 2],
        response_token_ids=list(response),
        loss_mask=list(loss_mask) if loss_mask is not None else [1] * len(response),
        rollout_log_probs=list(rollout) if rollout is not None else [],
    )

def test_split_into_steps_and_micro_batches_keep_order():
    items = list(range(12))
    assert split_into_steps(items, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert split_into_micro_batches(items[:5], 2) == [[0, 1], [2, 3], [4]]

@pytest.mark.parametrize("n, steps", [(7, 2), (0, 1), (4, 0)])
def test_split_into_steps_refuses_uneven_chunks(n, steps):
    with pytest.raises(ValueError, match="equal optimizer steps"):
        split_into_steps(list(range(n)), steps)

def test_micro_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="--micro-batch-size"):
        split_into_micro_batches([1, 2], 0)

def test_loss_normalizer_counts_samples_or_masked_tokens_without_distributed():
    batch = [sample(response=(1, 2, 3), loss_mask=(1, 0, 1)), sample(response=(4,), loss_mask=(1,))]
    assert loss_normalizer(batch, per_token=False) == 2.0
    assert loss_normalizer(batch, per_token=True) == 3.0
    with pytest.raises(ValueError, match="no samples"):
        loss_normalizer([], per_token=True)
    # a fully masked sample counts 0 tokens (upstream's clamp_min(mask.sum(), 1) would make it 2 + 1 + 1 = 4 here;
    # the departure is in docs/design/grpo.md) and 1 sample, as upstream
    batch.append(sample(response=(5, 6), loss_mask=(0, 0)))
    assert (loss_normalizer(batch, per_token=True), loss_normalizer(batch, per_token=False)) == (3.0, 3.0)


def test_a_step_with_every_token_masked_has_zero_loss_not_an_error(caplog):
    """--overlong-filter can mask a whole step: N = 1, so the (all-zero) loss stays 0 and finite."""
    masked = [sample(response=(1, 2), loss_mask=(0, 0)), sample(response=(3,), loss_mask=(0,))]
    assert loss_normalizer(masked, per_token=True) == 1.0
    assert "masked out of the loss" in caplog.text
    values = torch.tensor([[5.0, -2.0]], requires_grad=True)
    loss = aggregate_loss(values, torch.zeros(1, 2), per_token=True, global_normalizer=1.0)
    loss.backward()
    assert loss.item() == 0.0 and values.grad.abs().sum().item() == 0.0

@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(response=()), "no response tokens"),
        (dict(loss_mask=(1,)), "loss_mask has 1 entries but the response has 3"),
        (dict(rollout=(-1.0,)), "rollout_log_probs has 1 entries"),
    ],
)
def test_check_train_sample_names_the_sample_and_field(bad, match):
    with pytest.raises(SampleError, match=match) as info:
        check_train_sample(sample(index=17, **bad))
    assert "sample 17" in str(info.value)

def test_check_train_samples_requires_rollout_log_probs_when_asked():
    check_train_samples([sample()])  # fine without
    with pytest.raises(SampleError, match="--use-rollout-logprobs"):
        check_train_samples([sample()], need_rollout_log_probs=True)

def test_logprob_gap_is_token_weighted_per_prompt_kind_and_omits_empty_splits():
    samples = [
        sample(0, response=(1, 2), loss_mask=(1, 1), rollout=(-1.0, -2.0), images=["img"]),
        sample(1, response=(3, 4, 5), loss_mask=(1, 0, 1), rollout=(-1.0, -1.0, -1.0)),
        sample(2, response=(6,), rollout=None),  # no rollout log-probs: left out
    ]
    train = [torch.tensor([-1.5, -2.0]), torch.tensor([-1.25, -9.0, -0.5]), torch.tensor([-3.0])]
    sums = all_reduce_sums(logprob_gap_sums(samples, train))
    metrics = logprob_gap_metrics(sums)
    # d = train - rollout; image: -0.5, 0 over 2 tokens; text: -0.25, +0.5 over 2 masked tokens.
    # k3 = e^d - 1 - d; off: |e^d - 1| > 0.2 (e^-0.5 - 1 = -0.39, e^-0.25 - 1 = -0.22, e^0.5 - 1 = 0.65).
    k3 = {d: math.exp(d) - 1 - d for d in (-0.5, 0.0, -0.25, 0.5)}
    assert metrics == {
        "train/logprob_abs_diff_image": pytest.approx(0.25),
        "train/logprob_abs_diff_text": pytest.approx(0.375),
        "train/logprob_abs_diff": pytest.approx(1.25 / 4),
        "train/logprob_k3_kl_image": pytest.approx((k3[-0.5] + k3[0.0]) / 2),
        "train/logprob_k3_kl_text": pytest.approx((k3[-0.25] + k3[0.5]) / 2),
        "train/logprob_k3_kl": pytest.approx(sum(k3.values()) / 4),
        "train/logprob_ratio_off_frac_image": pytest.approx(0.5),
        "train/logprob_ratio_off_frac_text": pytest.approx(1.0),
        "train/logprob_ratio_off_frac": pytest.approx(0.75),
        "train/logprob_gap_altered_tokens": 0.0,
    }
    text_only = logprob_gap_metrics(all_reduce_sums(logprob_gap_sums(samples[1:2], train[1:2])))
    assert set(text_only) == {
        "train/logprob_abs_diff_text", "train/logprob_abs_diff", "train/logprob_gap_altered_tokens",
        "train/logprob_k3_kl_text", "train/logprob_k3_kl", "train/logprob_ratio_off_frac_text",
        "train/logprob_ratio_off_frac",
    }
    assert logprob_gap_metrics(all_reduce_sums(logprob_gap_sums(samples[2:], train[2:]))) == {
        "train/logprob_gap_altered_tokens": 0.0
    }


def test_logprob_gap_leaves_out_the_tokens_after_a_generated_placeholder():
    """The trainer feeds a generated image placeholder (id 9 here) as a pad token, so the tokens
    after it see another context than the engine's: left out of the gap, and counted."""
    samples = [sample(0, response=(1, 9, 2, 3), loss_mask=(1, 1, 1, 0), rollout=(-1.0, -1.0, -1.0, -1.0), images=["i"])]
    train = [torch.tensor([-1.5, -1.25, -7.0, -9.0])]  # tokens 2 and 3 (after the 9) differ a lot
    metrics = logprob_gap_metrics(all_reduce_sums(logprob_gap_sums(samples, train, placeholder_ids={9})))
    # Kept: token 0 (|0.5|) and the placeholder itself (|0.25|, its context is unchanged); left out:
    # token 2 (masked in) and token 3 (masked out, so not counted).
    assert {k: v for k, v in metrics.items() if "k3" not in k and "ratio" not in k} == {
        "train/logprob_abs_diff_image": pytest.approx(0.375),
        "train/logprob_abs_diff": pytest.approx(0.375),
        "train/logprob_gap_altered_tokens": 1.0,
    }

def test_all_reduce_sums_without_distributed_returns_floats():
    out = all_reduce_sums({"b": torch.tensor(2.5), "a": 1})
    assert out == {"a": 1.0, "b": 2.5} and all(isinstance(v, float) for v in out.values())


def _sample(i: int, prompt: int, response: int) -> Sample:
    return Sample(index=i, prompt="", label="", prompt_token_ids=[1] * prompt, response_token_ids=[2] * response,
                  loss_mask=[1] * response)


def test_balanced_bins_are_nonempty_and_by_longest_first():
    bins = balanced_bins([10, 1, 7, 3, 5], 2)
    assert sorted(itertools.chain(*bins)) == [0, 1, 2, 3, 4]
    # LPT by hand: 10 -> A (10), 7 -> B (7), 5 -> B (12), 3 -> A (13), 1 -> B (13)
    assert bins == [[0, 3], [1, 2, 4]]
    with pytest.raises(ValueError, match="non-empty"):
        balanced_bins([1, 2], 3)


def test_budget_gives_the_fewest_bins_within_it():
    lengths = [300, 280, 120, 90, 60, 40]
    k = bins_for_budget(lengths, 400)
    assert all(sum(lengths[i] for i in b) <= 400 for b in balanced_bins(lengths, k))
    assert k == 3  # 890 tokens need at least 3 bins of 400
    assert bins_for_budget([900, 10], 400) == 2  # a sample over the budget gets its own bin


def test_plan_by_micro_batch_size_or_by_tokens():
    samples = [_sample(i, 50, n) for i, n in enumerate([10, 200, 30, 5, 60])]
    assert plan_micro_batches(samples, micro_batch_size=2, max_tokens=None, dp_group=None) == [[0, 1], [2, 3], [4]]
    plan = plan_micro_batches(samples, micro_batch_size=1, max_tokens=260, dp_group=None)
    assert sorted(itertools.chain(*plan)) == list(range(5))
    assert all(sum(sample_tokens(samples[i]) for i in b) <= 260 or len(b) == 1 for b in plan)
    assert len(plan) == bins_for_budget([sample_tokens(s) for s in samples], 260)
