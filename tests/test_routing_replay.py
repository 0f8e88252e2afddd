"""Routing replay in training (R3 ``--use-rollout-routing-replay``, R2 ``--use-routing-replay``) and the mismatch
monitor's router agreement and gate (``docs/design/routing_replay.md``).

The step's part runs with the stand-in backend of ``tests/standin_backend.py`` given a route shape: which routes
each forward of the step replays, what R2 records, and that a bad route stops the step before any forward.  The
backends' part (FSDP padded, Megatron packed THD, both on the tiny Qwen3.5-MoE checkpoint in one spawned process)
checks the replayed experts token by token, a training step with forced routes against one whose routers chose
them, R2's replay in both optimizer steps and the agreement figure against numpy.  The router gradient is checked
against the MoE block written out in float64 (``tests/qwen35_helpers.moe_block_f64``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from slime.backends.samples import SampleError
from slime.backends.step import micro_batches, train_step
from slime.backends.train_metrics import LogprobGapError, check_gap_threshold, logprob_gap_metrics
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.routing_replay import RouteShape, route_agreement_sums
from tests.standin_backend import GRPO, StandIn, hand_samples
from tests.helpers import (
    GEO3K_DATA, IMAGES, LENS, exported, make_backend, make_megatron, make_samples, spawn,
)

SHAPE = RouteShape(num_layers=2, top_k=2, num_experts=4)


def _routes(sample: Sample, seed: int) -> np.ndarray:
    """Random distinct top-2 ids of 4 experts, uint8 [P + R - 1, 2, 2]."""
    rng = np.random.default_rng(seed)
    n = len(sample.prompt_token_ids) + sample.response_length - 1
    return np.stack([rng.permutation(4)[:2] for _ in range(n * 2)]).reshape(n, 2, 2).astype(np.uint8)


class RoutedStandIn(StandIn):
    """The stand-in with an MoE route shape: records each forward's replayed routes, and "captures" as its own
    routes a fixed table per sample (``own``)."""

    def __init__(self, grpo, *, r3=False, r2=False, **kw):
        super().__init__(grpo, **kw)
        self.spec.train = dataclasses.replace(self.spec.train, use_rollout_routing_replay=r3, use_routing_replay=r2)
        self.replayed: list[tuple[str, list]] = []  # (pass, per sample the routes replayed or None)
        self.own: dict[int, np.ndarray] = {}

    def route_shape(self):
        return SHAPE

    def log_probs(self, model, batches, *, replay_routes=False, capture_routes=False):
        name = "ref" if model is self.ref_model else "policy"
        for batch in batches:
            self.replayed.append((name, batch.routes if replay_routes else None))
            if capture_routes:
                batch.trainer_routes = [self.own[s.index] for s in batch.samples]
        return super().log_probs(model, batches)

    def forward_backward(self, batches, normalizer):
        self.replayed.extend(("train", b.routes) for b in batches)
        return super().forward_backward(batches, normalizer)


def _routed_samples():
    samples = hand_samples()
    for s in samples:
        s.rollout_routed_experts = _routes(s, 100 + s.index)
    return samples


def test_r3_replays_the_engines_routes_in_the_old_ref_and_training_forwards():
    samples = _routed_samples()
    backend = RoutedStandIn(GRPOConfig(**GRPO), r3=True)
    backend.own = {s.index: s.rollout_routed_experts for s in samples}  # what a replaying router takes
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=2)
    assert metrics["train/router_agreement"] == 1.0  # with R3: the experts taken against the engine's
    passes = [name for name, _ in backend.replayed]
    assert passes == ["policy"] * 4 + ["ref"] * 4 + ["train"] * 4  # micro-batches [0, 1], [2], [3, 4], [5]
    seen = [r for _, routes in backend.replayed for r in routes]
    expected = [samples[i].rollout_routed_experts for i in (0, 1, 2, 3, 4, 5)] * 3
    assert len(seen) == len(expected) and all(a is b for a, b in zip(seen, expected))


def test_r3_without_the_old_log_prob_pass_replays_the_engines_routes_in_the_training_forward():
    # --skip-actor-forward-only with R3: no policy pass, so no router agreement; the reference and training forwards
    # take the engine's routes.
    samples = _routed_samples()
    backend = RoutedStandIn(GRPOConfig(**GRPO), r3=True)
    backend.spec.train = dataclasses.replace(backend.spec.train, skip_actor_forward_only=True)
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=1)
    assert "train/router_agreement" not in metrics and metrics["train/ppo_kl"] == 0.0
    assert [name for name, _ in backend.replayed] == ["ref"] * 3 + ["train"] * 3  # [0, 1], [2, 3], [4, 5]
    seen = [r for _, routes in backend.replayed for r in routes]
    assert all(a is b for a, b in zip(seen, [s.rollout_routed_experts for s in samples] * 2)) and len(seen) == 12


def test_r2_records_the_old_pass_and_replays_it_in_every_optimizer_step():
    samples = _routed_samples()
    backend = RoutedStandIn(GRPOConfig(**GRPO), r2=True)
    backend.own = {s.index: _routes(s, 200 + s.index) for s in samples}
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=2)
    assert backend.optimizer_steps == 2
    by_pass = {}
    for name, routes in backend.replayed:
        by_pass.setdefault(name, []).append(routes)
    assert by_pass["policy"] == [None] * 4 and by_pass["ref"] == [None] * 4  # the routers' own choice there
    seen = [r for routes in by_pass["train"] for r in routes]  # both steps' micro-batches
    assert all(a is backend.own[i] for a, i in zip(seen, range(6), strict=True))
    # the monitor compared the recorded routes with the engine's (random tables: agreement by numpy)
    same = [(np.sort(s.rollout_routed_experts, -1) == np.sort(backend.own[s.index], -1)).all(-1) for s in samples]
    assert metrics["train/router_agreement"] == pytest.approx(np.concatenate([m.ravel() for m in same]).mean())


def test_router_agreement_only_where_engine_routes_exist_and_malformed_ones_are_counted():
    samples = _routed_samples()
    samples[2].rollout_routed_experts = None  # no routes: not compared
    samples[3].rollout_routed_experts = samples[3].rollout_routed_experts[:-1]  # malformed: counted
    backend = RoutedStandIn(GRPOConfig(**GRPO))
    backend.own = {s.index: _routes(s, 100 + s.index) for s in samples}  # the engine's routes, where they exist
    backend.own[4] = backend.own[4][:, :, ::-1].copy()  # the same sets in another order agree
    backend.init()
    metrics = train_step(backend, 0, samples, num_steps=2)
    assert metrics["train/router_agreement"] == 1.0 and metrics["train/router_agreement_skipped"] == 1.0
    assert metrics["train/router_agreement_image"] == 1.0  # samples 1 and 4 have images


def test_without_engine_routes_nothing_is_captured_or_reported():
    backend = RoutedStandIn(GRPOConfig(**GRPO))
    backend.init()
    metrics = train_step(backend, 0, hand_samples(), num_steps=2)  # own is empty: a capture would raise KeyError
    assert not any("router_agreement" in k for k in metrics)


@pytest.mark.parametrize("fault, message", [
    ("missing", r"sample 3 \(group 1\) has no rollout_routed_experts to replay"),
    ("tokens", r"sample 3 \(group 1\): routed experts are uint8 \[2, 2, 2\], expected uint8 \[3, 2, 2\]"),
    ("layers", r"sample 3 \(group 1\): routed experts are uint8 \[3, 1, 2\], expected uint8 \[3, 2, 2\]"),
    ("top_k", r"sample 3 \(group 1\): routed experts are uint8 \[3, 2, 1\], expected uint8 \[3, 2, 2\]"),
    ("range", "sample 3 \\(group 1\\): routed expert id 4 >= the model's 4 experts"),
])
def test_r3_stops_the_step_naming_the_sample_before_any_forward(fault, message):
    samples = _routed_samples()
    good = samples[3].rollout_routed_experts
    samples[3].rollout_routed_experts = {
        "missing": None, "tokens": good[:-1], "layers": good[:, :1], "top_k": good[:, :, :1],
        "range": np.where(good == good.max(), 4, good).astype(np.uint8),
    }[fault]
    backend = RoutedStandIn(GRPOConfig(**GRPO), r3=True)
    backend.init()
    with pytest.raises(SampleError, match=message):
        train_step(backend, 0, samples, num_steps=2)
    assert backend.replayed == [] and backend.forward_passes == [] and backend.optimizer_steps == 0


# ----------------------------------------------------------------------------- the monitor's figures, the gate


def test_route_agreement_sums_compare_top_k_sets_per_token_and_layer():
    image = Sample(index=0, prompt="p", label="1", prompt_token_ids=[1, 2], response_token_ids=[3, 4], images=["i"])
    text = Sample(index=1, prompt="p", label="1", prompt_token_ids=[1], response_token_ids=[3, 4])
    image.rollout_routed_experts = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]]], np.uint8)
    trainer_image = np.array([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[1, 2], [3, 1]]], np.uint8)
    text.rollout_routed_experts = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]]], np.uint8)
    trainer_text = np.array([[[3, 2], [2, 3]], [[0, 1], [3, 2]]], np.uint8)
    # image pairs: (0,0) same set, (0,1) same, (1,0) {0,2} != {0,1}, (1,1) same, (2,0) same, (2,1) {1,3} != {0,3}
    # text pairs: (0,0) {2,3} != {0,1}, (0,1) same, (1,0) same, (1,1) same
    sums = route_agreement_sums([(image, trainer_image), (text, trainer_text)])
    assert sums == {"routes/image/agree": 4.0, "routes/image/pairs": 6.0, "routes/text/agree": 3.0,
                    "routes/text/pairs": 4.0}
    gap = {f"gap/{k}/{w}": 0.0 for k in ("image", "text") for w in ("abs_diff", "k3", "ratio_off", "tokens")}
    metrics = logprob_gap_metrics({**gap, **sums, "routes/skipped": 2.0})
    assert metrics["train/router_agreement_image"] == pytest.approx(4 / 6)
    assert metrics["train/router_agreement_text"] == pytest.approx(3 / 4)
    assert metrics["train/router_agreement"] == pytest.approx(7 / 10)
    assert metrics["train/router_agreement_skipped"] == 2.0
    with pytest.raises(ValueError, match=r"sample 1: engine routes \[2, 2, 2\], trainer routes \[1, 2, 2\]"):
        route_agreement_sums([(text, trainer_text[:1])])


def test_the_gap_gate_names_the_step_and_the_split():
    metrics = {"train/logprob_abs_diff_image": 0.3, "train/logprob_abs_diff_text": 0.05, "train/logprob_abs_diff": 0.2}
    check_gap_threshold(metrics, None, 3)  # no bound
    check_gap_threshold(metrics, 0.3, 3)  # at the bound: passes
    with pytest.raises(LogprobGapError, match=r"rollout step 3: .* passed --ci-train-rollout-logprob-abs-diff-"
                                              r"threshold 0.1 nats \(image prompts 0.3\); no update was applied"):
        check_gap_threshold(metrics, 0.1, 3)
    with pytest.raises(LogprobGapError, match=r"\(image prompts 0.3, text prompts 0.05\)"):
        check_gap_threshold(metrics, 0.01, 3)


def test_the_gate_stops_the_step_before_any_update():
    backend = StandIn(GRPOConfig(**GRPO))
    backend.spec.train = dataclasses.replace(backend.spec.train, ci_train_rollout_logprob_abs_diff_threshold=1e-3)
    backend.init()
    w0 = backend.model.w.detach().clone()
    with pytest.raises(LogprobGapError, match="rollout step 7"):
        train_step(backend, 7, hand_samples(), num_steps=2)
    assert backend.optimizer_steps == 0 and torch.equal(backend.model.w.detach(), w0)


# ----------------------------------------------------------------------------- both backends on the tiny MoE model


def _job_backends(rank_info, ckpt_dir, samples, own, other, out):

    def routed(routes):
        return [dataclasses.replace(s, rollout_routed_experts=r) for s, r in zip(samples, routes)]

    # AdamW's first step moves a weight by about lr * g / (|g| + eps): with eps = 1 >> |g| and no decay that is
    # lr * g, so the weights after a step compare the gradients (eps ~ 0 would move every weight by +-lr)
    optimizer = {"lr": 1.0, "adam_eps": 1.0, "weight_decay": 0.0}
    builders = {
        "fsdp": lambda train: make_backend(rank_info, ckpt_dir, train={"micro_batch_size": 2, **train},
                                           optimizer=optimizer),
        "megatron": lambda train: make_megatron(rank_info, ckpt_dir, train={
            "use_dynamic_batch_size": True, "max_tokens_per_gpu": 200, **train}, optimizer=optimizer),
    }
    result = {}
    for name, build in builders.items():
        r = result[name] = {}
        backend = build({})
        backend.init()
        r["initial_weights"] = exported(backend)[1]
        batches = micro_batches(backend, samples, range(len(samples)), engine_routes=False, dp_group=None)
        r["micro_batches"] = len(batches)
        backend.log_probs(backend.model, batches, capture_routes=True)
        r["captured_own"] = [t for b in batches for t in b.trainer_routes]
        for batch in batches:
            batch.routes = [other[i] for i in batch.indices]
        backend.log_probs(backend.model, batches, replay_routes=True, capture_routes=True)
        r["captured_replayed"] = [t for b in batches for t in b.trainer_routes]
        # one optimizer step: after an update a near-tie may flip, and the routers would then choose others
        r["plain"] = train_step(backend, 0, routed(other), num_steps=1)  # engine routes != own: agreement < 1
        r["plain_weights"] = exported(backend)[1]
        del backend
        backend = build({"use_rollout_routing_replay": True})
        backend.init()
        r["r3"] = train_step(backend, 0, routed(own), num_steps=1)
        r["r3_weights"] = exported(backend)[1]
        del backend
        backend = build({"use_routing_replay": True})
        backend.init()
        r["r2"] = train_step(backend, 0, routed(own), num_steps=2)
        del backend
    torch.save(result, out / "result.pt")


@pytest.fixture(scope="module")
def backends(tiny_ckpt, tmp_path_factory):
    """Own routes (the HF model's choice, every choice > 1e-4 from a tie, so both backends choose them too) and
    random other routes of the tiny model (4 layers, top-2 of 8), run through both backends."""
    from qwen35_helpers import own_and_random_routes
    from transformers import Qwen3_5MoeForConditionalGeneration


    out = tmp_path_factory.mktemp("routing_replay")
    samples = make_samples(tiny_ckpt, LENS[:4], images=IMAGES[:4])
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    own, other = own_and_random_routes(hf, samples, seed=1)
    initial = {name: p.detach().clone() for name, p in hf.named_parameters() if name.endswith("mlp.gate.weight")}
    spawn(_job_backends, tiny_ckpt, samples, own, other, out, world=1)
    return samples, own, other, initial, torch.load(out / "result.pt", weights_only=False)


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_replayed_routes_are_the_engines_token_by_token_after_padding_or_packing(backends, name):
    samples, own, other, _, result = backends
    r = result[name]
    assert r["micro_batches"] < len(samples)  # several samples per padded / packed micro-batch
    for got, want in zip(r["captured_replayed"], other, strict=True):
        assert got.dtype == np.uint8 and np.array_equal(got, want)  # the forced experts, in their order
    for got, want in zip(r["captured_own"], own, strict=True):  # without replay: the routers' own top-k sets
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1))


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_a_training_step_with_forced_routes_equals_one_whose_routers_chose_them(backends, name):
    _, own, other, initial, result = backends
    r = result[name]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/logprob_abs_diff", "train/entropy"):
        assert r["r3"][key] == pytest.approx(r["plain"][key], rel=1e-5, abs=1e-7), key
    assert r["plain_weights"].keys() == r["r3_weights"].keys()
    deltas = {key: (r["plain_weights"][key] - w0, r["r3_weights"][key] - w0)
              for key, w0 in r["initial_weights"].items()}
    scale = max(float(plain.abs().max()) for plain, _ in deltas.values())
    for key, (plain, forced) in deltas.items():  # the step's update, i.e. lr * gradient, of every weight
        if name == "fsdp":  # the HF router's own arithmetic: forcing its own choice changes no bit of the forward
            torch.testing.assert_close(forced, plain, rtol=1e-4, atol=1e-4 * float(plain.abs().max()) + 1e-12,
                                       msg=key)
        else:  # forced gate weights round unlike megatron-core's top-k softmax (float32, ~1e-7), which the tiny
            # random model's Gated-DeltaNet backward amplifies to a few % of its smallest gradients; a wrong expert
            # would change an expert's whole update (scale: the largest)
            assert float((forced - plain).abs().max()) < 0.05 * scale, key
    gates = [k for k in r["r3_weights"] if k.endswith("mlp.gate.weight")]
    assert len(gates) == 4  # the routers learn under R3: their gradients are not zero
    assert all(float((r["r3_weights"][k] - r["initial_weights"][k]).abs().max()) > 1e-6 for k in gates)
    assert all(torch.equal(r["initial_weights"][k], initial[k]) for k in gates)
    # the monitor: R3 off, engine routes = the random ones -> the share of equal top-k sets, by numpy
    agree = np.concatenate([(np.sort(a, -1) == np.sort(b, -1)).all(-1).ravel() for a, b in zip(own, other)])
    assert r["plain"]["train/router_agreement"] == pytest.approx(agree.mean())
    assert 0 < agree.mean() < 0.5
    assert r["r3"]["train/router_agreement"] == 1.0  # R3: the experts the trainer took are the engine's


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_r2_trains_on_the_recorded_routes_of_the_old_pass(backends, name):
    r = backends[-1][name]
    assert r["r2"]["train/router_agreement"] == 1.0  # recorded at the initial weights: the engine's (own) routes
    # the old-log-prob pass is the same forward with or without recording
    assert r["r2"]["train/logprob_abs_diff"] == pytest.approx(r["plain"]["train/logprob_abs_diff"], rel=1e-5)


def test_router_gradients_under_forced_routes_equal_the_float64_block(tiny_ckpt):
    """The gradient of the router weight through an MoE block whose routes are forced equals the one of the block
    written out in float64 (``moe_block_f64``: softmax over all logits at the forced experts, renormalised), and is
    not zero: the router keeps learning under replay."""
    from qwen35_helpers import moe_block_f64
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slime.routing_replay import force_hf_routes, hf_moe_routers

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32)
    layers = len(hf_moe_routers(model))
    block = model.model.language_model.layers[2].mlp
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 10, block.gate.hidden_dim, generator=gen)
    weight = torch.randn(10, block.gate.hidden_dim, generator=gen)  # d loss / d output
    e, k = block.gate.num_experts, block.gate.top_k
    routes = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(10 * layers)]).view(10, layers, k)
    with force_hf_routes(model, routes):
        (block(x)[0].reshape(10, -1) * weight).sum().backward()
    got = block.gate.weight.grad.clone()

    reference = type("Block", (), {})()  # the block's tensors in float64, the gate weight a leaf
    gate = block.gate.weight.detach().double().requires_grad_()
    reference.gate = type("Gate", (), {"weight": gate})()
    reference.experts, reference.shared_expert = block.experts, block.shared_expert
    reference.shared_expert_gate = block.shared_expert_gate
    (moe_block_f64(reference, x[0], routes[:, 2]) * weight.double()).sum().backward()
    assert float(gate.grad.abs().max()) > 1e-3  # not zero
    torch.testing.assert_close(got.double(), gate.grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- flags


def _parse(ckpt, *extra):
    from slime.arguments import parse_args

    return parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "y", "--num-rollout", "1",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                       "--rollout-backend", "transformers", "--colocate", *extra])


def _refusal(ckpt, capsys, *extra) -> str:
    with pytest.raises(SystemExit) as excinfo:
        _parse(ckpt, *extra)
    assert excinfo.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_r3_implies_r2_and_asks_the_rollout_for_routes(tiny_ckpt):
    from slime.routing_replay import rollout_routes_wanted

    def wanted(cfg):
        return rollout_routes_wanted(cfg.train, cfg.parity, cfg.checkpoint.hf_checkpoint, parity_check=False)

    cfg = _parse(tiny_ckpt, "--train-backend", "fsdp", "--use-rollout-routing-replay")
    assert cfg.train.use_routing_replay and cfg.train.use_rollout_routing_replay
    assert wanted(cfg)
    plain = _parse(tiny_ckpt, "--train-backend", "fsdp")
    assert not plain.train.use_routing_replay and not wanted(plain)
    assert not wanted(_parse(tiny_ckpt, "--train-backend", "fsdp", "--use-routing-replay"))  # R2: the trainer's own
    assert _parse(tiny_ckpt, "--ci-train-rollout-logprob-abs-diff-threshold", "0.5").train \
        .ci_train_rollout_logprob_abs_diff_threshold == 0.5
    skip = _parse(tiny_ckpt, "--train-backend", "fsdp", "--use-rollout-routing-replay", "--skip-actor-forward-only")
    assert skip.train.skip_actor_forward_only and wanted(skip)  # R3 without the pass still takes the engine's routes


def test_routing_replay_is_refused_where_it_cannot_run(tiny_ckpt, tmp_path, capsys):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"text_config": {"num_hidden_layers": 2}}')
    assert ("--use-rollout-routing-replay replays the routed experts of an MoE model, but --hf-checkpoint "
            f"{dense} has no MoE layers") in _refusal(dense, capsys, "--train-backend", "fsdp",
                                                      "--use-rollout-routing-replay")
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text('{"text_config": {"num_hidden_layers": 2, "num_experts_per_tok": 8, '
                                      '"num_experts": 512}}')
    assert "--use-routing-replay: --hf-checkpoint" in _refusal(wide, capsys, "--train-backend", "fsdp",
                                                                "--use-routing-replay")
    err = _refusal(tiny_ckpt, capsys, "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                   "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-rollout-routing-replay")
    assert ("--use-rollout-routing-replay: routing replay in the Megatron trainer is proven only at TP = PP = CP = "
            "EP = 1 (no multi-GPU test yet), not at --tensor-model-parallel-size 2") in err
    err = _refusal(tiny_ckpt, capsys, "--train-backend", "megatron", "--recompute-granularity", "full",
                   "--recompute-method", "uniform", "--recompute-num-layers", "1", "--use-routing-replay")
    assert "--use-routing-replay: --recompute-granularity full recomputes layer blocks in the backward pass" in err
    err = _refusal(tiny_ckpt, capsys, "--train-backend", "fsdp", "--use-routing-replay", "--use-rollout-logprobs")
    assert "--use-routing-replay records the routes of the trainer's old-log-prob pass, which --use-rollout-" \
           "logprobs skips" in err
    _parse(tiny_ckpt, "--train-backend", "fsdp", "--use-rollout-routing-replay", "--use-rollout-logprobs")  # fine
    err = _refusal(tiny_ckpt, capsys, "--ci-train-rollout-logprob-abs-diff-threshold", "0")
    assert "--ci-train-rollout-logprob-abs-diff-threshold must be > 0 nats, got 0.0" in err
    err = _refusal(tiny_ckpt, capsys, "--ci-train-rollout-logprob-abs-diff-threshold", "0.1", "--use-rollout-logprobs")
    assert "--use-rollout-logprobs skips that trainer pass" in err  # the gate would never run


def test_rollout_only_refuses_flags_of_the_training_step(tiny_ckpt, capsys, caplog):
    err = _refusal(tiny_ckpt, capsys, "--debug-rollout-only", "--use-tis", "--freeze-params-name-list", "visual")
    assert "--debug-rollout-only runs no training step, so --use-tis, --freeze-params-name-list would do nothing" in err
    with caplog.at_level("WARNING"):
        cfg = _parse(tiny_ckpt, "--debug-rollout-only", "--use-rollout-routing-replay", "--train-backend", "fsdp",
                     "--save", "/tmp/never-written")
    assert cfg.run_mode.debug_rollout_only and "no checkpoint is written to --save /tmp/never-written" in caplog.text


# ----------------------------------------------------------------------------- through the driver


@pytest.mark.slow
def test_the_driver_runs_r3_from_the_engines_routes_and_the_gate_stops_the_run(tiny_ckpt, tmp_path):
    """The transformers engine captures its routers' choices for every training sample (R3 asks for them), the FSDP
    trainer checks them and replays them in the old-log-prob pass (a missing or malformed route would stop the step
    with a SampleError first); the engine's KV-cached forward is not the trainer's, so the gap is above 1e-12 nats
    and the gate stops the run at step 0 naming the split (the first two geo3k rows have images)."""
    from slime import driver
    from slime.arguments import parse_args

    cfg = parse_args([
        "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(GEO3K_DATA), "--input-key", "problem",
        "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template",
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--global-batch-size", "4", "--train-backend", "fsdp",
        "--rollout-backend", "transformers", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--skip-eval-before-train", "--output-dir", str(tmp_path / "run"),
        "--no-progress-bar", "--use-rollout-routing-replay", "--ci-train-rollout-logprob-abs-diff-threshold", "1e-12",
    ])  # fmt: skip
    with pytest.raises(LogprobGapError, match=r"rollout step 0: the mean \|trainer - rollout log-prob\| passed "
                                              r"--ci-train-rollout-logprob-abs-diff-threshold 1e-12 nats \(image "
                                              r"prompts [0-9.e-]+\); no update was applied"):
        driver.train(cfg)
