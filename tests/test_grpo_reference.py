"""Every advantage estimator and loss option of upstream slime's GRPO_ARGS against a float64 reference, CPU only.

The references below are plain Python loops with ``math``, written from the papers and upstream slime's formulas
(``slime/utils/ppo_utils.py``, ``slime/backends/megatron_utils/loss.py``, ``slime/ray/rollout.py``, the
``train_infer_mismatch_helper/mis.py`` example), never by calling this project's code.  The batches hold masked
tokens, a sample of length 1, a fully masked sample and ratios far from 1 (``exp(+-3)``); the loss runs padded and
packed.  Gradients are compared with central differences of the reference loss.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from slime.grpo.advantages import compute_advantages
from slime.grpo.config import GRPOConfig
from slime.grpo.correction import mismatch_metrics
from slime.grpo.loss import grpo_loss, grpo_micro_batch_loss, loss_metric_names
from slime.grpo.token_advantages import token_advantages, whitening_of, whitening_sums
from slime.utils.config import ConfigError

F64 = torch.float64
KL = {"k1": lambda x: x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(-x) - 1 + x}


def make_samples(seed: int, lengths=(1, 4, 3, 6, 5), spread: float = 3.0) -> list[dict]:
    """Per-token lists: ``old``, ``lp`` (``old`` + U(-spread, spread): ratios from exp(-3) to exp(3)), ``ref``,
    ``roll`` (the engine's), ``ent`` and ``mask``; per sample ``adv`` and ``reward``.  Sample 2 is fully masked,
    sample 0 has one token, the others mask some tokens out (the last token of sample 3 included)."""
    rng = random.Random(seed)
    samples = []
    for i, n in enumerate(lengths):
        old = [rng.uniform(-4.0, -0.05) for _ in range(n)]
        mask = [1] + [int(rng.random() < 0.7) for _ in range(n - 1)]
        if i == 2:
            mask = [0] * n
        if i == 3:
            mask[-1] = 0
        samples.append(dict(
            old=old, lp=[o + rng.uniform(-spread, spread) for o in old], ref=[o + rng.uniform(-1, 1) for o in old],
            roll=[o + rng.uniform(-1.5, 1.5) for o in old], ent=[rng.uniform(0.0, 3.0) for _ in range(n)],
            mask=mask, adv=rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 2.0), reward=float(rng.randint(0, 1)),
        ))
    return samples


def layouts(samples: list[dict], token_adv: list[list[float]] | None = None) -> list[dict]:
    """The padded and the packed inputs of ``grpo_loss`` (garbage under the mask; 2 trailing padding tokens packed)."""
    width = max(len(s["mask"]) for s in samples)
    adv = token_adv or [[s["adv"]] * len(s["mask"]) for s in samples]
    rows = {k: [s[k] for s in samples] for k in ("old", "lp", "ref", "roll", "ent", "mask")} | {"adv": adv}
    names = dict(old="old_log_probs", lp="log_probs", ref="ref_log_probs", roll="rollout_log_probs", ent="entropy",
                 mask="loss_mask", adv="advantages")
    padded = {names[k]: torch.tensor([r + [7.0 if k != "mask" else 0] * (width - len(r)) for r in v], dtype=F64)
              for k, v in rows.items()}
    packed = {names[k]: torch.tensor([x for r in v for x in r] + [7.0 if k != "mask" else 0] * 2, dtype=F64)
              for k, v in rows.items()}
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s["mask"]))
    return [padded, dict(packed, cu_seqlens=torch.tensor(cu))]


# --------------------------------------------------------------------------- the reference loss


def ref_weight(s: dict, t: int, cfg: GRPOConfig) -> float:
    """IS weight of one token at --tis-level token (upstream vanilla_tis / icepop, mis.py's rejection)."""
    if not cfg.use_tis:
        return 1.0
    ratio = math.exp(min(max(s["old"][t] - s["roll"][t], -20.0), 20.0))
    inside = cfg.tis_clip_low <= ratio <= cfg.tis_clip
    return {"truncate": min(max(ratio, cfg.tis_clip_low), cfg.tis_clip), "icepop": ratio if inside else 0.0,
            "reject": 1.0 if inside else 0.0}[cfg.tis_mode]


def ref_terms(samples: list[dict], cfg: GRPOConfig, lp_of=lambda s, t: s["lp"][t]) -> dict[str, float]:
    """The loss and its terms: token loss (PPO eq. 7 with DAPO's clip-higher, dual-clip, or CISPO eq. 4), IS weight,
    rejected tokens (weight 0) out of every numerator, the original masks in every denominator (upstream)."""
    sums = {k: [] for k in ("pg", "clip", "ppo_kl", "kl", "ent", "opsm")}
    counts = []
    for s in samples:
        per = dict.fromkeys(sums, 0.0)
        on = [t for t, m in enumerate(s["mask"]) if m]
        seq_kl = math.fsum(s["roll"][t] - s["lp"][t] for t in on) / max(len(on), 1)  # OPSM, current policy detached
        gspo_log_ratio = math.fsum(lp_of(s, t) - s["old"][t] for t in on) / max(len(on), 1)  # GSPO eq. 7
        for t in on:
            lp, old, a = lp_of(s, t), s["old"][t], s["adv"][t] if isinstance(s["adv"], list) else s["adv"]
            r = math.exp(gspo_log_ratio if cfg.gspo else lp - old)
            lo, hi = 1 - cfg.eps_clip, 1 + cfg.eps_clip_high
            if cfg.cispo:  # the clipped ratio under a stop-gradient: of the unperturbed log-prob
                r0 = math.exp(s["lp"][t] - old)
                rc = min(max(r0, lo), hi)
                loss, clipped = -rc * a * lp, float(rc != r0)
            else:
                l1, l2 = -a * r, -a * min(max(r, lo), hi)
                loss, clipped = max(l1, l2), float(l2 > l1)
                if cfg.eps_clip_c is not None and a < 0:
                    loss = min(loss, -a * cfg.eps_clip_c)
            w = ref_weight(s, t, cfg)
            masked = cfg.use_opsm and a < 0 and seq_kl > cfg.opsm_delta  # DeepSeek-V3.2 eq. 9, per token
            per["opsm"] += float(masked)
            per["pg"] += 0.0 if masked else loss * w
            if w == 0.0:
                continue  # rejected: out of every numerator
            per["clip"] += clipped
            per["ppo_kl"] += -gspo_log_ratio if cfg.gspo else old - lp  # upstream's compute_gspo_kl for GSPO
            kl = KL[cfg.kl_loss_type.replace("low_var_kl", "k3")](lp - s["ref"][t])
            if cfg.use_unbiased_kl:
                kl *= r
            per["kl"] += min(max(kl, -10.0), 10.0) if cfg.kl_loss_type == "low_var_kl" else kl
            per["ent"] += s["ent"][t]
        for k in sums:
            sums[k].append(per[k])
        counts.append(len(on))
    if cfg.calculate_per_token_loss:
        out = {k: math.fsum(v) / max(sum(counts), 1) for k, v in sums.items()}
    else:
        out = {k: math.fsum(x / max(n, 1) for x, n in zip(v, counts)) / len(samples) for k, v in sums.items()}
    kl = cfg.kl_loss_coef * out["kl"] if cfg.use_kl_loss else 0.0
    out["loss"] = out["pg"] + kl - cfg.entropy_coef * out["ent"]
    return out


def ref_gradient(samples: list[dict], cfg: GRPOConfig, h: float = 1e-6) -> list[list[float]]:
    """d loss / d lp_t by central differences of :func:`ref_terms` (0 at masked tokens)."""
    grads = []
    for i, s in enumerate(samples):
        row = []
        for t in range(len(s["mask"])):
            def shifted(delta):
                return ref_terms(samples, cfg, lambda x, u: x["lp"][u] + (delta if x is s and u == t else 0.0))
            row.append((shifted(h)["loss"] - shifted(-h)["loss"]) / (2 * h) if s["mask"][t] else 0.0)
        grads.append(row)
    return grads


def check_loss(samples: list[dict], cfg: GRPOConfig, token_adv=None) -> None:
    want = ref_terms(samples, cfg)
    grad = ref_gradient(samples, cfg)
    for inputs in layouts(samples, token_adv):
        inputs["log_probs"].requires_grad_()
        loss, m = grpo_loss(cfg=cfg, **inputs)
        assert loss.item() == pytest.approx(want["loss"], rel=1e-9, abs=1e-12)
        for name, key in (("pg_loss", "pg"), ("pg_clipfrac", "clip"), ("ppo_kl", "ppo_kl"), ("entropy", "ent")):
            assert m[name].item() == pytest.approx(want[key], rel=1e-9, abs=1e-12), name
        if cfg.use_kl_loss:
            assert m["kl_loss"].item() == pytest.approx(want["kl"], rel=1e-9, abs=1e-12)
        loss.backward()
        got = inputs["log_probs"].grad
        flat = got.reshape(-1).tolist() if "cu_seqlens" in inputs else [x for row in got.tolist() for x in row]
        expected = [x for row in grad for x in row] if "cu_seqlens" in inputs else [
            x for row in grad for x in row + [0.0] * (got.shape[-1] - len(row))]
        expected += [0.0] * (len(flat) - len(expected))
        assert flat == pytest.approx(expected, rel=1e-5, abs=1e-8)


OPTIONS = {
    "grpo": dict(),
    "dual_clip": dict(eps_clip_c=3.0),
    "dual_clip_gspo_off_clip_higher": dict(eps_clip_c=1.5, eps_clip=0.1, eps_clip_high=0.4),
    "gspo": dict(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    "gspo_dual_clip_icepop": dict(advantage_estimator="gspo", eps_clip=0.1, eps_clip_c=2.0, use_tis=True,
                                  tis_mode="icepop", tis_clip_low=0.5, entropy_coef=0.05),
    "cispo": dict(advantage_estimator="cispo"),
    "cispo_canonical": dict(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=4.0),
    **{f"unbiased_{t}": dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type=t, use_unbiased_kl=True)
       for t in ("k1", "k2", "k3", "low_var_kl")},
    "kl_k1_default": dict(use_kl_loss=True, kl_loss_coef=0.3),
    "truncate": dict(use_tis=True, tis_clip_low=0.3, entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1),
    "icepop_rejects": dict(use_tis=True, tis_mode="icepop", tis_clip_low=0.5, tis_clip=1.8, entropy_coef=0.05,
                           use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"),
    "reject_rejects": dict(use_tis=True, tis_mode="reject", tis_clip_low=0.5, tis_clip=1.8, entropy_coef=0.05,
                           use_kl_loss=True, kl_loss_coef=0.1, use_unbiased_kl=True),
    "cispo_icepop": dict(advantage_estimator="cispo", use_tis=True, tis_mode="icepop", tis_clip_low=0.5,
                         entropy_coef=0.05),
}


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
@pytest.mark.parametrize("option", OPTIONS)
def test_loss_terms_and_gradient_match_the_float64_reference(option, per_token):
    samples = make_samples(seed=len(option))
    if per_token and OPTIONS[option].get("advantage_estimator") == "gspo":
        with pytest.raises(ConfigError, match="gspo with --calculate-per-token-loss"):  # GSPO's objective: eq. 5
            GRPOConfig(calculate_per_token_loss=per_token, **OPTIONS[option])
        return
    cfg = GRPOConfig(calculate_per_token_loss=per_token, **OPTIONS[option])
    if cfg.use_tis and cfg.tis_mode != "truncate":  # the batch must exercise the rejection
        assert any(ref_weight(s, t, cfg) == 0 for s in samples for t, m in enumerate(s["mask"]) if m)
    check_loss(samples, cfg)


def test_the_reference_sees_clipped_dual_clipped_and_rejected_tokens():
    """The batches above are not trivial: ratios far from 1 clip, dual-clip and reject."""
    samples = make_samples(seed=len("dual_clip"))
    ratios = [math.exp(s["lp"][t] - s["old"][t]) for s in samples for t, m in enumerate(s["mask"]) if m]
    assert min(ratios) < 0.2 and max(ratios) > 5
    dual = [s for s in samples if s["adv"] < 0 and any(
        m and math.exp(s["lp"][t] - s["old"][t]) > 3.0 for t, m in enumerate(s["mask"]))]
    assert dual, "a negative-advantage token with ratio > eps_clip_c"


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
def test_opsm_masks_the_negative_advantage_tokens_of_off_policy_samples(per_token):
    # per-token advantages of both signs in one sample (REINFORCE++ returns, --kl-coef shaping): only the negative
    # ones of a sample past delta go (the paper's A_{i,t} < 0, as upstream's compute_opsm_mask)
    samples = make_samples(seed=13)
    rng = random.Random(13)
    token_adv = [[rng.uniform(-1.5, 1.5) for _ in s["mask"]] for s in samples]
    cfg = GRPOConfig(use_opsm=True, opsm_delta=0.05, calculate_per_token_loss=per_token)
    ref_samples = [dict(s, adv=row) for s, row in zip(samples, token_adv)]
    want = ref_terms(ref_samples, cfg)
    assert 0 < want["opsm"] < 1, "some tokens masked, not all"
    for inputs in layouts(samples, token_adv):
        inputs["log_probs"].requires_grad_()
        loss, m = grpo_loss(cfg=cfg, **inputs)
        assert loss.item() == pytest.approx(want["loss"], rel=1e-9, abs=1e-12)
        assert m["opsm_masked_frac"].item() == pytest.approx(want["opsm"], rel=1e-9, abs=1e-12)
        assert m["pg_clipfrac"].item() == pytest.approx(want["clip"], rel=1e-9)  # OPSM leaves the metrics alone


def test_rejected_tokens_leave_entropy_kl_clipfrac_and_ppo_kl_but_not_the_normaliser_by_hand():
    # One sample, 2 tokens, ratios PPO 1 (lp = old), IS ratios 3 (rejected by reject [0, 2]) and 1 (kept).
    # entropy (2, 5): kept only -> 5 / 2 tokens = 2.5; k1 KL (lp - ref = 1, 0.5) -> 0.5 / 2; ppo_kl 0; loss -A w
    old = torch.tensor([-1.0, -2.0], dtype=F64)
    inputs = dict(log_probs=old.clone().requires_grad_(), old_log_probs=old, advantages=torch.ones(2, dtype=F64),
                  loss_mask=torch.ones(2), rollout_log_probs=old - torch.tensor([math.log(3.0), 0.0], dtype=F64),
                  ref_log_probs=old - torch.tensor([1.0, 0.5], dtype=F64), entropy=torch.tensor([2.0, 5.0], dtype=F64))
    cfg = GRPOConfig(use_tis=True, tis_mode="reject", use_kl_loss=True, kl_loss_coef=1.0, entropy_coef=0.1)
    loss, m = grpo_loss(cfg=cfg, **inputs)
    assert m["entropy"].item() == 2.5 and m["kl_loss"].item() == 0.25 and m["pg_loss"].item() == -0.5
    assert loss.item() == pytest.approx(-0.5 + 0.25 - 0.1 * 2.5, rel=1e-12)
    truncate, _ = grpo_loss(cfg=GRPOConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=1.0), **inputs)
    assert truncate.item() == pytest.approx((-2.0 - 1.0) / 2 + (1.0 + 0.5) / 2, rel=1e-12)  # weight 2, nothing out


# --------------------------------------------------------------------------- advantages


def ref_advantages(rewards: list[float], n: int, estimator: str, raw: bool, no_std: bool) -> list[float]:
    """Upstream's _post_process_rewards: group mean (and unbiased std + 1e-6 for grpo / gspo / cispo) unless
    --disable-rewards-normalization; reinforce_plus_plus keeps the raw reward; an all-equal group gives 0."""
    if estimator == "reinforce_plus_plus" or raw:
        return list(rewards)
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = math.fsum(group) / n
        if max(group) == min(group):
            out += [0.0] * n
            continue
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in group) / (n - 1))
        divide = estimator in ("grpo", "gspo", "cispo") and not no_std
        out += [(x - mean) / (std + 1e-6) if divide else x - mean for x in group]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "gspo", "cispo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("raw", [False, True], ids=["normalised", "raw"])
def test_every_estimator_and_disable_rewards_normalization(estimator, raw):
    if raw and estimator == "reinforce_plus_plus":
        with pytest.raises(ConfigError, match="--disable-rewards-normalization with --advantage-estimator "
                           "reinforce_plus_plus, whose rewards are never normalised"):
            GRPOConfig(advantage_estimator=estimator, normalize_advantages=True, disable_rewards_normalization=True)
        return
    rewards = [0.3, 1.0, 0.0, 2.5, 1.0, 1.0, 1.0, 1.0, -0.5, 0.25, 4.0, 0.0]
    cfg = GRPOConfig(advantage_estimator=estimator, disable_rewards_normalization=raw,
                     normalize_advantages=estimator.startswith("reinforce"))
    got = compute_advantages(torch.tensor(rewards), 4, cfg).tolist()
    assert got == pytest.approx(ref_advantages(rewards, 4, estimator, raw, False), rel=1e-6, abs=1e-7)
    if estimator == "grpo" and not raw:
        no_std = GRPOConfig(disable_grpo_std_normalization=True)
        assert compute_advantages(torch.tensor(rewards), 4, no_std).tolist() == pytest.approx(
            ref_advantages(rewards, 4, "grpo", False, True), rel=1e-6)


def ref_returns(s: dict, kl_coef: float, gamma: float) -> list[float]:
    """REINFORCE++ (upstream get_reinforce_plus_plus_returns): token rewards -kl_coef * k1(old, ref) on loss-masked
    tokens, the reward on the last loss-masked one, G_t = r_t + gamma G_{t+1} over every position."""
    on = [t for t, m in enumerate(s["mask"]) if m]
    rewards = [-kl_coef * (s["old"][t] - s["ref"][t]) if s["mask"][t] else 0.0 for t in range(len(s["mask"]))]
    if on:
        rewards[on[-1]] += s["reward"]
    out, carry = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        carry = rewards[t] + gamma * carry
        out[t] = carry
    return out


def ref_token_advantages(samples: list[dict], cfg: GRPOConfig) -> list[list[float]]:
    if cfg.reinforce_plus_plus_returns:
        return [ref_returns(s, cfg.kl_coef, cfg.gamma) for s in samples]
    return [[s["adv"] - (cfg.kl_coef * (s["old"][t] - s["ref"][t]) if m else 0.0) for t, m in enumerate(s["mask"])]
            for s in samples]


def ref_whiten(samples: list[dict], token_adv: list[list[float]]) -> list[list[float]]:
    """upstream distributed_masked_whiten: mean and Bessel-corrected variance over loss-masked tokens, eps 1e-8."""
    values = [a for s, row in zip(samples, token_adv) for a, m in zip(row, s["mask"]) if m]
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in token_adv]


@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (1.0, 0.05), (0.9, 0.05), (0.0, 0.1), (0.97, 0.0)])
def test_reinforce_plus_plus_returns_padded_and_packed(gamma, kl_coef):
    samples = make_samples(seed=3, lengths=(1, 4, 3, 6, 300))  # 300 positions: three blocks of the chunked sum
    cfg = GRPOConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=gamma,
                     kl_coef=kl_coef)
    want = ref_token_advantages(samples, cfg)
    rewards = torch.tensor([s["reward"] for s in samples], dtype=F64)
    for inputs in layouts(samples):
        got = token_advantages(rewards, inputs["loss_mask"], cfg, old_log_probs=inputs["old_log_probs"],
                               ref_log_probs=inputs["ref_log_probs"], cu_seqlens=inputs.get("cu_seqlens"))
        for i, (s, row) in enumerate(zip(samples, want)):
            if "cu_seqlens" in inputs:
                a = int(inputs["cu_seqlens"][i])
                got_row = got[a : a + len(row)].tolist()
            else:
                got_row = got[i, : len(row)].tolist()
            assert got_row == pytest.approx(row, rel=1e-10, abs=1e-12), i
    assert want[2] == [0.0] * 3  # the fully masked sample earns nothing (upstream asserts it cannot happen)


@pytest.mark.parametrize("estimator,kl_coef", [("reinforce_plus_plus", 0.05), ("reinforce_plus_plus_baseline", 0.05),
                                               ("grpo", 0.0)])
def test_normalize_advantages_whitens_over_every_rank_then_the_loss_matches(estimator, kl_coef):
    samples = make_samples(seed=11, lengths=(1, 4, 3, 6, 5, 2, 7))
    cfg = GRPOConfig(advantage_estimator=estimator, normalize_advantages=True, kl_coef=kl_coef, gamma=1.0)
    if estimator == "reinforce_plus_plus":
        for s in samples:
            s["adv"] = s["reward"]  # its per-sample advantage is the raw reward
    whitened = ref_whiten(samples, ref_token_advantages(samples, cfg))
    # two "ranks": each sums its own samples' statistics; the sums add up over the data-parallel group
    sums = {}
    for part in (samples[:3], samples[3:]):
        for s in part:
            mask = torch.tensor(s["mask"], dtype=F64)
            adv = token_advantages(torch.tensor([s["adv"]], dtype=F64), mask, cfg,
                                   old_log_probs=torch.tensor(s["old"], dtype=F64),
                                   ref_log_probs=torch.tensor(s["ref"], dtype=F64))
            for k, v in whitening_sums(adv, mask).items():
                sums[k] = sums.get(k, 0.0) + v
    whitening = whitening_of(sums)
    want = ref_terms([dict(s, adv=row) for s, row in zip(samples, whitened)], cfg)
    for inputs in layouts(samples):
        per_sample = torch.tensor([s["adv"] for s in samples], dtype=F64)
        loss, m = grpo_micro_batch_loss(**dict(inputs, advantages=per_sample), cfg=cfg, global_normalizer=None,
                                        advantage_whitening=whitening)
        assert loss.item() == pytest.approx(want["loss"], rel=1e-9, abs=1e-12)
        assert m["pg_clipfrac"].item() == pytest.approx(want["clip"], rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="--normalize-advantages needs the rollout step's advantage_whitening"):
        grpo_micro_batch_loss(**dict(layouts(samples)[0], advantages=per_sample), cfg=cfg, global_normalizer=None)


# --------------------------------------------------------------------------- mismatch metrics and the reducer


def ref_mismatch(samples: list[dict], per_token: bool) -> dict[str, float]:
    """mis.py's add_ppl_metrics per sample, averaged like the loss (sum_of_sample_mean)."""
    values = {}
    counts = []
    for s in samples:
        on = [t for t, m in enumerate(s["mask"]) if m]
        n = max(len(on), 1)
        d = [s["old"][t] - s["roll"][t] for t in on]
        mean_train = math.fsum(s["old"][t] for t in on) / n
        mean_roll = math.fsum(s["roll"][t] for t in on) / n
        chi2_token = math.fsum(math.exp(2 * min(max(x, -20.0), 20.0)) for x in d) / n - 1
        chi2_seq = math.exp(2 * min(max(math.fsum(d), -20.0), 20.0)) - 1
        diff = mean_roll - mean_train
        per_sample = dict(mis_training_log_ppl=-mean_train, mis_training_ppl=math.exp(-mean_train),
                          mis_rollout_log_ppl=-mean_roll, mis_rollout_ppl=math.exp(-mean_roll),
                          mis_log_ppl_diff=diff, mis_log_ppl_abs_diff=abs(diff), mis_ppl_ratio=math.exp(diff),
                          mis_chi2_token=chi2_token, mis_chi2_seq=chi2_seq)
        per_token_sums = dict(mis_kl=math.fsum(-x for x in d), mis_k3_kl=math.fsum(math.exp(x) - 1 - x for x in d))
        for k, v in per_sample.items():  # spread over the sample's tokens
            values.setdefault(k, []).append(v * len(on))
        for k, v in per_token_sums.items():
            values.setdefault(k, []).append(v)
        counts.append(len(on))
    if per_token:
        return {k: math.fsum(v) / sum(counts) for k, v in values.items()}
    return {k: math.fsum(x / max(n, 1) for x, n in zip(v, counts)) / len(samples) for k, v in values.items()}


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
def test_mismatch_metrics_match_upstreams_mis_formulas(per_token):
    samples = make_samples(seed=5)
    samples[1]["roll"] = [o + 25.0 for o in samples[1]["old"]]  # a log-ratio sum past the safety bound of 20
    cfg = GRPOConfig(get_mismatch_metrics=True, calculate_per_token_loss=per_token)
    want = ref_mismatch(samples, per_token)
    for inputs in layouts(samples):
        _, m = grpo_loss(cfg=cfg, **inputs)
        names = set(loss_metric_names(cfg, with_kl_loss=False)[0]) - {"loss", "pg_loss", "pg_clipfrac", "ppo_kl",
                                                                        "entropy"}
        assert set(want) <= set(m) and names == set(want)
        for name, value in want.items():
            assert m[name].item() == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert set(mismatch_metrics(*(torch.zeros(1),) * 3)) == set(want)


def dr_grpo_budget(token_losses: list[torch.Tensor], cfg: GRPOConfig) -> torch.Tensor:
    """A reducer of the tests: Dr.GRPO's constant normaliser, every token's loss summed over a budget of 8."""
    return sum((x.sum() for x in token_losses), torch.zeros((), dtype=F64)) / 8.0


def not_a_scalar(token_losses, cfg):
    return torch.stack([x.sum() for x in token_losses])


def test_custom_pg_loss_reducer_by_path_with_rejection():
    samples = make_samples(seed=9)
    cfg = GRPOConfig(custom_pg_loss_reducer_function_path="tests.test_grpo_reference.dr_grpo_budget", use_tis=True,
                     tis_mode="icepop", tis_clip_low=0.5, tis_clip=1.8, entropy_coef=0.05)
    assert cfg.custom_pg_loss_reducer_function_path == "tests.test_grpo_reference:dr_grpo_budget"  # upstream's form
    base = ref_terms(samples, cfg)
    pg = math.fsum(ref_terms([s], cfg)["pg"] * max(sum(s["mask"]), 1) for s in samples) / 8.0 / len(samples)
    grad = ref_gradient(samples, GRPOConfig(use_tis=True, tis_mode="icepop", tis_clip_low=0.5, tis_clip=1.8,
                                            calculate_per_token_loss=True))
    total_tokens = sum(sum(s["mask"]) for s in samples)
    for inputs in layouts(samples):
        inputs["log_probs"].requires_grad_()
        loss, m = grpo_loss(cfg=cfg, **inputs, global_normalizer=len(samples))
        assert m["pg_loss"].item() == pytest.approx(pg, rel=1e-9)
        assert loss.item() == pytest.approx(pg - 0.05 * base["ent"], rel=1e-9)  # the entropy keeps the default
        loss.backward()
        # the token-mean gradient times total_tokens / (8 * samples): the same sum, another constant
        scale = total_tokens / (8.0 * len(samples))
        got = [x for x in inputs["log_probs"].grad.reshape(-1).tolist()]
        want = [x * scale for x in (
            [x for row in grad for x in row] if "cu_seqlens" in inputs else
            [x for row in grad for x in row + [0.0] * (inputs["log_probs"].shape[-1] - len(row))])]
        assert got[: len(want)] == pytest.approx(want, rel=1e-5, abs=1e-8)
    bad = GRPOConfig(custom_pg_loss_reducer_function_path="tests.test_grpo_reference:not_a_scalar")
    with pytest.raises(ConfigError, match="^--custom-pg-loss-reducer-function-path tests.test_grpo_reference:"
                       "not_a_scalar returned Tensor .*a reducer returns a 0-d Tensor"):
        grpo_loss(cfg=bad, **layouts(samples)[0])
