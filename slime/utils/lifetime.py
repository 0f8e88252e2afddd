"""The run stops when its launcher dies, whatever kills the launcher (``--parent-pid``).

:func:`watch_parent` watches the launcher's PID from a daemon thread (a pidfd where available, else a
poll every ``POLL_S``).  When it exits, the thread interrupts the main thread with :data:`WAKE_SIGNAL`,
whose handler raises :class:`ParentExited`, so the driver unwinds as after Ctrl-C (engines, trainers
and the Ray instance it started are stopped; no checkpoint is started or marked complete).  If the
process is still alive ``grace_s`` later, the thread ends it with ``os._exit``.  Without
``--parent-pid`` nothing is watched.  Why a watch (not ``PR_SET_PDEATHSIG``, not a lease):
``docs/design/run_lifetime.md``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""Seconds between checks where no pidfd is available."""
GRACE_S = 60.0
"""Seconds the driver has to shut down after its parent died before the process is ended."""


class ParentExited(KeyboardInterrupt):
    """Raised in the main thread once the watched process has exited; a ``KeyboardInterrupt``, so that Ctrl-C's
    clean-up runs.  ``ray.get`` re-raises it as a plain ``KeyboardInterrupt``: tell them apart by
    :attr:`ParentWatch.fired`.
    """


WAKE_SIGNAL = signal.SIGUSR1
"""The signal the watch thread sends to the main thread: a real signal, so that a main thread
blocked in a system call (``time.sleep``, a lock, a pipe read) wakes up.  SIGINT cannot serve:
a shell starts background jobs with SIGINT ignored, and then Python never raises
``KeyboardInterrupt`` for it.  While the watch runs, a SIGUSR1 from elsewhere is passed to the
previous handler (default: ignored while the parent lives)."""


class ParentWatch:
    """Watches process ``pid`` (``None``: nothing) from a daemon thread; built by :func:`watch_parent`.

    Started by :meth:`start` or a ``with`` block, which stops it on exit.  ``fired`` is set once the
    process has exited and the main thread was interrupted.
    """

    def __init__(self, pid: int | None, grace_s: float = GRACE_S, poll_s: float = POLL_S):
        self.pid, self.grace_s, self.poll_s = pid, grace_s, poll_s
        self.fired = threading.Event()
        self._stopped = threading.Event()
        self._previous_handler = None
        self._pidfd: int | None = None
        self._was_parent = False
        self._main_thread = threading.main_thread().ident

    def start(self) -> "ParentWatch":
        """Begin watching; call from the main thread (it installs the :data:`WAKE_SIGNAL` handler).

        Raises:
            RuntimeError: called from another thread while a pid is given.
        """
        if self.pid is None:
            return self
        if threading.get_ident() != self._main_thread:
            raise RuntimeError("watch_parent(...).start() must run in the main thread (it installs a signal handler)")
        self._previous_handler = signal.signal(WAKE_SIGNAL, self._on_wake_signal)
        self._pidfd = _open_pidfd(self.pid)
        self._was_parent = os.getppid() == self.pid  # after the pidfd: then that pidfd is this live parent
        threading.Thread(target=self._run, name=f"parent-watch-{self.pid}", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop watching (within ``poll_s``); after the watch fired it changes nothing."""
        if self.fired.is_set():
            return
        self._stopped.set()
        if self._previous_handler is not None and threading.get_ident() == self._main_thread:
            signal.signal(WAKE_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def __enter__(self) -> "ParentWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _on_wake_signal(self, signum, frame) -> None:
        if self.fired.is_set():
            raise ParentExited(f"the process --parent-pid {self.pid} has exited")
        previous = self._previous_handler
        if callable(previous):
            previous(signum, frame)

    def _run(self) -> None:
        while self._alive():
            if self._stopped.is_set():
                return
        if self._stopped.is_set():
            return
        self._fire()

    def _fire(self) -> None:
        logger.error(
            "the launcher (pid %d, --parent-pid) has exited: stopping this run (engines, trainers and the Ray "
            "instance it started); nothing more is written to the checkpoint folder", self.pid,
        )  # fmt: skip
        self.fired.set()
        signal.pthread_kill(self._main_thread, WAKE_SIGNAL)
        time.sleep(self.grace_s)
        logger.error("the run did not stop within %.0f s of its launcher's exit: ending the process", self.grace_s)
        logging.shutdown()
        os._exit(1)

    def _alive(self) -> bool:
        """Wait up to ``poll_s`` seconds; False once the watched process has exited."""
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], self.poll_s)
            return not readable
        time.sleep(self.poll_s)
        if self._was_parent:
            return os.getppid() == self.pid  # reparented to a reaper: the parent is gone (no PID-reuse race)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by someone else
        return True


def watch_parent(pid: int | None, *, grace_s: float = GRACE_S, poll_s: float = POLL_S) -> ParentWatch:
    """A watch (not yet started) that stops this process's run when process ``pid`` exits; ``None`` watches nothing.

    Use it around the run from the driver's main thread: ``with watch_parent(pid) as watch:``.  A ``pid``
    that has already exited interrupts at once.  ``grace_s``: seconds from the interrupt to ending the
    process; ``poll_s``: seconds between checks (also how soon :meth:`ParentWatch.stop` takes effect).
    """
    return ParentWatch(pid, grace_s, poll_s)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (always readable if it has exited), or None where pidfds are unavailable."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return _exited_pidfd()
    except OSError:  # ENOSYS (old kernel) or EPERM (seccomp): poll instead
        return None


def _exited_pidfd() -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end
