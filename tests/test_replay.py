"""Train-only replay of saved rollouts (--save-debug-rollout-data -> --load-debug-rollout-data), on CPU.

- A rollout saved by the rollout manager's writer and read back trains a fresh trainer from the same checkpoint to
  the same loss, gradient norm and weights as the original samples, bit for bit (torch.equal), on 2 FSDP ranks.
- Bad input is an error naming the file: a missing rollout id (the saved ids listed), another model's tokenizer,
  another batch shape, a file that is not a saved rollout; the flags' combinations are refused at parse time.
"""

from __future__ import annotations

import pytest
import torch

from slime.backends.step import train_step
from slime.rollout.replay import ReplayError, load_rollout, model_fingerprint, replay_path, save_rollout
from slime.utils.config import ConfigError
from slime.ray.config import RunModeConfig
from scripts.harness.spawn_ranks import spawn_ranks
from tests.helpers import GEO3K_DATA, full_params, make_backend, make_samples, rank_share

FINGERPRINT = {"model_type": "qwen3_5_moe", "vocab_size": 100, "vocab_sha256": "ab", "image_token_id": 7}


def _job(rank, ckpt_dir, original, replayed, out):
    from slime.backends.config import RankInfo

    info = RankInfo(rank, 2, "127.0.0.1", 0, "cpu")
    result = {}
    for key, samples in (("original", original), ("replayed", replayed)):
        backend = make_backend(info, ckpt_dir)
        backend.init()
        metrics = train_step(backend, 0, rank_share(samples, rank, 2), num_steps=2)
        result[key] = (metrics, full_params(backend.model))
        del backend
    torch.save(result, out / f"rank{rank}.pt")


def test_a_replayed_rollout_trains_to_the_same_step_bit_for_bit(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [5, 4, 3, 6, 4, 5, 2, 3], images=[True, False, True, True] * 2, seed=4)
    summary = tmp_path / "dumps" / "rollout_{rollout_id}.jsonl"
    save_rollout(replay_path(str(summary).format(rollout_id=0)), 0, samples, {"rollout/x": 1.0}, FINGERPRINT, 2)
    replayed, metrics, path = load_rollout(str(tmp_path / "dumps"), 0, fingerprint=FINGERPRINT,
                                           n_samples_per_prompt=2, num_samples=8)
    assert path == tmp_path / "dumps" / "rollout_0.pt" and metrics == {"rollout/x": 1.0}
    assert load_rollout(str(summary), 0, fingerprint=FINGERPRINT, n_samples_per_prompt=2, num_samples=8)[2] == path
    for a, b in zip(samples, replayed):
        assert a.response_token_ids == b.response_token_ids and a.loss_mask == b.loss_mask
        assert a.advantage == b.advantage and a.rollout_log_probs == b.rollout_log_probs and a.status == b.status
        assert a.multimodal_inputs.keys() == b.multimodal_inputs.keys()
        assert all(torch.equal(a.multimodal_inputs[k], b.multimodal_inputs[k]) for k in a.multimodal_inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spawn_ranks(_job, tiny_ckpt, samples, replayed, tmp_path, world_size=2)
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        (m_a, w_a), (m_b, w_b) = result["original"], result["replayed"]
        assert m_a["train/loss"] == m_b["train/loss"] and m_a["train/grad_norm"] == m_b["train/grad_norm"]
        assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[n], w_b[n]) for n in w_a)


def test_bad_saved_rollouts_are_errors_naming_the_file(tiny_ckpt, tmp_path):
    samples = make_samples(tiny_ckpt, [3, 2, 4, 2], images=[False] * 4)
    save_rollout(tmp_path / "rollout_3.pt", 3, samples, {}, FINGERPRINT, 2)
    kw = dict(fingerprint=FINGERPRINT, n_samples_per_prompt=2, num_samples=4)
    with pytest.raises(ReplayError, match=r"no saved rollout 4: .*rollout_4\.pt does not exist \(saved rollout ids "
                                          r"there: \[3\]\)"):
        load_rollout(str(tmp_path), 4, **kw)
    with pytest.raises(ReplayError, match=r"rollout_3\.pt was saved from another model or tokenizer .*vocab_sha256"):
        load_rollout(str(tmp_path), 3, **{**kw, "fingerprint": {**FINGERPRINT, "vocab_sha256": "cd"}})
    with pytest.raises(ReplayError, match=r"rollout_3\.pt holds 4 samples in groups of 2; this run's "
                                          r"--rollout-batch-size x --n-samples-per-prompt is 4 x 2"):
        load_rollout(str(tmp_path), 3, **{**kw, "num_samples": 8})
    (tmp_path / "rollout_5.pt").write_text("not torch")
    with pytest.raises(ReplayError, match=r"rollout_5\.pt is not a saved rollout"):
        load_rollout(str(tmp_path), 5, **kw)
    literal = tmp_path / "rollout_3.jsonl"  # no {rollout_id}: the same file for every step (upstream)
    assert len(load_rollout(str(literal), 9, **kw)[0]) == 4


def test_the_fingerprint_tells_tokenizers_apart(tiny_ckpt):
    from slime.data.processor import load_processor

    tokenizer = load_processor(tiny_ckpt).tokenizer
    one = model_fingerprint(tokenizer, {"model_type": "m"})
    tokenizer.add_tokens(["<brand_new_token>"])
    other = model_fingerprint(tokenizer, {"model_type": "m"})
    assert one["vocab_size"] + 1 == other["vocab_size"] and one["vocab_sha256"] != other["vocab_sha256"]


def test_debug_flags_are_checked_at_parse_time():
    assert RunModeConfig(load_debug_rollout_data="/d").debug_train_only  # implied, as upstream
    with pytest.raises(ConfigError, match="--debug-train-only needs --load-debug-rollout-data"):
        RunModeConfig(debug_train_only=True)
    with pytest.raises(ConfigError, match="--debug-rollout-only cannot go with"):
        RunModeConfig(load_debug_rollout_data="/d", debug_rollout_only=True)
    with pytest.raises(ConfigError, match="--save-debug-rollout-data .*JSONL"):
        RunModeConfig(save_debug_rollout_data="/d/r_{rollout_id}.pt")


@pytest.mark.slow
def test_the_driver_replays_a_saved_rollout_without_engines(tiny_ckpt, tmp_path, monkeypatch,
                                                            driver_joins_local_ray):
    """One rollout through the driver (transformers engine, 2 FSDP ranks) saved; the same flags with
    --load-debug-rollout-data start no engine and reach the same loss, gradient norm and saved weights; with
    --debug-rollout-only no trainer starts and the same rollout is generated and saved again.  Slow (about 30 s on
    2 cores): three driver runs, each starting its actors on one Ray instance (``driver_joins_local_ray``)."""
    from safetensors.torch import load_file

    from slime import driver
    from slime.arguments import parse_args
    from slime.utils.metrics import read_metrics

    def run(name, *extra):
        cfg = parse_args([
            "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(GEO3K_DATA), "--input-key", "problem",
            "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "6", "--micro-batch-size", "1", "--skip-eval-before-train",
            "--custom-rm-path", "tests.rewards:odd_length_reward", "--lr", "1e-4", "--train-backend", "fsdp",
            "--rollout-backend", "transformers", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
            "--save", str(tmp_path / name / "ckpt"), "--output-dir", str(tmp_path / name / "run"),
            "--no-progress-bar", *extra])  # fmt: skip
        return read_metrics(driver.train(cfg) / "metrics.jsonl")

    original = run("original", "--save-debug-rollout-data", str(tmp_path / "dumps" / "rollout_{rollout_id}.jsonl"))
    class NoEngines:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a replay started a rollout engine")

    monkeypatch.setattr(driver, "RolloutEngineGroup", NoEngines)
    replayed = run("replayed", "--load-debug-rollout-data", str(tmp_path / "dumps"))
    monkeypatch.undo()

    class NoTrainers:
        def __init__(self, *args, **kwargs):
            raise AssertionError("--debug-rollout-only started a trainer")

    monkeypatch.setattr(driver, "TrainerGroup", NoTrainers)
    rollout_only = run("rollout_only", "--debug-rollout-only",
                       "--save-debug-rollout-data", str(tmp_path / "dumps2" / "rollout_{rollout_id}.jsonl"))
    assert not any(k.startswith("train/") for k in rollout_only[-1])
    assert not list((tmp_path / "rollout_only" / "ckpt").glob("iter_*"))
    assert (tmp_path / "dumps" / "rollout_0.jsonl").read_text() == (tmp_path / "dumps2" / "rollout_0.jsonl").read_text()
    step_a, step_b = original[-1], replayed[-1]
    assert step_b["rollout/replayed"] == 1.0 and "perf/sync_time_s" not in step_b
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert step_a[key] == step_b[key], key
    weights = [load_file(next((tmp_path / name / "ckpt").glob("iter_*/model/*.safetensors")))
               for name in ("original", "replayed")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def test_flags_that_would_do_nothing_in_a_replay_or_a_save_are_refused(caplog):
    with pytest.raises(ConfigError, match="--debug-rollout-only cannot go with --debug-train-only"):
        RunModeConfig(debug_train_only=True, debug_rollout_only=True)
    with pytest.raises(ConfigError, match="--load-debug-rollout-data generates none .*drop --save-debug-rollout-data"):
        RunModeConfig(load_debug_rollout_data="/d", save_debug_rollout_data="/e/r_{rollout_id}.jsonl")
    with pytest.raises(ConfigError, match=r"\{rollout_id\} is in the file's suffix"):
        RunModeConfig(save_debug_rollout_data="/d/run.{rollout_id}")
    with caplog.at_level("WARNING"):
        RunModeConfig(save_debug_rollout_data="/d/r.jsonl")
    assert "has no {rollout_id}: every rollout overwrites" in caplog.text


def test_missing_saved_rollouts_are_named_before_anything_starts(tiny_ckpt, tmp_path):
    from slime.rollout.replay import check_saved_rollouts

    samples = make_samples(tiny_ckpt, [3, 2], images=[False] * 2)
    for k in (0, 1, 2):
        save_rollout(tmp_path / f"rollout_{k}.pt", k, samples, {}, FINGERPRINT, 2)
    check_saved_rollouts(str(tmp_path), range(0, 3))
    check_saved_rollouts(str(tmp_path / "rollout_{rollout_id}.jsonl"), range(1, 3))
    with pytest.raises(ReplayError, match=r"replays rollouts 1 to 4, and 2 are not saved \(3, 4: .*rollout_3\.pt does "
                                          r"not exist\); saved rollout ids there: \[0, 1, 2\]"):
        check_saved_rollouts(str(tmp_path), range(1, 5))
    with pytest.raises(ReplayError, match="/no/such/dir: no such folder"):
        check_saved_rollouts("/no/such/dir", range(0, 1))


def test_a_replay_with_r3_refuses_rollouts_saved_without_routes(tiny_ckpt, tmp_path):
    from types import SimpleNamespace

    from slime.rollout.manager import RolloutManager

    samples = make_samples(tiny_ckpt, [3, 2], images=[False] * 2)
    save_rollout(tmp_path / "rollout_0.pt", 0, samples, {}, FINGERPRINT, 2)
    manager = RolloutManager.__new__(RolloutManager)  # only what _replay reads
    manager.replay_from, manager.fingerprint, manager.replay_needs_routes = str(tmp_path), FINGERPRINT, True
    manager.cfg = SimpleNamespace(n_samples_per_prompt=2, samples_per_rollout=2)
    with pytest.raises(ReplayError, match=r"rollout_0\.pt was saved without the engine's routed experts \(2 of 2 "
                                          r"samples, first: dataset index"):
        manager.generate(0)
    manager.replay_needs_routes = False
    assert manager.generate(0).metrics["rollout/replayed"] == 1.0
