"""The SGLang server process the engine starts: ``python -m slime.rollout.engines.sglang.server_main [SGLang flags]``.

The same as ``python -m sglang.launch_server [SGLang flags]`` (SGLang 0.5.17's ``launch_server``:
load the plugins, ``prepare_server_args``, ``run_server``), with one difference: the run's secret
is read from the first line of standard input and handed to SGLang's own parser as ``--api-key=<secret>``
and ``--admin-api-key=<secret>`` in this process (SGLang 0.5.17's ``ServerArgs`` is read-only once resolved,
so the keys cannot be set afterwards), so it is in neither the command line (``ps``,
``/proc/<pid>/cmdline``) nor the environment.  With both keys set to the same secret, SGLang 0.5.17 refuses every endpoint
without ``Authorization: Bearer <secret>`` except ``/health*`` and ``/metrics``
(``sglang.srt.utils.auth.decide_request_auth``: normal endpoints check ``api_key``, management
endpoints ``admin_api_key``).  An empty first line leaves the server open (tests only).

Everything else is SGLang's; the plugin (:mod:`.server_plugin`) is found through the
``*.dist-info`` folder the engine put on ``PYTHONPATH``.

The server also dies with the engine (:func:`exit_with_parent`): a thread watches the parent process (the
engine's Ray actor) and, once it is gone (e.g. the actor was killed), kills the server's own session (SGLang's
scheduler and detokenizer processes with it); and a guard process in the session kills the session once the
server's main process is gone, however it ended (Ray kills an exiting actor's direct children, which the thread
cannot see), so no orphaned server process keeps the GPU memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

PARENT_POLL_S = 1.0


_SESSION_GUARD = """
import os, signal, sys, time
main, poll_s = int(sys.argv[1]), float(sys.argv[2])
while os.getppid() == main:
    time.sleep(poll_s)
if os.getsid(0) == main:
    os.killpg(os.getpgrp(), signal.SIGKILL)
"""
"""The session guard (:func:`exit_with_parent`): argv ``<main pid> <poll seconds>``."""


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Tie this process's session to this process and to its parent (the engine's actor); returns the thread.

    - A daemon thread polls ``os.getppid()`` every ``poll_s`` seconds; once the parent has exited it kills this
      process's session (when it leads one, as the engine starts it) with ``SIGKILL``, or else this process alone.
    - When this process leads its session, a *session guard*: a small process (``python -I``) in the session that
      polls its own parent (this process) and, once this process has exited however it ended, ``SIGKILL`` s the
      session.  Ray kills an actor's direct children when the actor exits (``RAY_kill_child_processes_on_worker_exit``,
      default on; not recursive) and an OOM killer may pick this process: neither lets the thread run, and both
      would leave SGLang's scheduler and detokenizer processes behind.  The session's number is held by its
      members (the guard among them) until the last one exits, so the guard's ``killpg`` reaches this session only.
    """
    parent = os.getppid()
    if os.getsid(0) == os.getpid():
        subprocess.Popen([sys.executable, "-I", "-c", _SESSION_GUARD, str(os.getpid()), str(poll_s)],
                         stdin=subprocess.DEVNULL)

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        if os.getsid(0) == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    secret = sys.stdin.readline().strip()
    sys.stdin.close()
    exit_with_parent()
    from slime.rollout.engines.sglang.server_plugin import MAIN_PID_ENV

    os.environ[MAIN_PID_ENV] = str(os.getpid())  # children inherit it: the plugin tells main from schedulers

    from sglang.srt.plugins import load_plugins

    load_plugins()

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    # One token each (``--api-key=<secret>``): a separate value starting with "-" (token_urlsafe's alphabet has it,
    # 1 start in 64) would be read by argparse as an option, and the server would refuse to start.
    keys = [f"--api-key={secret}", f"--admin-api-key={secret}"] if secret else []
    server_args = prepare_server_args([*argv, *keys])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
