"""Process bookkeeping for the end-to-end tests (Linux ``/proc``): which processes belong to a
run, and whether any of them outlived it.

A run is identified by its *session*: the driver (or the launcher's driver) starts a new
session, every process it starts inherits it, and so does every Ray process of a local Ray
instance, even Ray's workers, which each get their own process *group*.  Nothing outside the
run can join the session.  Zombies (exited, not yet reaped by their new parent) count as gone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process: ids from ``/proc/<pid>/stat`` and its command line."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    comm: str
    cmdline: str

    def __str__(self) -> str:
        command = self.cmdline[:160] or self.comm
        return f"pid {self.pid} (pgid {self.pgid}, sid {self.sid}, state {self.state}): {command}"


def read_proc(pid: int) -> Proc | None:
    """The process ``pid``, or None if it does not exist (or vanished while being read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state, ppid, pgid, sid = stat[stat.rindex(")") + 2 :].split()[:4]
    return Proc(pid, int(ppid), int(pgid), int(sid), state, comm, cmdline)


def all_processes() -> list[Proc]:
    procs = (read_proc(int(name)) for name in os.listdir("/proc") if name.isdigit())
    return [p for p in procs if p is not None]


def is_alive(proc: Proc) -> bool:
    """Whether ``proc`` (the same process: same pid and session) still runs (not a zombie)."""
    now = read_proc(proc.pid)
    return now is not None and now.sid == proc.sid and now.state not in ("Z", "X")


def session_members(sid: int) -> list[Proc]:
    """Live (non-zombie) processes of session ``sid``."""
    return [p for p in all_processes() if p.sid == sid and p.state not in ("Z", "X")]


def wait_session_gone(sid: int, timeout_s: float) -> list[Proc]:
    """Poll until session ``sid`` has no live process; returns the survivors after ``timeout_s`` ([] if none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = session_members(sid)
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def wait_for(condition, timeout_s: float, what: str, process=None, interval_s: float = 0.2):
    """Poll ``condition()`` until it returns a truthy value (returned); fail after ``timeout_s``
    or as soon as ``process`` (a ``subprocess.Popen``) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process exited with code {process.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid``, one pid at a time (test clean-up after a failure)."""
    for proc in session_members(sid):
        try:
            os.kill(proc.pid, 9)
        except ProcessLookupError:
            pass
