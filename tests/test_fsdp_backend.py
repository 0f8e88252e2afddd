"""--train-backend fsdp on CPU: 2 ranks over gloo against single-process references.

Each test spawns its own 2 ranks (:func:`scripts.harness.spawn_ranks.spawn_ranks`: gloo, a FileStore
rendezvous, no port) that build :class:`FSDPBackend` on the tiny Qwen3.5-MoE checkpoint and write what they
computed into ``tmp_path``; the test process then compares it with a reference written
here independently: the plain Hugging Face model, log-probs by ``log_softmax`` in float64,
the GRPO loss by hand, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from slime.backends.config import RankInfo
from slime.backends.step import train_step
from slime.checkpoints import layout as ckpt
from slime.grpo.config import GRPOConfig
from tests.helpers import (
    TEMPERATURE, WORLD, full_params, hf_model, make_backend, make_samples, rank_share, reference_log_probs, spawn,
    without_timings,
)

# ---------------------------------------------------------------------------------------
# the reference loss (samples, spawning, backends, the reference model: tests/helpers.py)
# ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """The reference model runs in this process: one thread (the ranks use one each), since
    intra-op threads on a busy 2-core machine slow the tiny model's forward ~100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_grpo_loss(model, samples, old_log_probs, per_token: bool, eps: float = 0.2) -> torch.Tensor:
    """The clipped GRPO loss of one optimizer step, by hand (float64), over ALL ranks' samples."""
    token_losses, masks = [], []
    for sample, old in zip(samples, old_log_probs):
        ratio = torch.exp(reference_log_probs(model, sample) - old)
        adv = sample.advantage
        token_losses.append(torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)))
        masks.append(torch.tensor(sample.loss_mask, dtype=torch.float64))
    if per_token:
        return sum((l * m).sum() for l, m in zip(token_losses, masks)) / sum(m.sum() for m in masks)
    return sum((l * m).sum() / m.sum() for l, m in zip(token_losses, masks)) / len(samples)


# ---------------------------------------------------------------------------------------
# one optimizer step == single-process reference (per-sample and per-token aggregation)
# ---------------------------------------------------------------------------------------


def _job_train(rank_info, ckpt_dir, samples, out, overrides):
    backend = make_backend(rank_info, ckpt_dir, **overrides)
    backend.init()
    metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, num_steps=2), num_steps=2)
    params = full_params(backend.model)
    if rank_info.rank == 0:
        torch.save({"metrics": metrics, "params": params}, out / "result.pt")
    torch.save(metrics, out / f"metrics{rank_info.rank}.pt")


@pytest.mark.parametrize(
    "per_token, micro_batch_size, recompute",
    [(False, 1, False), (True, 2, True)],
    ids=["per-sample,mbs1", "per-token,mbs2,gradient-checkpointing"],
)
def test_two_optimizer_steps_match_single_process_reference(
    tiny_ckpt, tmp_path, per_token, micro_batch_size, recompute
):
    # 8 samples, 2 steps of 4; in every step rank 0 gets two long responses, rank 1 two short
    # ones, so a per-rank mean would weigh tokens differently from the global mean.
    lens = [9, 7, 2, 3, 8, 6, 3, 2]
    samples = make_samples(tiny_ckpt, lens, images=[True, False, True, False, False, True, True, False])
    grpo = GRPOConfig(calculate_per_token_loss=per_token)
    # adam_eps 1e-4: with the default 1e-8, Adam divides by sqrt(v) ~ |g| for weights whose
    # gradient is ~1e-9 (float32 noise level), and the 1e-7-relative gradient differences of
    # a sharded vs a plain computation become update differences of ~1% there.
    optimizer = {"clip_grad": 0.5, "adam_eps": 1e-4}
    train = {"micro_batch_size": micro_batch_size}
    overrides = dict(grpo=grpo, train=train, fsdp={"gradient_checkpointing": recompute}, optimizer=optimizer)
    spawn(_job_train, tiny_ckpt, samples, tmp_path, overrides)
    result = torch.load(tmp_path / "result.pt")

    model = hf_model(tiny_ckpt)
    with torch.no_grad():
        old = [reference_log_probs(model, s) for s in samples]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, eps=1e-4
    )
    losses, norms = [], []
    for step in range(2):
        chunk = slice(4 * step, 4 * step + 4)
        loss = reference_grpo_loss(model, samples[chunk], old[chunk], per_token)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    metrics = result["metrics"]
    assert metrics["train/loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert metrics["train/pg_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(np.mean(norms), rel=1e-5)
    assert min(norms) > 0.5, "the test should exercise gradient clipping"
    assert metrics["train/lr"] == pytest.approx(1e-3)
    for name, expected in model.named_parameters():
        torch.testing.assert_close(result["params"][name], expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # The metrics are reduced across ranks: identical everywhere (the perf/ timings are each rank's own clock).
    reduced = [without_timings(torch.load(tmp_path / f"metrics{r}.pt")) for r in range(WORLD)]
    assert reduced[0] == reduced[1] and "train/loss" in reduced[0]


def _job_metrics(rank_info, ckpt_dir, samples, out):
    backend = make_backend(rank_info, ckpt_dir)
    backend.init()
    old = [torch.tensor(lp) for lp in backend.compute_log_probs(rank_share(samples, rank_info.rank, 1))]
    metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, num_steps=1), num_steps=1)
    torch.save({"metrics": metrics, "old": old}, out / f"rank{rank_info.rank}.pt")


def test_first_step_metrics_logprob_gap_split_and_zero_ratio_kl(tiny_ckpt, tmp_path):
    # Rank 0: one image prompt and one text prompt; rank 1: two image prompts.
    samples = make_samples(tiny_ckpt, [4, 5, 3, 6], images=[True, False, True, True])
    spawn(_job_metrics, tiny_ckpt, samples, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    metrics = ranks[0]["metrics"]
    assert without_timings(ranks[1]["metrics"]) == without_timings(metrics)

    # Independent: |trainer old log-prob - rollout log-prob| over loss-masked tokens, by prompt kind.
    gaps = {"image": [], "text": []}
    for rank, result in enumerate(ranks):
        for sample, old in zip(rank_share(samples, rank, 1), result["old"]):
            mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
            diff = (old.double() - torch.tensor(sample.rollout_log_probs, dtype=torch.float64)).abs()[mask]
            gaps["image" if sample.images else "text"].extend(diff.tolist())
    assert metrics["train/logprob_abs_diff_image"] == pytest.approx(np.mean(gaps["image"]), rel=1e-6)
    assert metrics["train/logprob_abs_diff_text"] == pytest.approx(np.mean(gaps["text"]), rel=1e-6)
    assert metrics["train/logprob_abs_diff"] == pytest.approx(np.mean(gaps["image"] + gaps["text"]), rel=1e-6)
    # Old log-probs come from the same policy before the update: the ratio is exactly 1.
    assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/entropy"] > 0
    assert "train/kl_loss" not in metrics


def _job_text_only_gap(rank_info, ckpt_dir, samples, out):
    backend = make_backend(rank_info, ckpt_dir)
    backend.init()
    metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, num_steps=1), num_steps=1)
    if rank_info.rank == 0:
        torch.save(metrics, out / "metrics.pt")


def test_logprob_gap_split_without_image_prompts_is_omitted(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [3, 4, 2, 5], images=[False] * 4)
    spawn(_job_text_only_gap, tiny_ckpt, samples, tmp_path)
    metrics = torch.load(tmp_path / "metrics.pt")
    assert "train/logprob_abs_diff_image" not in metrics
    assert metrics["train/logprob_abs_diff_text"] == metrics["train/logprob_abs_diff"]


def _job_rollout_logprobs(rank_info, ckpt_dir, samples, out):
    backend = make_backend(rank_info, ckpt_dir, train={"use_rollout_logprobs": True})
    backend.init()
    metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, num_steps=1), num_steps=1)
    if rank_info.rank == 0:
        torch.save(metrics, out / "metrics.pt")


def test_use_rollout_logprobs_takes_the_ratio_from_the_engine(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [4, 6, 3, 5], images=[True, False, False, True])
    spawn(_job_rollout_logprobs, tiny_ckpt, samples, tmp_path)
    metrics = torch.load(tmp_path / "metrics.pt")

    model = hf_model(tiny_ckpt)
    rollout = [torch.tensor(s.rollout_log_probs, dtype=torch.float64) for s in samples]
    with torch.no_grad():
        expected_loss = reference_grpo_loss(model, samples, rollout, per_token=False)
        # ppo_kl: sample-mean of the masked token mean of (old - new) = (rollout - current policy).
        kl = [
            ((old - reference_log_probs(model, s)) * torch.tensor(s.loss_mask)).sum() / sum(s.loss_mask)
            for s, old in zip(samples, rollout)
        ]
    assert metrics["train/loss"] == pytest.approx(float(expected_loss), rel=1e-5)
    assert metrics["train/ppo_kl"] == pytest.approx(float(sum(kl) / len(kl)), rel=1e-5)
    assert metrics["train/pg_clipfrac"] > 0  # random rollout log-probs are far from the policy's
    assert not any(name.startswith("train/logprob_abs_diff") for name in metrics)


# ---------------------------------------------------------------------------------------
# log-probs with images
# ---------------------------------------------------------------------------------------


def _job_log_probs(rank_info, ckpt_dir, samples, out, micro_batch_size):
    backend = make_backend(rank_info, ckpt_dir, train={"micro_batch_size": micro_batch_size})
    backend.init()
    log_probs = backend.compute_log_probs(samples)
    changed = [dataclasses.replace(s, multimodal_inputs=dict(s.multimodal_inputs)) for s in samples]
    for s in changed:
        if s.multimodal_inputs:
            s.multimodal_inputs["pixel_values"] = s.multimodal_inputs["pixel_values"].flip(0) + 0.5
    log_probs_changed = backend.compute_log_probs(changed)
    if rank_info.rank == 0:
        torch.save({"lp": log_probs, "changed": log_probs_changed}, out / "lp.pt")


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_log_probs_equal_plain_hf_forward_and_see_the_image(tiny_ckpt, tmp_path, micro_batch_size):
    samples = make_samples(tiny_ckpt, [5, 3, 6, 4], images=[True, False, True, False])
    spawn(_job_log_probs, tiny_ckpt, samples, tmp_path, micro_batch_size)
    result = torch.load(tmp_path / "lp.pt")

    model = hf_model(tiny_ckpt)
    with torch.no_grad():
        for sample, got, got_changed in zip(samples, result["lp"], result["changed"]):
            expected = reference_log_probs(model, sample)
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected, rtol=0, atol=2e-5)
            if sample.images:
                change = (torch.tensor(got_changed) - torch.tensor(got)).abs().max()
                assert change > 1e-3, "pixels must reach the policy"
            else:
                torch.testing.assert_close(torch.tensor(got_changed), torch.tensor(got))


def test_generated_image_placeholder_is_scored_without_breaking_the_forward(tiny_ckpt):
    from slime.backends.fsdp.backend import build_model_inputs, response_log_probs

    model = hf_model(tiny_ckpt).eval()
    sample = make_samples(tiny_ckpt, [6], images=[True])[0]
    k = 3
    sample.response_token_ids[k] = model.config.image_token_id  # a policy may sample any id
    with torch.no_grad():
        got, _ = response_log_probs(model, build_model_inputs([sample], model.config, "cpu"), TEMPERATURE)
        # Independent: response tokens 0..k are predicted from inputs before the placeholder.
        p = len(sample.prompt_token_ids)
        ids = torch.tensor([sample.prompt_token_ids + sample.response_token_ids[:k]])
        mm = dict(sample.multimodal_inputs, mm_token_type_ids=(ids == model.config.image_token_id).long())
        logits = model(input_ids=ids, **mm).logits[0, p - 1 : p + k]
        targets = torch.tensor(sample.response_token_ids[: k + 1])
        expected = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got[0, : k + 1].double(), expected, rtol=0, atol=2e-5)
    assert torch.isfinite(got).all()


# ---------------------------------------------------------------------------------------
# weight buckets for the engines
# ---------------------------------------------------------------------------------------


def _job_buckets(rank_info, ckpt_dir, out, sizes):
    backend = make_backend(rank_info, ckpt_dir)
    backend.init()
    for size in sizes:
        buckets = list(backend.iter_weight_buckets(size, device="cpu"))
        torch.save(buckets, out / f"buckets{size}_rank{rank_info.rank}.pt")


def test_weight_buckets_carry_checkpoint_names_and_tensors(tiny_ckpt, tmp_path):
    """Each rank yields the rounds it is the source of (round k: rank k % 2), in lockstep; the union is
    the checkpoint, each name once, every tensor equal to the safetensors on disk."""
    sizes = [1, 300_000, 1 << 30]
    spawn(_job_buckets, tiny_ckpt, tmp_path, sizes)

    on_disk = {}
    for file in Path(tiny_ckpt).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            on_disk.update({key: f.get_tensor(key) for key in f.keys()})
    counts = []
    for size in sizes:
        by_rank = [torch.load(tmp_path / f"buckets{size}_rank{rank}.pt") for rank in range(WORLD)]
        assert len(by_rank[0]) == len(by_rank[1]), "lockstep: every rank yields once per round"
        rounds = len(by_rank[0])
        for k in range(rounds):
            source = k % WORLD
            assert by_rank[source][k], f"round {k} at size {size} is empty on its source rank {source}"
            assert by_rank[1 - source][k] == [], f"round {k} at size {size} also yielded by rank {1 - source}"
        names = [name for buckets in by_rank for bucket in buckets for name, _ in bucket]
        assert sorted(names) == sorted(on_disk), f"bucket_bytes={size}"
        assert len(names) == len(set(names))
        for buckets in by_rank:
            for bucket in buckets:
                for name, tensor in bucket:
                    assert tensor.device.type == "cpu" and tensor.dtype == torch.float32
                    torch.testing.assert_close(tensor, on_disk[name], rtol=0, atol=0, msg=name)
        # A decoder layer (with all its experts) or a vision block never straddles two rounds.
        owner = {}
        for k in range(rounds):
            for name, _ in by_rank[k % WORLD][k]:
                if name.startswith(("model.language_model.layers.", "model.visual.blocks.")):
                    unit = ".".join(name.split(".")[:4])  # e.g. model.language_model.layers.3
                    assert owner.setdefault(unit, k) == k, f"{unit} split across rounds at size {size}"
        counts.append(rounds)
    # 4 decoder layers + 2 vision blocks + the root's parameters: one round each at 1 byte (so both
    # ranks are sources: 4 rounds on rank 0, 3 on rank 1); all in one round at 1 GiB.
    assert counts[0] == 7 and counts[-1] == 1 and counts[0] > counts[1] > 1


# ---------------------------------------------------------------------------------------
# save -> load
# ---------------------------------------------------------------------------------------


def _job_save_load(rank_info, ckpt_dir, samples, root):
    backend = make_backend(rank_info, ckpt_dir, optimizer={"lr_warmup_iters": 3})
    backend.init()
    train_step(backend, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    backend.save(0, ckpt.iteration_dir(root, 0))
    if rank_info.rank == 0:
        ckpt.mark_latest(root, 0)
    dist.barrier()
    after_save = {"params": full_params(backend.model), "lp": backend.compute_log_probs(samples)}

    resumed = make_backend(rank_info, ckpt_dir, optimizer={"lr_warmup_iters": 3}, checkpoint={"load": str(root)})
    next_id = resumed.init()
    for (name, p), (name2, q) in zip(backend.model.named_parameters(), resumed.model.named_parameters()):
        assert name == name2
        assert torch.equal(p.to_local(), q.to_local()), name
    original, loaded = backend.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert original["state"].keys() == loaded["state"].keys() and len(original["state"]) > 0
    for key, state in original["state"].items():
        for field, value in state.items():
            other = loaded["state"][key][field]
            local = value.to_local() if hasattr(value, "to_local") else value
            other_local = other.to_local() if hasattr(other, "to_local") else other
            assert torch.equal(local, other_local), (key, field)
    assert [g["lr"] for g in loaded["param_groups"]] == [g["lr"] for g in original["param_groups"]]
    assert resumed.optimizer_steps == backend.optimizer_steps == 1

    # Both continue identically (LR warm-up position, AdamW moments, weights).
    share = rank_share(samples[4:], rank_info.rank, 1)
    metrics_a = train_step(backend, 1, share, num_steps=1)
    metrics_b = train_step(resumed, 1, share, num_steps=1)
    assert without_timings(metrics_a) == without_timings(metrics_b)
    for p, q in zip(backend.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    if rank_info.rank == 0:
        torch.save({**after_save, "next_id": next_id, "lr1": metrics_a["train/lr"]}, root / "result.pt")


def test_save_then_load_restores_params_optimizer_and_lr(tiny_ckpt, tmp_path):
    from transformers import AutoModelForImageTextToText

    samples = make_samples(tiny_ckpt, [4, 3, 5, 2, 3, 4, 2, 5], images=[True, False] * 4)
    spawn(_job_save_load, tiny_ckpt, samples, tmp_path)
    result = torch.load(tmp_path / "result.pt")
    assert result["next_id"] == 1
    assert result["lr1"] == pytest.approx(1e-3 * 2 / 3)  # warm-up step 1 of 3

    model_dir = ckpt.model_dir(tmp_path, 0)
    side_files = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for name in (*side_files, "preprocessor_config.json", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (Path(tiny_ckpt) / name).read_bytes(), name
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    with safe_open(Path(tiny_ckpt) / "model.safetensors", "pt") as f:
        assert sorted(index["weight_map"]) == sorted(f.keys())
    loaded = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param.detach(), result["params"][name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        for sample, got in zip(samples, result["lp"]):
            torch.testing.assert_close(
                reference_log_probs(loaded, sample), torch.tensor(got, dtype=torch.float64), rtol=0, atol=2e-5
            )
    assert sorted(p.name for p in ckpt.trainer_dir(tmp_path, 0).iterdir()) == [
        "frozen_params.json",  # [] here: nothing frozen (tests/test_freeze.py)
        "optimizer",
        "rng_rank00000.pt",
        "rng_rank00001.pt",
        "scheduler.pt",
    ]


def _job_no_optim(rank_info, ckpt_dir, root, out):
    backend = make_backend(rank_info, ckpt_dir, checkpoint={"load": str(root)})
    try:
        backend.init()
    except ckpt.CheckpointError as e:
        if rank_info.rank == 0:
            (out / "error.txt").write_text(str(e))
    resumed = make_backend(rank_info, ckpt_dir, checkpoint={"load": str(root), "no_load_optim": True})
    assert resumed.init() == 1 and resumed.optimizer_steps == 0 and not resumed.optimizer.state


def _job_save_without_optim(rank_info, ckpt_dir, root):
    backend = make_backend(rank_info, ckpt_dir, checkpoint={"no_save_optim": True})
    backend.init()
    backend.save(0, ckpt.iteration_dir(root, 0))
    if rank_info.rank == 0:
        ckpt.mark_latest(root, 0)


def test_resume_without_saved_optimizer_needs_no_load_optim(tiny_ckpt, tmp_path):
    root = tmp_path / "ckpt"
    spawn(_job_save_without_optim, tiny_ckpt, root)
    assert not (ckpt.trainer_dir(root, 0) / "optimizer").exists()
    spawn(_job_no_optim, tiny_ckpt, root, tmp_path)
    message = (tmp_path / "error.txt").read_text()
    assert "optimizer" in message and "--no-load-optim" in message


# ---------------------------------------------------------------------------------------
# reference model
# ---------------------------------------------------------------------------------------


def _job_ref_model(rank_info, ckpt_dir, samples, out):
    cases = {
        "default": GRPOConfig(),
        "kl_loss": GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"),
        "kl_loss_zero_coef": GRPOConfig(use_kl_loss=True, kl_loss_coef=0.0),
        "kl_penalty": GRPOConfig(kl_coef=0.05),
    }
    found = {}
    for name, grpo in cases.items():
        backend = make_backend(rank_info, ckpt_dir, grpo=grpo)
        backend.init()
        metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, 1), num_steps=1)
        found[name] = {"has_ref": backend.ref_model is not None, "metrics": metrics}
    if rank_info.rank == 0:
        torch.save(found, out / "ref.pt")


def test_reference_model_exists_only_with_a_nonzero_kl_coefficient(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [3, 4, 2, 3], images=[True, False, False, True])
    spawn(_job_ref_model, tiny_ckpt, samples, tmp_path)
    found = torch.load(tmp_path / "ref.pt")
    assert {name: case["has_ref"] for name, case in found.items()} == {
        "default": False,
        "kl_loss": True,
        "kl_loss_zero_coef": False,
        "kl_penalty": True,
    }
    # Before the first update the policy equals the reference: KL 0, and the KL-shaped
    # advantages equal the plain ones (same loss as without the penalty).
    assert found["kl_loss"]["metrics"]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert "train/kl_loss" not in found["default"]["metrics"]
    plain_loss = found["default"]["metrics"]["train/loss"]
    assert found["kl_penalty"]["metrics"]["train/loss"] == pytest.approx(plain_loss, rel=1e-6)


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def _job_bad_samples(rank_info, ckpt_dir, samples, out):
    from slime.backends.samples import SampleError

    backend = make_backend(rank_info, ckpt_dir, train={"use_rollout_logprobs": True})
    backend.init()
    errors = {}
    no_rollout_lp = [dataclasses.replace(s, rollout_log_probs=[]) for s in samples]
    bad_mask = [dataclasses.replace(samples[0], loss_mask=[1]), *samples[1:]]
    for name, batch in (("no_rollout_lp", no_rollout_lp), ("bad_mask", bad_mask)):
        try:
            train_step(backend, 0, rank_share(batch, rank_info.rank, 1), num_steps=1)
        except SampleError as e:
            errors[name] = str(e)
    torch.save(errors, out / f"errors{rank_info.rank}.pt")


def test_malformed_samples_raise_naming_the_sample(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [3, 4, 2, 3], images=[False, True, False, True])
    spawn(_job_bad_samples, tiny_ckpt, samples, tmp_path)
    errors, errors_rank1 = (torch.load(tmp_path / f"errors{rank}.pt") for rank in range(WORLD))
    assert "rollout_log_probs" in errors["no_rollout_lp"] and "--use-rollout-logprobs" in errors["no_rollout_lp"]
    assert "sample 0" in errors["bad_mask"] and "loss_mask" in errors["bad_mask"]
    # Rank 1's samples were fine, but it stops too instead of waiting for rank 0 forever.
    assert "another trainer rank" in errors_rank1["bad_mask"]


def test_dynamic_batching_is_refused_when_built_directly(tiny_ckpt):
    # Megatron's flags never reach FSDPBackend (they live in MegatronConfig); the shared one it does not
    # implement is refused by the backend itself too, not only at parse time.
    from slime.utils.config import ConfigError

    train = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 1024}
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size"):
        make_backend(RankInfo(0, 1, "127.0.0.1", 0, "cpu"), tiny_ckpt, train=train)


def test_pad_per_token_right_pads():
    from slime.backends.fsdp.backend import pad_per_token

    out = pad_per_token([[1.0, 2.0], [], [3.0]], torch.float32, pad=-1)
    assert out.tolist() == [[1.0, 2.0], [-1.0, -1.0], [3.0, -1.0]]


def test_registry_resolves_fsdp_lazily():
    from slime.backends.fsdp.backend import FSDPBackend
    from slime.backends.registry import TRAIN_BACKENDS

    assert TRAIN_BACKENDS.get("fsdp") is FSDPBackend
    with pytest.raises(KeyError, match="fsdp"):
        TRAIN_BACKENDS.get("deepspeed")


# ---------------------------------------------------------------------------------------
# GPU: NCCL, bf16 mixed precision, offload / onload (skipped on CPU machines)
# ---------------------------------------------------------------------------------------


def _job_gpu(rank_info, ckpt_dir, samples, out):
    backend = make_backend(rank_info, ckpt_dir, train={"bf16": True})
    backend.init()
    log_probs = backend.compute_log_probs(samples)
    metrics = train_step(backend, 0, rank_share(samples, rank_info.rank, 1), num_steps=1)
    master_dtypes = {p.dtype for p in backend.model.parameters()}
    params = full_params(backend.model)

    def tensors():  # parameter shards and Adam moments (not Adam's scalar step count)
        moments = [v for state in backend.optimizer.state.values() for v in state.values() if v.dim() > 0]
        return list(backend.model.parameters()) + moments

    shard_bytes = sum(t.to_local().numel() * t.element_size() for t in tensors())
    on_gpu = torch.cuda.memory_allocated()
    backend.memory.offload()
    offloaded = torch.cuda.memory_allocated()
    devices_offloaded = {t.device.type for t in tensors()}
    backend.memory.onload()
    devices_onloaded = {t.device.type for t in tensors()}
    params_after = full_params(backend.model)
    assert all(torch.equal(params[name], params_after[name]) for name in params)
    # The optimizer still steps the model's own parameter objects, so training goes on.
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in backend.model.parameters()}
    metrics_after = train_step(backend, 1, rank_share(samples, rank_info.rank, 1), num_steps=1)
    trained = full_params(backend.model)
    assert not torch.equal(trained["lm_head.weight"], params_after["lm_head.weight"])
    buckets = [
        [(n, t.dtype, t.device.type) for n, t in bucket]
        for bucket in backend.iter_weight_buckets(1 << 20, device="cpu")
    ]
    torch.save(buckets, out / f"gpu_buckets{rank_info.rank}.pt")
    backend.save(0, ckpt.iteration_dir(out / "ckpt", 0))
    if rank_info.rank == 0:
        torch.save(
            dict(
                log_probs=log_probs,
                metrics=[metrics, metrics_after],
                master_dtypes=master_dtypes,
                memory=(on_gpu - offloaded, shard_bytes),
                devices=(devices_offloaded, devices_onloaded),
            ),
            out / "gpu.pt",
        )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_bf16_training_offload_and_weight_sync(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [5, 3, 6, 4], images=[True, False, True, False])
    spawn(_job_gpu, tiny_ckpt, samples, tmp_path, device="cuda")
    result = torch.load(tmp_path / "gpu.pt")

    model = hf_model(tiny_ckpt)
    with torch.no_grad():
        for sample, got in zip(samples, result["log_probs"]):
            # bf16 compute vs the float32 reference: log-probs agree to bf16 precision.
            expected = reference_log_probs(model, sample)
            assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max() < 0.1
    assert result["master_dtypes"] == {torch.float32}
    freed, shard_bytes = result["memory"]
    assert freed >= shard_bytes > 0, result["memory"]  # the shards and Adam moments left the GPU
    assert result["devices"] == ({"cpu"}, {"cuda"})
    for metrics in result["metrics"]:
        assert all(np.isfinite(v) for v in metrics.values()), metrics
    buckets = [bucket for rank in range(WORLD) for bucket in torch.load(tmp_path / f"gpu_buckets{rank}.pt")]
    with safe_open(Path(tiny_ckpt) / "model.safetensors", "pt") as f:
        assert sorted(name for bucket in buckets for name, _, _ in bucket) == sorted(f.keys())
    assert {(dtype, device) for bucket in buckets for _, dtype, device in bucket} == {(torch.bfloat16, "cpu")}
    loaded = hf_model(ckpt.model_dir(tmp_path / "ckpt", 0))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
