"""DAPO dynamic sampling (:mod:`slime.rollout.dynamic_sampling`): the real rollout manager and request scheduler on
a stand-in engine pool with a simulated clock, and a scripted answer per dataset row, so that every kept group,
round, trimming order, cap, fallback and data cursor below is worked out by hand.

Rows are scripted ``R`` (every answer right: rewards all 1), ``W`` (all wrong: all 0) or ``M`` (sample ``j`` right
when ``j`` is even: rewards [1, 0, 1, 0], which vary); each row also has a call duration (simulated seconds).
Right is ``\boxed{5}`` (every label is 5), wrong ``\boxed{7}``; a row ``N`` answers ``\boxed{3}`` to even ``j``
(right otherwise), which ``tests.rewards:boxed_ratio_reward`` scores NaN.
One engine of capacity 8 and 4 requests per call: each call is one group of ``n = 4``, two in flight at once.
"""

from __future__ import annotations

import copy
import io
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from slime.arguments import parse_args
from slime.data.image import decode_image
from slime.data.sample import Sample
from slime.rollout.dynamic_sampling import DynamicSamplingError
from slime.rollout.engines.base import GenerateOutput
from slime.rollout.filters import GroupVerdict, filter_name, nonzero_std, nonzero_std_with_fallback, verdict_of
from slime.rollout.manager import RolloutManager
from slime.rollout.scheduler import EngineState, RequestScheduler
from slime.utils.config import ConfigError

N = 4
P = "rollout/dynamic_sampling/"
D = "rollout/dynamic_filter/drop_"


class ScriptedPool:
    """An :class:`~slime.rollout.scheduler.EnginePool` of one engine; a call of row ``r`` lasts ``durations[r]``
    simulated seconds, calls run concurrently; :meth:`abort` ends the calls in flight at once, cut off."""

    def __init__(self, processor, patterns: str, durations: list[float]):
        self.processor, self.patterns, self.durations = processor, patterns, durations
        self.now = 0.0
        self.calls: dict[int, dict] = {}
        self.aborts: list[tuple[float, set[int]]] = []
        self.sent_rids: list[str] = []
        self.seeds: list[int] = []

    def state(self, engine):
        return EngineState.SERVING

    def describe(self, engine):
        return f"engine {engine} (scripted)"

    def submit(self, engine, requests):
        rows = {int(r.rid.split(":")[0]) for r in requests}
        assert len(rows) == 1, "each call is one group here"
        self.sent_rids += [r.rid for r in requests]
        self.seeds += [r.sampling_params.sampling_seed for r in requests]
        call = len(self.calls)
        self.calls[call] = dict(requests=requests, done_at=self.now + self.durations[rows.pop()], aborted=False)
        return call

    def wait(self, calls, timeout_s):
        call = min(calls, key=lambda c: (self.calls[c]["done_at"], c))
        self.now = max(self.now, self.calls[call]["done_at"])
        return call

    def result(self, call):
        outs = []
        for req in self.calls[call]["requests"]:
            row, position = (int(x) for x in req.rid.split(":"))
            pattern, even = self.patterns[row], position % N % 2 == 0
            right = {"R": True, "W": False, "M": even, "N": True}[pattern]
            text = "\\boxed{3}" if pattern == "N" and even else "\\boxed{5}" if right else "\\boxed{7}"
            prompt_tokens = len(self.processor(req.text, [decode_image(b) for b in req.image_data]).input_ids)
            reason = "abort" if self.calls[call]["aborted"] else "stop"
            outs.append(GenerateOutput(text, [11, 12], [-0.5, -0.5], reason, prompt_tokens, rid=req.rid))
        return outs

    def unhealthy(self, engines, timeout_s):
        return {}

    def fail(self, engine, why, cause):
        raise AssertionError(why)

    def wait_for_restarts(self):
        pass

    def abort(self, engines):
        self.aborts.append((self.now, set(engines)))
        for call in self.calls.values():
            if call["done_at"] > self.now:
                call["done_at"], call["aborted"] = self.now, True


class ScriptedEngines:
    """Duck-typed RolloutEngineGroup over :class:`ScriptedPool` and the real :class:`RequestScheduler`."""

    def __init__(self, pool: ScriptedPool):
        self.pool = pool
        self.scheduler = RequestScheduler(pool, clock=lambda: pool.now)

    def generate(self, requests, on_outputs=None):
        return self.scheduler.generate(requests, [(8, 4)], on_outputs)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def make(tmp_path, tiny_ckpt):
    from slime.data.processor import load_processor

    processor = load_processor(tiny_ckpt)
    made = []

    def build(patterns: str, durations: list[float], *flags: str):
        path = tmp_path / "train.parquet"
        png = _png()
        pq.write_table(pa.table({
            "problem": [f"<image>Row {r}?" for r in range(len(patterns))],
            "answer": ["5"] * len(patterns),
            "images": [[{"bytes": png, "path": None}] for _ in patterns],
        }), path)  # fmt: skip
        cfg = parse_args([
            "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(path),
            "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
            "--apply-chat-template", "--rm-type", "math", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "3",
            "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
            "--over-sampling-batch-size", "4", *flags,
        ])  # fmt: skip
        pool = ScriptedPool(processor, patterns, durations)
        manager = RolloutManager(
            rollout=cfg.rollout, data=cfg.data, reward=cfg.reward, grpo=cfg.grpo, evaluation=cfg.eval,
            processor=processor, engines=ScriptedEngines(pool), seed=cfg.rollout.rollout_seed,
        )
        made.append(manager)
        return manager, pool

    yield build
    for manager in made:
        manager.close()


def _rows(batch) -> list[int]:
    return [s.index for s in batch.samples[::N]]


# Round 1: rows 0-3 (R M W R), round 2: rows 4-7 (M M M W); durations make row 1 slow and row 6 slower.
PATTERNS = "RMWRMMMWRMWR"
DURATIONS = [1, 5, 1, 1, 1, 0.5, 10, 1, 1, 1, 1, 1]


def test_keeps_the_first_passing_groups_in_draw_order_and_aborts_the_rest(make):
    manager, pool = make(PATTERNS, DURATIONS, "--dynamic-sampling-filter-path", "nonzero_std")
    batch = manager.generate(0)
    # Simulated schedule (two groups in flight): t=0 send g0 (row 0, ends 1), g1 (ends 5); t=1 g0 R, send g2;
    # t=2 g2 W, send g3; t=3 g3 R: 0 passed + 1 pending (g1) < 2 -> round 2 (rows 4-7), send g4; t=4 g4 passes,
    # send g5; t=4.5 g5 passes, send g6 (ends 14.5); t=5 g1 passes: g0..g4 are done and hold 2 passing groups
    # (g1, g4) -> stop: g7 is never sent, g6 is aborted at t=5, not waited for.
    assert _rows(batch) == [1, 4]  # draw order, although g4 and g5 finished before g1; g5 is the surplus
    assert [s.group_index for s in batch.samples] == [0] * N + [1] * N
    assert [s.reward for s in batch.samples] == [1.0, 0.0, 1.0, 0.0] * 2
    adv = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # GRPO on [1, 0, 1, 0]: (r - 0.5) / (unbiased std + eps)
    assert [s.advantage for s in batch.samples] == pytest.approx([adv, -adv, adv, -adv] * 2, rel=1e-6)
    assert pool.aborts == [(5.0, {0})] and pool.now == 5.0
    assert [rid.split(":")[0] for rid in pool.sent_rids[::N]] == ["0", "1", "2", "3", "4", "5", "6"]
    m = batch.metrics
    # the filter's drops under upstream's names and reasons (rows 0 and 3 all right, row 2 all wrong)
    # (non_finite_reward and dropped_unusable: written as 0, every step, for a continuous series)
    assert {k: v for k, v in m.items() if k.startswith(D)} == {
        D + "zero_std_1.0": 2.0, D + "zero_std_0.0": 1.0, D + "non_finite_reward": 0.0}
    assert {k[len(P):]: v for k, v in m.items() if k.startswith(P)} == {
        "rounds": 2.0, "groups_drawn": 8.0, "groups_generated": 6.0, "groups_passed": 3.0, "groups_kept": 2.0,
        "groups_fallback": 0.0, "dropped_surplus": 1.0, "dropped_cancelled": 2.0, "dropped_unusable": 0.0,
        # request-seconds: g0 1, g1 5, g2 1, g3 1, g4 1, g5 0.5, g6 0.5 (aborted), g7 0; kept g1 + g4 = 6 of 10
        "dropped_generation_time_frac": pytest.approx(0.4),
        "generate_time_s": m[P + "generate_time_s"],  # real seconds: not scripted
        # rewards of the generated groups: 1 (R) 0.5 (M) 0 (W) 1 (R) 0.5 0.5, 4 samples each
        "generated_reward_mean": pytest.approx(14 / 24),
    }
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/zero_std_group_frac"] == 0.0
    # The data cursor counts every prompt drawn: the 8 of the two rounds, g6 and g7 included.
    assert manager.state_dict()["dataset"]["position"] == 8


def test_exact_resume_draws_the_same_groups_with_the_same_seeds(make):
    manager, pool = make(PATTERNS, DURATIONS, "--dynamic-sampling-filter-path", "nonzero_std")
    manager.generate(0)
    state = copy.deepcopy(manager.state_dict())
    seeds_before = len(pool.seeds)
    expected = manager.generate(1)
    resumed, resumed_pool = make(PATTERNS, DURATIONS, "--dynamic-sampling-filter-path", "nonzero_std")
    resumed.load_state_dict(state)
    got = resumed.generate(1)
    # Step 1 starts at row 8 (R M W R): round 1 keeps row 9; round 2 wraps (rows 0-3) and keeps row 1.
    assert _rows(got) == _rows(expected) == [9, 1]
    assert [(s.index, s.response, s.reward) for s in got.samples] == [
        (s.index, s.response, s.reward) for s in expected.samples]
    assert resumed_pool.sent_rids == pool.sent_rids[seeds_before:]
    assert resumed_pool.seeds == pool.seeds[seeds_before:]
    assert resumed.state_dict() == manager.state_dict()
    assert (resumed.state_dict()["dataset"]["epoch"], resumed.state_dict()["dataset"]["position"]) == (1, 4)


@pytest.mark.parametrize("filter_flags", [("--dynamic-sampling-filter-path", "nonzero_std_with_fallback"), ()])
def test_a_group_with_a_nan_reward_is_dropped_counted_and_logged(make, caplog, filter_flags):
    # Through the real scorer (worker processes): tests.rewards:boxed_ratio_reward gives answer / label, NaN for an
    # answer below the label.  Row 0 is N: rewards [nan, 1, nan, 1]; M rows [1, 1.4, 1, 1.4]; R all 1; W all 1.4.
    manager, _ = make("NMWRMMMWRMWR", DURATIONS, "--custom-rm-path", "tests.rewards:boxed_ratio_reward", *filter_flags)
    with caplog.at_level("WARNING", logger="slime.rollout.filters"):
        batch = manager.generate(0)
    m = batch.metrics
    if filter_flags:
        # The draw-order test's schedule: rows 1 and 4 kept; row 0 is dropped for its NaN before the filter.
        assert _rows(batch) == [1, 4]
        assert {k: v for k, v in m.items() if k.startswith(D)} == {
            D + "non_finite_reward": 1.0, D + "zero_std_1.0": 1.0, D + "zero_std_1.4": 1.0}  # rows 0; 3; 2
        # generated groups g0..g5 (rows 0-5): finite rewards 1+1, 4.8, 4 * 1.4, 4 * 1, 4.8, 4.8 over 22 samples
        assert m[P + "generated_reward_mean"] == pytest.approx((2 + 4.8 + 5.6 + 4 + 4.8 + 4.8) / 22, rel=1e-12)
    else:
        # No filter: every finite group passes; row 0 (done at t=1) is dropped, rows 1 (t=5) and 2 (t=2) kept.
        assert _rows(batch) == [1, 2]
        assert {k: v for k, v in m.items() if k.startswith(D)} == {D + "non_finite_reward": 1.0}
    assert m["rollout/non_finite_reward_groups"] == 1.0
    assert m["rollout/reward_non_finite"] == 2.0 and m["rollout/reward_errors"] == 0.0  # row 0's samples 0 and 2
    assert caplog.text.count("rewards [nan, 1.0, nan, 1.0] are not all finite") == 1
    assert "dropping the group of dataset index 0" in caplog.text
    # The kept M group (rewards 1, 1.4, 1, 1.4) by hand in float64: mean 1.2, unbiased std sqrt(4 * 0.2^2 / 3).
    adv = 0.2 / (math.sqrt(4 * 0.2**2 / 3) + 1e-6)
    assert [s.reward for s in batch.samples[:N]] == [1.0, 1.4, 1.0, 1.4]
    assert [s.advantage for s in batch.samples[:N]] == pytest.approx([-adv, adv, -adv, adv], rel=1e-6)  # float32
    assert all(math.isfinite(s.reward) for s in batch.samples)
    nan_group = [Sample(index=0, prompt="", label="5", reward=r) for r in (math.nan, math.nan, math.inf)]
    for fn in (nonzero_std, nonzero_std_with_fallback):  # before: statistics.stdev raised AttributeError
        assert fn(nan_group) == GroupVerdict(False, reason="non_finite_reward")  # never a fallback


def test_the_cap_on_rounds_stops_with_a_clear_message(make):
    # Round 1 (R M W R) passes 1 group, round 2 (R W R W) none: 1 < 2 after the 2 rounds allowed.
    manager, _ = make("RMWRRWRWMMMM", [1] * 12, "--dynamic-sampling-filter-path", "nonzero_std",
                      "--dynamic-sampling-max-rounds", "2")
    with pytest.raises(DynamicSamplingError, match=r"2 sampling round\(s\) of 4 prompts gave 1 groups .*"
                       r"--rollout-batch-size 2.*--dynamic-sampling-max-rounds \(now 2\)"):
        manager.generate(0)


def test_the_fallback_fills_the_batch_with_the_first_rejected_groups(make, caplog):
    upstream = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    manager, pool = make("RMWRRWRWMMMM", [1] * 12, "--dynamic-sampling-filter-path", upstream,
                         "--dynamic-sampling-max-rounds", "2")
    with caplog.at_level("WARNING", logger="slime.rollout.dynamic_sampling"):
        batch = manager.generate(0)
    assert "rollout 0: 2 sampling round(s) gave 1 of --rollout-batch-size 2 groups" in caplog.text
    assert "filled with 1 rejected group(s) (fallback" in caplog.text  # once only a metric said so
    # 1 passing group (row 1); every rejected group has std 0, so the first rejected in draw order (row 0) fills.
    assert _rows(batch) == [0, 1]
    assert [s.reward for s in batch.samples] == [1.0] * 4 + [1.0, 0.0, 1.0, 0.0]
    assert [s.advantage for s in batch.samples[:N]] == [0.0] * N
    m = batch.metrics
    assert (m[P + "rounds"], m[P + "groups_fallback"], m[P + "groups_kept"]) == (2.0, 1.0, 2.0)
    assert (m[D + "zero_std_1.0"], m[D + "zero_std_0.0"]) == (3.0, 3.0)  # rows 3 4 6; rows 2 5 7
    assert pool.aborts == [] and manager.state_dict()["dataset"]["position"] == 8


def test_over_sampling_without_a_filter_keeps_the_first_groups_drawn(make):
    manager, pool = make(PATTERNS, DURATIONS)
    batch = manager.generate(0)
    # No filter: every group passes.  t=1 g0 done, g2 sent; t=2 g2 done (g1, ending at 5, pending), g3 sent;
    # t=3 g3 done; t=5 g1 done: g0, g1 are the batch, g2 and g3 the surplus; nothing left in flight to abort.
    assert _rows(batch) == [0, 1]
    assert batch.metrics[P + "rounds"] == 1.0 and batch.metrics[P + "dropped_surplus"] == 2.0
    assert pool.aborts == []


def test_eval_is_never_filtered(make, tmp_path):
    manager, _ = make(PATTERNS, DURATIONS, "--dynamic-sampling-filter-path", "nonzero_std",
                      "--n-samples-per-eval-prompt", str(N))
    before = manager.state_dict()
    assert manager.sampler is not None
    manager.eval_sets = {"held_out": manager.dataset.eval_samples()[:2]}  # rows 0 (R) and 1 (M)
    m = manager.evaluate(0)
    # Row 0's constant group (positions 0-3, all right), which the filter would drop, is in the metrics with
    # row 1's (positions 4-7: right, wrong, right, wrong): 6 of 8 right.
    assert m["eval/held_out/num_samples"] == 8.0 and m["eval/held_out/accuracy"] == 0.75
    assert manager.state_dict() == before


def test_nonzero_std_verdicts_by_hand():
    def group(*rewards):
        return [Sample(index=0, prompt="", label="5", reward=r) for r in rewards]

    assert nonzero_std(group(1.0, 0.0, 1.0, 0.0)) == GroupVerdict(True, score=pytest.approx(math.sqrt(1 / 3)))
    # upstream's reason: the first reward rounded to 0.1 as Python prints a float
    assert nonzero_std(group(1.0, 1.0)) == GroupVerdict(False, reason="zero_std_1.0", score=0.0)
    assert nonzero_std(group(0.0, 0.0)).reason == "zero_std_0.0"
    assert nonzero_std(group(0.25, 0.25)).reason == "zero_std_0.2"  # round half to even, as upstream's round()
    assert verdict_of(lambda g: True, group(1.0)) == GroupVerdict(True)
    assert verdict_of(lambda g: torch.tensor([1.0, 1.0]).std() > 1e-6, group(1.0)) == GroupVerdict(False)
    with pytest.raises(TypeError, match="returned 'yes' for the group of dataset index 0"):
        verdict_of(lambda g: "yes", group(1.0))
    assert filter_name("my.filters.keep") == "my.filters:keep"


@pytest.mark.parametrize("flags, message", [
    (["--over-sampling-batch-size", "1"], "--over-sampling-batch-size 1 must be >= --rollout-batch-size 2"),
    (["--dynamic-sampling-filter-path", "nonzero_std", "--dynamic-sampling-max-rounds", "0"],
     "--dynamic-sampling-max-rounds must be >= 1"),
    (["--dynamic-sampling-max-rounds", "3"], "--dynamic-sampling-max-rounds 3 caps the sampling rounds of "
     "dynamic sampling, which is off"),
    (["--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero"],
     "is not one of upstream's filters that this project has"),
    (["--dynamic-sampling-filter-path", "std"], "'std' is not a filter; use one of nonzero_std"),
    (["--dynamic-sampling-filter-path", "no_such_pkg.filters.keep"], "no_such_pkg.filters:keep cannot be imported"),
    (["--dynamic-sampling-filter-path", "nonzero_std", "--n-samples-per-prompt", "1"], "groups of one sample"),
])  # fmt: skip
def test_bad_flags_are_refused_naming_the_flag(tiny_ckpt, flags, message, capsys):
    with pytest.raises(SystemExit):  # parse_args prints the ConfigError's message and exits 2
        parse_args(["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", "x.parquet", "--num-rollout", "1",
                    "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3",
                    *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("path, message", [
    ("os:sep", "--dynamic-sampling-filter-path 'os:sep' is a str, not a function"),
    ("operator:add", "--dynamic-sampling-filter-path 'operator:add' has the signature (a, b, /)"),
])
def test_check_only_refuses_a_filter_that_cannot_take_a_group(tiny_ckpt, path, message):
    # --check-only (resolve_components) imports the filter: once it passed these and the run failed mid-step.
    from slime.driver import resolve_components

    cfg = parse_args(["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", "x.parquet", "--num-rollout", "1",
                      "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3",
                      "--rollout-num-gpus", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp",
                      "--dynamic-sampling-filter-path", path])
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_components(cfg)
