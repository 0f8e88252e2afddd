"""RolloutManager with a scripted engine group (no Ray): rewards, group advantages, prompt length mismatches,
aborted samples, truncation and skip counters, truncation options, per-request seeds, eval isolation.

The engine stand-in answers ``\\boxed{5}`` to odd-numbered requests and ``\\boxed{7}`` to
even ones, so every expected reward and advantage is worked out by hand below.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from slime.arguments import parse_args
from slime.data.image import decode_image
from slime.data.sample import Sample, SampleStatus
from slime.rollout.engines.base import GenerateOutput
from slime.rollout.manager import (
    NonFiniteRewardError,
    PromptMismatchError,
    RolloutAbortedError,
    RolloutManager,
    _drop_non_finite_groups,
)


def _png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(buf, format="PNG")
    return buf.getvalue()


def _write_rows(path, rows):
    """rows: (problem, answer, image bytes or None)."""
    table = pa.table(
        {
            "problem": [p for p, _, _ in rows],
            "answer": [a for _, a, _ in rows],
            "images": [[{"bytes": b, "path": None}] if b is not None else [] for _, _, b in rows],
        }
    )
    pq.write_table(table, path)


class ScriptedEngines:
    """Duck-typed RolloutEngineGroup: request i of a call answers 5 if i is odd, else 7;
    every ``truncate_every``-th request ends by length.  The prompt length it reports is what
    the checkpoint's processor makes of the request's text and images, plus ``miscount[i]``
    tokens for request i (an engine that sees another prompt).  The requests in ``abort`` end with
    ``finish_reason "abort"`` after one token (same text: scoring one would count it)."""

    def __init__(self, truncate_every: int = 0, extra_token: int | None = None, miscount: dict[int, int] | None = None,
                 abort: set[int] = frozenset()):
        self.truncate_every = truncate_every
        self.extra_token = extra_token
        self.miscount = miscount or {}
        self.abort = abort
        self.calls = []

    def generate(self, requests):
        self.calls.append(requests)
        outs = []
        for i, req in enumerate(requests):
            truncated = bool(self.truncate_every) and i % self.truncate_every == 0
            text = "\\boxed{5}" if i % 2 else "\\boxed{7}"
            ids = [11, 12, 13] if truncated else [11, 12]
            if self.extra_token is not None and i % 4 == 1:
                ids = [self.extra_token] + ids[1:]
            reason = "length" if truncated else "stop"
            if i in self.abort:
                ids, reason = ids[:1], "abort"
            prompt_tokens = len(PROCESSOR(req.text, [decode_image(b) for b in req.image_data]).input_ids)
            outs.append(GenerateOutput(text, ids, [-0.5] * len(ids), reason, prompt_tokens + self.miscount.get(i, 0),
                                       engine_index=i % 2))
        return outs


PROCESSOR = None
"""The tiny checkpoint's processor, set by the ``processor`` fixture (the engines' own tokenisation)."""


@pytest.fixture(autouse=True)
def _module_processor(processor):
    """The module's helpers read the shared processor (conftest's ``processor``) as ``PROCESSOR``."""
    global PROCESSOR
    PROCESSOR = processor
    return PROCESSOR


def _manager(tmp_path, tiny_ckpt, engines, extra=(), eval_labels=None):
    """``eval_labels``: {dataset name: labels} for eval sets of one image prompt per label
    (default: ``held_out`` with labels 5 and 7)."""
    train = tmp_path / "train.parquet"
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    _write_rows(
        train,
        [
            ("<image>What is x?", "5", red),
            ("<image>What is y?", "5", blue),
            ("<image>Broken image", "5", b"not a png"),
            ("<image>No label", "", red),
            ("<image>What is z?", "7", blue),
            ("<image>What is w?", "7", red),
        ],
    )
    eval_args = []
    for name, labels in (eval_labels or {"held_out": ["5", "7"]}).items():
        test = tmp_path / f"{name}.parquet"
        _write_rows(test, [(f"<image>Eval {i}", label, red) for i, label in enumerate(labels)])
        eval_args += [name, str(test)]
    cfg = parse_args(
        [
            "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(train),
            "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
            "--apply-chat-template", "--rm-type", "math", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3",
            "--global-batch-size", "8", "--eval-prompt-data", *eval_args,
            "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", *extra,
        ]
    )
    from slime.data.processor import load_processor

    return RolloutManager(
        rollout=cfg.rollout, data=cfg.data, reward=cfg.reward, grpo=cfg.grpo, evaluation=cfg.eval,
        processor=load_processor(tiny_ckpt), engines=engines, seed=cfg.rollout.rollout_seed,
        debug_dump=cfg.run_mode.save_debug_rollout_data,  # as slime/driver.py passes it
    )


def test_rewards_and_group_advantages(tmp_path, tiny_ckpt):
    manager = _manager(tmp_path, tiny_ckpt, ScriptedEngines())
    try:
        batch = manager.generate(0)
    finally:
        manager.close()
    samples = batch.samples
    assert len(samples) == 8
    assert [s.group_index for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Both prompts of the first batch (file order, no shuffle) have label 5: odd requests
    # answer 5 (reward 1), even ones 7 (reward 0) -> each group is [0, 1, 0, 1].
    assert [s.label for s in samples] == ["5"] * 8
    assert [s.reward for s in samples] == [0.0, 1.0] * 4
    # GRPO: (r - 0.5) / (unbiased std + 1e-6); std of [0, 1, 0, 1] = sqrt(1/3).
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    for s in samples:
        assert s.advantage == pytest.approx(expected if s.reward == 1.0 else -expected, rel=1e-6)
        assert s.loss_mask == [1] * len(s.response_token_ids)
        assert s.rollout_log_probs == [-0.5] * len(s.response_token_ids)
        assert s.status == SampleStatus.COMPLETED
    assert batch.metrics["rollout/reward_mean"] == pytest.approx(0.5)
    assert batch.metrics["rollout/accuracy"] == pytest.approx(0.5)
    assert batch.metrics["rollout/zero_std_group_frac"] == 0.0
    assert batch.metrics["rollout/truncated_count"] == 0
    assert batch.metrics["rollout/vision_token_responses"] == 0


def test_generated_image_placeholders_are_counted(tmp_path, tiny_ckpt):
    from slime.data.processor import load_processor

    image_token = load_processor(tiny_ckpt).image_token_id
    manager = _manager(tmp_path, tiny_ckpt, ScriptedEngines(extra_token=image_token))
    try:
        batch = manager.generate(0)
    finally:
        manager.close()
    # Requests 1 and 5 of 8 start with the image placeholder id.
    assert [s.response_token_ids[0] == image_token for s in batch.samples] == [False, True, False, False] * 2
    assert batch.metrics["rollout/vision_token_responses"] == 2


def test_truncation_and_skip_counters(tmp_path, tiny_ckpt):
    engines = ScriptedEngines(truncate_every=3)
    manager = _manager(tmp_path, tiny_ckpt, engines)
    try:
        manager.generate(0)  # rows 0, 1
        batch = manager.generate(1)  # rows 2 (bad image) and 3 (empty label) are skipped -> rows 4, 5
    finally:
        manager.close()
    # Request indices 0, 3, 6 of the 8 are cut by length.
    truncated = [s for s in batch.samples if s.status == SampleStatus.TRUNCATED]
    assert len(truncated) == 3 and all(s.response_length == 3 for s in truncated)
    assert batch.metrics["rollout/truncated_count"] == 3
    assert batch.metrics["rollout/truncated_frac"] == pytest.approx(3 / 8)
    assert batch.metrics["data/skipped_bad_image"] == 1
    assert batch.metrics["data/skipped_empty_label"] == 1
    assert [s.label for s in batch.samples] == ["7"] * 8
    # Label 7: the even requests (answer 7) are right.
    assert [s.reward for s in batch.samples] == [1.0, 0.0] * 4


def test_eval_uses_held_out_rows_and_leaves_training_cursor(tmp_path, tiny_ckpt):
    engines = ScriptedEngines()
    manager = _manager(tmp_path, tiny_ckpt, engines)
    try:
        before = manager.state_dict()
        metrics = manager.evaluate(0)
        assert manager.state_dict() == before
    finally:
        manager.close()
    # Two eval prompts, one sample each: request 0 answers 7 (label 5: wrong), request 1
    # answers 5 (label 7: wrong).
    assert metrics["eval/held_out/num_samples"] == 2
    assert metrics["eval/held_out/accuracy"] == 0.0
    (requests,) = engines.calls
    assert all("Eval" in r.text for r in requests)


def test_eval_accuracy_per_dataset(tmp_path, tiny_ckpt):
    # The scripted engine answers 7, 5, 7, 5, ... in request order, whether the two sets are
    # sent in one call or one call each: set "a" (labels 7, 7, 7) gets 7, 5, 7 -> 2/3 right;
    # set "b" (labels 5, 5) gets one 5 and one 7 in either order -> 1/2.
    engines = ScriptedEngines()
    manager = _manager(tmp_path, tiny_ckpt, engines, eval_labels={"a": ["7", "7", "7"], "b": ["5", "5"]})
    try:
        metrics = manager.evaluate(3)
    finally:
        manager.close()
    assert metrics["eval/a/num_samples"] == 3 and metrics["eval/b/num_samples"] == 2
    assert metrics["eval/a/accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/b/accuracy"] == pytest.approx(1 / 2)
    assert sum(len(call) for call in engines.calls) == 5


def test_prompt_length_mismatch_is_caught_for_any_engine(tmp_path, tiny_ckpt):
    # Requests 3 and 6 of the 8 come back with one token more / two fewer than the processor makes of
    # them; the scripted group says engine i % 2 served request i.
    engines = ScriptedEngines(miscount={3: 1, 6: -2})
    manager = _manager(tmp_path, tiny_ckpt, engines)
    try:
        with pytest.raises(PromptMismatchError) as info:
            manager.generate(0)
    finally:
        manager.close()
    (requests,) = engines.calls
    true_len = [len(PROCESSOR(r.text, [decode_image(b) for b in r.image_data]).input_ids) for r in requests]
    message = str(info.value)
    assert message.startswith("2 of 8 prompts have another length in the rollout engine than in the data pipeline")
    # The first batch is rows 0 and 1 (file order), 4 samples each: sample 3 is row 0's, sample 6 row 1's.
    assert (f"sample 3 (dataset index 0, rid 0:3): engine 1 saw {true_len[3] + 1} prompt tokens, the data "
            f"pipeline computed {true_len[3]}") in message
    assert (f"sample 6 (dataset index 1, rid 1:6): engine 0 saw {true_len[6] - 2} prompt tokens, the data "
            f"pipeline computed {true_len[6]}") in message
    assert "--image-min-pixels / --image-max-pixels" in message
    assert "--max-prompt-length-mismatch-fraction 0.1" in message  # 2 / 8 is over the default


def _true_lengths(requests):
    return [len(PROCESSOR(r.text, [decode_image(b) for b in r.image_data]).input_ids) for r in requests]


def test_one_prompt_length_mismatch_drops_its_group_only(tmp_path, tiny_ckpt, caplog):
    # Request 2 of 8 (group 0: rows 0's samples 0..3) comes back one token long; 1 / 8 is under the fraction.
    extra = ("--max-prompt-length-mismatch-fraction", "0.2")
    (tmp_path / "ref").mkdir()
    (tmp_path / "bad").mkdir()
    reference = _manager(tmp_path / "ref", tiny_ckpt, ScriptedEngines(), extra=extra)
    engines = ScriptedEngines(miscount={2: 1})
    dump = tmp_path / "bad" / "dump_{rollout_id}.jsonl"
    manager = _manager(tmp_path / "bad", tiny_ckpt, engines, extra=(*extra, "--save-debug-rollout-data", str(dump)))
    try:
        expected_batch = reference.generate(0)
        with caplog.at_level(logging.WARNING, logger="slime.rollout.manager"):
            batch = manager.generate(0)
    finally:
        reference.close()
        manager.close()
    samples = batch.samples
    assert len(samples) == 8  # the batch keeps its size: --global-batch-size 8 still splits it
    assert [s.group_index for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [s.status for s in samples] == [SampleStatus.COMPLETED] * 2 + [SampleStatus.FAILED] + [
        SampleStatus.COMPLETED] * 5  # fmt: skip
    # Group 0 gives no gradient: every response token masked, advantage 0.
    for s in samples[:4]:
        assert s.loss_mask == [0] * len(s.response_token_ids) and len(s.response_token_ids) == 2
        assert s.advantage == 0.0
    # Group 1 is trained on as without the mismatch: rewards [0, 1, 0, 1], advantages
    # +-0.5 / (sqrt(1/3) + 1e-6) (unbiased std, eps 1e-6), full loss masks; the same as the clean run's.
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [s.reward for s in samples[4:]] == [0.0, 1.0, 0.0, 1.0]
    assert [s.advantage for s in samples[4:]] == pytest.approx([-expected, expected] * 2, rel=1e-6)
    for got, want in zip(samples[4:], expected_batch.samples[4:]):
        assert (got.prompt_token_ids, got.response_token_ids, got.loss_mask, got.rollout_log_probs) == (
            want.prompt_token_ids, want.response_token_ids, want.loss_mask, want.rollout_log_probs)
        assert got.advantage == want.advantage
    m = batch.metrics
    assert m["rollout/prompt_length_mismatches"] == 1.0
    assert m["rollout/prompt_length_mismatch_groups"] == 1.0
    # The failed sample is left out of the reward statistics: rewards 0, 1, (failed), 1, 0, 1, 0, 1.
    assert m["rollout/num_samples"] == 7.0
    assert m["rollout/reward_mean"] == pytest.approx(4 / 7)
    assert m["rollout/zero_std_group_frac"] == 0.0
    # The scorer saw the 7 usable responses only (the clean run: 8); the failed one keeps no reward.
    assert (m["rollout/reward_responses"], expected_batch.metrics["rollout/reward_responses"]) == (7, 8)
    assert samples[2].reward is None
    assert (m["rollout/aborted_samples"], m["rollout/aborted_groups"]) == (0.0, 0.0)
    assert expected_batch.metrics["rollout/prompt_length_mismatches"] == 0.0
    assert expected_batch.metrics["rollout/prompt_length_mismatch_groups"] == 0.0
    (requests,) = engines.calls
    true_len = _true_lengths(requests)
    warning = caplog.text
    assert "1 of 8 prompts have another length in the rollout engine than in the data pipeline" in warning
    assert (f"sample 2 (dataset index 0, rid 0:2): engine 0 saw {true_len[2] + 1} prompt tokens, the data "
            f"pipeline computed {true_len[2]}") in warning
    assert "--image-min-pixels / --image-max-pixels" in warning
    rows = [json.loads(line) for line in Path(str(dump).format(rollout_id=0)).read_text().splitlines()]
    assert [(r["status"], r["in_loss"]) for r in rows] == [("completed", False)] * 2 + [("failed", False)] + [
        ("completed", False)] + [("completed", True)] * 4  # the whole of group 0 is out of the loss  # fmt: skip


@pytest.mark.parametrize("fraction, raises", [("0.25", False), ("0.24", True), ("0", True)])
def test_prompt_length_mismatch_fraction_boundary(tmp_path, tiny_ckpt, fraction, raises):
    # 2 of 8 samples mismatch, both in group 1: a fraction of exactly 0.25.
    engines = ScriptedEngines(miscount={5: 3, 7: -1})
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--max-prompt-length-mismatch-fraction", fraction))
    try:
        if raises:
            with pytest.raises(PromptMismatchError, match=r"^2 of 8 prompts have another length"):
                manager.generate(0)
            return
        batch = manager.generate(0)
    finally:
        manager.close()
    assert batch.metrics["rollout/prompt_length_mismatches"] == 2.0
    assert batch.metrics["rollout/prompt_length_mismatch_groups"] == 1.0
    assert [s.advantage == 0.0 for s in batch.samples] == [False] * 4 + [True] * 4


def test_every_prompt_mismatching_stops_the_run_whatever_the_fraction(tmp_path, tiny_ckpt):
    engines = ScriptedEngines(miscount={i: 1 for i in range(8)})
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--max-prompt-length-mismatch-fraction", "1"))
    try:
        with pytest.raises(PromptMismatchError) as info:
            manager.generate(0)
    finally:
        manager.close()
    assert str(info.value).startswith("8 of 8 prompts have another length in the rollout engine")
    assert "--image-min-pixels / --image-max-pixels" in str(info.value)


def test_a_mismatch_in_every_group_leaves_nothing_to_train_on(tmp_path, tiny_ckpt):
    # One mismatch per group (samples 1 and 4): 2 / 8 is allowed, but no group is left.
    engines = ScriptedEngines(miscount={1: 1, 4: 1})
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--max-prompt-length-mismatch-fraction", "0.5"))
    try:
        with pytest.raises(PromptMismatchError, match="every one of the 2 groups of this rollout holds a sample"):
            manager.generate(0)
    finally:
        manager.close()


def test_eval_leaves_a_mismatching_sample_out_of_its_metrics(tmp_path, tiny_ckpt):
    # Set "a" (labels 7, 7, 7) gets answers 7, 5, 7: request 1 (the wrong one) mismatches, so the
    # set's accuracy is 2 / 2 over 2 samples (3 samples with it would give 2 / 3).
    engines = ScriptedEngines(miscount={1: -1})
    manager = _manager(tmp_path, tiny_ckpt, engines, eval_labels={"a": ["7", "7", "7"]},
                       extra=("--max-prompt-length-mismatch-fraction", "0.4"))
    try:
        metrics = manager.evaluate(0)
    finally:
        manager.close()
    assert metrics["eval/a/prompt_length_mismatches"] == 1.0
    assert metrics["eval/a/num_samples"] == 2.0
    assert metrics["eval/a/accuracy"] == pytest.approx(1.0)
    assert metrics["eval/reward_responses"] == 2  # the failed sample is not scored


# ---------------------------------------------------------------------------------------
# Aborted samples (finish_reason "abort"): the group-drop path of the mismatches


def test_one_aborted_sample_drops_its_group_only(tmp_path, tiny_ckpt, caplog):
    # Request 5 (group 1: row 1's samples 4..7, answer 5 to label 5) is aborted after one token.
    (tmp_path / "ref").mkdir()
    (tmp_path / "bad").mkdir()
    reference = _manager(tmp_path / "ref", tiny_ckpt, ScriptedEngines())
    dump = tmp_path / "bad" / "dump_{rollout_id}.jsonl"
    manager = _manager(tmp_path / "bad", tiny_ckpt, ScriptedEngines(abort={5}),
                       extra=("--save-debug-rollout-data", str(dump)))
    try:
        expected_batch = reference.generate(0)
        with caplog.at_level(logging.WARNING, logger="slime.rollout.manager"):
            batch = manager.generate(0)
    finally:
        reference.close()
        manager.close()
    samples = batch.samples
    assert len(samples) == 8 and [s.group_index for s in samples] == [0] * 4 + [1] * 4
    assert [s.status for s in samples] == [SampleStatus.COMPLETED] * 5 + [SampleStatus.ABORTED] + [
        SampleStatus.COMPLETED] * 2  # fmt: skip
    # Group 1 gives no gradient: every response token masked (the aborted one has 1 token), advantage 0.
    assert [s.loss_mask for s in samples[4:]] == [[0, 0], [0], [0, 0], [0, 0]]
    assert [s.advantage for s in samples[4:]] == [0.0] * 4
    # Group 0 is trained on as in the clean run: rewards [0, 1, 0, 1], advantages +-0.5 / (sqrt(1/3) + 1e-6).
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [s.advantage for s in samples[:4]] == pytest.approx([-expected, expected] * 2, rel=1e-6)
    for got, want in zip(samples[:4], expected_batch.samples[:4]):
        assert (got.response_token_ids, got.loss_mask, got.reward, got.advantage) == (
            want.response_token_ids, want.loss_mask, want.reward, want.advantage)
    # The aborted response ("\boxed{5}", right for label 5) is not scored: scored, it would make the mean 4/8.
    assert samples[5].reward is None
    m = batch.metrics
    assert (m["rollout/aborted_samples"], m["rollout/aborted_groups"]) == (1.0, 1.0)
    assert (m["rollout/prompt_length_mismatches"], m["rollout/prompt_length_mismatch_groups"]) == (0.0, 0.0)
    assert m["rollout/num_samples"] == 7.0 and m["rollout/reward_responses"] == 7
    assert m["rollout/reward_mean"] == pytest.approx(3 / 7)  # rewards 0, 1, 0, 1, 0, (aborted), 0, 1
    assert m["rollout/response_len_mean"] == 2.0  # the aborted sample's 1 token is left out
    assert (expected_batch.metrics["rollout/aborted_samples"], expected_batch.metrics["rollout/aborted_groups"]) == (
        0.0, 0.0)  # fmt: skip
    assert "1 of 8 train samples were aborted by the rollout engine (sample 5 (dataset index 1, rid 1:5, engine 1, " \
        "response length 1))" in caplog.text
    assert "/pause_generation" in caplog.text
    rows = [json.loads(line) for line in Path(str(dump).format(rollout_id=0)).read_text().splitlines()]
    assert [(r["status"], r["in_loss"], r["reward"]) for r in rows[4:]] == [
        ("completed", False, 0.0), ("aborted", False, None), ("completed", False, 0.0), ("completed", False, 1.0)]


def test_aborts_and_mismatches_in_one_group_count_in_both_and_drop_it_once(tmp_path, tiny_ckpt, caplog):
    # Group 0: request 1 mismatches, 2 is aborted, 3 both (it counts as a mismatch); group 1 is clean.
    engines = ScriptedEngines(miscount={1: 1, 3: -1}, abort={2, 3})
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--max-prompt-length-mismatch-fraction", "0.25"))
    try:
        with caplog.at_level(logging.WARNING, logger="slime.rollout.manager"):
            batch = manager.generate(0)
    finally:
        manager.close()
    samples = batch.samples
    assert [s.status for s in samples[:4]] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.ABORTED,
                                               SampleStatus.FAILED]
    assert all(not any(s.loss_mask) and s.advantage == 0.0 for s in samples[:4])
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [s.advantage for s in samples[4:]] == pytest.approx([-expected, expected] * 2, rel=1e-6)
    m = batch.metrics
    assert (m["rollout/prompt_length_mismatches"], m["rollout/prompt_length_mismatch_groups"]) == (2.0, 1.0)
    assert (m["rollout/aborted_samples"], m["rollout/aborted_groups"]) == (1.0, 1.0)
    # Usable: sample 0 (reward 0) and group 1 (0, 1, 0, 1).
    assert (m["rollout/num_samples"], m["rollout/reward_responses"]) == (5.0, 5)
    assert m["rollout/reward_mean"] == pytest.approx(2 / 5)
    assert "1 of 8 train samples were aborted by the rollout engine (sample 2 (dataset index 0, rid 0:2" in caplog.text


@pytest.mark.parametrize("miscount, abort, counts", [
    ({}, {0, 7}, "aborted (2 samples in 2 groups) or one whose prompt has another length in the engine than in the "
     "data pipeline (0 samples in 0 groups)"),
    ({1: 1}, {6}, "aborted (1 samples in 1 groups) or one whose prompt has another length in the engine than in the "
     "data pipeline (1 samples in 1 groups)"),
])  # fmt: skip
def test_an_abort_in_every_group_leaves_nothing_to_train_on(tmp_path, tiny_ckpt, miscount, abort, counts):
    engines = ScriptedEngines(miscount=miscount, abort=abort)
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--max-prompt-length-mismatch-fraction", "0.5"))
    try:
        with pytest.raises(RolloutAbortedError) as info:
            manager.generate(0)
    finally:
        manager.close()
    message = str(info.value)
    assert message.startswith("every one of the 2 groups of this rollout holds a sample the rollout engine ")
    assert counts in message and "so no group is left to train on" in message and "/pause_generation" in message


def test_eval_leaves_an_aborted_sample_out_of_its_metrics(tmp_path, tiny_ckpt):
    # Set "a" (labels 7, 7, 7) gets answers 7, 5, 7 and set "b" (label 5) gets 5; request 1 of "a" is
    # aborted: accuracy 2 / 2 over 2 samples (3 samples with it would give 2 / 3), 3 responses scored.
    engines = ScriptedEngines(abort={1})
    manager = _manager(tmp_path, tiny_ckpt, engines, eval_labels={"a": ["7", "7", "7"], "b": ["5"]})
    try:
        metrics = manager.evaluate(0)
    finally:
        manager.close()
    assert (metrics["eval/a/aborted_samples"], metrics["eval/a/prompt_length_mismatches"]) == (1.0, 0.0)
    assert (metrics["eval/a/num_samples"], metrics["eval/a/accuracy"]) == (2.0, pytest.approx(1.0))
    assert metrics["eval/a/response_len_mean"] == 2.0
    assert metrics["eval/b/aborted_samples"] == 0.0 and metrics["eval/b/num_samples"] == 1.0
    assert metrics["eval/reward_responses"] == 3


def test_an_eval_set_with_every_sample_aborted_stops_with_a_clear_error(tmp_path, tiny_ckpt):
    engines = ScriptedEngines(abort={0, 1})
    manager = _manager(tmp_path, tiny_ckpt, engines, eval_labels={"a": ["7", "7"]})
    try:
        with pytest.raises(RolloutAbortedError, match=r"every one of the 2 samples of eval set 'a' at rollout 4 was "
                           r"aborted by the rollout engine \(2\) or saw another prompt length \(0\)"):
            manager.evaluate(4)
    finally:
        manager.close()


# ---------------------------------------------------------------------------------------
# A NaN or infinite reward (the reward function's fault), without dynamic sampling


def test_a_nan_reward_drops_its_group_without_dynamic_sampling(tmp_path, tiny_ckpt, caplog):
    # Through the real scorer: tests.rewards:boxed_ratio_reward gives answer / label, NaN for an answer below the
    # label.  Batch of 3 (rows 0, 1, 4: labels 5, 5, 7; rows 2-3 skipped); requests answer 7, 5, 7, 5, ...
    # Groups 0 and 1 (label 5): [7/5, 1, 7/5, 1]; group 2 (label 7): [1, nan, 1, nan].
    dump = tmp_path / "dump_{rollout_id}.jsonl"
    manager = _manager(tmp_path, tiny_ckpt, ScriptedEngines(), eval_labels={"a": ["5", "7"]}, extra=(
        "--custom-rm-path", "tests.rewards:boxed_ratio_reward", "--rollout-batch-size", "3",
        "--global-batch-size", "12", "--save-debug-rollout-data", str(dump)))
    try:
        with caplog.at_level(logging.WARNING):
            batch = manager.generate(0)
            eval_metrics = manager.evaluate(0)
    finally:
        manager.close()
    samples = batch.samples
    assert [s.label for s in samples[::4]] == ["5", "5", "7"]
    assert [s.reward for s in samples[:8]] == [1.4, 1.0] * 4
    assert [s.reward for s in samples[8:]][::2] == [1.0, 1.0] and all(math.isnan(s.reward) for s in samples[9::2])
    # Group 2 is left out of the loss (not trained on 0.0): every token masked, advantage 0.
    assert [s.loss_mask for s in samples[8:]] == [[0, 0]] * 4 and [s.advantage for s in samples[8:]] == [0.0] * 4
    # Groups 0 and 1 by hand in float64: mean 1.2, deviations +-0.2, unbiased std sqrt(4 * 0.2^2 / 3), eps 1e-6.
    adv = 0.2 / (math.sqrt(4 * 0.2**2 / 3) + 1e-6)
    assert [s.advantage for s in samples[:8]] == pytest.approx([adv, -adv] * 4, rel=1e-6)
    assert all(s.loss_mask == [1, 1] for s in samples[:8])
    m = batch.metrics
    assert m["rollout/non_finite_reward_groups"] == 1.0
    assert (m["rollout/reward_non_finite"], m["rollout/reward_errors"], m["rollout/reward_responses"]) == (2, 0, 12)
    # The 10 finite rewards: 4 * 1.4 + 4 * 1 + 2 * 1 (the NaN ones are left out); all >= 1.
    assert m["rollout/reward_mean"] == pytest.approx((4 * 1.4 + 6) / 10, rel=1e-12) and m["rollout/accuracy"] == 1.0
    assert caplog.text.count("dropping the group of dataset index 4: its rewards [1.0, nan, 1.0, nan]") == 1
    assert "scored 0.0" not in caplog.text  # a NaN is not a scorer failure, and logged once
    def strict(constant):  # Python's json reads a bare NaN; strict JSON readers (jq, JavaScript) do not
        raise ValueError(f"{constant} in the debug dump")

    rows = [json.loads(line, parse_constant=strict)
            for line in Path(str(dump).format(rollout_id=0)).read_text().splitlines()]
    assert [r["in_loss"] for r in rows] == [True] * 8 + [False] * 4
    assert [r["reward"] for r in rows[8:]] == [1.0, "NaN", 1.0, "NaN"]  # as metrics.jsonl writes it
    # Eval: answers 7 to label 5 (7/5) and 5 to label 7 (nan): the NaN is left out of the set's mean and accuracy.
    assert (eval_metrics["eval/a/reward_mean"], eval_metrics["eval/a/accuracy"]) == (1.4, 1.0)
    assert eval_metrics["eval/reward_non_finite"] == 1
    assert "eval a at rollout 0: the reward function gave 1 of 2 samples a NaN or infinite reward" in caplog.text


def test_a_non_finite_reward_in_every_group_stops_with_a_clear_error():
    samples = [Sample(index=i // 2, prompt="", label="5", reward=r, response_token_ids=[1]) for i, r in
               enumerate([math.nan, 1.0, 0.0, math.inf])]
    with pytest.raises(NonFiniteRewardError, match=r"every one of the 2 usable groups of this rollout holds a NaN or "
                       r"infinite reward.*--custom-rm-path / --rm-type"):
        _drop_non_finite_groups(samples, 2)
    kept, dropped = _drop_non_finite_groups(samples[:2] + [Sample(index=2, prompt="", label="5", reward=r,
                                                                  response_token_ids=[1]) for r in (0.0, 1.0)], 2)
    assert [s.index for s in kept] == [2, 2] and [s.index for s in dropped] == [0, 0]


# ---------------------------------------------------------------------------------------
# Truncated samples: --stop-properly-penalty-coef and --overlong-filter


def _truncated_batch(tmp_path, tiny_ckpt, *extra):
    """Rollout 0 with requests 0, 3 and 6 cut by length: labels 5, so request 3 (answer 5) is a
    truncated response with a correct box; 0 and 6 (answer 7) are truncated and wrong."""
    manager = _manager(tmp_path, tiny_ckpt, ScriptedEngines(truncate_every=3), extra=extra)
    try:
        return manager.generate(0)
    finally:
        manager.close()


def test_truncated_samples_keep_their_reward_by_default(tmp_path, tiny_ckpt):
    batch = _truncated_batch(tmp_path, tiny_ckpt)
    assert [s.reward for s in batch.samples] == [0.0, 1.0] * 4  # request 3 scores 1 (upstream behaviour)
    assert all(s.loss_mask == [1] * s.response_length for s in batch.samples)
    m = batch.metrics
    assert (m["rollout/truncated_count"], m["rollout/truncated_rewarded_count"]) == (3, 1)
    assert m["rollout/truncated_reward_penalized_count"] == 0 and m["rollout/loss_masked_samples"] == 0
    assert "rollout/shaped_reward_mean" not in m


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_stop_properly_penalty_scales_truncated_rewards_before_advantages(tmp_path, tiny_ckpt, coef):
    batch = _truncated_batch(tmp_path, tiny_ckpt, "--stop-properly-penalty-coef", str(coef))
    rewards = [s.reward for s in batch.samples]
    assert rewards == [0.0, 1.0, 0.0, coef, 0.0, 1.0, 0.0, 1.0]
    # Group 0 is [0, 1, 0, c]: GRPO by hand in float64 (unbiased std, eps 1e-6).
    group = rewards[:4]
    mean = sum(group) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)
    for sample, r in zip(batch.samples[:4], group):
        assert sample.advantage == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)
    m = batch.metrics
    assert m["rollout/truncated_reward_penalized_count"] == 1  # request 3; 0 * coef == 0 for 0 and 6
    assert m["rollout/shaped_reward_mean"] == pytest.approx((3 + coef) / 8)
    assert m["rollout/accuracy"] == 0.5 and m["rollout/reward_mean"] == 0.5  # the reward function's verdicts


def test_overlong_filter_masks_truncated_samples_out_of_the_loss(tmp_path, tiny_ckpt):
    batch = _truncated_batch(tmp_path, tiny_ckpt, "--overlong-filter")
    for i, sample in enumerate(batch.samples):
        assert sample.loss_mask == ([0] * 3 if i % 3 == 0 else [1] * sample.response_length), i
    assert [s.reward for s in batch.samples] == [0.0, 1.0] * 4  # rewards and advantages as by default
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [s.advantage for s in batch.samples] == pytest.approx([-expected, expected] * 4, rel=1e-6)
    assert batch.metrics["rollout/loss_masked_samples"] == 3


def test_overlong_filter_with_a_stop_properly_penalty_applies_both_and_says_so(tmp_path, tiny_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="slime.rollout.manager"):
        batch = _truncated_batch(tmp_path, tiny_ckpt, "--overlong-filter", "--stop-properly-penalty-coef", "0.5")
    assert "--overlong-filter and --stop-properly-penalty-coef 0.5 are both set, and both apply" in caplog.text
    rewards = [s.reward for s in batch.samples]
    assert rewards == [0.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 1.0]  # request 3 penalised ...
    for i, sample in enumerate(batch.samples):  # ... and every truncated sample (0, 3, 6) masked
        assert sample.loss_mask == ([0] * 3 if i % 3 == 0 else [1] * sample.response_length), i
    group = rewards[:4]  # the penalised reward moves its group's advantages (float64, unbiased std, eps 1e-6)
    mean = sum(group) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)
    for sample, r in zip(batch.samples[:4], group):
        assert sample.advantage == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)
    m = batch.metrics
    assert (m["rollout/truncated_reward_penalized_count"], m["rollout/loss_masked_samples"]) == (1, 3)
    assert m["rollout/shaped_reward_mean"] == pytest.approx(3.5 / 8)


def test_stop_properly_penalty_coef_out_of_range_is_refused(tmp_path, tiny_ckpt):
    with pytest.raises(SystemExit):
        _manager(tmp_path, tiny_ckpt, ScriptedEngines(), extra=("--stop-properly-penalty-coef", "1.5"))


# ---------------------------------------------------------------------------------------
# Per-request sampling seeds


def test_every_request_carries_the_seed_of_its_position(tmp_path, tiny_ckpt):
    from slime.rollout.seeds import sampling_seed

    engines = ScriptedEngines()
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--rollout-seed", "9"))
    try:
        manager.generate(0)
        manager.generate(1)
        manager.evaluate(2)
    finally:
        manager.close()
    train0, train1, held_out = ([r.sampling_params.sampling_seed for r in call] for call in engines.calls)
    assert train0 == [sampling_seed(9, 0, i) for i in range(8)]
    assert train1 == [sampling_seed(9, 1, i) for i in range(8)]
    assert held_out == [sampling_seed(9, 2, i, "eval/held_out") for i in range(2)]
    assert len(set(train0 + train1 + held_out)) == 18


def test_eval_temperature_zero_sends_greedy_requests_and_training_keeps_sampling(tmp_path, tiny_ckpt):
    engines = ScriptedEngines()
    manager = _manager(tmp_path, tiny_ckpt, engines, extra=("--eval-temperature", "0", "--rollout-temperature", "0.7"))
    try:
        manager.evaluate(0)
        manager.generate(0)
    finally:
        manager.close()
    held_out, train0 = engines.calls
    assert {r.sampling_params.temperature for r in held_out} == {0.0}
    assert {r.sampling_params.temperature for r in train0} == {0.7}
