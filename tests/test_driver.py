"""Driver helpers without Ray: schedules, resume bookkeeping, batch split, start-up errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slime.data.sample import Sample
from slime.driver import _due, _logged_before, _resolve_num_rollout, resolve_components
from slime.ray.trainer_group import TrainerGroup
from slime.train import EXIT_NOT_STARTED, main
from slime.utils.config import ConfigError
from tests.helpers import GEO3K_DATA, geo3k_cfg

@pytest.mark.parametrize(
    "rollout_id, interval, num_rollout, due",
    [(0, 2, 10, False), (1, 2, 10, True), (3, 2, 10, True), (4, 3, 10, False), (9, 4, 10, True), (2, None, 3, True), (1, None, 3, False)],
)
def test_periodic_actions_run_every_interval_and_after_the_last_step(rollout_id, interval, num_rollout, due):
    assert _due(rollout_id, interval, num_rollout) is due


def test_resume_keeps_rollout_records_before_start_and_eval_records_up_to_it():
    # Resuming at rollout 3: rollouts 0..2 were trained, and the eval after rollout 2 is step 3.
    assert _logged_before({"step": 2, "rollout/reward_mean": 0.1}, 3)
    assert not _logged_before({"step": 3, "rollout/reward_mean": 0.1}, 3)
    assert _logged_before({"step": 3, "eval/geo3k/accuracy": 0.5}, 3)
    assert not _logged_before({"step": 4, "eval/geo3k/accuracy": 0.5}, 3)
    assert _logged_before({"step": 0, "eval/geo3k/accuracy": 0.5}, 3)  # the eval before training


def test_num_epoch_becomes_num_rollout_from_the_row_count(tiny_ckpt):
    cfg = geo3k_cfg(tiny_ckpt, "--num-epoch", "2", "--rollout-backend", "transformers", "--train-backend", "fsdp")
    _resolve_num_rollout(cfg)
    assert cfg.rollout.num_rollout == 2 * 64 // 5  # the bundled sample has 64 train rows


def test_unimportable_backend_names_the_flag(tiny_ckpt):
    # The module exists (so parsing accepts it), the class does not: found when the driver imports it,
    # before anything starts.
    cfg = geo3k_cfg(tiny_ckpt, "--num-rollout", "1", "--rollout-backend", "transformers",
               "--train-backend", "slime.backends.fsdp.backend:NoSuchTrainer")
    message = "--train-backend slime.backends.fsdp.backend:NoSuchTrainer: cannot be imported"
    with pytest.raises(ConfigError, match=message):
        resolve_components(cfg)


def test_check_only_validates_and_exits_without_reading_the_checkpoint(tmp_path, capsys):
    # A checkpoint folder that does not exist yet (the launcher checks before downloading).
    argv = ["--hf-checkpoint", str(tmp_path / "not-downloaded"), "--prompt-data", str(tmp_path / "nope.parquet"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp"]
    main([*argv, "--rollout-backend", "transformers", "--check-only"])
    assert capsys.readouterr().out.strip() == "slime: flags OK (engine TransformersEngine, trainer FSDPBackend)"
    if importlib.util.find_spec("sglang") is None:
        missing = ("slime: error: --rollout-backend sglang cannot run here: it needs sglang 0.5.17 (not installed); "
                   "SGLang serves on GPUs and is installed by the GPU profile")
        with pytest.raises(SystemExit) as info:  # the SGLang engine without sglang installed: refused at parse time
            main([*argv, "--rollout-backend", "sglang", "--check-only"])
        assert info.value.code == 2
        assert missing in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # both backends wrong: both named in one run
        main([*argv[:-2], "--train-backend", "no_such_pkg.mod:Trainer", "--rollout-backend", "no_such.engine:E",
              "--check-only"])
    message = capsys.readouterr().err
    assert "--rollout-backend no_such.engine:E cannot be imported here" in message
    assert ". --train-backend no_such_pkg.mod:Trainer cannot be imported here" in message
    assert list(tmp_path.iterdir()) == []  # nothing read or written


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--advantage-estimator", "nope_xyz.mod:fn"],
         "--advantage-estimator nope_xyz.mod:fn: cannot be imported here: ModuleNotFoundError: No module named 'nope_xyz'"),
        (["--advantage-estimator", "json:dumps"], "--advantage-estimator 'json:dumps' has the signature"),
        (["--custom-rm-path", "nope_xyz.rewards:score"], "--custom-rm-path 'nope_xyz.rewards:score' cannot be imported"),
        (["--rm-type", "slime.rollout.rm_hub:no_such_reward"],
         "--rm-type 'slime.rollout.rm_hub:no_such_reward' cannot be imported"),
        (["--custom-pg-loss-reducer-function-path", "nope_xyz.mod.reduce"],
         "--custom-pg-loss-reducer-function-path nope_xyz.mod:reduce: cannot be imported here"),
        (["--custom-pg-loss-reducer-function-path", "json:loads"],
         "--custom-pg-loss-reducer-function-path 'json:loads' has the signature"),
    ],
)  # fmt: skip
def test_check_only_imports_the_estimator_and_the_reward_function(tmp_path, flags, message, capsys):
    """Parsing checks only the form of these import paths; --check-only (and a run, before Ray) imports
    them, so a typo stops here with the flag named instead of after the engines have started."""
    argv = ["--hf-checkpoint", str(tmp_path / "not-downloaded"), "--prompt-data", str(tmp_path / "nope.parquet"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp",
            "--rollout-backend", "transformers", "--check-only", *flags]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_NOT_STARTED
    err = capsys.readouterr().err
    assert f"slime: error: {message}" in err, err


def test_check_only_refuses_a_load_that_is_a_file(tmp_path, capsys):
    """The run refuses ``--load <file>`` (it would start fresh, silently); a review found --check-only said OK."""
    (tmp_path / "afile").write_text("not a checkpoint folder")
    argv = ["--hf-checkpoint", str(tmp_path / "not-downloaded"), "--prompt-data", str(tmp_path / "nope.parquet"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend",
            "transformers", "--check-only", "--load", str(tmp_path / "afile")]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_NOT_STARTED
    assert f"slime: error: --load {tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    main([*argv[:-2], "--load", str(tmp_path / "not-yet")])  # a folder still to be made: fine
    assert capsys.readouterr().out.startswith("slime: flags OK")


def test_a_run_without_gpus_refuses_what_only_cuda_runs_before_anything_starts(tmp_path, capsys, monkeypatch):
    """The Megatron backend's all-to-all dispatcher and its model / expert parallelism need CUDA: on a machine
    without GPUs --check-only refuses them (a review found it said OK, and the run then failed at model build after
    Ray and the engines had started), and so does the driver's set-up, before any placement (its first step)."""
    import torch

    from slime import driver

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--hf-checkpoint", str(tmp_path / "not-downloaded"), "--prompt-data", str(tmp_path / "nope.parquet"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--colocate", "--train-backend", "megatron", "--rollout-backend", "transformers",
            "--check-only"]  # fmt: skip
    refused = {("--moe-token-dispatcher-type", "alltoall"): "--moe-token-dispatcher-type alltoall needs CUDA",
               ("--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"):
               "the Megatron backend on CPU runs data parallelism only, not --expert-model-parallel-size 2"}
    for flags, message in refused.items():
        with pytest.raises(SystemExit) as info:
            main([*argv, *flags])
        assert info.value.code == EXIT_NOT_STARTED
        assert f"slime: error: {message}" in capsys.readouterr().err
    for flags in ([], ["--moe-token-dispatcher-type", "allgather"]):  # the CPU's own dispatcher
        main([*argv, *flags])
        assert capsys.readouterr().out.startswith("slime: flags OK")
    cfg = geo3k_cfg(tmp_path / "not-downloaded", "--num-rollout", "1", "--train-backend", "megatron",
                    "--moe-token-dispatcher-type", "alltoall", "--rollout-backend", "transformers")
    monkeypatch.setattr(driver, "cluster_num_gpus", lambda: 0)
    monkeypatch.setattr(driver, "create_placement_groups", lambda *a, **k: pytest.fail("placement reached"))
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type alltoall needs CUDA"):
        driver.setup(cfg, None, None, None)


def test_check_only_accepts_an_importable_estimator_path(tmp_path, capsys):
    argv = ["--hf-checkpoint", str(tmp_path / "not-downloaded"), "--prompt-data", str(tmp_path / "nope.parquet"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend",
            "transformers", "--check-only", "--advantage-estimator", "slime.grpo.advantages:dr_grpo",
            "--rm-type", "slime.rollout.rm_hub.geo3k:geo3k_reward"]  # fmt: skip
    main(argv)
    assert capsys.readouterr().out.startswith("slime: flags OK")


def _group(global_batch_size, dp_ranks, dp_size):
    group = TrainerGroup.__new__(TrainerGroup)  # no actors: only the split is exercised
    group.global_batch_size, group.dp_ranks, group.dp_size = global_batch_size, dp_ranks, dp_size
    return group


def _samples(n):
    return [Sample(index=i, prompt="", label="") for i in range(n)]


def test_samples_split_into_optimizer_steps_then_data_parallel_ranks():
    shards, steps = _group(4, [0, 1], 2).split_by_rank(_samples(8))
    assert steps == 2
    # Step 0 is samples 0-3 (rank 0: 0, 1; rank 1: 2, 3); step 1 is samples 4-7.
    assert [[s.index for s in shard] for shard in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_model_parallel_peers_get_the_same_samples():
    shards, _ = _group(4, [0, 0, 1, 1], 2).split_by_rank(_samples(4))
    assert [[s.index for s in shard] for shard in shards] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="--global-batch-size 4"):
        _group(4, [0, 1], 2).split_by_rank(_samples(6))


def test_hf_checkpoint_without_weights_fails_before_ray(tmp_path, tiny_ckpt):
    from slime.checkpoints.layout import CheckpointError
    from slime.driver import prepare

    folder = tmp_path / "no_weights"
    folder.mkdir()
    (folder / "config.json").write_text((Path(tiny_ckpt) / "config.json").read_text())
    cfg = geo3k_cfg(folder, "--num-rollout", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp")
    with pytest.raises(CheckpointError, match=r"--hf-checkpoint .*no_weights: no weights"):
        prepare(cfg)


def test_load_folder_that_is_not_a_checkpoint_is_refused(tmp_path, tiny_ckpt):
    from slime.checkpoints.layout import CheckpointError
    from slime.driver import prepare

    load = tmp_path / "garbage"
    (load / "iter_0000001").mkdir(parents=True)
    (load / "latest_checkpointed_iteration.txt").write_text("1\n")
    cfg = geo3k_cfg(tiny_ckpt, "--num-rollout", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp",
               "--load", str(load))
    with pytest.raises(CheckpointError, match=r"--load .*garbage: the latest checkpoint \(rollout 1\) lacks .*model"):
        prepare(cfg)


def test_debug_dump_template_with_unknown_placeholder_is_refused_at_parse_time(tiny_ckpt):
    with pytest.raises(SystemExit):
        geo3k_cfg(tiny_ckpt, "--num-rollout", "1", "--save-debug-rollout-data", "/tmp/x_{bogus}.jsonl")


def test_clean_up_runs_on_error_and_keeps_the_original_error(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """train() stops what setup started, last started first, whatever fails; a failing clean-up
    step is logged and the error that ended the run is the one raised."""
    import contextlib
    import logging

    from slime import driver

    calls = []

    class Manager:
        def close(self):
            calls.append("reward workers")
            raise RuntimeError("scorer pool already broken")

    def setup(cfg, components, rollout_manager, cleanup: contextlib.ExitStack):
        cleanup.callback(calls.append, "placement groups")
        cleanup.callback(calls.append, "engines")
        cleanup.callback(calls.append, "trainers")
        raise ValueError("trainer rank 1 died")

    monkeypatch.setattr(driver, "resolve_components", lambda cfg: None)
    monkeypatch.setattr(driver, "prepare", lambda cfg: Manager())
    monkeypatch.setattr(driver, "init_ray", lambda cluster: True)
    monkeypatch.setattr(driver.ray, "shutdown", lambda: calls.append("ray"))
    monkeypatch.setattr(driver, "setup", setup)
    cfg = geo3k_cfg(tiny_ckpt, "--num-rollout", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp")
    cfg.logging.output_dir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="slime"), pytest.raises(ValueError, match="trainer rank 1 died"):
        driver.train(cfg)
    assert calls == ["trainers", "engines", "placement groups", "reward workers", "ray"]
    assert "stopping the reward workers failed: scorer pool already broken" in caplog.text


def test_sigterm_becomes_system_exit_during_a_run():
    import os
    import signal

    from slime.train import _sigterm_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info, _sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        raise AssertionError("SIGTERM did not raise")
    assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # restored after the run


@pytest.mark.parametrize(
    "starts, error, expected_status", [(False, None, 2), (True, "mismatch", 1), (True, "abort", 1)]
)
def test_exit_status_says_whether_the_run_began_and_command_sh_is_written_by_the_lock_holder(
    tiny_ckpt, tmp_path, monkeypatch, capsys, starts, error, expected_status
):
    """An error before the first rollout step exits 2 (nothing to resume; the launcher prints no
    resume line), one after it exits 1; command.sh is written once the run holds its folders."""
    import os
    import shlex
    import sys

    from slime import driver
    from slime.data.sources import DatasetError
    from slime.rollout.manager import PromptMismatchError, RolloutAbortedError

    messages = {"mismatch": "engine saw 12 prompt tokens", "abort": "every one of the 2 groups holds an aborted sample"}

    def train(cfg, on_start=None):
        if starts:
            on_start()
            raise (PromptMismatchError if error == "mismatch" else RolloutAbortedError)(messages[error])
        raise DatasetError("train.parquet row 3: no 'problem' column")

    monkeypatch.setattr(driver, "train", train)
    run = tmp_path / "run"
    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(GEO3K_DATA), "--rollout-batch-size", "5",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--rollout-num-gpus", "1",
            "--num-rollout", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp",
            "--output-dir", str(run), "--parent-pid", str(os.getpid()), "--lr", "2e-6"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == expected_status
    err = capsys.readouterr().err
    assert f"slime: error: {messages[error] if starts else 'train.parquet row 3'}" in err
    without_parent = argv[:-4] + argv[-2:]
    assert shlex.split((run / "command.sh").read_text()) == [sys.executable, "-m", "slime.train", *without_parent]


def test_a_dataset_whose_every_row_is_skipped_stops_the_run_before_it_starts(tiny_ckpt, tmp_path, capsys):
    """Bad data is refused before anything starts, with exit status 2 (nothing to resume), as README says:
    not in the first rollout step (status 1, and the launcher would print a resume line)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(GEO3K_DATA / "train.parquet").slice(0, 6)
    table = table.set_column(table.column_names.index("answer"), "answer", pa.array([""] * table.num_rows))
    pq.write_table(table, tmp_path / "no_labels.parquet")
    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(tmp_path / "no_labels.parquet"),
            "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp",
            "--rollout-backend", "transformers", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    from slime import driver

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a dataset with no usable row")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "init_ray", no_ray)
        with pytest.raises(SystemExit) as info:
            main(argv)
    assert info.value.code == EXIT_NOT_STARTED == 2
    err = capsys.readouterr().err
    assert f"slime: error: --prompt-data {tmp_path / 'no_labels.parquet'}: all 6 rows are skipped" in err, err
    assert "'empty_label': 6" in err
