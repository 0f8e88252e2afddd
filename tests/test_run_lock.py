"""One writer per run directory and checkpoint folder (``slime.utils.run_lock``), checked with real
processes: a holder in another process, killed with SIGKILL, and the driver's own entry point."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime.checkpoints.layout import CheckpointError
from slime.utils.run_lock import LOCK_FILE, RunDirError, check_run_dirs, claim_run_dirs

REPO = Path(__file__).resolve().parents[1]

HOLDER = textwrap.dedent("""
    import sys
    from slime.utils.run_lock import claim_run_dirs
    claim = claim_run_dirs(sys.argv[1], sys.argv[2], None, command=["holder", "run"])
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the test closes stdin or kills this process
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the locks of ``tmp_path/run`` and ``tmp_path/run/ckpt``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run"), str(tmp_path / "run" / "ckpt")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_runs_folders_are_refused_naming_its_pid(tmp_path, holder):
    run, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    record = json.loads((run / LOCK_FILE).read_text())
    assert record["pid"] == holder.pid and record["command"] == "holder run"
    in_use = rf"--output-dir {run} is in use by another slime run \(pid {holder.pid} on host"
    with pytest.raises(RunDirError, match=in_use):
        claim_run_dirs(run, tmp_path / "elsewhere", None)
    with pytest.raises(RunDirError, match=rf"--save {ckpt} is in use .*pid {holder.pid}.*kill {holder.pid}"):
        claim_run_dirs(tmp_path / "other_run", ckpt, None)
    with pytest.raises(RunDirError, match=f"pid {holder.pid}"):  # the probe the launcher runs
        check_run_dirs(tmp_path / "other_run", ckpt, None, overwrite=False)
    with claim_run_dirs(tmp_path / "other_run", tmp_path / "elsewhere", None):  # refused claims kept no lock
        pass


def test_the_lock_dies_with_its_holder_even_by_sigkill(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with claim_run_dirs(tmp_path / "run", tmp_path / "run" / "ckpt", None) as claim:
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    claim.release()  # idempotent


def test_the_driver_refuses_a_live_runs_folder_before_loading_anything(tmp_path, holder, tiny_ckpt, capsys):
    from slime.train import main

    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(tmp_path / "missing.parquet"),
            "--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--output-dir", str(tmp_path / "run")]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2  # before its first step: nothing of it to resume
    err = capsys.readouterr().err
    assert err.startswith(f"slime: error: --output-dir {tmp_path / 'run'} is in use")
    assert f"pid {holder.pid}" in err


def _used_run(root: Path) -> tuple[Path, Path]:
    """A finished run's folders: 2 metrics records, a plot, the wandb id, two checkpoints."""
    run, ckpt = root / "run", root / "run" / "checkpoints"
    (ckpt / "iter_0000001" / "model").mkdir(parents=True)
    (ckpt / "iter_0000003").mkdir()
    (ckpt / "iter_0000003" / "rollout_state.pt").write_bytes(b"state")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run / "reward_curve.png").write_bytes(b"png")
    (run / "wandb_run.json").write_text("{}")
    (run / "command.sh").write_text("python -m slime.train\n")
    return run, ckpt


def test_a_used_run_directory_is_refused_without_load(tmp_path):
    run, ckpt = _used_run(tmp_path)
    used = rf"--output-dir {run} already holds the metrics of a run .*2 records.*--load"
    with pytest.raises(RunDirError, match=used):
        claim_run_dirs(run, ckpt, None)
    (run / "metrics.jsonl").write_text("")  # only the checkpoints are left
    with pytest.raises(RunDirError, match=rf"--save {ckpt} already holds checkpoints \(iter_0000001, iter_0000003, "
                                          r"latest_checkpointed_iteration.txt\)\. Resume from them with --load"):
        claim_run_dirs(run, ckpt, None)
    with pytest.raises(RunDirError, match="already holds checkpoints"):  # resuming another folder into this one
        claim_run_dirs(run, ckpt, tmp_path / "other_checkpoints")
    assert sorted(p.name for p in ckpt.iterdir()) == [".slime.lock", "iter_0000001", "iter_0000003",
                                                      "latest_checkpointed_iteration.txt"]  # fmt: skip


def test_resuming_the_same_folders_is_allowed_and_changes_nothing(tmp_path):
    run, ckpt = _used_run(tmp_path)
    with claim_run_dirs(run, ckpt, ckpt):
        assert (run / "metrics.jsonl").read_text().count("\n") == 2
        assert (ckpt / "iter_0000003").is_dir()


def test_overwrite_output_dir_deletes_the_earlier_run_and_logs_each_file(tmp_path, caplog):
    run, ckpt = _used_run(tmp_path)
    with caplog.at_level(logging.WARNING), claim_run_dirs(run, ckpt, None, overwrite=True):
        pass
    assert sorted(p.name for p in run.iterdir()) == [".slime.lock", "checkpoints", "command.sh"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".slime.lock"]
    deleted = {Path(r.getMessage().split("deleting ")[1]) for r in caplog.records if "deleting" in r.getMessage()}
    assert deleted == {run / "metrics.jsonl", run / "reward_curve.png", run / "wandb_run.json",
                       ckpt / "iter_0000001", ckpt / "iter_0000003", ckpt / "latest_checkpointed_iteration.txt"}


def test_overwrite_refuses_to_delete_what_load_resumes_from(tmp_path):
    run, ckpt = _used_run(tmp_path)
    with pytest.raises(RunDirError, match="--overwrite-output-dir would delete the checkpoints in --save"):
        claim_run_dirs(run, ckpt, ckpt, overwrite=True)
    assert (ckpt / "iter_0000003").is_dir() and (run / "metrics.jsonl").stat().st_size > 0


def test_save_equal_to_output_dir_is_one_folder(tmp_path):
    run = tmp_path / "run"
    with claim_run_dirs(run, run, None):  # locked once: a second flock in this process would refuse
        assert (run / LOCK_FILE).is_file()
    (run / "iter_0000000").mkdir()
    with pytest.raises(RunDirError, match=rf"--output-dir {run} already holds checkpoints"):
        claim_run_dirs(run, run, None)


def test_cli_probe_for_the_launcher(tmp_path):
    run, ckpt = _used_run(tmp_path)

    def probe(*flags):
        return subprocess.run([sys.executable, "-m", "slime.utils.run_lock", *flags], capture_output=True, text=True,
                              env=_env(), cwd=REPO)  # fmt: skip

    common = ["--output-dir", str(run), "--lr", "1e-6", "--save", str(ckpt), "--apply-chat-template"]
    refused = probe(*common)
    # 2 as the driver's own refusal (slime.errors: an error before anything ran), not 1 (a run that failed)
    assert refused.returncode == 2 and refused.stderr.startswith(f"slime: error: --output-dir {run} already holds")
    assert probe(*common, "--load", str(ckpt)).returncode == 0
    typo = probe(*common, "--load", str(tmp_path / "ckpt_typo"))
    assert typo.returncode == 2 and f"--load {tmp_path / 'ckpt_typo'} does not exist" in typo.stderr
    assert probe(*common, "--overwrite-output-dir").returncode == 0
    assert (ckpt / "iter_0000003").is_dir()  # the probe deletes nothing
    assert probe("--output-dir", str(tmp_path / "new"), "--output-dir", str(run)).returncode == 2  # last one wins
    usage = probe("--save", str(ckpt))  # no --output-dir: argparse's usage error
    assert usage.returncode == 2 and "the following arguments are required: --output-dir" in usage.stderr
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------
# --load of a used run directory must resume something (issue 12: only a resume or an overwrite)


def _earlier_run(run: Path, save: Path, steps: int, saved_at: tuple[int, ...] = ()) -> str:
    """A run that held ``run`` with ``--save save`` and logged ``steps`` records (those in
    ``saved_at`` with the save time a step that saved has); returns its metrics file's text."""
    with claim_run_dirs(run, save, save, command=["earlier", "run"]):
        text = "".join(
            json.dumps({"step": k, "rollout/reward_mean": 0.0, **({"perf/save_time_s": 1.5} if k in saved_at else {})})
            + "\n" for k in range(steps)
        )  # fmt: skip
        (run / "metrics.jsonl").write_text(text)
    return text


def _lock_record(folder: Path) -> dict:
    return json.loads((folder / LOCK_FILE).read_text())


def test_a_load_that_resumes_nothing_is_refused_and_the_metrics_stay(tmp_path):
    # The reviewer's case: a finished run's folder (5 records, checkpoints in ck), re-run with
    # a new --save and a --load typo; and the same with a --load folder that holds no checkpoint.
    run, ck = tmp_path / "run", tmp_path / "ck"
    text = _earlier_run(run, ck, 5, saved_at=(2, 4))
    (ck / "iter_0000004").mkdir()
    (ck / "iter_0000004" / "rollout_state.pt").write_bytes(b"state")
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")
    record = _lock_record(run)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(tmp_path / "ckpt_typo", "does not exist"), (empty, "holds no checkpoint")]
    for load, why in cases:
        with pytest.raises(RunDirError, match=rf"--output-dir {run} already holds the metrics of a run .*5 records\), "
                                              rf"and --load {load} {why}.*--overwrite-output-dir"):
            claim_run_dirs(run, tmp_path / "ck2", load)
        with pytest.raises(RunDirError, match=why):
            check_run_dirs(run, tmp_path / "ck2", load, overwrite=False)  # the launcher's probe says the same
        assert (run / "metrics.jsonl").read_text() == text
        assert _lock_record(run) == record  # the refused run put the folder's record back
    with claim_run_dirs(run, tmp_path / "ck2", ck):  # a real checkpoint is a resume (the driver drops later records)
        assert (run / "metrics.jsonl").read_text() == text


def test_the_driver_refuses_a_load_typo_on_a_used_run_directory_and_keeps_its_metrics(tmp_path, tiny_ckpt, capsys):
    from slime.train import EXIT_NOT_STARTED, main

    run = tmp_path / "run"
    text = _earlier_run(run, tmp_path / "ck", 5, saved_at=(2, 4))
    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(tmp_path / "missing.parquet"),
            "--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--output-dir", str(run), "--save", str(tmp_path / "ck2"), "--load", str(tmp_path / "ckpt_typo")]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_NOT_STARTED == 2
    assert f"slime: error: --output-dir {run} already holds the metrics" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == text
    assert not (run / "command.sh").exists()  # written only by a run that holds the folder


def test_a_load_that_is_a_file_is_refused_before_any_folder_is_made(tmp_path, tiny_ckpt, capsys):
    from slime.train import EXIT_NOT_STARTED, main

    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"weights")
    run, save = tmp_path / "run", tmp_path / "ck"
    message = f"--load {a_file} is a file, not a folder"
    for check in (check_run_dirs, lambda *a, overwrite: claim_run_dirs(*a, overwrite=overwrite)):
        with pytest.raises(CheckpointError, match=message):
            check(run, save, a_file, overwrite=False)
    probe = subprocess.run([sys.executable, "-m", "slime.utils.run_lock", "--output-dir", str(run), "--load",
                            str(a_file)], capture_output=True, text=True, env=_env(), cwd=REPO)  # fmt: skip
    assert probe.returncode == 2 and probe.stderr.startswith(f"slime: error: {message}")
    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(tmp_path / "missing.parquet"),
            "--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--output-dir", str(run), "--save", str(save), "--load", str(a_file)]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_NOT_STARTED == 2
    assert f"slime: error: {message}" in capsys.readouterr().err
    assert not save.exists() and list(run.iterdir()) == []  # driver.make_run_dir makes the empty run folder first


def test_save_d_load_d_restarts_a_run_that_died_before_its_first_checkpoint(tmp_path, caplog):
    run, d = tmp_path / "run", tmp_path / "d"
    _earlier_run(run, d, 2)  # --save d --load d, killed during rollout 2: no checkpoint, 2 records
    (run / "reward_curve.png").write_bytes(b"png")
    assert check_run_dirs(run, d, d, overwrite=False) is None and (run / "metrics.jsonl").exists()  # the probe
    with caplog.at_level(logging.WARNING), claim_run_dirs(run, d, d):
        assert not (run / "metrics.jsonl").exists() and not (run / "reward_curve.png").exists()
    assert f"--output-dir {run}: restarting its run, which stopped before its first checkpoint" in caplog.text
    assert "dropping its 2 metrics records" in caplog.text


def test_save_d_load_d_does_not_restart_another_runs_or_a_checkpointed_runs_metrics(tmp_path):
    run, d, other = tmp_path / "run", tmp_path / "d", tmp_path / "other"
    text = _earlier_run(run, d, 2)
    with pytest.raises(RunDirError, match=rf"--load {other} holds no checkpoint, and the run in this folder saved to "
                                          rf"--save {d}, not to {other}"):
        claim_run_dirs(run, other, other)
    assert (run / "metrics.jsonl").read_text() == text
    with claim_run_dirs(run, d, d):  # the refusal above kept the folder's record: its own --save still restarts it
        assert not (run / "metrics.jsonl").exists()

    # A run that saved checkpoints (its records say so) whose --save folder is now empty: refused.
    run2 = tmp_path / "run2"
    text = _earlier_run(run2, d, 3, saved_at=(1,))
    with pytest.raises(RunDirError, match=r"saved checkpoints \(records with perf/save_time_s\) that are gone"):
        claim_run_dirs(run2, d, d)
    # A run directory whose lock file does not say which --save its run used (an older slime): refused.
    (run2 / LOCK_FILE).write_text("")
    with pytest.raises(RunDirError, match="which --save the run in this folder used is unknown"):
        claim_run_dirs(run2, d, d)
    assert (run2 / "metrics.jsonl").read_text() == text


def test_a_used_run_directory_resumed_from_an_incomplete_checkpoint_is_refused(tmp_path):
    run, ckpt = _used_run(tmp_path)
    (ckpt / "iter_0000003" / "rollout_state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"--load .*checkpoints: the latest checkpoint \(rollout 3\) lacks"):
        claim_run_dirs(run, ckpt, ckpt)
    (ckpt / "iter_0000003" / "rollout_state.pt").write_bytes(b"state")
    with pytest.raises(CheckpointError, match=r"lacks .*iter_0000003/model"):  # the backend's parts, from the driver
        claim_run_dirs(run, ckpt, ckpt, checkpoint_parts=("model",))
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
