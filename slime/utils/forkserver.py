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
from typing import Iterable


def preloaded() -> list[str]:
    """The modules the fork server imports when it starts, as set so far (the default ``__main__`` left out: a
    Ray worker's or pytest's main module is not for a fork server to import)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)  # the stdlib's own instance (no public getter)
    return [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]


def forkserver_context(modules: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context, ``modules`` added to its server's preload (those already there kept, in order).

    Raises:
        ValueError: the platform has no ``forkserver`` start method (not POSIX).
    """
    context = multiprocessing.get_context("forkserver")
    current = preloaded()
    context.set_forkserver_preload(current + [m for m in modules if m not in current])
    return context
