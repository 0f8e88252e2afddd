"""Backend-neutral trainer helpers: slime.backends.batching and slime.backends.train_metrics (single process)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.batching import (
    SampleError,
    bucket_by_bytes,
    check_train_sample,
    check_train_samples,
    loss_normalizer,
    pad_per_token,
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

def test_pad_per_token_right_pads():
    out = pad_per_token([[1.0, 2.0], [], [3.0]], torch.float32, pad=-1)
    assert out.tolist() == [[1.0, 2.0], [-1.0, -1.0], [3.0, -1.0]]

def test_loss_normalizer_counts_samples_or_masked_tokens_without_distributed():
    batch = [sample(response=(1, 2, 3), loss_mask=(1, 0, 1)), sample(response=(4,), loss_mask=(1,))]
    assert loss_normalizer(batch, per_token=False) == 2.0
    assert loss_normalizer(batch, per_token=True) == 3.0
    with pytest.raises(ValueError, match="no samples"):
        loss_normalizer([], per_token=True)


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

def test_bucket_by_bytes_never_splits_a_group():
    def group(name, n):
        return [(f"{name}.{i}", torch.zeros(n, dtype=torch.float32)) for i in range(2)]  # 8n bytes

    groups = [group("a", 10), group("b", 10), group("c", 100), group("d", 1)]  # 80, 80, 800, 8 bytes
    names = [[n.split(".")[0] for n, _ in bucket] for bucket in bucket_by_bytes(groups, 150)]
    assert names == [["a", "a", "b", "b"], ["c", "c"], ["d", "d"]]
    assert len(list(bucket_by_bytes(groups, 1))) == 4
    assert len(list(bucket_by_bytes(groups, 10**9))) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_bytes(groups, 0))

def test_logprob_gap_is_token_weighted_per_prompt_kind_and_omits_empty_splits():
    samples = [
        sample(0, response=(1, 2), loss_mask=(1, 1), rollout=(-1.0, -2.0), images=["img"]),
        sample(1, response=(3, 4, 5), loss_mask=(1, 0, 1), rollout=(-1.0, -1.0, -1.0)),
        sample(2, response=(6,), rollout=None),  # no rollout log-probs: left out
    ]
    train = [torch.tensor([-1.5, -2.0]), torch.tensor([-1.25, -9.0, -0.5]), torch.tensor([-3.0])]
    sums = all_reduce_sums(logprob_gap_sums(samples, train))
    metrics = logprob_gap_metrics(sums)
    # image: |0.5| + |0| over 2 tokens; text: |0.25| + |0.5| over 2 masked tokens.
    assert metrics == {
        "train/logprob_abs_diff_image": pytest.approx(0.25),
        "train/logprob_abs_diff_text": pytest.approx(0.375),
        "train/logprob_abs_diff": pytest.approx(1.25 / 4),
        "train/logprob_gap_altered_tokens": 0.0,
    }
    text_only = logprob_gap_metrics(all_reduce_sums(logprob_gap_sums(samples[1:2], train[1:2])))
    assert set(text_only) == {
        "train/logprob_abs_diff_text", "train/logprob_abs_diff", "train/logprob_gap_altered_tokens"
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
    assert metrics == {
        "train/logprob_abs_diff_image": pytest.approx(0.375),
        "train/logprob_abs_diff": pytest.approx(0.375),
        "train/logprob_gap_altered_tokens": 1.0,
    }

def test_all_reduce_sums_without_distributed_returns_floats():
    out = all_reduce_sums({"b": torch.tensor(2.5), "a": 1})
    assert out == {"a": 1.0, "b": 2.5} and all(isinstance(v, float) for v in out.values())
