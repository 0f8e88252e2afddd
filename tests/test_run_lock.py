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


def test_the_driver_refuses_a_live_runs_folder_before_loading_anything(tmp_path, holder, tiny_ckpt):
    from slime.train import main

    argv = ["--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(tmp_path / "missing.parquet"),
            "--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--output-dir", str(tmp_path / "run")]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert str(info.value.code).startswith(f"slime: error: --output-dir {tmp_path / 'run'} is in use")
    assert f"pid {holder.pid}" in str(info.value.code)


def _used_run(root: Path) -> tuple[Path, Path]:
    """A finished run's folders: 2 metrics records, a plot, the wandb id, two checkpoints."""
    run, ckpt = root / "run", root / "run" / "checkpoints"
    (ckpt / "iter_0000001" / "model").mkdir(parents=True)
    (ckpt / "iter_0000003").mkdir()
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
    assert refused.returncode == 1 and refused.stderr.startswith(f"slime: error: --output-dir {run} already holds")
    assert probe(*common, "--load", str(ckpt)).returncode == 0
    assert probe(*common, "--overwrite-output-dir").returncode == 0
    assert (ckpt / "iter_0000003").is_dir()  # the probe deletes nothing
    assert probe("--output-dir", str(tmp_path / "new"), "--output-dir", str(run)).returncode == 1  # last one wins
    assert not (tmp_path / "new").exists()
