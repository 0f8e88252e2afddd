"""Tests of the GRPO math (slime/grpo/: advantages, loss), CPU only.

References are written here independently: numbers worked out by hand (the arithmetic is
in the test), or float64 loops over groups / samples / tokens using ``math``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from slime.grpo.advantages import (
    compute_advantages,
    compute_group_advantages,
    get_advantage_estimator,
    resolve_advantage_estimator,
)
from slime.grpo.config import ADVANTAGE_ESTIMATORS, GRPOConfig, is_group_relative
from slime.grpo.loss import (
    aggregate_loss,
    compute_approx_kl,
    compute_policy_loss,
    grpo_loss,
    grpo_micro_batch_loss,
)
from slime.grpo.token_advantages import apply_kl_penalty_to_advantages, per_token_advantages
from slime.utils.config import ConfigError

EPS = 1e-6


# --------------------------------------------------------------------------- references


def ref_group_advantages(rewards: list[float], n: int, normalize_std: bool) -> list[float]:
    """float64 loop: (r - mean) / (unbiased std + eps); exactly 0 for an all-equal group."""
    out = []
    for g in range(len(rewards) // n):
        group = [float(x) for x in rewards[g * n : (g + 1) * n]]
        if max(group) == min(group):
            out += [0.0] * n
            continue
        mean = math.fsum(group) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in group) / (n - 1))
        out += [(x - mean) / (std + EPS) if normalize_std else x - mean for x in group]
    return out


def ref_kl(x: float, kl_type: str) -> float:
    """KL(pi || ref) estimators of Schulman 2020 for one token, x = log pi - log ref."""
    if kl_type == "k1":
        return x
    if kl_type == "k2":
        return x * x / 2
    k3 = math.exp(-x) - 1 + x
    return min(max(k3, -10.0), 10.0) if kl_type == "low_var_kl" else k3


def ref_grpo_loss(samples: list[dict], cfg: GRPOConfig, normalizer: float | None = None) -> dict[str, float]:
    """float64 loop over samples and tokens; each sample is a dict of per-token lists."""
    sums = {"pg_loss": [], "pg_clipfrac": [], "ppo_kl": [], "kl_loss": [], "entropy": []}
    counts = []
    for s in samples:
        per = {k: 0.0 for k in sums}
        count = 0
        for t in range(len(s["mask"])):
            if not s["mask"][t]:
                continue
            count += 1
            x = s["lp"][t] - s["old"][t]
            ratio, a = math.exp(x), s["adv"][t]
            unclipped = -a * ratio
            clipped = -a * min(max(ratio, 1 - cfg.eps_clip), 1 + cfg.eps_clip_high)
            per["pg_loss"] += max(unclipped, clipped)
            per["pg_clipfrac"] += 1.0 if clipped > unclipped else 0.0
            per["ppo_kl"] += s["old"][t] - s["lp"][t]
            per["kl_loss"] += ref_kl(s["lp"][t] - s["ref"][t], cfg.kl_loss_type)
            per["entropy"] += s["ent"][t]
        for k in sums:
            sums[k].append(per[k])
        counts.append(count)
    out = {}
    for k, values in sums.items():
        if cfg.calculate_per_token_loss:
            out[k] = math.fsum(values) / (normalizer or max(sum(counts), 1))
        else:
            out[k] = math.fsum(v / max(c, 1) for v, c in zip(values, counts)) / (normalizer or len(samples))
    out["loss"] = out["pg_loss"] + cfg.kl_loss_coef * out["kl_loss"] - cfg.entropy_coef * out["entropy"]
    return out


def random_samples(rng: random.Random, lengths: list[int]) -> list[dict]:
    """Samples with random per-token log-probs, advantages, masks (first token always masked in)."""
    samples = []
    for n in lengths:
        old = [rng.uniform(-4, -0.05) for _ in range(n)]
        samples.append(
            dict(
                old=old,
                lp=[o + rng.uniform(-0.5, 0.5) for o in old],
                ref=[o + rng.uniform(-0.5, 0.5) for o in old],
                adv=[rng.choice([-1.0, 1.0]) * rng.uniform(0, 2)] * n,
                ent=[rng.uniform(0, 3) for _ in range(n)],
                mask=[1] + [int(rng.random() < 0.8) for _ in range(n - 1)],
            )
        )
    return samples


def pack(samples: list[dict], key: str, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor([v for s in samples for v in s[key]], dtype=dtype)


def pad(samples: list[dict], key: str, fill: float, dtype=torch.float64) -> torch.Tensor:
    width = max(len(s["mask"]) for s in samples)
    return torch.tensor([s[key] + [fill] * (width - len(s[key])) for s in samples], dtype=dtype)


def cu_seqlens_of(samples: list[dict]) -> list[int]:
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s["mask"]))
    return cu


def packed_inputs(samples: list[dict]) -> dict:
    return dict(
        log_probs=pack(samples, "lp").requires_grad_(),
        old_log_probs=pack(samples, "old"),
        advantages=pack(samples, "adv"),
        loss_mask=pack(samples, "mask", torch.bool),
        ref_log_probs=pack(samples, "ref"),
        entropy=pack(samples, "ent"),
        cu_seqlens=cu_seqlens_of(samples),
    )


CFG_KW = dict(
    use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3", entropy_coef=0.01, eps_clip=0.2, eps_clip_high=0.28
)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3
    # group 1: mean 0.75, deviations (0.25, 0.25, 0.25, -0.75), var = (3 * 0.0625 + 0.5625) / 3 = 0.25
    std0, std1 = math.sqrt(1 / 3), 0.5
    expected = [0.5 / (std0 + EPS), -0.5 / (std0 + EPS), -0.5 / (std0 + EPS), 0.5 / (std0 + EPS)]
    expected += [0.25 / (std1 + EPS)] * 3 + [-0.75 / (std1 + EPS)]
    adv = compute_group_advantages(rewards, 4)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32))
    no_std = compute_group_advantages(rewards, 4, normalize_std=False)
    torch.testing.assert_close(no_std, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_group_advantages_match_float64_loop(n, normalize_std):
    rng = random.Random(n)
    rewards = [rng.choice([0.0, 0.9, 1.0, rng.uniform(-3, 3)]) for _ in range(12 * n)]
    adv = compute_group_advantages(torch.tensor(rewards, dtype=torch.float64), n, normalize_std=normalize_std)
    expected = torch.tensor(ref_group_advantages(rewards, n, normalize_std), dtype=torch.float64)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("value", [0.9, 1.0, 0.0, -0.3, 0.1, 1 / 3, 7.7])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 64])
def test_equal_groups_are_exactly_zero(dtype, value, n):
    mixed = torch.tensor([0.0, 1.0] * (n // 2) + [0.5] * (n % 2), dtype=dtype)  # a non-equal neighbour group
    rewards = torch.cat([torch.full((n,), value, dtype=dtype), mixed, torch.full((n,), value, dtype=dtype)])
    for normalize_std in (True, False):
        adv = compute_group_advantages(rewards, n, normalize_std=normalize_std)
        assert torch.equal(adv[:n], torch.zeros(n)) and torch.equal(adv[2 * n :], torch.zeros(n))
        assert adv[n : 2 * n].abs().max() > 0.1


def test_equal_groups_exact_zero_random_values():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(2, 32)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
        values = [rng.uniform(-100, 100) if trial % 2 else rng.random() for _ in range(6)]
        rewards = torch.cat([torch.full((n,), v, dtype=dtype) for v in values])
        for normalize_std in (True, False):
            adv = compute_group_advantages(rewards, n, normalize_std)
            assert torch.equal(adv, torch.zeros(6 * n)), (n, dtype, values)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_and_bool_rewards(dtype):
    rewards = torch.tensor([1, 1, 1, 1, 0, 1, 1, 0], dtype=torch.int64).to(dtype)
    # group 0 all equal -> 0; group 1: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3) + EPS
    expected = torch.tensor([0, 0, 0, 0, -0.5 / s, 0.5 / s, 0.5 / s, -0.5 / s], dtype=torch.float32)
    torch.testing.assert_close(compute_group_advantages(rewards, 4), expected)


def test_rewards_promoted_before_arithmetic():
    # in fp16 the group sum 60000 + 60000 overflows (max 65504); in bf16 0.9 - mean would round
    rewards16 = torch.tensor([60000.0, 60000.0, 0.0, 0.0], dtype=torch.float16)
    expected = ref_group_advantages([60000.0, 60000.0, 0.0, 0.0], 4, True)
    adv = compute_group_advantages(rewards16, 4)
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64))
    rewards_bf16 = torch.tensor([0.9, 0.9, 0.9, 0.0], dtype=torch.bfloat16)
    exact = [float(x) for x in rewards_bf16.double()]  # the bf16 values, exactly
    expected = ref_group_advantages(exact, 4, False)
    torch.testing.assert_close(
        compute_group_advantages(rewards_bf16, 4, normalize_std=False).double(),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-7,
        atol=0,
    )


def test_single_sample_groups_are_zero():
    assert torch.equal(compute_group_advantages(torch.tensor([0.0, 1.0, 0.9, 5.0]), 1), torch.zeros(4))


def test_bad_group_size_raises():
    with pytest.raises(ValueError, match="n_samples_per_prompt=4"):
        compute_group_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_group_advantages(torch.ones(6), 0)
    with pytest.raises(ValueError, match="1-D"):
        compute_group_advantages(torch.ones(2, 4), 4)


def test_non_finite_reward_names_the_sample():
    with pytest.raises(ValueError, match="sample 5 \\(group 1\\) is nan"):
        compute_group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, float("nan")]), 3)


def test_registry_dispatch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, deviations (0.75, -0.25 x3), unbiased std = sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25])
    torch.testing.assert_close(compute_advantages(rewards, 4, GRPOConfig()), centred / (0.5 + EPS))
    torch.testing.assert_close(compute_advantages(rewards, 4, GRPOConfig(advantage_estimator="dr_grpo")), centred)
    torch.testing.assert_close(compute_advantages(rewards, 4, GRPOConfig(disable_grpo_std_normalization=True)), centred)
    by_path = GRPOConfig(advantage_estimator="slime.grpo.advantages:dr_grpo")
    torch.testing.assert_close(compute_advantages(rewards, 4, by_path), centred)


def test_registry_errors():
    with pytest.raises(KeyError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda rewards, group_size, cfg: rewards)
    with pytest.raises(KeyError, match="dr_grpo, grpo"):
        get_advantage_estimator("a2c")
    with pytest.raises(ConfigError, match="--advantage-estimator 'a2c'.*dr_grpo, grpo"):
        GRPOConfig(advantage_estimator="a2c")


def test_builtin_estimators_are_marked_group_relative():
    assert is_group_relative(get_advantage_estimator("grpo")) and is_group_relative(get_advantage_estimator("dr_grpo"))
    assert not is_group_relative(lambda rewards, group_size, cfg: rewards)


@pytest.mark.parametrize(
    "path, message",
    [
        ("nope_xyz.mod:fn", "--advantage-estimator nope_xyz.mod:fn: cannot be imported here: ModuleNotFoundError"),
        ("slime.grpo.advantages:no_such_fn", "has no attribute 'no_such_fn'"),
        ("slime.grpo.config:KL_TYPES", "--advantage-estimator 'slime.grpo.config:KL_TYPES' is a tuple"),
        ("math:sqrt", "an advantage estimator must accept (rewards: Tensor, group_size: int, cfg: GRPOConfig)"),
    ],
)
def test_resolving_an_estimator_path_names_the_flag(path, message):
    cfg = GRPOConfig(advantage_estimator=path)  # only the form is checked here
    with pytest.raises(ConfigError) as info:
        resolve_advantage_estimator(cfg)
    assert message in str(info.value)


def test_resolving_an_estimator_path_returns_it():
    from slime.grpo.advantages import dr_grpo

    assert resolve_advantage_estimator(GRPOConfig(advantage_estimator="slime.grpo.advantages:dr_grpo")) is dr_grpo
    assert resolve_advantage_estimator(GRPOConfig()) is get_advantage_estimator("grpo")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eps_clip=-0.1), "--eps-clip must be >= 0"),
        (dict(eps_clip_high=-0.1), "--eps-clip-high must be >= 0"),
        (dict(kl_coef=-1.0), "--kl-coef must be >= 0"),
        (dict(use_kl_loss=True, kl_loss_coef=-1.0), "--kl-loss-coef must be >= 0"),
        (dict(kl_loss_coef=0.01), "--kl-loss-coef 0.01 has no effect without --use-kl-loss"),
        (dict(kl_loss_type="k4"), "--kl-loss-type 'k4'"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_config_defaults():
    assert GRPOConfig(eps_clip=0.3).eps_clip_high == 0.3
    assert GRPOConfig(eps_clip=0.2, eps_clip_high=0.28).eps_clip_high == 0.28
    assert not GRPOConfig(use_kl_loss=True).needs_ref_model
    assert GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1).needs_ref_model and GRPOConfig(kl_coef=0.1).needs_ref_model


def test_kl_penalty_on_advantages_by_hand():
    adv = torch.tensor([1.0, 1.0, -0.5])
    old = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, float("nan")])
    mask = torch.tensor([1, 1, 0])
    # k1 = old - ref = (0.5, -1.0, masked); A - 0.1 * k1 = (0.95, 1.1, -0.5 unchanged)
    out = apply_kl_penalty_to_advantages(adv, old, ref, 0.1, mask)
    torch.testing.assert_close(out, torch.tensor([0.95, 1.1, -0.5]))
    with pytest.raises(ValueError, match="--kl-coef"):
        apply_kl_penalty_to_advantages(adv, old, ref, -0.1)


# --------------------------------------------------------------------------- policy loss


def test_policy_loss_clipping_by_hand():
    eps_lo, eps_hi = 0.2, 0.28  # ratio clipped to [0.8, 1.28]
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 1.25, 1.0, 2.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 1.0, 0.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0])
    old = torch.full((8,), -1.0, dtype=torch.float64)
    log_probs = (old + ratio.log()).requires_grad_()
    terms = compute_policy_loss(log_probs, old, adv, mask, eps_lo, eps_hi)
    # token: max(-A r, -A clip(r))                          clipped?  d loss / d log_prob
    # 0: r 1.5,  A +1: max(-1.5, -1.28)  = -1.28              yes      0
    # 1: r 1.5,  A -1: max(1.5, 1.28)    = 1.5                no       -A r = 1.5
    # 2: r 0.5,  A +1: max(-0.5, -0.8)   = -0.5               no       -0.5
    # 3: r 0.5,  A -1: max(0.5, 0.8)     = 0.8                yes      0
    # 4: r 1.1,  A +2: max(-2.2, -2.2)   = -2.2               no       -2.2
    # 5: r 1.25, A +1: inside [0.8, 1.28] (clipped if eps_hi were 0.2) = -1.25, no, -1.25
    # 6: r 1.0,  A 0:  0                                      no       0
    # 7: masked out: 0
    expected_loss = torch.tensor([-1.28, 1.5, -0.5, 0.8, -2.2, -1.25, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(terms.loss, expected_loss)
    torch.testing.assert_close(terms.clipped, torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(terms.log_ratio, torch.where(mask.bool(), ratio.log(), 0.0))
    terms.loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([0, 1.5, -0.5, 0, -2.2, -1.25, 0, 0], dtype=torch.float64))
    symmetric = compute_policy_loss(log_probs.detach(), old, adv, mask, eps_lo, eps_lo)
    assert symmetric.clipped[5] == 1.0 and symmetric.loss[5] == pytest.approx(-1.2)


def test_masked_garbage_gives_finite_values_and_gradients():
    log_probs = torch.tensor([-1.0, 50.0, float("nan")], requires_grad=True)
    old = torch.tensor([-1.2, -200.0, float("-inf")])
    ref = torch.tensor([-0.9, float("inf"), -3.0])
    mask = torch.tensor([True, False, False])
    cfg = GRPOConfig(**CFG_KW)
    loss, metrics = grpo_loss(log_probs, old, torch.ones(3), mask, cfg, ref_log_probs=ref, entropy=torch.ones(3))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all() and log_probs.grad[1:].eq(0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_policy_loss_shape_mismatch_raises():
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(4), torch.ones(3), 0.2, 0.2)


# --------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_pointwise(kl_type):
    xs = [-12.0, -3.0, -0.7, -1e-4, 0.0, 1e-4, 0.3, 2.0, 9.0]
    lp = torch.tensor([-1.0 + x for x in xs], dtype=torch.float64)
    ref = torch.full((len(xs),), -1.0, dtype=torch.float64)
    out = compute_approx_kl(lp, ref, kl_type)
    expected = torch.tensor([ref_kl(x, kl_type) for x in xs], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-15)
    out32 = compute_approx_kl(lp.float(), ref.float(), kl_type)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-6)


def test_k3_and_k2_nonnegative_and_low_var_clamped():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float32)
    assert (compute_approx_kl(x, torch.zeros_like(x), "k3") >= 0).all()
    assert (compute_approx_kl(x, torch.zeros_like(x), "k2") >= 0).all()
    low = compute_approx_kl(x, torch.zeros_like(x), "low_var_kl")
    assert low.max() == 10.0 and low.min() >= 0
    # x = -5: k3 = e^5 - 1 - 5 = 142.41 -> 10; x = 0.5: k3 = e^-0.5 - 0.5 = 0.10653 (unclamped)
    torch.testing.assert_close(
        compute_approx_kl(torch.tensor([-5.0, 0.5]), torch.zeros(2), "low_var_kl"),
        torch.tensor([10.0, math.exp(-0.5) - 1 + 0.5]),
    )


def _categoricals():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08], dtype=torch.float64)
    true_kl = math.fsum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    return p, q, true_kl


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_unbiased_kl_estimators_exact_expectation(kl_type):
    # E_{y~p}[k(y)] = sum_y p(y) k(y) must equal KL(p || q) exactly for k1 and k3
    p, q, true_kl = _categoricals()
    per_category = compute_approx_kl(p.log(), q.log(), kl_type)
    assert math.fsum((p * per_category).tolist()) == pytest.approx(true_kl, rel=1e-12)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_sampled_expectation(kl_type):
    # true KL = 0.0252 nats; the k1 standard error at 400k samples is ~1.5% of it, and k2's
    # bias here is -2.4% (third order in the log-ratio), well inside the 10% tolerance
    p, q, true_kl = _categoricals()
    gen = torch.Generator().manual_seed(0)
    y = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    estimate = compute_approx_kl(p.log()[y], q.log()[y], kl_type).mean().item()
    assert estimate == pytest.approx(true_kl, rel=0.1)


def test_kl_unknown_type_lists_valid():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "kl")


# --------------------------------------------------------------------------- aggregation


def test_aggregation_by_hand_padded_and_packed():
    # sample 0: values (1, 2, [9 masked]); sample 1: values (3, 4, 5, 6)
    padded = torch.tensor([[1.0, 2.0, 9.0, 0.0], [3.0, 4.0, 5.0, 6.0]])
    padded_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    packed = torch.tensor([1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 6.0])
    packed_mask = torch.tensor([1, 1, 0, 1, 1, 1, 1])
    cu = [0, 3, 7]
    # sample-mean: (mean(1, 2) + mean(3, 4, 5, 6)) / 2 = (1.5 + 4.5) / 2 = 3.0
    # token-mean: (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5
    assert aggregate_loss(padded, padded_mask).item() == pytest.approx(3.0)
    assert aggregate_loss(packed, packed_mask, cu_seqlens=cu).item() == pytest.approx(3.0)
    assert aggregate_loss(packed, packed_mask, cu_seqlens=torch.tensor(cu)).item() == pytest.approx(3.0)
    assert aggregate_loss(padded, padded_mask, per_token=True).item() == pytest.approx(3.5)
    assert aggregate_loss(packed, packed_mask, cu_seqlens=cu, per_token=True).item() == pytest.approx(3.5)
    # without cu_seqlens a 1-D tensor is one sample: mean of the 6 masked values
    assert aggregate_loss(packed, packed_mask).item() == pytest.approx(3.5)
    # a sample with no loss tokens counts in N and contributes 0: (1.5 + 4.5 + 0) / 3
    values3, mask3 = torch.cat([packed, torch.tensor([7.0])]), torch.cat([packed_mask, torch.tensor([0])])
    assert aggregate_loss(values3, mask3, cu_seqlens=[0, 3, 7, 8]).item() == pytest.approx(2.0)
    # trailing padding after cu_seqlens[-1], masked out, is ignored
    values_pad, mask_pad = torch.cat([packed, torch.tensor([5.0, 5.0])]), torch.cat([packed_mask, torch.tensor([0, 0])])
    assert aggregate_loss(values_pad, mask_pad, cu_seqlens=cu).item() == pytest.approx(3.0)
    # global normaliser: sample-mean share of 2 samples out of 8 = (1.5 + 4.5) / 8
    assert aggregate_loss(packed, packed_mask, cu_seqlens=cu, global_normalizer=8).item() == pytest.approx(0.75)
    assert aggregate_loss(packed, packed_mask, per_token=True, global_normalizer=12).item() == pytest.approx(21 / 12)


def test_aggregation_errors():
    values, mask = torch.ones(5), torch.ones(5)
    with pytest.raises(ValueError, match="non-decreasing"):
        aggregate_loss(values, mask, cu_seqlens=[0, 3, 2, 5])
    with pytest.raises(ValueError, match="non-decreasing"):
        aggregate_loss(values, mask, cu_seqlens=[1, 5])
    with pytest.raises(ValueError, match="ends at 6 but the packed tensors have 5 tokens"):
        aggregate_loss(values, mask, cu_seqlens=[0, 6])
    with pytest.raises(ValueError, match="tokens 4..4 lie after cu_seqlens"):
        aggregate_loss(values, mask, cu_seqlens=[0, 4])
    with pytest.raises(ValueError, match="padded tensor"):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 3), cu_seqlens=[0, 3, 6])
    with pytest.raises(ValueError, match="global_normalizer must be > 0"):
        aggregate_loss(values, mask, global_normalizer=0)
    with pytest.raises(ValueError, match="loss_mask"):
        aggregate_loss(values, torch.ones(4))
    with pytest.raises(ValueError, match="sample_token_counts"):
        aggregate_loss(values, mask, cu_seqlens=[0, 2, 5], sample_token_counts=torch.tensor([2, 3, 1]))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("kl_type", ["k1", "k3", "low_var_kl"])
def test_grpo_loss_matches_float64_reference_packed_and_padded(per_token, kl_type):
    rng = random.Random(1)
    samples = random_samples(rng, [3, 7, 1, 5, 9])
    cfg = GRPOConfig(**{**CFG_KW, "kl_loss_type": kl_type, "calculate_per_token_loss": per_token})
    expected = ref_grpo_loss(samples, cfg)
    loss, metrics = grpo_loss(cfg=cfg, **packed_inputs(samples))
    # padding holds garbage that must not leak into any term
    padded_loss, padded_metrics = grpo_loss(
        pad(samples, "lp", 30.0),
        pad(samples, "old", -1e4),
        pad(samples, "adv", 5.0),
        pad(samples, "mask", 0, torch.bool),
        cfg,
        ref_log_probs=pad(samples, "ref", float("nan")),
        entropy=pad(samples, "ent", 7.0),
    )
    for got, got_metrics in ((loss, metrics), (padded_loss, padded_metrics)):
        assert got.item() == pytest.approx(expected["loss"], rel=1e-10)
        for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy"):
            assert got_metrics[key].item() == pytest.approx(expected[key], rel=1e-10, abs=1e-12), key


@pytest.mark.parametrize("per_token", [False, True])
def test_micro_batches_sum_to_full_batch(per_token):
    rng = random.Random(2)
    samples = random_samples(rng, [4, 2, 8, 5, 3, 6])
    cfg = GRPOConfig(**{**CFG_KW, "calculate_per_token_loss": per_token})
    full_loss, full_metrics = grpo_loss(cfg=cfg, **packed_inputs(samples))
    # the global normaliser of the step: number of samples, or of loss tokens
    normalizer = sum(sum(s["mask"]) for s in samples) if per_token else len(samples)
    total_loss, total_metrics = 0.0, {k: 0.0 for k in full_metrics}
    for micro in (samples[:1], samples[1:4], samples[4:]):
        loss, metrics = grpo_loss(cfg=cfg, global_normalizer=normalizer, **packed_inputs(micro))
        total_loss += loss.item()
        for k in total_metrics:
            total_metrics[k] += metrics[k].item()
    assert total_loss == pytest.approx(full_loss.item(), rel=1e-12)
    for k, v in full_metrics.items():
        assert total_metrics[k] == pytest.approx(v.item(), rel=1e-12, abs=1e-15), k
    assert full_loss.item() == pytest.approx(ref_grpo_loss(samples, cfg)["loss"], rel=1e-10)


def test_context_parallel_chunks_with_sample_token_counts():
    # every sample split into two chunks held by two "ranks"; the per-sample means need the
    # full samples' token counts, and the chunks' shares then sum to the full value.
    rng = random.Random(3)
    samples = random_samples(rng, [6, 4, 9])
    cfg = GRPOConfig(**CFG_KW)
    full_loss, _ = grpo_loss(cfg=cfg, **packed_inputs(samples))
    counts = torch.tensor([sum(s["mask"]) for s in samples])
    first = [{k: v[: len(v) // 2] for k, v in s.items()} for s in samples]
    second = [{k: v[len(v) // 2 :] for k, v in s.items()} for s in samples]
    halves = [first, second]
    total = sum(
        grpo_loss(cfg=cfg, global_normalizer=len(samples), sample_token_counts=counts, **packed_inputs(chunk))[0].item()
        for chunk in halves
    )
    assert total == pytest.approx(full_loss.item(), rel=1e-12)


def test_gradient_matches_analytic():
    # sample-mean, k3 (d/dx (e^-x - 1 + x) = 1 - e^-x):
    # d loss / d lp_t = m_t / (n_s * N) * [(-A_t r_t if not clipped else 0) + kl_coef * (1 - exp(-(lp_t - ref_t)))]
    # d loss / d entropy_t = -entropy_coef * m_t / (n_s * N)
    rng = random.Random(4)
    samples = random_samples(rng, [3, 5])
    samples[0]["lp"][0] = samples[0]["old"][0] + math.log(1.6)  # a clipped token (if A > 0) or unclipped (A < 0)
    cfg = GRPOConfig(**CFG_KW)
    inputs = packed_inputs(samples)
    inputs["entropy"].requires_grad_()
    loss, _ = grpo_loss(cfg=cfg, **inputs)
    loss.backward()
    expected_lp, expected_ent = [], []
    for s in samples:
        n_s = sum(s["mask"])
        for t in range(len(s["mask"])):
            scale = s["mask"][t] / (n_s * len(samples))
            ratio, a = math.exp(s["lp"][t] - s["old"][t]), s["adv"][t]
            clipped = -a * min(max(ratio, 1 - cfg.eps_clip), 1 + cfg.eps_clip_high) > -a * ratio
            d_pg = 0.0 if clipped else -a * ratio
            d_kl = 1 - math.exp(-(s["lp"][t] - s["ref"][t]))
            expected_lp.append(scale * (d_pg + cfg.kl_loss_coef * d_kl))
            expected_ent.append(-cfg.entropy_coef * scale)
    torch.testing.assert_close(inputs["log_probs"].grad, torch.tensor(expected_lp, dtype=torch.float64))
    torch.testing.assert_close(inputs["entropy"].grad, torch.tensor(expected_ent, dtype=torch.float64))


def test_grpo_loss_metric_keys_and_missing_inputs():
    lp, mask = torch.zeros(4), torch.ones(4)
    loss, metrics = grpo_loss(lp, lp, torch.ones(4), mask, GRPOConfig())
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "ppo_kl"}
    # on-policy first step: ratio 1, loss = mean(-A) = -1, nothing clipped, KL 0
    assert loss.item() == -1.0 and metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        grpo_loss(lp, lp, lp, mask, GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="--entropy-coef 0.01 needs the per-token entropy"):
        grpo_loss(lp, lp, lp, mask, GRPOConfig(entropy_coef=0.01))


# --------------------------------------------------------------------------- the micro-batch loss


def _tiny_padded() -> dict:
    """Two samples: A (advantage 0.5, two tokens, the second with ratio 1.5), B (advantage -1.0,
    one token and one padding slot holding garbage)."""
    nan = float("nan")
    return dict(
        log_probs=torch.tensor([[-1.0, -2.0 + math.log(1.5)], [-0.5, 9.0]], dtype=torch.float64).requires_grad_(),
        old_log_probs=torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64),
        advantages=torch.tensor([0.5, -1.0], dtype=torch.float64),
        loss_mask=torch.tensor([[1, 1], [1, 0]]),
        ref_log_probs=torch.tensor([[-1.2, -1.6], [-1.5, nan]], dtype=torch.float64),  # old - ref: 0.2, -0.4; 1.0
        entropy=torch.tensor([[1.0, 2.0], [3.0, 7.0]], dtype=torch.float64),
    )


def _packed(padded: dict) -> dict:
    """The same two samples packed THD-style, [A0, A1, B0, trailing padding], cu_seqlens [0, 2, 3]."""
    keep = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])  # (row, column) of each packed token
    out = {k: v.detach()[keep[:, 0], keep[:, 1]] for k, v in padded.items() if k != "advantages"}
    out["log_probs"].requires_grad_()
    return dict(out, advantages=padded["advantages"], cu_seqlens=torch.tensor([0, 2, 3]))


def test_micro_batch_loss_by_hand_padded_and_packed():
    # --kl-coef 0.1 shapes the advantages with old - ref:
    #   A: 0.5 - 0.1 * 0.2 = 0.48, 0.5 - 0.1 * (-0.4) = 0.54;  B: -1.0 - 0.1 * 1.0 = -1.1
    # token losses: -0.48 (ratio 1); max(-0.54 * 1.5, -0.54 * 1.2) = -0.648 (clipped); 1.1 (ratio 1)
    # pg_loss (sample-mean) = ((-0.48 - 0.648) / 2 + 1.1) / 2 = 0.268
    # entropy = ((1 + 2) / 2 + 3) / 2 = 2.25;  loss = 0.268 - 0.01 * 2.25 = 0.2455
    # pg_clipfrac = ((0 + 1) / 2 + 0) / 2 = 0.25;  ppo_kl = ((0 - ln 1.5) / 2 + 0) / 2
    cfg = GRPOConfig(kl_coef=0.1, entropy_coef=0.01)
    padded = _tiny_padded()
    packed = _packed(padded)
    for normalizer, share in ((None, 1.0), (4, 0.5)):  # 2 of the step's 4 samples: half of it
        for inputs in (padded, packed):
            loss, metrics = grpo_micro_batch_loss(cfg=cfg, global_normalizer=normalizer, **inputs)
            assert loss.item() == pytest.approx(0.2455 * share, rel=1e-12)
            assert metrics["pg_loss"].item() == pytest.approx(0.268 * share, rel=1e-12)
            assert metrics["entropy"].item() == pytest.approx(2.25 * share, rel=1e-12)
            assert metrics["pg_clipfrac"].item() == pytest.approx(0.25 * share, rel=1e-12)
            assert metrics["ppo_kl"].item() == pytest.approx(-math.log(1.5) / 4 * share, rel=1e-12)
    # d loss / d lp: A0: -0.48 / (2 * 2) (ratio 1, unclipped); A1: 0 (clipped); B0: 1.1 / (1 * 2)
    loss, _ = grpo_micro_batch_loss(cfg=cfg, global_normalizer=None, **padded)
    loss.backward()
    packed_loss, _ = grpo_micro_batch_loss(cfg=cfg, global_normalizer=None, **packed)
    packed_loss.backward()
    expected = torch.tensor([[-0.12, 0.0], [0.55, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(padded["log_probs"].grad, expected)
    torch.testing.assert_close(packed["log_probs"].grad, torch.tensor([-0.12, 0.0, 0.55, 0.0], dtype=torch.float64))


def test_micro_batch_loss_without_old_log_probs_is_the_on_policy_gradient_by_hand():
    # --skip-actor-forward-only: old_log_probs None means the forward's own, detached: every ratio 1, nothing
    # clipped, ppo_kl 0, and d loss / d lp = -A / (tokens of the sample) / samples (sample-mean), no KL shaping here.
    #   A (2 tokens, A = 0.5): -0.5 / 2 / 2 = -0.125 each;  B (1 token, A = -1.0): 1.0 / 1 / 2 = 0.5
    #   pg_loss = ((-0.5 - 0.5) / 2 + 1.0) / 2 = 0.25
    cfg = GRPOConfig(eps_clip=0.2, eps_clip_high=0.28)
    padded = {k: v for k, v in _tiny_padded().items() if k not in ("ref_log_probs", "old_log_probs")}
    loss, metrics = grpo_micro_batch_loss(cfg=cfg, global_normalizer=None, old_log_probs=None, **padded)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0
    assert metrics["pg_loss"].item() == pytest.approx(0.25, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(padded["log_probs"].grad, torch.tensor([[-0.125, -0.125], [0.5, 0.0]],
                                                                       dtype=torch.float64))


@pytest.mark.parametrize("per_token", [False, True])
def test_micro_batch_loss_packed_equals_padded_and_float64_reference(per_token):
    rng = random.Random(5)
    samples = random_samples(rng, [3, 7, 1, 5])
    cfg = GRPOConfig(**{**CFG_KW, "kl_coef": 0.05, "calculate_per_token_loss": per_token})
    advantages = [s["adv"][0] for s in samples]  # one per sample
    # the reference sees the shaped per-token advantages, computed here by hand
    shaped = [
        dict(s, adv=[a - cfg.kl_coef * (old - ref) for old, ref in zip(s["old"], s["ref"])])
        for s, a in zip(samples, advantages)
    ]
    normalizer = 11.0
    expected = ref_grpo_loss(shaped, cfg, normalizer)

    packed = packed_inputs(samples)
    del packed["advantages"]
    trailing = dict(log_probs=3.0, old_log_probs=-1e4, loss_mask=0, ref_log_probs=5.0, entropy=9.0)  # 2 pad tokens
    for key, fill in trailing.items():
        packed[key] = torch.cat([packed[key].detach(), torch.full((2,), fill, dtype=packed[key].dtype)])
    packed["log_probs"].requires_grad_()
    padded = dict(
        log_probs=pad(samples, "lp", 30.0).requires_grad_(),
        old_log_probs=pad(samples, "old", -1e4),
        loss_mask=pad(samples, "mask", 0, torch.bool),
        ref_log_probs=pad(samples, "ref", float("nan")),
        entropy=pad(samples, "ent", 7.0),
    )
    adv = torch.tensor(advantages, dtype=torch.float64)
    results = [
        grpo_micro_batch_loss(advantages=adv, cfg=cfg, global_normalizer=normalizer, **inputs)
        for inputs in (packed, padded)
    ]
    for loss, metrics in results:
        assert loss.item() == pytest.approx(expected["loss"], rel=1e-10)
        for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy"):
            assert metrics[key].item() == pytest.approx(expected[key], rel=1e-10, abs=1e-12), key
        loss.backward()
    # the same gradient at the same tokens; none into padding
    num_tokens, real = sum(len(s["mask"]) for s in samples), pad(samples, "mask", -1) >= 0
    torch.testing.assert_close(packed["log_probs"].grad[:num_tokens], padded["log_probs"].grad[real])
    assert torch.all(packed["log_probs"].grad[num_tokens:] == 0) and torch.all(padded["log_probs"].grad[~real] == 0)


def test_per_token_advantages_layouts():
    adv = torch.tensor([2.0, -1.0, 0.5])
    torch.testing.assert_close(
        per_token_advantages(adv, torch.ones(3, 2)), torch.tensor([[2.0, 2.0], [-1.0, -1.0], [0.5, 0.5]])
    )
    packed = per_token_advantages(adv, torch.ones(7), cu_seqlens=[0, 2, 2, 5])  # an empty sample, 2 trailing tokens
    assert packed.tolist() == [2.0, 2.0, 0.5, 0.5, 0.5, 0.0, 0.0]
    assert per_token_advantages(torch.tensor([3.0]), torch.ones(4)).tolist() == [3.0] * 4  # one packed sample
    assert per_token_advantages(adv.bfloat16(), torch.ones(3, 1)).dtype == torch.float32


def test_micro_batch_loss_bad_input():
    padded = _tiny_padded()
    with pytest.raises(ValueError, match=r"one value per sample, shape \(2,\), got \(2, 2\)"):
        grpo_micro_batch_loss(**{**padded, "advantages": torch.ones(2, 2)}, cfg=GRPOConfig(), global_normalizer=None)
    with pytest.raises(ValueError, match=r"one value per sample, shape \(2,\), got \(3,\)"):
        per_token_advantages(torch.ones(3), torch.ones(5), cu_seqlens=[0, 2, 5])
    with pytest.raises(ValueError, match="--kl-coef 0.1 needs old_log_probs and ref_log_probs"):
        grpo_micro_batch_loss(**{**padded, "ref_log_probs": None}, cfg=GRPOConfig(kl_coef=0.1), global_normalizer=None)
    with pytest.raises(ValueError, match="non-decreasing"):
        per_token_advantages(torch.ones(2), torch.ones(5), cu_seqlens=[0, 3, 2])

