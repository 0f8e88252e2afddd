"""A Ray cluster for the end-to-end tests whose runs join one with ``--ray-address`` (what ``SLIME_SCRIPT_EXTERNAL_RAY=1``
passes): ``ray start --head --block`` in a session of its own, so that a test can tell the cluster's processes from a
run's and stop exactly them.  Joining a running head spares each run a local Ray instance's start and stop (about
10 s on a 2-core machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.process_tree import kill_session, wait_session_gone

REPO = Path(__file__).resolve().parents[1]


def ray_env(**extra: str) -> dict[str, str]:
    """This environment plus what the head, ``ray status`` and the drivers must share: one authentication mode (Ray
    2.60's defaults differ between ``ray start`` and clients), no usage stats, no hub, the repository importable."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
            "RAY_AUTH_MODE": "disabled", **extra}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    """The ``ray`` command of this interpreter's environment."""
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")


def ray_status(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``ray status --address address`` (exit code 0 once the head answers)."""
    return subprocess.run([ray_cli(), "status", "--address", address], env=env, capture_output=True, text=True)


def start_head(env: dict[str, str], num_cpus: int = 4) -> tuple[subprocess.Popen, str]:
    """A ``ray start --head --block`` with ``num_cpus`` logical CPUs in a session of its own (its pid is the session
    id), once ``ray status`` answers; returns it and its ``host:port``.  AssertionError if it does not come up."""
    port = _free_port()
    head = subprocess.Popen(
        [ray_cli(), "start", "--head", "--block", "--port", str(port), "--num-cpus", str(num_cpus),
         "--include-dashboard", "false", "--node-ip-address", "127.0.0.1",
         "--object-store-memory", str(1 << 30)],  # the driver's own default for a local instance
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    status = None
    for _ in range(120):  # the head takes seconds to come up on a busy machine
        status = ray_status(address, env)
        if status.returncode == 0:
            return head, address
        time.sleep(1)
    stop_head(head)
    raise AssertionError(f"ray head did not start:\n{status.stdout}{status.stderr}")


def stop_head(head: subprocess.Popen) -> None:
    """SIGKILL every process of the head's session and wait (up to 60 s) until none is left."""
    kill_session(head.pid)
    wait_session_gone(head.pid, timeout_s=60)


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 4) -> Iterator[tuple[subprocess.Popen, str]]:
    """:func:`start_head` for the ``with`` block, stopped at its end."""
    head, address = start_head(env, num_cpus)
    try:
        yield head, address
    finally:
        stop_head(head)
