"""--train-backend megatron on CPU: the backend itself (megatron-core's forward/backward step and gradient
finalisation, fp32 torch kernels, 2 data-parallel ranks over gloo) against independent references.

- The FSDP backend on the same tiny checkpoint and samples (itself tested against the plain Hugging
  Face model and a hand-written GRPO loss in ``test_fsdp_backend.py``): log-probs, first-step metrics,
  the log-prob gap, and the weights after two AdamW steps with clipping.
- Packed micro-batches (``--use-dynamic-batch-size``) against one sample per micro-batch.
- Weight export: the union over ranks is the Hugging Face checkpoint, names and values, each once.
- Checkpoints: save, train on, and a resume from the saved folder reaches the same weights bit for bit;
  the same folder resumes at another data-parallel size; ``--save-hf`` loads in transformers.

Each test spawns its ranks (:mod:`scripts.harness.spawn_ranks`); the ranks write what they computed to ``tmp_path``
and the test process compares.  What runs only on a GPU (megatron-core's DDP, distributed optimizer,
pipeline schedules, TP / EP) is in ``tests/test_megatron_gpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from slime.backends.step import micro_batches, train_step  # noqa: E402
from slime.checkpoints import layout as ckpt  # noqa: E402
from slime.grpo.config import GRPOConfig  # noqa: E402
from slime.weight_sync.base import check_weight_sources  # noqa: E402
from tests.helpers import (  # noqa: E402
    IMAGES, LENS, WORLD, exported, hf_model, make_backend, make_megatron, make_samples, rank_share,
    reference_log_probs, spawn, without_timings,
)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# against the FSDP backend; packed == one sample per micro-batch; the export contract
# ---------------------------------------------------------------------------------------

# adam_eps 1e-4 and clipping below every step's norm, as in test_fsdp_backend (see its comment on eps)
OPTIM = {"clip_grad": 0.5, "adam_eps": 1e-4}


SKIP = {"skip_actor_forward_only": True}
"""--skip-actor-forward-only: the first step's old log-probs from its training forward."""


def _count_passes(backend) -> list:
    """A list that gets one entry per forward-only pass of ``backend`` (its ``log_probs``) from now on."""
    calls, log_probs = [], backend.log_probs
    backend.log_probs = lambda *args, **kwargs: calls.append(1) or log_probs(*args, **kwargs)
    return calls


def _job_against_fsdp(rank_info, ckpt_dir, samples, out):
    share = rank_share(samples, rank_info.rank, num_steps=2)
    result = {}
    fsdp = make_backend(rank_info, ckpt_dir, optimizer=OPTIM)
    fsdp.init()
    result["fsdp_lp"] = fsdp.compute_log_probs(samples)
    result["fsdp_first"] = train_step(fsdp, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    result["fsdp_first_weights"] = exported(fsdp)[1]
    fsdp = make_backend(rank_info, ckpt_dir, optimizer=OPTIM, train=SKIP)
    fsdp.init()
    result["fsdp_skip_passes"] = _count_passes(fsdp)
    result["fsdp_skip"] = train_step(fsdp, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    result["fsdp_skip_weights"] = exported(fsdp)[1]
    fsdp = make_backend(rank_info, ckpt_dir, optimizer=OPTIM)
    fsdp.init()
    result["fsdp_metrics"] = train_step(fsdp, 0, share, num_steps=2)
    result["fsdp_weights"] = exported(fsdp)[1]
    del fsdp

    megatron = make_megatron(rank_info, ckpt_dir, optimizer=OPTIM)
    megatron.init()
    result["init_buckets"], result["init_weights"] = exported(megatron)
    result["lp"] = megatron.compute_log_probs(samples)
    result["first"] = train_step(megatron, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    result["first_weights"] = exported(megatron)[1]
    megatron = make_megatron(rank_info, ckpt_dir, optimizer=OPTIM,  # packed: two samples' log-probs in one batch
                             train={**SKIP, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 200})
    megatron.init()
    result["skip_passes"] = _count_passes(megatron)
    result["skip"] = train_step(megatron, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    result["skip_micro_batches"] = result["skip"]["train/micro_batches"]
    result["skip_weights"] = exported(megatron)[1]
    megatron = make_megatron(rank_info, ckpt_dir, optimizer=OPTIM)
    megatron.init()
    result["metrics"] = train_step(megatron, 0, share, num_steps=2)
    result["weights"] = exported(megatron)[1]

    packed = make_megatron(rank_info, ckpt_dir, optimizer=OPTIM,
                           train={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 200})
    packed.init()
    result["packed_metrics"] = train_step(packed, 0, share, num_steps=2)
    result["packed_weights"] = exported(packed)[1]
    torch.save(result, out / f"rank{rank_info.rank}.pt")


@pytest.fixture(scope="module")
def against_fsdp(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("against_fsdp")
    samples = make_samples(tiny_ckpt, LENS, images=IMAGES)
    spawn(_job_against_fsdp, tiny_ckpt, samples, out)
    return samples, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_log_probs_and_first_step_match_fsdp(against_fsdp):
    samples, ranks = against_fsdp
    r0 = ranks[0]
    assert ranks[1]["lp"] == r0["lp"]  # every rank returns the same lists
    for sample, got, want in zip(samples, r0["lp"], r0["fsdp_lp"]):
        assert len(got) == sample.response_length
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=2e-5)
    first, fsdp = r0["first"], r0["fsdp_first"]
    assert without_timings(ranks[1]["first"]) == without_timings(first)  # reduced: identical on every rank
    assert first["train/ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # old log-probs from the same weights
    assert first["train/pg_clipfrac"] == 0.0
    for name in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/lr",
                 "train/logprob_abs_diff", "train/logprob_abs_diff_image", "train/logprob_abs_diff_text"):
        assert first[name] == pytest.approx(fsdp[name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_the_first_step_without_its_old_log_prob_pass_is_the_same_step(against_fsdp, backend):
    # --skip-actor-forward-only: the loss takes the training forward's own log-probs (ratio exactly 1), and the
    # monitor compares them with the rollout's; the same step as with the pass (whose old log-probs are the same
    # weights'), to float32 rounding, packed (Megatron: several samples a micro-batch) or not.
    _, ranks = against_fsdp
    prefix = "fsdp_" if backend == "fsdp" else ""
    with_pass, skipped = ranks[0][f"{prefix}first"], ranks[0][f"{prefix}skip"]
    assert without_timings(ranks[1][f"{prefix}skip"]) == without_timings(skipped)
    assert skipped["train/ppo_kl"] == 0.0 and skipped["train/pg_clipfrac"] == 0.0
    assert ranks[0][f"{prefix}skip_passes"] == [] and "perf/train_ref_log_probs_s" not in skipped  # no pass ran
    for name in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/logprob_abs_diff",
                 "train/logprob_abs_diff_image", "train/logprob_abs_diff_text", "train/logprob_k3_kl"):
        assert skipped[name] == pytest.approx(with_pass[name], rel=1e-5, abs=1e-7), name
    if backend == "megatron":
        assert ranks[0]["skip_micro_batches"] < with_pass["train/micro_batches"]  # it did pack
    want = {**ranks[0][f"{prefix}first_weights"], **ranks[1][f"{prefix}first_weights"]}
    got = {**ranks[0][f"{prefix}skip_weights"], **ranks[1][f"{prefix}skip_weights"]}
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_two_adamw_steps_match_fsdp(against_fsdp):
    _, ranks = against_fsdp
    r0 = ranks[0]
    # ppo_kl after an update is a mean difference of log-probs of magnitude ~5 (float32 rounding ~1e-6)
    for name in ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm"):
        assert r0["metrics"][name] == pytest.approx(r0["fsdp_metrics"][name], rel=1e-5, abs=1e-6), name
    assert r0["metrics"]["train/grad_norm"] > OPTIM["clip_grad"]  # clipping was exercised
    megatron = {**ranks[0]["weights"], **ranks[1]["weights"]}
    fsdp = {**ranks[0]["fsdp_weights"], **ranks[1]["fsdp_weights"]}
    assert megatron.keys() == fsdp.keys()
    for name, want in fsdp.items():
        torch.testing.assert_close(megatron[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_micro_batches_equal_one_sample_each(against_fsdp):
    _, ranks = against_fsdp
    r0 = ranks[0]
    assert r0["packed_metrics"]["train/micro_batches"] < r0["metrics"]["train/micro_batches"]  # it did pack
    # each step's micro-batches timed inside the forward-backward sub-phase (the figures are step means)
    m = r0["metrics"]
    assert 0 < m["perf/micro_batch_first_s"] <= m["perf/micro_batch_max_s"]
    assert 0 < m["perf/micro_batch_median_s"] <= m["perf/micro_batch_max_s"] < m["perf/train_forward_backward_s"]
    assert m["perf/micro_batch_first_quarter_tokens_per_s"] > 0 and m["perf/micro_batch_rest_tokens_per_s"] > 0
    for name in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/grad_norm", "train/entropy"):
        assert r0["packed_metrics"][name] == pytest.approx(r0["metrics"][name], rel=1e-5, abs=1e-6), name
    packed = {**ranks[0]["packed_weights"], **ranks[1]["packed_weights"]}
    alone = {**ranks[0]["weights"], **ranks[1]["weights"]}
    for name, want in alone.items():
        torch.testing.assert_close(packed[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_weight_export_is_the_checkpoint_each_name_once_in_lockstep(against_fsdp, tiny_ckpt):
    _, ranks = against_fsdp
    reference = load_file(tiny_ckpt / "model.safetensors")
    names = [[n for bucket in r["init_buckets"] for n in bucket] for r in ranks]
    sources = check_weight_sources(names)  # raises if a name came from two ranks
    assert sources.keys() == reference.keys()
    assert len(ranks[0]["init_buckets"]) == len(ranks[1]["init_buckets"]) > 1  # lockstep rounds
    merged = {**ranks[0]["init_weights"], **ranks[1]["init_weights"]}
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name
    # Buckets hold whole layers: a decoder layer's tensors never straddle two buckets.
    layer_of = {}
    for k, bucket in enumerate(ranks[0]["init_buckets"]):
        for n in bucket:
            if ".layers." in n:
                layer_of.setdefault(n.split(".layers.")[1].split(".")[0], set()).add(k)
    assert all(len(buckets) == 1 for buckets in layer_of.values()), layer_of


# ---------------------------------------------------------------------------------------
# routing replay in compute_log_probs (the engine parity check's trainer side)
# ---------------------------------------------------------------------------------------


def _with_routes(samples, routes):
    import dataclasses

    return [dataclasses.replace(s, rollout_routed_experts=r) for s, r in zip(samples, routes)]


def _job_replay(rank_info, ckpt_dir, samples, own, other, out):
    from slime.backends.samples import SampleError

    result = {}
    fsdp = make_backend(rank_info, ckpt_dir, train={"micro_batch_size": 4})  # padded rows of several samples
    fsdp.init()
    result["fsdp_plain"] = fsdp.compute_log_probs(samples)
    result["fsdp_own"] = fsdp.compute_log_probs(_with_routes(samples, own), replay_routes=True)
    result["fsdp_other"] = fsdp.compute_log_probs(_with_routes(samples, other), replay_routes=True)
    result["fsdp_other_noisy"] = fsdp.compute_log_probs(_with_routes(samples, other), replay_routes=True,
                                                        rounding_noise=True)
    del fsdp
    megatron = make_megatron(rank_info, ckpt_dir, train={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 200})
    megatron.init()
    result["plain"] = megatron.compute_log_probs(samples)
    result["own"] = megatron.compute_log_probs(_with_routes(samples, own), replay_routes=True)
    result["other"] = megatron.compute_log_probs(_with_routes(samples, other), replay_routes=True)
    result["micro_batches"] = len(micro_batches(megatron, samples, range(len(samples)), engine_routes=False,
                                                dp_group=None))
    short = _with_routes(samples, [r[:-1] for r in other])
    try:
        megatron.compute_log_probs(short, replay_routes=True)
    except SampleError as e:
        result["short_error"] = str(e)
    try:
        megatron.compute_log_probs(samples, replay_routes=True)
    except SampleError as e:
        result["missing_error"] = str(e)
    torch.save(result, out / f"rank{rank_info.rank}.pt")


@pytest.fixture(scope="module")
def replay(tiny_ckpt, tmp_path_factory):
    """The samples' own routes (the HF model's choice over prompt + response, every choice at least 1e-4 away from
    a tie, so the native model chooses the same) and random other routes, replayed by both backends."""
    from qwen35_helpers import own_and_random_routes
    from transformers import Qwen3_5MoeForConditionalGeneration

    out = tmp_path_factory.mktemp("replay")
    samples = make_samples(tiny_ckpt, LENS, images=IMAGES)
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    own, other = own_and_random_routes(hf, samples, seed=0)
    spawn(_job_replay, tiny_ckpt, samples, own, other, out, world=1)
    return samples, torch.load(out / "rank0.pt")


def test_replaying_the_models_own_routes_changes_no_log_prob(replay):
    _, r = replay
    assert r["fsdp_own"] == r["fsdp_plain"]  # bit for bit (the HF router's own arithmetic)
    torch.testing.assert_close(torch.tensor(sum(r["own"], [])), torch.tensor(sum(r["plain"], [])), rtol=0, atol=1e-6)
    assert r["micro_batches"] < len(LENS)  # the routes were laid out on packed micro-batches


def test_both_backends_replay_other_routes_alike_and_not_as_their_own(replay):
    samples, r = replay
    for sample, got, want, plain in zip(samples, r["other"], r["fsdp_other"], r["fsdp_plain"]):
        assert len(got) == sample.response_length
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=2e-5)
    gap = (torch.tensor(sum(r["fsdp_other"], [])) - torch.tensor(sum(r["fsdp_plain"], []))).abs().mean()
    assert gap > 1e-2  # other routes move the log-probs far beyond rounding
    noise = (torch.tensor(sum(r["fsdp_other_noisy"], [])) - torch.tensor(sum(r["fsdp_other"], []))).abs().max()
    assert 0 < noise < 1e-4  # one fp32 rounding step with the routes held: rounding only


def test_replay_refuses_samples_without_routes_or_with_routes_of_another_length(replay):
    samples, r = replay
    s = samples[0]
    n = len(s.prompt_token_ids) + s.response_length - 1
    assert r["short_error"] == (f"sample 0 (group 0): routed experts are uint8 [{n - 1}, 4, 2], expected uint8 "
                                f"[{n}, 4, 2] (prompt {len(s.prompt_token_ids)} + response {s.response_length} - 1 "
                                "positions, 4 layers, top-2)")
    assert r["missing_error"].startswith("sample 0 (group 0) has no rollout_routed_experts to replay")


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------


def _job_save_resume(rank_info, ckpt_dir, samples, root):
    save = root / "ckpt"
    hf_out = root / "hf_{rollout_id}"
    megatron_cfg = {"save_hf": str(hf_out)}
    first = make_megatron(rank_info, ckpt_dir, megatron=megatron_cfg, checkpoint={"save": str(save)})
    assert first.init() == 0
    train_step(first, 0, rank_share(samples[:4], rank_info.rank, 1), num_steps=1)
    first.save(0, ckpt.iteration_dir(save, 0))
    saved = exported(first)[1]
    if rank_info.rank == 0:
        torch.save({"rollout_id": 0}, ckpt.rollout_state_path(save, 0))
        ckpt.mark_latest(save, 0)
    torch.distributed.barrier()
    # Rollout 1 with an RNG draw in between, so that a missing RNG restore would show.
    torch.rand(3)
    metrics_a = train_step(first, 1, rank_share(samples[4:], rank_info.rank, 1), num_steps=1)
    after_a = exported(first)[1]

    second = make_megatron(rank_info, ckpt_dir, checkpoint={"load": str(save), "hf_checkpoint": str(ckpt_dir)})
    assert second.init() == 1
    loaded = exported(second)[1]
    torch.rand(3)
    metrics_b = train_step(second, 1, rank_share(samples[4:], rank_info.rank, 1), num_steps=1)
    after_b = exported(second)[1]
    fresh = make_megatron(rank_info, ckpt_dir, checkpoint={"load": str(save), "no_load_optim": True})
    assert fresh.init() == 1
    fresh_weights, fresh_steps = exported(fresh)[1], fresh.optimizer_steps
    # Upstream's --load <hf dir>: a Hugging Face folder (here the --save-hf export) is a fresh start from its weights.
    from_hf = make_megatron(rank_info, ckpt_dir, checkpoint={"load": str(root / "hf_0")})
    assert from_hf.init() == 0
    hf_weights = exported(from_hf)[1]

    # A KL term builds a reference model: the initial weights by default, a slime checkpoint with --ref-load.
    kl = GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1)
    step = rank_share(samples[:4], rank_info.rank, 1)
    kl_initial = make_megatron(rank_info, ckpt_dir, grpo=kl)
    kl_initial.init()
    kl_saved = make_megatron(rank_info, ckpt_dir, grpo=kl, checkpoint={"ref_load": str(save)})
    kl_saved.init()
    kl_metrics = (train_step(kl_initial, 0, step, num_steps=1), train_step(kl_saved, 0, step, num_steps=1))
    torch.save(dict(saved=saved, loaded=loaded, after_a=after_a, after_b=after_b, metrics_a=metrics_a,
                    metrics_b=metrics_b, fresh_weights=fresh_weights, fresh_steps=fresh_steps, hf_weights=hf_weights,
                    kl_metrics=kl_metrics, no_ref=first.ref_model is None), root / f"rank{rank_info.rank}.pt")


def _job_resume_one_rank(rank_info, ckpt_dir, root):
    backend = make_megatron(rank_info, ckpt_dir, checkpoint={"load": str(root / "ckpt")})
    assert backend.init() == 1
    torch.save({"loaded": exported(backend)[1], "steps": backend.optimizer_steps}, root / "one_rank.pt")


@pytest.fixture(scope="module")
def save_resume(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("save_resume")
    samples = make_samples(tiny_ckpt, LENS, images=IMAGES, seed=1)
    spawn(_job_save_resume, tiny_ckpt, samples, root)
    return root, [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]


def test_resume_from_a_saved_checkpoint_is_exact(save_resume):
    _, ranks = save_resume
    for r in ranks:
        for name, tensor in r["saved"].items():
            assert torch.equal(r["loaded"][name], tensor), name
        for name, tensor in r["after_a"].items():
            assert torch.equal(r["after_b"][name], tensor), name  # AdamW moments and step count restored
        assert without_timings(r["metrics_a"]) == without_timings(r["metrics_b"])


def test_no_load_optim_resumes_the_weights_with_a_fresh_adam(save_resume):
    _, ranks = save_resume
    for r in ranks:
        assert r["fresh_steps"] == 0
        for name, tensor in r["saved"].items():
            assert torch.equal(r["fresh_weights"][name], tensor), name


def test_load_of_a_hugging_face_folder_starts_from_its_weights(save_resume):
    _, ranks = save_resume
    for r in ranks:
        for name, tensor in r["saved"].items():
            assert torch.equal(r["hf_weights"][name], tensor), name


def test_reference_model_only_with_a_kl_term_from_initial_weights_or_ref_load(save_resume):
    _, ranks = save_resume
    initial, saved = ranks[0]["kl_metrics"]
    assert ranks[0]["no_ref"]  # no KL coefficient: no reference model
    assert initial["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # reference = the policy's own weights
    assert saved["train/kl_loss"] > 1e-4  # reference = the checkpoint after one AdamW step at lr 1e-3
    assert saved["train/loss"] == pytest.approx(saved["train/pg_loss"] + 0.1 * saved["train/kl_loss"], rel=1e-5)


def test_checkpoint_layout_holds_hf_named_model_and_adam_state(save_resume, tiny_ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    from slime.backends.megatron.config import MegatronConfig

    root, _ = save_resume
    iteration = ckpt.iteration_dir(root / "ckpt", 0)
    ckpt.check_complete(root / "ckpt", 0, MegatronConfig().checkpoint_parts())
    keys = set(FileSystemReader(str(iteration / "trainer" / "state")).read_metadata().state_dict_metadata)
    names = set(load_file(tiny_ckpt / "model.safetensors"))
    assert keys == {f"{kind}/{n}" for kind in ("param", "exp_avg", "exp_avg_sq") for n in names}
    assert {p.name for p in (iteration / "trainer").glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    assert torch.load(iteration / "trainer" / "scheduler.pt") == {"optimizer_steps": 1}
    assert json.loads((iteration / "trainer" / "layout.json").read_text())["data_parallel_size"] == WORLD


def test_save_hf_folder_loads_in_transformers(save_resume):
    from transformers import AutoModelForImageTextToText

    root, ranks = save_resume
    folder = root / "hf_0"
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    on_disk = {}
    for file in folder.glob("*.safetensors"):
        on_disk.update(load_file(file))
    saved = {**ranks[0]["saved"], **ranks[1]["saved"]}
    assert on_disk.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(on_disk[name], tensor), name
    assert model.lm_head.weight.shape[0] == model.config.text_config.vocab_size


def test_checkpoint_resumes_at_another_data_parallel_size(save_resume, tiny_ckpt):
    root, ranks = save_resume
    spawn(_job_resume_one_rank, tiny_ckpt, root, world=1)
    result = torch.load(root / "one_rank.pt")
    assert result["steps"] == 1
    saved = {**ranks[0]["saved"], **ranks[1]["saved"]}
    assert result["loaded"].keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(result["loaded"][name], tensor), name


# ---------------------------------------------------------------------------------------
# --use-tis: one step of each backend
# ---------------------------------------------------------------------------------------


def _job_tis(rank_info, ckpt_dir, samples, out):
    grpo = GRPOConfig(use_tis=True)
    result = {}
    for name, make in (("fsdp", make_backend), ("megatron", make_megatron)):
        backend = make(rank_info, ckpt_dir, grpo=grpo)
        backend.init()
        result[name] = train_step(backend, 0, rank_share(samples, rank_info.rank, 1), num_steps=1)
        del backend
    torch.save(result, out / f"rank{rank_info.rank}.pt")


def test_both_backends_run_a_step_with_tis(tiny_ckpt, tmp_path):
    # The engine's log-probs are the policy's plus a known gap g_t, so the first step's IS weight is
    # clamp(exp(-g_t), 0, 2) (the trainer's old log-probs are the policy's) and, with the PPO ratio 1, the
    # loss is the sample mean of sum_t m_t w_t (-A_s) / n_s.

    samples = make_samples(tiny_ckpt, [5, 3, 4, 6], images=[True, False, False, True], seed=3)
    gen = torch.Generator().manual_seed(0)
    model = hf_model(tiny_ckpt)
    weights = []
    with torch.no_grad():
        for s in samples:
            gap = torch.empty(s.response_length, dtype=torch.float64).uniform_(-1.2, 1.2, generator=gen)
            s.rollout_log_probs = (reference_log_probs(model, s) + gap).tolist()
            weights.append((-gap).exp().clamp(0, 2))
    masks = [torch.tensor(s.loss_mask, dtype=torch.float64) for s in samples]
    on = torch.cat([w[m.bool()] for w, m in zip(weights, masks)])
    expected = {
        "train/loss": sum(-s.advantage * (w * m).sum() / m.sum() for s, w, m in zip(samples, weights, masks)) / 4,
        "train/tis_weight_mean": sum((w * m).sum() / m.sum() for w, m in zip(weights, masks)) / 4,
        "train/tis_weight_min": on.min(),
        "train/tis_weight_max": on.max(),
        "train/tis_clipfrac": sum(((w == 2) * m).sum() / m.sum() for w, m in zip(weights, masks)) / 4,
    }
    assert 0 < expected["train/tis_clipfrac"] < 1  # some weights truncated, not all
    spawn(_job_tis, tiny_ckpt, samples, tmp_path)
    for rank in range(WORLD):
        metrics = torch.load(tmp_path / f"rank{rank}.pt")
        for backend in ("fsdp", "megatron"):
            for key, value in expected.items():
                assert metrics[backend][key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), (backend, key)
