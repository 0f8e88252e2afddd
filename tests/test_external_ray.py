"""End to end: with ``--ray-address`` (what ``SLIME_SCRIPT_EXTERNAL_RAY=1`` passes) the driver joins
a running Ray cluster, trains on it, and leaves it running: it never starts or stops one.  It
does stop everything it started there: the trainer and engine actors and the engine's server.
When its launcher (``--parent-pid``) is SIGKILLed, the driver and the run's actors go, the
cluster stays.

The cluster is a ``ray start --head --block`` started here in a session of its own, so the
test can check afterwards that every process of that session is still alive and then stop
exactly those processes.  The engine is the transformers engine plus a "server" process that
Ray's own clean-up of a finished job does not reach (:class:`tests.stub_engines.ServerEngine`):
only the run's shutdown stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime.utils.metrics import read_metrics
from tests.process_tree import all_processes, is_alive, read_proc, session_members, wait_for, wait_session_gone
from tests.ray_head import ray_env, ray_head, ray_status

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "examples" / "geo3k_vlm" / "data"


@pytest.fixture(scope="module")
def cluster():
    """One Ray head for both tests, each of which checks that it survives its run (a head's start costs ~10 s):
    ``(head, address, env, pids)``, ``pids`` the processes of the head's session right after it came up."""
    env = ray_env()
    with ray_head(env) as (head, address):
        yield head, address, env, {p.pid for p in session_members(head.pid)}


def _run_flags(tiny_ckpt: Path, out: Path, address: str, num_rollout: int) -> list[str]:
    return [
        "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(DATA_DIR),
        "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
        "--apply-chat-template", "--num-rollout", str(num_rollout), "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--global-batch-size", "4",
        "--skip-eval-before-train", "--train-backend", "fsdp", "--rollout-backend", "transformers",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--no-progress-bar",
        "--ray-address", address, "--output-dir", str(out),
    ]  # fmt: skip


def _run_actors(sid: int) -> list:
    """The run's actor processes in the cluster's session (idle pool workers are the cluster's)."""
    return [p for p in session_members(sid) if p.comm.startswith(("ray::TrainerAct", "ray::EngineAct"))]


def test_sigkill_of_the_launcher_stops_the_run_on_an_external_cluster_and_leaves_the_cluster(
    tmp_path, tiny_ckpt, cluster
):
    head, address, env, cluster_before = cluster
    launcher = None
    try:
        out = tmp_path / "run"
        # What the geo3k launcher does: the driver in a session of its own, watching the launcher's PID.
        script = 'setsid "$0" -m slime.train "$@" --parent-pid $$ & wait'
        with open(tmp_path / "driver.log", "w") as log:
            launcher = subprocess.Popen(
                ["bash", "-c", script, sys.executable, *_run_flags(tiny_ckpt, out, address, 50)],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(lambda: read_metrics(out / "metrics.jsonl"), 900, "the first rollout step", launcher)
        (driver,) = [p for p in all_processes() if p.ppid == launcher.pid and "slime.train" in p.cmdline]
        assert _run_actors(head.pid), [str(p) for p in session_members(head.pid)]

        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert not wait_session_gone(driver.sid, 60), "the driver outlived its launcher"
        wait_for(lambda: not _run_actors(head.pid), 60, "the run's actors to be stopped by the cluster")

        status = ray_status(address, env)
        assert status.returncode == 0, status.stderr
        assert head.poll() is None and cluster_before <= {p.pid for p in session_members(head.pid)}
        assert "the launcher (pid" in (tmp_path / "driver.log").read_text()
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()


def test_driver_joins_an_external_cluster_and_leaves_it_running(tmp_path, tiny_ckpt, cluster):
    head, address, env, cluster_before = cluster
    out = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "slime.train",
         "--hf-checkpoint", str(tiny_ckpt), "--prompt-data", str(DATA_DIR),
         "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
         "--apply-chat-template", "--num-rollout", "1", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--global-batch-size", "4",
         "--skip-eval-before-train", "--train-backend", "fsdp",
         "--rollout-backend", "tests.stub_engines:ServerEngine",
         "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--no-progress-bar",
         "--ray-address", address, "--output-dir", str(out)],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    # While the run goes on, note its processes: the actors (Ray names them "ray::<class>..."), and
    # the engine's server once the engine has written its pid.
    seen: dict[int, object] = {}
    record = out / "engine-0.json"

    def note_run_processes():
        seen.update({p.pid: p for p in session_members(head.pid)  # the cluster's workers, not other tests'
                     if p.cmdline.startswith(("ray::TrainerActor", "ray::EngineActor"))})
        if record.exists() and record.stat().st_size:
            server = read_proc(json.loads(record.read_text())["server_pid"])
            if server is not None:
                seen[server.pid] = server

    stderr = _collect_while_running(driver, note_run_processes, timeout_s=900)
    assert driver.returncode == 0, stderr[-4000:]
    assert "joined Ray cluster" in stderr
    assert "Started a local Ray instance" not in stderr  # it never starts one of its own
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "rollout/reward_mean" in r] == [0]

    # No process of the run is left: the 2 trainer ranks, the engine and its server (which would
    # outlive an actor that Ray kills at the end of the job).
    pids = json.loads(record.read_text())
    trainers = [p for p in seen.values() if p.cmdline.startswith("ray::TrainerActor")]
    assert len(trainers) == 2 and pids["actor_pid"] in seen and pids["server_pid"] in seen, seen
    deadline = time.monotonic() + 60  # Ray reaps a finished job's workers asynchronously
    while any(is_alive(p) for p in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(is_alive(p) for p in seen.values()), [str(p) for p in seen.values() if is_alive(p)]

    # The cluster survived the driver: the head process group answers, and every process
    # it had before the run still runs.
    status = ray_status(address, env)
    assert status.returncode == 0, status.stderr
    assert head.poll() is None
    assert cluster_before <= {p.pid for p in session_members(head.pid)}


def _collect_while_running(process: subprocess.Popen, sample, timeout_s: float, interval_s: float = 0.5) -> str:
    """Call ``sample()`` every ``interval_s`` until ``process`` exits; return its stderr (read in a
    thread, so that a full pipe never blocks it)."""
    import threading

    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(process.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the driver did not finish within {timeout_s:.0f}s")
        sample()
        time.sleep(interval_s)
    reader.join(timeout=30)
    return "".join(chunks)
