"""The run stops when its launcher dies, whatever kills the launcher (``--parent-pid``).

The geo3k launcher starts the driver in a session of its own (``setsid``), so that it can stop
exactly the run's processes on exit, Ctrl-C or SIGTERM.  Nothing can trap SIGKILL, though: a
``kill -9`` of the launcher used to leave the driver and its Ray processes running, writing the
checkpoint folder and the metrics file that a resumed run would then share.  So the launcher
passes its PID (``--parent-pid $$``) and the driver watches it (:func:`watch_parent`):

1. A daemon thread waits for the process to exit: on a pidfd (``os.pidfd_open``, Linux >= 5.3),
   which becomes readable the moment the process exits; elsewhere it polls every 0.5 s.
2. When it has exited, the thread logs it and interrupts the main thread: a SIGUSR1 sent to
   that thread (``signal.pthread_kill``) wakes it from any blocking call, and the handler raises
   :class:`ParentExited`, a ``KeyboardInterrupt`` (``ray.get`` breaks out too), so the driver
   unwinds as after Ctrl-C: its ``finally`` blocks stop the engines and trainers
   and the Ray instance it started (an external cluster, ``--ray-address``, is only left; Ray
   then kills the job's actors itself).  No checkpoint is started or marked complete on this
   path; one being written at that moment stays unmarked, so a resume uses the one before it.
3. If the driver is still alive ``grace_s`` seconds later (a hung clean-up), the thread ends the
   process with ``os._exit``; Ray's processes follow it (a local Ray instance shares the
   driver's fate; a cluster kills a dead driver's actors).

Why a watch rather than the alternatives:

- ``prctl(PR_SET_PDEATHSIG)`` fires when the *thread* that forked the child exits, not the
  process (wrong for a multi-threaded parent); it is set by the child after it starts, so a
  parent that died before that goes unnoticed; and it delivers a signal that the driver would
  have to turn into the same clean shutdown anyway.  If ``setsid`` has to fork (it does when
  called as a process-group leader), the driver's parent is ``setsid``, which exits at once.
- A lease (a pipe whose write end only the launcher holds; EOF means "launcher gone") is
  robust in principle, but a shell script cannot create an anonymous pipe for a child, and any
  other process that inherits the write end silently keeps the lease alive.
- A pidfd names one process, with no PID-reuse race once opened; when the PID is the driver's
  parent, checking ``os.getppid()`` after opening proves the pidfd is that live parent.  It
  needs nothing from the launcher but its PID.

Without ``--parent-pid`` nothing is watched: ``nohup python -m slime.train ... &`` outlives
its shell, as it should.
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
    """Raised in the main thread once the watched process has exited.

    A ``KeyboardInterrupt`` so that everything that cleans up after Ctrl-C cleans up after this
    too; ``ray.get`` re-raises it as a plain ``KeyboardInterrupt``, so callers tell the two
    apart by :attr:`ParentWatch.fired`, not by the exception's type.
    """


WAKE_SIGNAL = signal.SIGUSR1
"""The signal the watch thread sends to the main thread: a real signal, so that a main thread
blocked in a system call (``time.sleep``, a lock, a pipe read) wakes up.  SIGINT cannot serve:
a shell starts background jobs with SIGINT ignored, and then Python never raises
``KeyboardInterrupt`` for it.  While the watch runs, a SIGUSR1 from elsewhere is passed to the
previous handler (default: ignored while the parent lives)."""


class ParentWatch:
    """Watches process ``pid`` from a daemon thread (see the module docstring); built by
    :func:`watch_parent`, started by :meth:`start` or a ``with`` block, which stops it on exit.
    With ``pid=None`` it watches nothing.

    Attributes:
        pid: the watched process, or None.
        fired: set once the process has exited and the main thread was interrupted.
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
        """Stop watching (the run ended by itself); the thread exits within ``poll_s``.

        Once the watch has fired, this changes nothing: the process is on its way out and is
        ended ``grace_s`` seconds after the firing if it is still alive.
        """
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
        """Interrupt the main thread, then end the process if it is still alive after ``grace_s``."""
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
    """A watch that stops this process's run when process ``pid`` exits (``--parent-pid``);
    it watches nothing when ``pid`` is None.

    Use it from the driver's main thread around the run: ``with watch_parent(pid) as watch:``
    (or :meth:`ParentWatch.start` / :meth:`ParentWatch.stop`).  When ``pid`` has already
    exited, the main thread is interrupted at once.

    Args:
        pid: the launcher's PID, usually the driver's parent.
        grace_s: seconds between interrupting the main thread and ending the process.
        poll_s: seconds between checks (also the pidfd wait's timeout, so that :meth:`ParentWatch.stop`
            takes effect).

    Returns:
        The watch, not yet started.
    """
    return ParentWatch(pid, grace_s, poll_s)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, or None where pidfds are unavailable (then the watch polls).  For a pid
    that has already exited, a descriptor that is always readable (:func:`_exited_pidfd`)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return _exited_pidfd()
    except OSError:  # ENOSYS (old kernel) or EPERM (seccomp): poll instead
        return None


def _exited_pidfd() -> int:
    """A descriptor that is always readable, standing for a process that has exited."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end
