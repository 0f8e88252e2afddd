"""The SGLang server process the engine starts: ``python -m slime.rollout.engines.sglang.server_main [SGLang flags]``.

SGLang 0.5.17's ``launch_server`` (load the plugins, ``prepare_server_args``, ``run_server``), except that the run's
secret comes from the first line of standard input and goes to SGLang's parser as ``--api-key`` and
``--admin-api-key`` (so it is in neither the command line nor the environment; no secret, no server).  Before
``run_server``, :func:`check_server_args` refuses settings that would skip the key check or write the key to disk
(exit code 2), and :func:`exit_with_parent` ties the server's session to the engine's actor.  Why each:
``docs/design/sglang_engine.md``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

PARENT_POLL_S = 1.0
REFUSED_EXIT_CODE = 2
"""The server's exit code when :func:`check_server_args` refuses the resolved arguments."""
_TRUE = ("true", "1", "yes", "y")
"""What SGLang 0.5.17's ``EnvBool`` reads as true (``sglang/srt/environ.py``)."""


class UnsafeServerArgs(ValueError):
    """SGLang resolved server arguments that would open the server to requests without the run's key, or write
    the key to disk (:func:`check_server_args`)."""


def given_value(argv: list[str], flag: str) -> str | None:
    """The value of the first ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), None without one: slime's
    own flags come first in the server's command (:func:`~.launch.server_command`)."""
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token[len(flag) + 1:]
    return None


def check_server_args(server_args, host: str | None, secret: str, environ=None) -> None:
    """Refuse SGLang 0.5.17 ``ServerArgs`` (as ``prepare_server_args`` resolved them, whatever the route) that slime
    cannot run safely: no secret, a gRPC listener or mode, more than one tokenizer worker, another host than ``host``
    (the ``--host`` slime gave), keys other than ``secret``, a crash-dump folder, or ``SGLANG_RUST_SERVER`` set in
    ``environ`` (default ``os.environ``).

    Raises:
        UnsafeServerArgs: the message names every setting refused and why.
    """
    environ = os.environ if environ is None else environ
    problems = []
    if not secret:
        problems.append("no secret on standard input: the server would accept requests from anyone")
    if getattr(server_args, "grpc_port", None) is not None:
        problems.append(f"grpc_port={server_args.grpc_port} (from --grpc-port, SGLANG_GRPC_PORT or a --config file): "
                        "SGLang's gRPC listener skips the API-key check")
    for name in ("grpc_mode", "smg_grpc_mode"):
        if getattr(server_args, name, False):
            problems.append(f"{name} is set: SGLang's legacy gRPC server never checks the API key")
    workers = getattr(server_args, "tokenizer_worker_num", 1)
    if workers != 1:
        problems.append(f"tokenizer_worker_num={workers}: SGLang 0.5.17 enforces API keys only with one tokenizer "
                        "worker")
    if host is None or getattr(server_args, "host", None) != host:
        problems.append(f"host={getattr(server_args, 'host', None)!r}, not the {host!r} slime gave (--host)")
    if secret and (getattr(server_args, "api_key", None) != secret
                   or getattr(server_args, "admin_api_key", None) != secret):
        problems.append("api_key / admin_api_key are not the run's secret")
    if getattr(server_args, "crash_dump_folder", None) is not None:
        problems.append(f"crash_dump_folder={server_args.crash_dump_folder!r}: SGLang pickles its server arguments, "
                        "the secret among them, into it on a crash or SIGTERM")
    if environ.get("SGLANG_RUST_SERVER", "").strip().lower() in _TRUE:
        problems.append("SGLANG_RUST_SERVER is set: its embedded Rust server replaces the HTTP server whose key "
                        "check slime relies on")
    if problems:
        raise UnsafeServerArgs("slime refuses to start this SGLang server: " + "; ".join(problems))


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
    """Tie this process's session to this process and to its parent (the engine's actor); returns the watcher thread.

    A daemon thread kills the session (this process alone when it leads none) with ``SIGKILL`` once the parent has
    exited; when this process leads its session, a guard process in it (``python -I``) kills the session once this
    process has exited, however it ended.  Why both: ``docs/design/sglang_engine.md``.
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
        check_server_args(server_args, given_value(argv, "--host"), secret)
    except UnsafeServerArgs as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(REFUSED_EXIT_CODE)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
