"""IS corrections, OPSM and GSPO in the shared GRPO loss (slime/grpo/correction.py, loss.py), CPU only.

Expected values are worked out by hand in the comments (the arithmetic is written in the test), or by a
float64 loop over samples and tokens written here with ``math``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from slime.grpo.config import TIS_FUNCTIONS, GRPOConfig
from slime.grpo.correction import importance_weights, level_log_ratio, tis_function
from slime.grpo.loss import grpo_loss, grpo_micro_batch_loss
from slime.backends.train_metrics import all_reduce_extrema, extrema_over_steps
from slime.utils.config import ConfigError

F64 = torch.float64


def _batch(ratios: list[list[float]], masks: list[list[int]], advantages: list[float]) -> dict:
    """Padded inputs whose current log-probs equal the old ones (PPO ratio 1, token loss ``-A``), the rollout's
    ``old - ln(ratio)`` so that ``exp(old - rollout)`` is the given IS ratio; masked entries hold garbage."""
    width = max(len(r) for r in ratios)
    old = torch.full((len(ratios), width), -1.5, dtype=F64)
    rollout = torch.full_like(old, 7.0)  # garbage under the mask
    mask = torch.zeros_like(old, dtype=torch.bool)
    for b, (row, m) in enumerate(zip(ratios, masks)):
        for t, (r, on) in enumerate(zip(row, m)):
            rollout[b, t] = old[b, t] - math.log(r)
            mask[b, t] = bool(on)
    adv = torch.tensor(advantages, dtype=F64)[:, None].expand_as(old).clone()
    return dict(log_probs=old.clone().requires_grad_(), old_log_probs=old, advantages=adv, loss_mask=mask,
                rollout_log_probs=rollout)


# A: IS ratios 3.0 and 0.5, advantage +1; B: ratio 1.5 and one masked token, advantage -2.
# PPO ratio 1, so the token losses are -1, -1 (A) and +2 (B); the loss is the sample mean.
TWO = ([[3.0, 0.5], [1.5, 99.0]], [[1, 1], [1, 0]], [1.0, -2.0])
G = math.sqrt(1.5)  # A's geometric-mean ratio, sqrt(3 * 0.5)

CASES = [
    # mode, level, low, high, pg_loss, weight mean, min, max, clipfrac
    # token truncate [0, 2]: w = 2, 0.5 | 1.5: A (-2 - 0.5) / 2 = -1.25, B 3 -> 0.875; mean (1.25 + 1.5) / 2
    ("truncate", "token", 0.0, 2.0, (-1.25 + 3.0) / 2, (1.25 + 1.5) / 2, 0.5, 2.0, (0.5 + 0) / 2),
    # token icepop [0.6, 2]: w = 0, 0 | 1.5 -> (0 + 3) / 2; both of A's changed
    ("icepop", "token", 0.6, 2.0, 1.5, (0 + 1.5) / 2, 0.0, 1.5, (1 + 0) / 2),
    # token reject [0.6, 2]: w = 0, 0 | 1 -> (0 + 2) / 2; B's 1.5 became 1 (changed)
    ("reject", "token", 0.6, 2.0, 1.0, (0 + 1) / 2, 0.0, 1.0, (1 + 1) / 2),
    # sequence truncate [0, 2]: A 3 * 0.5 = 1.5, B 1.5 -> (-1.5 + 3) / 2, nothing clipped
    ("truncate", "sequence", 0.0, 2.0, (-1.5 + 3.0) / 2, 1.5, 1.5, 1.5, 0.0),
    # sequence icepop [0.5, 1.4]: A 1.5 and B 1.5 both out -> 0
    ("icepop", "sequence", 0.5, 1.4, 0.0, 0.0, 0.0, 0.0, 1.0),
    # geometric truncate [0, 1.4]: A sqrt(1.5) ~ 1.2247, B 1.5 -> 1.4
    ("truncate", "geometric", 0.0, 1.4, (-G + 2 * 1.4) / 2, (G + 1.4) / 2, G, 1.4, (0 + 1) / 2),
    # geometric icepop [0.9, 1.3]: A kept, B zeroed
    ("icepop", "geometric", 0.9, 1.3, -G / 2, G / 2, 0.0, G, (0 + 1) / 2),
    # geometric reject [0.9, 1.3]: A 1, B 0
    ("reject", "geometric", 0.9, 1.3, -1.0 / 2, 1 / 2, 0.0, 1.0, (1 + 1) / 2),
]


def _packed(batch: dict) -> dict:
    """The padded batch packed: [A0, A1, B0] plus one trailing padding token, cu_seqlens [0, 2, 3]."""
    keep = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    out = {k: v.detach()[keep[:, 0], keep[:, 1]] for k, v in batch.items()}
    out["loss_mask"][3] = False
    out["log_probs"].requires_grad_()
    return dict(out, cu_seqlens=torch.tensor([0, 2, 3]))


@pytest.mark.parametrize("mode,level,low,high,pg,mean,lo,hi,frac", CASES)
def test_is_modes_and_levels_by_hand_padded_and_packed(mode, level, low, high, pg, mean, lo, hi, frac):
    cfg = GRPOConfig(use_tis=True, tis_mode=mode, tis_level=level, tis_clip_low=low, tis_clip=high)
    padded = _batch(*TWO)
    for inputs in (padded, _packed(padded)):
        loss, m = grpo_loss(cfg=cfg, **inputs)
        assert loss.item() == pytest.approx(pg, rel=1e-12, abs=1e-15)
        assert m["tis_weight_mean"].item() == pytest.approx(mean, rel=1e-12, abs=1e-15)
        assert (m["tis_weight_min"].item(), m["tis_weight_max"].item()) == pytest.approx((lo, hi), rel=1e-12)
        assert m["tis_clipfrac"].item() == pytest.approx(frac, rel=1e-12, abs=1e-15)
        assert m["pg_clipfrac"].item() == 0.0 and m["ppo_kl"].item() == 0.0  # the PPO ratio is untouched


def test_is_weight_has_no_gradient_and_scales_the_token_gradient():
    # token truncate [0, 2]: d loss / d lp_t = -A w_t / (n_s * S): A: -2 / 4, -0.5 / 4; B: +2 * 1.5 / 2
    cfg = GRPOConfig(use_tis=True)
    batch = _batch(*TWO)
    loss, _ = grpo_loss(cfg=cfg, **batch)
    loss.backward()
    torch.testing.assert_close(batch["log_probs"].grad, torch.tensor([[-0.5, -0.125], [1.5, 0.0]], dtype=F64))


def test_old_log_probs_with_grad_do_not_leak_gradient_into_the_weight():
    old = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    w = importance_weights(old, torch.tensor([-1.5, -1.0], dtype=F64), torch.ones(2), GRPOConfig(use_tis=True))
    assert not w.weights.requires_grad
    torch.testing.assert_close(w.weights, torch.tensor([math.exp(0.5), math.exp(-1.0)], dtype=F64))


def test_level_log_ratio_is_clamped_and_zero_off_mask():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-15.0, -15.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    assert level_log_ratio(old, rollout, mask, "token").tolist() == [[15.0, 15.0, 0.0]]
    assert level_log_ratio(old, rollout, mask, "sequence").tolist() == [[20.0, 20.0, 0.0]]  # 30, clamped
    assert level_log_ratio(old, rollout, mask, "geometric").tolist() == [[15.0, 15.0, 0.0]]
    with pytest.raises(ValueError, match="--tis-level"):
        level_log_ratio(old, rollout, mask, "tokens")


def test_opsm_masks_negative_advantage_samples_past_delta_by_hand():
    # KL(rollout || pi) per sample = mean(rollout - lp) = mean(-ln ratio):
    #   A: ratios 0.25, 0.25 -> ln 4 = 1.386 > 0.5 but advantage +1: kept (token losses -1)
    #   B: ratios 0.5 -> ln 2 = 0.693 > 0.5 and advantage -2: masked
    #   C: ratios 0.9, 0.95 -> (0.105 + 0.051) / 2 = 0.078 < 0.5, advantage -0.5: kept (token losses +0.5)
    # pg_loss = (-1 + 0 + 0.5) / 3; masked fraction 1/3
    batch = _batch([[0.25, 0.25], [0.5, 1.0], [0.9, 0.95]], [[1, 1], [1, 0], [1, 1]], [1.0, -2.0, -0.5])
    cfg = GRPOConfig(use_opsm=True, opsm_delta=0.5)
    for inputs in (batch, _packed3(batch)):
        loss, m = grpo_loss(cfg=cfg, **inputs)
        assert loss.item() == pytest.approx(-0.5 / 3, rel=1e-12)
        assert m["opsm_masked_frac"].item() == pytest.approx(1 / 3, rel=1e-12)
        loss.backward()
        grads = inputs["log_probs"].grad
        assert (grads[1, 0] if grads.dim() == 2 else grads[2]).item() == 0.0  # no gradient from B
    # a delta above B's KL keeps it: (-1 + 2 + 0.5) / 3
    loss, m = grpo_loss(cfg=GRPOConfig(use_opsm=True, opsm_delta=0.7), **_batch(
        [[0.25, 0.25], [0.5, 1.0], [0.9, 0.95]], [[1, 1], [1, 0], [1, 1]], [1.0, -2.0, -0.5]))
    assert loss.item() == pytest.approx(1.5 / 3, rel=1e-12) and m["opsm_masked_frac"].item() == 0.0


def _packed3(batch: dict) -> dict:
    """Three 2-wide padded rows packed without their masked padding: [A0, A1, B0, C0, C1], cu [0, 2, 3, 5]."""
    keep = torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0], [2, 1]])
    out = {k: v.detach()[keep[:, 0], keep[:, 1]] for k, v in batch.items()}
    out["log_probs"].requires_grad_()
    return dict(out, cu_seqlens=torch.tensor([0, 2, 3, 5]))


def test_gspo_loss_and_gradient_by_hand():
    # eps 0.05.  A: lp - old = ln 1.21, 0 -> s = sqrt(1.21) = 1.1, A = +1: max(-1.1, -1.05) = -1.05 (clipped)
    #            B: lp - old = ln 0.98, 0 -> s = sqrt(0.98),      A = -1: max(s, clamp(s)) = s (not clipped)
    # pg_loss = (-1.05 + sqrt(0.98)) / 2; clipfrac 1/2; ppo_kl = (-ln 1.1 - ln 0.98 / 2) / 2
    # d loss / d lp_t: A 0 (clipped); B: -A s / (2 tokens) / 2 samples = sqrt(0.98) / 4 per token
    cfg = GRPOConfig(advantage_estimator="gspo", eps_clip=0.05)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64)
    lp = (old + torch.tensor([[math.log(1.21), 0.0], [math.log(0.98), 0.0]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    loss, m = grpo_loss(lp, old, adv, torch.ones(2, 2), cfg)
    assert loss.item() == pytest.approx((-1.05 + math.sqrt(0.98)) / 2, rel=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == pytest.approx((-math.log(1.1) - math.log(0.98) / 2) / 2, rel=1e-12)
    loss.backward()
    q = math.sqrt(0.98) / 4
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [q, q]], dtype=F64))
    # the token-level loss differs: token ratios 1.21 and 1 clip differently
    token_loss, _ = grpo_loss(lp.detach(), old, adv, torch.ones(2, 2), GRPOConfig(eps_clip=0.05))
    assert token_loss.item() == pytest.approx(((-1.05 - 1.0) / 2 + (0.98 + 1.0) / 2) / 2, rel=1e-12)


def test_all_masked_and_empty_batches_give_zero_and_neutral_extremes():
    cfg = GRPOConfig(use_tis=True, use_opsm=True, advantage_estimator="gspo", eps_clip=1e-3)
    batch = _batch(*TWO)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    empty_padded = {k: v.detach()[:0, :0] for k, v in batch.items()}
    empty_packed = {k: v.detach().reshape(-1)[:0] for k, v in batch.items()}
    for inputs in (batch, empty_padded, dict(empty_packed, cu_seqlens=[0, 0])):
        inputs["log_probs"] = inputs["log_probs"].detach().requires_grad_()
        loss, m = grpo_loss(cfg=cfg, **inputs)
        assert loss.item() == 0.0
        assert m["tis_weight_mean"].item() == 0.0 and m["tis_clipfrac"].item() == 0.0
        assert m["opsm_masked_frac"].item() == 0.0
        assert (m["tis_weight_min"].item(), m["tis_weight_max"].item()) == (math.inf, -math.inf)
        loss.backward()
        assert torch.all(inputs["log_probs"].grad == 0)


# --------------------------------------------------------------------------- padded == packed == float64 loop


def ref_loss(samples: list[dict], cfg: GRPOConfig) -> tuple[float, dict[str, float]]:
    """float64 loop: GSPO or token ratio, IS weight (truncate at the configured level), OPSM, sample mean."""
    per_sample, weights, clipped, masked = [], [], [], []
    for s in samples:
        on = [t for t in range(len(s["mask"])) if s["mask"][t]]
        n = len(on)
        gaps = [s["old"][t] - s["roll"][t] for t in on]
        if cfg.tis_level == "token":
            level = gaps
        else:
            total = math.fsum(gaps)
            level = [total / max(n, 1) if cfg.tis_level == "geometric" else total] * n
        raw = [math.exp(min(max(x, -20.0), 20.0)) for x in level]
        w = [min(max(r, cfg.tis_clip_low), cfg.tis_clip) for r in raw]
        kl = math.fsum(s["roll"][t] - s["lp"][t] for t in on) / max(n, 1)
        keep = 0.0 if (s["adv"] < 0 and kl > cfg.opsm_delta) else 1.0
        seq = math.fsum(s["lp"][t] - s["old"][t] for t in on) / max(n, 1)
        total = 0.0
        for i, t in enumerate(on):
            r = math.exp(seq if cfg.gspo else s["lp"][t] - s["old"][t])
            a = s["adv"]
            token = max(-a * r, -a * min(max(r, 1 - cfg.eps_clip), 1 + cfg.eps_clip_high))
            total += token * w[i] * keep
        per_sample.append(total / max(n, 1))
        weights.append(math.fsum(w) / max(n, 1))
        clipped.append(sum(x != y for x, y in zip(w, raw)) / max(n, 1))
        masked.append(1.0 - keep)
    count = len(samples)
    return math.fsum(per_sample) / count, dict(
        tis_weight_mean=math.fsum(weights) / count, tis_clipfrac=math.fsum(clipped) / count,
        opsm_masked_frac=math.fsum(masked) / count)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_padded_and_packed_equal_a_float64_loop(level, estimator):
    rng = random.Random(7)
    samples = []
    for n in (3, 6, 1, 4):
        old = [rng.uniform(-3, -0.1) for _ in range(n)]
        samples.append(dict(
            old=old, lp=[o + rng.uniform(-0.3, 0.3) for o in old], roll=[o + rng.uniform(-1, 1) for o in old],
            adv=rng.choice([-1, 1]) * rng.uniform(0.2, 2), mask=[1] + [int(rng.random() < 0.75) for _ in range(n - 1)],
        ))
    cfg = GRPOConfig(use_tis=True, tis_level=level, tis_clip=1.5, tis_clip_low=0.7, use_opsm=True, opsm_delta=0.05,
                     advantage_estimator=estimator, eps_clip=0.1)
    expected_loss, expected = ref_loss(samples, cfg)
    width = max(len(s["mask"]) for s in samples)

    def padded(key, fill):
        return torch.tensor([s[key] + [fill] * (width - len(s[key])) for s in samples], dtype=F64)

    def packed(key, fill):
        return torch.tensor([v for s in samples for v in s[key]] + [fill, fill], dtype=F64)  # 2 trailing tokens

    adv = torch.tensor([s["adv"] for s in samples], dtype=F64)
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s["mask"]))
    layouts = [
        dict(log_probs=padded("lp", 40.0), old_log_probs=padded("old", -1e4), rollout_log_probs=padded("roll", 9.0),
             loss_mask=padded("mask", 0).bool()),
        dict(log_probs=packed("lp", 40.0), old_log_probs=packed("old", -1e4), rollout_log_probs=packed("roll", 9.0),
             loss_mask=packed("mask", 0).bool(), cu_seqlens=cu),
    ]
    grads = []
    for inputs in layouts:
        inputs["log_probs"].requires_grad_()
        loss, m = grpo_micro_batch_loss(advantages=adv, cfg=cfg, global_normalizer=None, **inputs)
        assert loss.item() == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)
        for key, value in expected.items():
            assert m[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
        loss.backward()
        mask = inputs["loss_mask"]
        grads.append(inputs["log_probs"].grad[mask])
        assert torch.all(inputs["log_probs"].grad[~mask] == 0)
    torch.testing.assert_close(grads[0], grads[1])


# --------------------------------------------------------------------------- registry, flags, metric reduction


def sqrt_weight(ratio, cfg):
    return ratio.sqrt()


def negative_weight(ratio, cfg):
    return -ratio


def first_only(ratio, cfg):
    return ratio[:1]


def one_argument(ratio):
    return ratio


def test_custom_weighting_function_by_path_and_upstream_dotted_form():
    for path in ("tests.test_grpo_correction:sqrt_weight", "tests.test_grpo_correction.sqrt_weight"):
        cfg = GRPOConfig(use_tis=True, custom_tis_function_path=path)
        assert cfg.custom_tis_function_path == "tests.test_grpo_correction:sqrt_weight"
        w = importance_weights(torch.tensor([0.0, 0.0]), torch.tensor([-math.log(4), 0.0]), torch.tensor([1, 0]), cfg)
        assert w.weights.tolist() == [2.0, 0.0] and w.changed.tolist() == [1.0, 0.0]
    assert TIS_FUNCTIONS.names() == ["icepop", "reject", "truncate"]


def test_bad_weighting_function_output_raises():
    cfg = GRPOConfig(use_tis=True, custom_tis_function_path="tests.test_grpo_correction:negative_weight")
    # A ConfigError (a SlimeError: a message, not a traceback) naming the flag and the function.
    with pytest.raises(ConfigError, match=r"^--custom-tis-function-path tests.test_grpo_correction:negative_weight "
                       r"returned a negative or NaN weight"):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), cfg)
    with pytest.raises(ConfigError, match=r"^--custom-tis-function-path tests.test_grpo_correction:first_only returned "
                       r"shape \(1,\) for ratios of shape \(2,\)"):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2),
                           GRPOConfig(use_tis=True, custom_tis_function_path="tests.test_grpo_correction:first_only"))
    with pytest.raises(ConfigError, match=r"--custom-tis-function-path 'tests.test_grpo_correction:one_argument' has"):
        tis_function(GRPOConfig(use_tis=True, custom_tis_function_path="tests.test_grpo_correction:one_argument"))
    with pytest.raises(ConfigError, match=r"--custom-tis-function-path 'os:sep' is a str, not a function"):
        tis_function(GRPOConfig(use_tis=True, custom_tis_function_path="os:sep"))  # once a TypeError traceback
    with pytest.raises(ConfigError, match="--custom-tis-function-path"):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2),
                           GRPOConfig(use_tis=True, custom_tis_function_path="no_such_module_xyz:f"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(tis_clip_low=2.0), r"--tis-clip-low 2.0 must be below --tis-clip 2.0"),
    (dict(tis_clip_low=3.0, tis_clip=2.0), r"--tis-clip-low 3.0 must be below --tis-clip"),
    (dict(tis_clip=0.0), r"--tis-clip must be > 0"),
    (dict(tis_clip_low=-0.1), r"--tis-clip-low must be >= 0"),
    (dict(opsm_delta=-1e-4), r"--opsm-delta must be >= 0"),
    (dict(custom_tis_function_path="a.b:c"), r"--custom-tis-function-path a.b:c has no effect without --use-tis"),
    # once silently ignored: a correction that never ran
    (dict(tis_mode="icepop"), r"^--tis-mode icepop has no effect without --use-tis; add --use-tis or drop it$"),
    (dict(tis_clip=5.0, tis_level="sequence"), r"^--tis-clip 5.0, --tis-level sequence have no effect without --use-tis"),
    (dict(opsm_delta=0.5), r"^--opsm-delta 0.5 has no effect without --use-opsm; add --use-opsm or drop it$"),
    (dict(use_tis=True, tis_mode="icepop", custom_tis_function_path="a.b:c"), r"drop --tis-mode icepop"),
    (dict(use_tis=True, custom_tis_function_path="nodots"), r"--custom-tis-function-path 'nodots' is not a path"),
    (dict(advantage_estimator="gspo", calculate_per_token_loss=True), r"gspo with --calculate-per-token-loss"),
])
def test_flag_validation_names_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_defaults_are_upstreams():
    cfg = GRPOConfig()
    assert (cfg.use_tis, cfg.tis_clip, cfg.tis_clip_low, cfg.use_opsm, cfg.opsm_delta) == (False, 2.0, 0.0, False, 1e-4)
    assert (cfg.tis_mode, cfg.tis_level, cfg.custom_tis_function_path) == ("truncate", "token", None)


def test_extremes_reduce_by_min_and_max_and_skip_steps_without_tokens():
    assert all_reduce_extrema({"train/w_min": 0.5, "train/w_max": 2.0}) == {"train/w_max": 2.0, "train/w_min": 0.5}
    steps = {"train/w_min": [0.5, math.inf, 0.25], "train/w_max": [2.0, -math.inf, 1.5], "train/v_max": [-math.inf]}
    assert extrema_over_steps(steps) == {"train/w_min": 0.25, "train/w_max": 2.0}
