"""The process's one ``forkserver`` (the standard library's start method) and the modules its server imports.

Several parts of a process may start workers from the fork server, each wanting some modules imported once there
(the reward scorer: math-verify; the test harness's CPU ranks: torch and the backends).  The standard
library keeps one server per process and one preload list, and offers only a setter, so a second caller would
replace the first one's list; :func:`forkserver_context` adds to it instead.  The list counts only until the server
starts (the first worker of the process starts it); after that, a worker imports what its server lacks itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
from typing import Iterable


def preloaded() -> list[str]:
    """The modules the fork server imports when it starts, as set so far (the default ``__main__`` left out: a
    Ray worker's or pytest's main module is not for a fork server to import)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)  # the stdlib's own instance (no public getter)
    return [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]


UNIX_SOCKET_PATH_MAX = 107
"""The longest Unix-socket path Linux takes (``sun_path`` is 108 bytes with its NUL)."""


class ForkServerUnavailable(RuntimeError):
    """The fork server cannot start here (its Unix socket's path under ``TMPDIR`` is too long)."""


def check_socket_path() -> None:
    """Refuse a temporary directory too deep for the server's socket before the standard library fails on it.

    The server listens on a path that ``multiprocessing.connection.arbitrary_address("AF_UNIX")`` draws (a name in
    ``multiprocessing.util.get_temp_dir()``, itself ``pymp-XXXXXXXX`` under ``tempfile.gettempdir()``, so under
    ``TMPDIR``; drawing one creates nothing).  Past :data:`UNIX_SOCKET_PATH_MAX` bytes the start raises a bare
    ``OSError: AF_UNIX path too long`` from inside ``multiprocessing``.

    Raises:
        ForkServerUnavailable: naming the path, its length and the directory it sits under.
    """
    import multiprocessing.connection
    import multiprocessing.util

    socket = multiprocessing.connection.arbitrary_address("AF_UNIX")
    if len(os.fsencode(socket)) > UNIX_SOCKET_PATH_MAX:
        base = os.path.dirname(multiprocessing.util.get_temp_dir())
        raise ForkServerUnavailable(
            f"the fork server's socket would be {socket} ({len(os.fsencode(socket))} bytes), over the "
            f"{UNIX_SOCKET_PATH_MAX} bytes a Unix socket path may have; the temporary directory {base} (TMPDIR) "
            "is too deep: point TMPDIR at a shorter directory (e.g. /tmp)")


def forkserver_context(modules: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context, ``modules`` added to its server's preload (those already there kept, in order).

    Raises:
        ValueError: the platform has no ``forkserver`` start method (not POSIX).
        ForkServerUnavailable: ``TMPDIR`` too deep for the server's socket (:func:`check_socket_path`).
    """
    context = multiprocessing.get_context("forkserver")
    check_socket_path()
    current = preloaded()
    context.set_forkserver_preload(current + [m for m in modules if m not in current])
    return context
