"""Starting and stopping one SGLang server: its command line, environment, process and log.

:func:`server_command` runs :mod:`.server_main` (SGLang's ``launch_server`` with the run's secret read from standard
input) with the engine's flags, then every ``--sglang-*`` flag as given; :func:`server_env` builds its environment;
:class:`ServerProcess` runs it in a session of its own and stops that session; :class:`GPUStartLock` makes servers
that share a GPU start one at a time.  The secret never appears in the command, the environment, the log or
anything slime prints.  What each flag and variable is for: ``docs/design/sglang_engine.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from slime.rollout.engines.sglang.server_plugin import (
    ENTRY_POINT,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    REPORT_DIR_ENV,
)
from slime.utils.processes import session_processes

logger = logging.getLogger(__name__)

SERVER_MODULE = "slime.rollout.engines.sglang.server_main"
SERVER_PYTHONPATH_ENV = "SLIME_SGLANG_PYTHONPATH"
"""Extra ``PYTHONPATH`` entries for the SGLang servers only (colon-separated)."""
SERVER_OMP_ENV = "SLIME_SGLANG_OMP_NUM_THREADS"
"""``OMP_NUM_THREADS`` for the SGLang servers (default: unset, torch's own choice)."""
UNSAFE_SERVER_ENV = {
    "SGLANG_GRPC_PORT": "starts SGLang's native gRPC listener, which skips the API-key check "
    "(ServerArgs._handle_deprecated_args reads it when --grpc-port is unset)",
    "SGLANG_RUST_SERVER": "replaces SGLang's Python HTTP server and tokenizer manager (whose API-key check and "
    "endpoints slime relies on) with an embedded Rust server in the scheduler",
}
"""Variables of the actor's environment that the server does not inherit, and why (SGLang 0.5.17's
``sglang/srt/environ.py``; each also under its deprecated ``SGL_`` spelling, which SGLang renames to ``SGLANG_``)."""
LOCALHOST = "127.0.0.1"
ROUTES_FLAG = "--enable-return-routed-experts"
"""SGLang's server flag that captures the routed experts of every forward (0.5.17, ``server_args.py``)."""
STOP_GRACE_S = 30.0
"""Seconds between ``SIGTERM`` and ``SIGKILL`` when a server is stopped."""
LOG_TAIL_LINES = 60
_SLIME_SOURCE = str(Path(__file__).resolve().parents[4])
"""The folder holding the ``slime`` package (the server imports the plugin and entry point from it)."""


def server_host(node_ip: str, num_nodes: int) -> str:
    """The address a server binds: loopback on a one-node cluster, the node's own address across
    nodes (``0.0.0.0`` never: it would expose the weight-update endpoints on every interface).

    Raises:
        ValueError: ``num_nodes < 1``, or an empty / wildcard ``node_ip`` with several nodes.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes = {num_nodes}; a cluster has at least one node")
    if num_nodes == 1:
        return LOCALHOST
    if not node_ip or node_ip in ("0.0.0.0", "::"):
        raise ValueError(f"cannot bind an SGLang server to {node_ip!r}: give the node's own address")
    return node_ip


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """What one server is started with (everything but the secret): ``model_path`` (``--hf-checkpoint``), ``tp_size``
    (the engine's GPUs), ``host`` (:func:`server_host`), ``port``, ``seed`` (SGLang's ``--random-seed``), ``colocated``
    (adds ``--enable-memory-saver``), ``passthrough`` (the ``--sglang-*`` flags as SGLang flags) and
    ``return_routed_experts`` (adds :data:`ROUTES_FLAG`)."""

    model_path: str
    tp_size: int
    host: str
    port: int
    seed: int
    colocated: bool
    passthrough: tuple[str, ...] = ()
    return_routed_experts: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def server_command(spec: ServerSpec, python: str = sys.executable) -> list[str]:
    """The server's command line (no secret): ``--model-path``, ``--tp-size``, ``--base-gpu-id 0``, ``--host``,
    ``--port``, ``--random-seed``; when colocated ``--enable-memory-saver`` (with ``--speculative-algorithm`` also
    ``--enable-draft-weights-cpu-backup``); :data:`ROUTES_FLAG` when asked; ``--dtype bfloat16``; then the pass-through
    flags.  An added flag is left out where they set it already (or ``--dtype``, or ``--enable-weights-cpu-backup``)."""
    argv = [
        python, "-m", SERVER_MODULE,
        "--model-path", spec.model_path,
        "--tp-size", str(spec.tp_size),
        "--base-gpu-id", "0",
        "--host", spec.host,
        "--port", str(spec.port),
        "--random-seed", str(spec.seed),
    ]  # fmt: skip
    if spec.colocated and "--enable-memory-saver" not in spec.passthrough:
        argv.append("--enable-memory-saver")
    speculative = any(t == "--speculative-algorithm" or t.startswith("--speculative-algorithm=") for t in spec.passthrough)
    backups = ("--enable-draft-weights-cpu-backup", "--enable-weights-cpu-backup")
    if spec.colocated and speculative and not any(flag in spec.passthrough for flag in backups):
        argv.append("--enable-draft-weights-cpu-backup")
    if spec.return_routed_experts and ROUTES_FLAG not in spec.passthrough:
        argv.append(ROUTES_FLAG)
    if not any(token == "--dtype" or token.startswith("--dtype=") for token in spec.passthrough):
        argv += ["--dtype", "bfloat16"]
    return argv + list(spec.passthrough)


def write_plugin_dist(folder: str | os.PathLike) -> Path:
    """Write the ``*.dist-info`` folder that makes :mod:`.server_plugin` an SGLang general plugin (entry point
    ``sglang.srt.plugins: slime_server_plugin``) for processes with ``folder`` on ``sys.path``; returns ``folder``."""
    folder = Path(folder)
    dist = folder / "slime_sglang_plugin-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: slime-sglang-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT}\n")
    return folder


def server_env(base: dict[str, str], plugin_path: str | os.PathLike, report_dir: str | os.PathLike) -> dict[str, str]:
    """The server's environment: ``base`` with ``PYTHONPATH`` = the plugin folder, ``SLIME_SGLANG_PYTHONPATH``, slime's
    source, the inherited path; ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``; the report folder; no
    ``OMP_NUM_THREADS`` unless ``SLIME_SGLANG_OMP_NUM_THREADS`` gives one; less :data:`UNSAFE_SERVER_ENV` (a warning
    names each variable dropped)."""
    env = dict(base)
    for name in UNSAFE_SERVER_ENV:
        for spelling in (name, "SGL_" + name.removeprefix("SGLANG_")):
            if env.pop(spelling, None) is not None:
                logger.warning("the SGLang server does not inherit %s: it %s", spelling, UNSAFE_SERVER_ENV[name])
    extra = [p for p in env.get(SERVER_PYTHONPATH_ENV, "").split(os.pathsep) if p]
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(plugin_path), *extra, _SLIME_SOURCE, *inherited]))
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"
    env.pop("OMP_NUM_THREADS", None)  # Ray's per-actor value (often 1) would make SGLang's image processing serial
    if env.get(SERVER_OMP_ENV):
        env["OMP_NUM_THREADS"] = env[SERVER_OMP_ENV]
    env[REPORT_DIR_ENV] = str(report_dir)
    if env.get("SGLANG_PLUGINS"):  # an allow-list: keep ours on it
        names = [n.strip() for n in env["SGLANG_PLUGINS"].split(",") if n.strip()]
        env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*names, ENTRY_POINT_NAME]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class ServerProcess:
    """One running server: ``Popen`` in its own session, its log file, its secret on stdin.

    The server leads its session, so its pid numbers the process group that SGLang's scheduler and detokenizer
    inherit, and :meth:`stop` signals that group.  The leader is never reaped before the group is killed (its exit is
    read with ``waitid(..., WNOWAIT)``), so the number cannot pass to another process meanwhile; should something else
    reap it, :meth:`stop` signals nothing and logs what ``/proc`` shows in that session.  Why this is safe:
    ``docs/design/sglang_engine.md``.

    Args:
        command, env: :func:`server_command`, :func:`server_env`.
        log_path: where stdout and stderr go (appended).
        secret: written to the server's stdin (:mod:`.server_main`); scrubbed from :meth:`log_tail`.

    Raises:
        OSError: the process cannot be started.
    """

    def __init__(self, command: list[str], env: dict[str, str], log_path: str | os.PathLike, secret: str):
        self.command = list(command)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._secret = secret
        self._guard = threading.Lock()  # the leader's state: read by the engine's watcher thread, reaped by stop()
        self._stopping = threading.Lock()
        self._exit: int | None = None  # the leader's exit code once seen (Popen's convention)
        self._reaped = False  # by stop(), or stop() found it reaped elsewhere: its number is never signalled again
        self._reaped_elsewhere = False  # by something else: its number may be another's
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, cwd=str(self.log_path.parent),
            )  # fmt: skip
        try:
            self.process.stdin.write((secret + "\n").encode())
            self.process.stdin.close()
        except OSError:  # it exited at once; exit_code() and the log say why
            pass
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        """The server's pid, also its session's and process group's number."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the server's main process still runs (not reaped by this)."""
        return self.exit_code() is None

    def exit_code(self) -> int | None:
        """None while the main process runs, else its exit status as ``Popen.returncode`` gives it (``-N``:
        killed by signal ``N``; ``0`` when something else reaped it unseen, as ``Popen`` has it).  Does not reap."""
        with self._guard:
            self._look()
            return self._exit

    def _look(self) -> bool:
        """Look at the main process without reaping it (the caller holds ``_guard``); record its exit code once it
        exited.  Returns whether it is still this object's child (running, or a zombie holding its number)."""
        if self._reaped or self._reaped_elsewhere:
            return False
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = False
        if info is False or (info is None and self._exit is not None):  # reaped behind our back (None: the number
            self._reaped_elsewhere = True  # went to a new child of ours)
            if self._exit is None:
                self._exit = 0
            self.process.returncode = self._exit  # Popen must not wait for it either
            return False
        if info is not None and self._exit is None:
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self._exit = -info.si_status if killed else info.si_status
        return True

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` seconds for the main process to exit, without reaping it; its
        :meth:`exit_code` (None: it still runs)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)
        return code

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log, with the secret (should it be there) replaced."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        tail = "\n".join(collections.deque(text.splitlines(), maxlen=lines))
        return tail.replace(self._secret, "<redacted>") if self._secret else tail

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """``SIGTERM`` the server's process group, wait up to ``grace_s`` seconds for the main process, ``SIGKILL`` the
        group, then reap the main process; idempotent.  The group is never signalled after the reap; a main process that
        survives ``SIGKILL`` for 10 s stays unreaped, and a later ``stop()`` signals its group again."""
        with self._stopping:
            if self._reaped:
                return
            if not self._owns_number():
                self._warn_unsignalled()
                self._reaped = True
                return
            if self.alive():
                self._signal_group(signal.SIGTERM)
                self.wait_exit(grace_s)
            self._signal_group(signal.SIGKILL)
            if self.wait_exit(10.0) is None:
                return
            with self._guard:
                if self._look():
                    try:
                        self.process.wait(timeout=1.0)  # it has exited: this returns at once
                    except subprocess.TimeoutExpired:
                        return
                self._reaped = True

    def _owns_number(self) -> bool:
        """Whether the main process is still this object's unreaped child, so that its number names its group."""
        with self._guard:
            return self._look()

    def _signal_group(self, sig: int) -> None:
        """Send ``sig`` to the server's process group while its number is the server's."""
        with self._guard:
            if not self._look():
                return
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _warn_unsignalled(self) -> None:
        sid = self.process.pid
        found = [f"pid {pid} ({command})" for pid, command in session_processes(sid)]
        if found:
            logger.warning(
                "the SGLang server's main process (pid %d) was reaped by something other than slime, so its process "
                "group can no longer be told from another with the same number; not signalled: %s",
                sid, "; ".join(found),
            )


class GPUStartLock:
    """Exclusive ``flock`` s on one file per GPU of this node (``<tmp>/slime-sglang-start-gpu<i>.lock``), taken in GPU
    order and held while a server starts (why: ``docs/design/sglang_engine.md``).  Blocking (the engine group bounds the
    start-up); :meth:`release` is idempotent; the kernel drops a dead process's locks; the empty files stay.

    Args:
        gpu_ids: the engine's GPUs as ``nvidia-smi`` numbers them on this node; none: no lock.
        folder: where the lock files live (default: the system's temporary folder).

    Raises:
        PermissionError: a lock file that can be neither created nor read (nothing stays locked then).
    """

    def __init__(self, gpu_ids: list[str], folder: str | os.PathLike | None = None):
        folder = Path(folder or tempfile.gettempdir())
        self._guard = threading.Lock()  # release() may run in the engine's watcher thread and its caller
        self._files: list[int] = []
        try:
            for gpu in sorted(set(gpu_ids), key=lambda g: (len(str(g)), str(g))):
                fd = _open_lock_file(folder / f"slime-sglang-start-gpu{gpu}.lock")
                self._files.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:  # e.g. an unreadable lock file of the second GPU: the first one's lock goes too
            self.release()
            raise

    @property
    def held(self) -> bool:
        return bool(self._files)

    def release(self) -> None:
        with self._guard:
            for fd in self._files:
                os.close(fd)  # drops the flock (this is the only descriptor of its open file description)
            self._files = []


def _open_lock_file(path: Path) -> int:
    """A descriptor of the lock file ``path``, created mode 0666 so that every user's engines share it; another user's
    file (in a sticky folder, or not writable) is opened read-only (``flock`` needs no write access).  A symbolic link
    is never followed (``O_NOFOLLOW``).

    Raises:
        PermissionError: the file can be neither created nor read (the message names it and the way out).
        OSError: ``path`` is a symbolic link (``ELOOP``; the message names it and the way out).
    """
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o666)
        except PermissionError:
            try:
                return os.open(path, os.O_RDONLY | flags)
            except PermissionError as e:
                raise PermissionError(
                    f"cannot open the SGLang start lock {path} (another user's, not readable): make it readable "
                    f"(chmod a+r), or remove it while no SGLang server starts on that GPU"
                ) from e
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise OSError(
            errno.ELOOP, f"the SGLang start lock {path} is a symbolic link, which slime does not follow (someone "
            f"else's link could point it at any file): remove it, or give the lock files another folder "
            f"(TMPDIR)", str(path),
        ) from e
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # not a hard link to a file
            os.fchmod(fd, 0o666)
    except OSError:
        pass
    return fd

