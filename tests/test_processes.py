"""The ``/proc`` helpers of :mod:`slime.utils.processes` on a small process tree of our own.

A parent (in a session of its own) starts a child, which starts a grandchild; each prints its pid once it
runs, so the test reads the pids instead of waiting for time to pass.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from slime.utils.processes import kill_descendants, session_processes
from tests.process_tree import is_alive, read_proc, wait_for

_SLEEPER = "import time\nwhile True: time.sleep(1)"
_CHILD = (
    "import subprocess, sys, time\n"
    f"grandchild = subprocess.Popen([sys.executable, '-c', {_SLEEPER!r}, 'grandchild'])\n"
    "print(grandchild.pid, flush=True)\n"
    "while True: time.sleep(1)\n"
)
_TREE = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {_CHILD!r}, 'child'], stdout=subprocess.PIPE, text=True)\n"
    "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
    "while True: time.sleep(1)\n"
)


def _tree():
    parent = subprocess.Popen([sys.executable, "-c", _TREE, "parent"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child, grandchild = (int(pid) for pid in parent.stdout.readline().split())
    return parent, read_proc(child), read_proc(grandchild)


def test_kill_descendants_kills_the_whole_tree_below_a_process_and_names_each_one():
    parent, child, grandchild = _tree()
    try:
        assert child.ppid == parent.pid and grandchild.ppid == child.pid
        killed = kill_descendants(parent.pid)
        assert len(child.cmdline) > 200 and len(grandchild.cmdline) < 200  # the first is cut, the second not
        assert sorted(killed) == sorted(f"pid {p.pid}: {p.cmdline[:200]}" for p in (child, grandchild))
        assert child.cmdline.endswith(" child") and grandchild.cmdline.endswith(" grandchild")
        wait_for(lambda: not is_alive(child) and not is_alive(grandchild), timeout_s=60, what="the tree to die")
        assert parent.poll() is None  # the process itself is left alone
        assert kill_descendants(parent.pid) == []  # its dead (zombie) child is not killed again
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_session_processes_lists_every_process_of_a_session():
    parent, child, grandchild = _tree()
    try:
        members = dict(session_processes(parent.pid))
        assert set(members) == {parent.pid, child.pid, grandchild.pid}
        assert all(name == read_proc(pid).comm for pid, name in members.items())
        assert session_processes(os.getsid(0)) and parent.pid not in dict(session_processes(os.getsid(0)))
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
