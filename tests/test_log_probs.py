"""Log-probs and entropies from logits (slime/grpo/log_probs.py), CPU only.

References are computed here independently: float64 ``torch.log_softmax`` over the real
vocabulary (gradients by float64 autograd through it), or ``math`` loops.  The vocab-parallel
version runs on 2 gloo ranks (:func:`scripts.harness.spawn_ranks.spawn_ranks`), each holding half of the
(padded) vocabulary as Megatron's column-parallel LM head does; its log-probs, entropies and
gradients w.r.t. the logit shards must equal the float64 full-vocabulary reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime.grpo.log_probs import entropy_from_logits, full_vocab_log_probs, gather_log_probs, vocab_parallel_log_probs
from scripts.harness.spawn_ranks import spawn_ranks

TP = 2

# --------------------------------------------------------------------------- full vocabulary


def test_gather_log_probs_matches_float64_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16) * 4
    tokens = torch.randint(0, 11, (2, 5))
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]
        got = gather_log_probs(logits, tokens, temperature)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_gather_log_probs_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        gather_log_probs(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="must agree"):
        gather_log_probs(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))


def test_entropy_matches_float64_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=gen, dtype=torch.float64) * 4
    logits[0, 0] += 1e4  # a large shift must not overflow (logsumexp)
    logits[1, 2, 7] = 80.0  # nearly one-hot
    logits = logits.float().double()  # the reference sees exactly the float32 inputs
    expected = torch.empty(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(4):
            row = logits[i, j].tolist()
            top = max(row)
            z = math.fsum(math.exp(v - top) for v in row)
            probs = [math.exp(v - top) / z for v in row]
            expected[i, j] = -math.fsum(pv * math.log(pv) for pv in probs if pv > 0)
    out = entropy_from_logits(logits.float())
    assert out.dtype == torch.float32 and out.shape == (3, 4)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    bf16 = entropy_from_logits(logits.bfloat16())
    assert bf16.dtype == torch.float32
    # uniform logits: H = log V
    assert entropy_from_logits(torch.zeros(7, dtype=torch.bfloat16)).item() == pytest.approx(math.log(7), rel=1e-6)



def test_full_vocab_log_probs_is_both_in_one_call_and_its_entropy_can_skip_autograd():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 30, generator=gen) * 3).requires_grad_()
    tokens = torch.randint(0, 30, (2, 5), generator=gen)
    log_probs, entropy = full_vocab_log_probs(logits, tokens, 0.7, with_entropy=True)
    torch.testing.assert_close(log_probs, gather_log_probs(logits, tokens, 0.7), rtol=0, atol=0)
    torch.testing.assert_close(entropy, entropy_from_logits(logits / 0.7), rtol=0, atol=0)
    assert entropy.requires_grad
    assert full_vocab_log_probs(logits, tokens, 0.7)[1] is None
    assert not full_vocab_log_probs(logits, tokens, 0.7, with_entropy=True, entropy_grad=False)[1].requires_grad


def make_case(name: str) -> dict:
    """Full padded logits ``[..., V_padded]``, targets, temperature, ``vocab_size`` to pass, the real
    vocabulary size ``V`` and the weights of the test loss ``sum(w_lp * lp) + sum(w_h * H)``.

    Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``: with a
    divisor of 4 and TP 2, a 13-token vocabulary becomes 16 (each rank 8 columns, rank 1 holding
    ids 8..15 of which 13..15 are padding).
    """
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "even":  # V = 16 split 8 + 8; targets on both sides and at the split
        real, padded, temperature, vocab_size, dtype = 16, 16, 1.0, None, torch.float32
        tokens = torch.tensor([0, 7, 8, 15, 3, 12, 9])
    elif name == "padded-temperature":  # [B, T] layout; padding holds large finite garbage
        real, padded, temperature, vocab_size, dtype = 13, 16, 0.7, 13, torch.float32
        tokens = torch.tensor([[12, 0, 7, 8, 11], [5, 13, 15, 9, 2]])  # 13, 15: padding ids (invalid)
    elif name == "padded-minus-inf":  # padded columns set to -inf instead, no vocab_size
        real, padded, temperature, vocab_size, dtype = 13, 16, 1.3, None, torch.float32
        tokens = torch.tensor([12, 0, 8, 10, 4, 7])
    elif name == "bf16-large-shift":  # bf16 logits, one row shifted by 1e3 (logsumexp stability)
        real, padded, temperature, vocab_size, dtype = 16, 16, 0.8, None, torch.bfloat16
        tokens = torch.tensor([[1, 9, 15], [8, 0, 6]])
    elif name == "rank-of-padding-only":  # V = 3 padded to 8: rank 1 holds ids 4..7, all padding
        real, padded, temperature, vocab_size, dtype = 3, 8, 1.0, 3, torch.float32
        tokens = torch.tensor([0, 2, 1, 2])
    else:
        raise KeyError(name)
    logits = torch.randn(*tokens.shape, padded, generator=gen, dtype=torch.float64) * 3
    if name == "bf16-large-shift":
        logits[0] += 1e3
    if padded > real:
        logits[..., real:] = float("-inf") if name == "padded-minus-inf" else 40.0
    return dict(
        logits=logits.to(dtype),
        tokens=tokens,
        temperature=temperature,
        vocab_size=vocab_size,
        real=real,
        w_lp=torch.randn(tokens.shape, generator=gen, dtype=torch.float64),
        w_h=torch.randn(tokens.shape, generator=gen, dtype=torch.float64),
    )


CASES = ["even", "padded-temperature", "padded-minus-inf", "bf16-large-shift", "rank-of-padding-only"]
VARIANTS = ["both", "log_probs", "entropy"]  # which outputs the test loss uses (all backward branches)


def weighted_loss(case: dict, log_probs: torch.Tensor, entropy: torch.Tensor | None, variant: str) -> torch.Tensor:
    """``sum(w_lp * lp)`` over valid targets and / or ``sum(w_h * H)``, by ``variant``."""
    loss = 0.0
    if variant in ("both", "log_probs"):
        valid = case["tokens"] < case["real"]
        loss = loss + (case["w_lp"] * torch.where(valid, log_probs.double(), 0.0)).sum()
    if variant in ("both", "entropy"):
        loss = loss + (case["w_h"] * entropy.double()).sum()
    return loss


def _job_vocab_parallel(rank: int, out) -> None:
    results = {}
    for name in CASES:
        case = make_case(name)
        width = case["logits"].shape[-1] // TP
        for variant in VARIANTS:
            shard = case["logits"][..., rank * width : (rank + 1) * width].clone().requires_grad_()
            log_probs, entropy = vocab_parallel_log_probs(
                shard,
                case["tokens"],
                case["temperature"],
                vocab_size=case["vocab_size"],
                with_entropy=variant != "log_probs",
            )
            weighted_loss(case, log_probs, entropy, variant).backward()
            entropy = None if entropy is None else entropy.detach()
            results[name, variant] = dict(log_probs=log_probs.detach(), entropy=entropy, grad=shard.grad)
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def vocab_parallel_results(tmp_path_factory):
    """Every case and variant on 2 gloo ranks (one spawn for the module): ``{(case, variant): [rank0, rank1]}``."""
    out = tmp_path_factory.mktemp("vocab_parallel")
    spawn_ranks(_job_vocab_parallel, out, world_size=TP)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(TP)]
    return {key: [results[key] for results in per_rank] for key in per_rank[0]}


def reference(case: dict, variant: str) -> dict:
    """float64 log_softmax over the real vocabulary; gradients by autograd, zero on padded columns."""
    logits = case["logits"].double()
    real = logits[..., : case["real"]].detach().requires_grad_()
    log_p = torch.log_softmax(real / case["temperature"], dim=-1)
    valid = case["tokens"] < case["real"]
    log_probs = log_p.gather(-1, case["tokens"].clamp(max=case["real"] - 1)[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    weighted_loss(case, log_probs, entropy, variant).backward()
    grad = torch.zeros_like(logits)
    grad[..., : case["real"]] = real.grad
    return dict(log_probs=log_probs.detach(), entropy=entropy.detach(), valid=valid, grad=grad)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CASES)
def test_vocab_parallel_equals_full_vocabulary_float64(vocab_parallel_results, name, variant):
    case = make_case(name)
    expected = reference(case, variant)
    ranks = vocab_parallel_results[name, variant]
    bf16 = case["logits"].dtype == torch.bfloat16
    for got in ranks:  # every rank returns the full per-token values
        assert got["log_probs"].dtype == torch.float32
        valid = expected["valid"]
        torch.testing.assert_close(got["log_probs"][valid].double(), expected["log_probs"][valid], rtol=1e-5, atol=1e-5)
        assert torch.isnan(got["log_probs"][~valid]).all()  # padding ids: NaN, never a plausible number
        if variant == "log_probs":
            assert got["entropy"] is None
        else:
            torch.testing.assert_close(got["entropy"].double(), expected["entropy"], rtol=1e-5, atol=1e-5)
    grad = torch.cat([got["grad"] for got in ranks], dim=-1)  # shards side by side: the full gradient
    assert grad.dtype == case["logits"].dtype and grad.shape == case["logits"].shape
    tol = dict(rtol=1e-2, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected["grad"], **tol)
    assert torch.all(grad[..., case["real"] :] == 0)  # padded columns get no gradient


# --------------------------------------------------------------------------- vocab-parallel: one rank


def test_one_rank_without_distributed_equals_the_full_vocabulary_functions():
    """TP = 1 (torch.distributed not initialised): the same values and gradients as
    gather_log_probs / entropy_from_logits under autograd."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4, 10, generator=gen)
    tokens = torch.randint(0, 10, (3, 4), generator=gen)
    w_lp, w_h = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    full = logits.clone().requires_grad_()
    ((w_lp * gather_log_probs(full, tokens, 0.9)).sum() + (w_h * entropy_from_logits(full / 0.9)).sum()).backward()
    shard = logits.clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(shard, tokens, 0.9, with_entropy=True)
    ((w_lp * log_probs).sum() + (w_h * entropy).sum()).backward()
    torch.testing.assert_close(log_probs, gather_log_probs(logits, tokens, 0.9))
    torch.testing.assert_close(entropy, entropy_from_logits(logits / 0.9))
    torch.testing.assert_close(shard.grad, full.grad)
    with torch.no_grad():  # no grad: nothing saved, same values
        torch.testing.assert_close(vocab_parallel_log_probs(logits, tokens, 0.9)[0], log_probs.detach())


def test_vocab_parallel_bad_input():
    logits, tokens = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="--rollout-temperature must be > 0"):
        vocab_parallel_log_probs(logits, tokens, 0.0)
    with pytest.raises(ValueError, match="must agree up to the vocab dim"):
        vocab_parallel_log_probs(logits, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        vocab_parallel_log_probs(logits, tokens.float())
    with pytest.raises(ValueError, match=r"vocab_size 5 must be in \[1, 4\]"):
        vocab_parallel_log_probs(logits, tokens, vocab_size=5)
    with pytest.raises(ValueError, match=r"vocab_size 0 must be in \[1, 4\]"):
        vocab_parallel_log_probs(logits, tokens, vocab_size=0)
