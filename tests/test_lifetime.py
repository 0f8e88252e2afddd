"""``--parent-pid`` (``slime.utils.lifetime``): a process whose watched parent is SIGKILLed is
interrupted within seconds, and ended if it does not stop; checked with real processes.

Layout of each case: the test starts a *parent* (a Python process that only sleeps), which
starts a *child* in a session of its own (as the launcher's ``setsid`` does).  The child
watches the parent and reports, through a file, when it is watching and when its main thread
was interrupted.  The test SIGKILLs the parent and reads the child's reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slime.utils.lifetime import WAKE_SIGNAL, watch_parent
from tests.process_tree import read_proc, wait_for

REPO = Path(__file__).resolve().parents[1]
NOTICE_S = 10  # generous on a loaded 2-core CI machine; the pidfd fires at once

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import slime.utils.lifetime as lifetime
    report, mode, pid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if mode.endswith("-poll"):
        lifetime._open_pidfd = lambda pid: None  # the fallback without pidfds
    watch = lifetime.watch_parent(pid, grace_s=1.0 if mode.startswith("stuck") else 60.0, poll_s=0.1)
    report.write_text("watching\\n")
    try:
        watch.start()
        time.sleep(600)
    except KeyboardInterrupt:
        with report.open("a") as f:
            f.write(f"interrupted fired={watch.fired.is_set()}\\n")
        if mode.startswith("stuck"):
            time.sleep(600)  # a clean-up that hangs: the watch must end the process
        sys.exit(3)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys, os, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3], str(os.getpid())],
                             start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int, Path]:
    report = tmp_path / "report.txt"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(report), mode], stdout=subprocess.PIPE,
                              text=True, env=_env())  # fmt: skip
    child_pid = int(parent.stdout.readline())
    wait_for(lambda: report.exists() and "watching" in report.read_text(), 60, "the child to watch its parent")
    return parent, child_pid, report


def _gone(pid: int) -> bool:
    proc = read_proc(pid)
    return proc is None or proc.state in ("Z", "X")


@pytest.mark.parametrize("mode", ["pidfd", "parent-poll"])
def test_sigkill_of_the_parent_interrupts_the_child_within_seconds(tmp_path, mode):
    parent, child_pid, report = _start(tmp_path, mode)
    try:
        time.sleep(0.5)  # the child keeps running while its parent lives
        assert report.read_text() == "watching\n" and not _gone(child_pid)
        killed_at = time.monotonic()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: _gone(child_pid), NOTICE_S, "the child to stop after its parent's SIGKILL")
        assert time.monotonic() - killed_at < NOTICE_S
        assert report.read_text() == "watching\ninterrupted fired=True\n"
    finally:
        parent.kill()
        if not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_that_does_not_stop_is_ended_after_the_grace_period(tmp_path):
    parent, child_pid, report = _start(tmp_path, "stuck")
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: "interrupted" in report.read_text(), NOTICE_S, "the interrupt")
        wait_for(lambda: _gone(child_pid), NOTICE_S + 1, "the grace period to end the child")
    finally:
        parent.kill()
        if not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_watched_process_that_is_already_gone_fires_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    report = tmp_path / "report.txt"
    child = subprocess.run([sys.executable, "-c", CHILD, str(report), "pidfd", str(dead.pid)], env=_env(),
                           timeout=60)  # fmt: skip
    assert child.returncode == 3  # the child's exit after the interrupt
    assert report.read_text() == "watching\ninterrupted fired=True\n"


def test_no_parent_pid_watches_nothing_and_a_stopped_watch_never_fires():
    with watch_parent(None) as idle:
        time.sleep(0.1)
    assert not idle.fired.is_set()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with watch_parent(sleeper.pid, poll_s=0.05) as watch:
            pass  # the run ended by itself
        sleeper.kill()
        sleeper.wait()
        time.sleep(0.5)
        assert not watch.fired.is_set()
        # While the watched process lives, a SIGUSR1 from elsewhere is not taken for its exit.
        with watch_parent(os.getppid(), poll_s=0.05) as alive:
            os.kill(os.getpid(), WAKE_SIGNAL)
            time.sleep(0.2)
        assert not alive.fired.is_set()
        assert signal.getsignal(WAKE_SIGNAL) == signal.SIG_DFL  # restored by stop()
    finally:
        sleeper.kill()
