"""Linux process trees read from ``/proc``: the descendants of a process, the members of a session.

Both read ``/proc/<pid>/stat`` (``proc(5)``: after ``(comm)`` come state, ppid, pgrp, session, ...).
Where ``/proc`` cannot be read (not Linux) they see no process; a process that exits while it is read
is skipped.
"""

from __future__ import annotations

import collections
import os
import signal
from typing import Iterator


def _stats() -> Iterator[tuple[int, str, list[bytes]]]:
    """``(pid, comm, fields after comm)`` of every process that ``/proc`` shows."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        yield int(name), comm, stat[stat.rindex(b")") + 2 :].split()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kill_descendants(pid: int) -> list[str]:
    """SIGKILL every live (not zombie) descendant of process ``pid``.

    Returns:
        ``"pid N: command"`` (the command line cut at 200 characters) for each process killed.
    """
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, _, fields in _stats():
        state, ppid = fields[0], int(fields[1])
        if state not in (b"Z", b"X"):
            children[ppid].append(child)
    killed, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        stack.extend(children.get(child, []))
        command = _cmdline(child)
        try:
            os.kill(child, signal.SIGKILL)
            killed.append(f"pid {child}: {command[:200]}")
        except ProcessLookupError:
            pass
    return killed


def session_processes(sid: int) -> list[tuple[int, str]]:
    """``(pid, command name)`` of each process of session ``sid``."""
    return [(pid, comm) for pid, comm, fields in _stats() if len(fields) > 3 and int(fields[3]) == sid]
