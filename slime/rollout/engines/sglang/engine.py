"""The SGLang rollout engine: one SGLang server process per engine, driven over its HTTP API.

:class:`SGLangEngine` lives in the engine's Ray actor with ``CUDA_VISIBLE_DEVICES`` set to the engine's GPUs on its
node; it starts the server (:mod:`.launch`) and talks to it through :class:`~.client.SGLangClient` with a per-server
secret that never leaves the actor and the server.  Each :class:`~slime.rollout.engines.base.RolloutEngine` method
is one endpoint (``docs/design/sglang_engine.md`` lists them).  Once ``/health`` answers, the engine checks the
plugin's reports (:mod:`.server_plugin`) and refuses to serve without them, or without the multimodal-RoPE fix where
the release needs it (unless ``SLIME_SGLANG_MROPE_FIX=0``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

import torch

from slime.routing_replay import RouteShape
from slime.rollout.engines.base import (
    GPU_MEMORY_TYPE_CUDA_GRAPH,
    EngineResources,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    memory_tags,
)
from slime.rollout.engines.sglang import generation
from slime.rollout.engines.sglang.client import SGLangClient, SGLangRequestError, SGLangUnavailable
from slime.rollout.engines.config import EngineSpec
from slime.rollout.engines.sglang.flags import (
    SGLangConfig,
    MAX_SERVER_CONCURRENCY,
    default_requests_per_call,
    requests_per_call,
    server_concurrency,
    slime_owned_args,
)
from slime.rollout.engines.sglang.launch import (
    ROUTES_FLAG,
    GPUStartLock,
    ServerProcess,
    ServerSpec,
    server_command,
    server_env,
    server_host,
    write_plugin_dist,
)
from slime.rollout.engines.sglang.server_plugin import MROPE_FIX_ENV, read_reports
from slime.rollout.engines.sglang.versions import memory_tags_supported, needs_mrope_fix

logger = logging.getLogger(__name__)

MAX_CONCURRENT_CALLS = MAX_SERVER_CONCURRENCY
"""Threads of an SGLang engine's actor for ``generate`` (one call each); the upper bound of
``--sglang-server-concurrency``."""
EXIT_WAIT_S = 2.0
"""After a lost connection, how long to wait for the server's exit code before reporting only the lost connection."""
FLUSH_RETRY_S = 60.0
"""How long ``/flush_cache`` is retried while the server still has requests (it answers 400 then)."""


class ServerReportError(RuntimeError):
    """The server runs without what slime needs in it (the plugin's reports say what is missing)."""


class SGLangEngine(RolloutEngine):
    """One SGLang server (module docstring).

    Args:
        spec: what the server is started with (:class:`~.launch.ServerSpec`).
        run_dir: folder for the server's log (``server.log``), plugin folder and reports.
        capacity: requests in flight (``--sglang-server-concurrency``), at most :data:`MAX_CONCURRENT_CALLS`.
        requests_per_call: requests per ``/generate`` call (``--sglang-requests-per-call``), 1..``capacity``; default
            :func:`~.config.default_requests_per_call`.
        gpu_ids: the engine's GPUs as ``nvidia-smi`` numbers them (for :meth:`memory_info`).
        secret: the first server's key (default: a new random one); a restarted server gets a new one.
        env: variables set for the server on top of this process's environment.

    Raises:
        ValueError: ``capacity`` or ``requests_per_call`` out of range.
        OSError: the server cannot be started.
    """

    weight_transports: ClassVar[tuple[str, ...]] = ("cuda_ipc", "nccl", "object_store")
    max_concurrent_calls: ClassVar[int] = MAX_CONCURRENT_CALLS
    parity_check: ClassVar[bool] = True

    def __init__(self, spec: ServerSpec, run_dir: str | os.PathLike, *, capacity: int = 512,
                 requests_per_call: int | None = None, gpu_ids: list[str] | None = None, secret: str | None = None,
                 env: dict[str, str] | None = None):
        if not 1 <= capacity <= MAX_CONCURRENT_CALLS:
            raise ValueError(f"--sglang-server-concurrency {capacity}: must be in 1..{MAX_CONCURRENT_CALLS}")
        if requests_per_call is None:
            requests_per_call = default_requests_per_call(capacity)
        if not 1 <= requests_per_call <= capacity:
            raise ValueError(f"--sglang-requests-per-call {requests_per_call}: must be in 1..{capacity} "
                             "(--sglang-server-concurrency)")
        self._requests_per_call = requests_per_call
        self.spec = spec
        self.run_dir = Path(run_dir)
        self._capacity = capacity
        self.gpu_ids = list(gpu_ids or [])
        self._secret = secret or _new_secret()
        self._env_overrides = dict(env or {})
        self._lock = threading.Lock()
        self._released: set[str] = set()
        self._shut_down = False
        self.server: ServerProcess | None = None
        self.client: SGLangClient | None = None
        self.reports: list[dict] = []
        self.memory_tags: tuple[str, ...] = ()
        self.version: str | None = None
        self._start_lock = GPUStartLock([])
        self.route_shape = RouteShape.from_checkpoint(spec.model_path) if ROUTES_FLAG in self.server_command() else None
        """The model's route shape when the server captures routes (requests may then ask for them), else None."""
        self._start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(cls, spec: EngineSpec, resources: EngineResources) -> SGLangEngine:
        """Engine ``resources.index`` of a run: its server on the engine's GPUs (see :mod:`.launch`).

        Raises:
            ValueError: the engine has no GPUs, or spans several nodes.
        """
        cls.check_resources(resources)
        sglang = spec.sglang or SGLangConfig()
        _, passthrough = slime_owned_args(sglang)
        server = ServerSpec(
            model_path=spec.hf_checkpoint,
            tp_size=len(resources.local_gpu_ids) or 1,
            host=server_host(resources.node_ip, _cluster_nodes()),
            port=_free_port(),
            seed=spec.rollout_seed + resources.index,
            colocated=resources.colocated,
            passthrough=tuple(passthrough),
            return_routed_experts=spec.return_routed_experts,  # the server captures routes: --enable-return-...
        )
        return cls(server, _run_dir(spec.output_dir, resources.index), capacity=server_concurrency(sglang),
                   requests_per_call=requests_per_call(sglang), gpu_ids=resources.local_gpu_ids)

    @classmethod
    def check_resources(cls, resources: EngineResources) -> None:
        """Raises:
        ValueError: CPU bundles (SGLang serves on CUDA GPUs), or bundles on several nodes.
        """
        if not resources.use_gpu:
            raise ValueError(
                f"--rollout-backend sglang needs GPUs, but {resources.describe()} has none; use "
                "--rollout-backend transformers on machines without a GPU"
            )
        if len(resources.node_ips) > 1:
            raise ValueError(
                f"{resources.describe()} spans {len(resources.node_ips)} nodes; an SGLang engine spans one node "
                "here: use --rollout-num-gpus-per-engine <= the GPUs per node"
            )

    def server_command(self) -> list[str]:
        """The command that starts the server (no secret in it)."""
        return server_command(self.spec)

    def _start(self) -> None:
        attempt = f"start-{time.strftime('%H%M%S')}-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
        folder = self.run_dir / attempt
        reports = folder / "reports"
        reports.mkdir(parents=True, exist_ok=True)
        plugin = write_plugin_dist(folder / "plugin")
        command = self.server_command()
        logger.info("starting SGLang server: %s (log %s)", " ".join(command), folder / "server.log")
        self.report_dir = reports
        env = server_env({**os.environ, **self._env_overrides}, plugin, reports)
        self.mrope_fix_disabled = env.get(MROPE_FIX_ENV) == "0"
        lock = GPUStartLock(self.gpu_ids)  # dropped by the watcher below once healthy or dead, or when stopped
        try:
            server = ServerProcess(command, env, folder / "server.log", self._secret)
        except BaseException:
            lock.release()
            raise
        self.server, self._start_lock = server, lock
        self.client = SGLangClient(self.spec.url, self._secret)
        self.reports, self.memory_tags, self.version = [], (), None
        self._released = set()
        if self._start_lock.held:
            watcher = SGLangClient(self.spec.url, self._secret)  # its own connection: the client is not shared
            threading.Thread(target=self._release_when_up, args=(self._start_lock, self.server, watcher),
                             name="sglang-start-lock", daemon=True).start()

    @staticmethod
    def _release_when_up(lock: GPUStartLock, server: ServerProcess, client: SGLangClient, poll_s: float = 0.5) -> None:
        """Drop ``lock`` once ``server`` answers ``/health`` (its caches are sized: the next server on these GPUs
        may start) or has exited, whoever else polls it, or nobody."""
        try:
            while lock.held and server.alive() and not client.healthy():
                time.sleep(poll_s)
        finally:  # whatever happens here, the next server on these GPUs is not left waiting
            lock.release()
            client.close()

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_requests_per_call(self) -> int:
        return self._requests_per_call

    # ------------------------------------------------------------------ health and reports

    def health(self) -> bool:
        """Whether the server is up; the first time it is, its plugin reports are checked.

        Raises:
            EngineUnavailableError: the server process exited (exit code and log tail in the message).
            ServerReportError: the server is up without the plugin's reports or the needed fix.
        """
        if self._shut_down:
            return False
        self._check_alive()
        if not self.client.healthy():
            return False
        if not self.reports:
            self._check_reports()
        return True

    def _check_alive(self) -> None:
        if self.server is not None and not self.server.alive():
            raise EngineUnavailableError(
                f"the SGLang server at {self.spec.url} exited with code {self.server.exit_code()}; log "
                f"{self.server.log_path}, last lines:\n{self.server.log_tail(30)}"
            )

    def _check_reports(self) -> None:
        """Read the plugin's reports (one per server process) and check them; sets the server's version and tags."""
        reports = read_reports(self.report_dir)
        schedulers = [r for r in reports if not r.get("main")]
        if not any(r.get("main") for r in reports) or len(schedulers) < self.spec.tp_size:
            raise ServerReportError(
                f"the SGLang server at {self.spec.url} is up, but slime's plugin reported from "
                f"{len(reports)} process(es) ({len(schedulers)} scheduler(s) for --tp-size {self.spec.tp_size}): "
                "it did not load in every server process, so the multimodal-RoPE fix and the log redaction "
                f"cannot be vouched for. Check the log {self.server.log_path} for 'plugin'."
            )
        version = reports[0]["sglang"]
        states = {r["mrope_fix"] for r in schedulers}  # the main process runs no model
        if states == {"pending"} and not _is_qwen35(self.client.model_info()):
            states = {"not needed (not a Qwen3.5 model)"}  # SGLang never imported Qwen3.5's model module
        elif needs_mrope_fix(version) and states != {"disabled" if self.mrope_fix_disabled else "applied"}:
            raise ServerReportError(
                f"SGLang {version} has the Qwen3.5 multimodal-RoPE bug, and the fix is {sorted(states)} in its "
                f"processes (wanted 'applied' in all); see {self.server.log_path}"
            )
        flushes = {r.get("mm_embedding_flush", "not reported") for r in schedulers}
        if flushes != {"applied"}:  # an SGLang whose scheduler has another layout: serving works, a sync may not
            logger.warning("SGLang %s at %s: slime's multimodal-embedding flush is %s in its scheduler processes "
                           "(wanted 'applied'): after a weight sync a repeated image may be embedded with the old "
                           "vision weights; see %s", version, self.spec.url, sorted(flushes), self.server.log_path)
        batch_wait = {r.get("batch_wait_fix", "not reported") for r in reports if r.get("main")}
        if not batch_wait <= {"applied", "not needed"}:  # serving works; a refused batch is resent one request a call
            logger.warning("SGLang %s at %s: slime's fix for batched requests that finish before SGLang waits for them "
                           "is %s in its main process (wanted 'applied'): such a batch fails with HTTP 500 and is "
                           "sent again one request per call; see %s", version, self.spec.url, sorted(batch_wait),
                           self.server.log_path)
        self.reports, self.version = reports, version
        self.memory_tags = memory_tags_supported(reports[0].get("memory_tags"))
        logger.info("SGLang %s at %s: multimodal-RoPE fix %s in %d scheduler process(es); memory tags %s",
                    version, self.spec.url, "/".join(sorted(states)), len(schedulers), list(self.memory_tags))

    def log_tail(self) -> str:
        return self.server.log_tail() if self.server is not None else ""

    def _call(self, fn, *args, **kwargs):
        """Run a client call; a dead server process turns any failure into :class:`EngineUnavailableError`."""
        if self._shut_down:
            raise EngineUnavailableError("the SGLang engine was shut down")
        try:
            return fn(*args, **kwargs)
        except SGLangUnavailable:
            if self.server is not None:  # a dying server resets its connections before it exits: give it a moment
                self.server.wait_exit(EXIT_WAIT_S)  # not reaped: stop() still owns the process group
            self._check_alive()
            raise

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete the requests in one ``/generate`` call (:func:`.generation.generate`), with routed experts where a
        request asks and :attr:`route_shape` is set.

        Raises:
            EngineUnavailableError: the server is gone (the group retries the requests elsewhere).
            SGLangRequestError: a request refused (its ``rid`` and SGLang's reason) or answered malformed.
        """
        return generation.generate(requests, lambda payload: self._call(self.client.generate, payload),
                                   lambda: self.client.close(), self.spec.url, self.route_shape)

    # ------------------------------------------------------------------ weights

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]],
                                   flush_cache: bool = True) -> None:
        """One bucket from the object store: CPU tensors sent by value (the same payload for every TP rank)."""
        from slime.weight_sync.flattened import flatten, serialize_bucket_by_value

        payload = serialize_bucket_by_value(flatten(named_tensors, device="cpu"))
        self._call(self.client.update_weights_from_tensor, [payload] * self.spec.tp_size, "flattened_bucket",
                   flush_cache=False)
        if flush_cache:
            self.flush_cache()

    def update_weights_from_ipc(self, serialized_per_tp_rank: list[str]) -> None:
        if len(serialized_per_tp_rank) != self.spec.tp_size:
            raise ValueError(
                f"{len(serialized_per_tp_rank)} CUDA IPC payloads for an engine of --tp-size {self.spec.tp_size}; "
                "one per TP rank, each made on that rank's GPU"
            )
        self._call(self.client.update_weights_from_tensor, list(serialized_per_tp_rank), "flattened_bucket",
                   flush_cache=False)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str) -> None:
        self._call(self.client.init_weights_update_group, master_address, master_port, rank_offset, world_size,
                   group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str) -> None:
        self._call(self.client.update_weights_from_distributed, names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str) -> None:
        try:
            self._call(self.client.destroy_weights_update_group, group_name)
        except SGLangRequestError as e:  # a group this (maybe restarted) server never joined
            logger.info("destroy_weights_update_group %s: %s", group_name, e)

    # ------------------------------------------------------------------ memory, cache, pause

    def _tags(self, tags: list[str] | None) -> list[str]:
        """``tags`` (None: all) that this server has: not ``cuda_graph`` where the release lacks that tag or the
        server captures no CUDA graphs (``--disable-cuda-graph``)."""
        wanted = memory_tags(tags)
        supported = self.memory_tags or memory_tags_supported(None)
        if "--disable-cuda-graph" in self.spec.passthrough:
            supported = tuple(t for t in supported if t != GPU_MEMORY_TYPE_CUDA_GRAPH)
        return [t for t in wanted if t in supported]

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` for ``tags`` that are held (the server refuses a tag twice)."""
        todo = [t for t in self._tags(tags) if t not in self._released]
        if todo:
            self._call(self.client.release_memory_occupation, todo)
            self._released.update(todo)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``/resume_memory_occupation`` for ``tags`` that are released (the server refuses the others)."""
        todo = [t for t in self._tags(tags) if t in self._released]
        if todo:
            self._call(self.client.resume_memory_occupation, todo)
            self._released.difference_update(todo)

    def flush_cache(self) -> None:
        """``/flush_cache``, retried for up to :data:`FLUSH_RETRY_S` while the server still has requests.

        Raises:
            SGLangRequestError: it still refuses after that.
        """
        deadline = time.monotonic() + FLUSH_RETRY_S
        while True:
            try:
                self._call(self.client.flush_cache)
                return
            except SGLangRequestError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def pause_generation(self, mode: str = "abort") -> None:
        """``/pause_generation``: ``abort`` (SGLang 0.5.17's default: running requests return with
        ``finish_reason "abort"``) or ``retract`` (they go back to the queue and resume after continue)."""
        self._call(self.client.pause_generation, mode)

    def continue_generation(self) -> None:
        self._call(self.client.continue_generation)

    def abort_requests(self) -> None:
        """``/pause_generation`` in ``abort`` mode (the requests in flight return cut off), then
        ``/continue_generation``."""
        self.pause_generation("abort")
        self.continue_generation()

    def memory_info(self) -> dict[str, float]:
        """Free and total memory of the engine's GPUs (``nvidia-smi``), GiB; empty when it cannot tell."""
        return gpu_memory(self.gpu_ids)

    # ------------------------------------------------------------------ lifecycle

    def restart(self) -> None:
        """Stop what is left of the old server and start a new one on a new port with a new secret (nothing the old
        server, or a process that read its key, holds stays usable); a recording (``client.record``) goes on, redacted.
        """
        with self._lock:
            if self._shut_down:
                raise EngineUnavailableError("the SGLang engine was shut down")
            if self.server is not None:
                self.server.stop()
            self._start_lock.release()
            record = None
            if self.client is not None:
                self.client.close()
                record = self.client.record
            self.spec = dataclasses.replace(self.spec, port=_free_port())
            self._secret = _new_secret()
            self._start()
            self.client.record = record

    def shutdown(self) -> None:
        """Stop the server and everything it started (its session); idempotent."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            if self.server is not None:
                self.server.stop()
            self._start_lock.release()


def _new_secret() -> str:
    """A server's key: 32 random bytes, URL-safe base64 (``secrets.token_urlsafe``)."""
    return secrets.token_urlsafe(32)


def _is_qwen35(model_info: dict) -> bool:
    """Whether SGLang's ``/model_info`` names a Qwen3.5 architecture (the ones of ``sglang/srt/models/qwen3_5*.py``)."""
    return any(str(arch).startswith("Qwen3_5") for arch in model_info.get("architectures") or [])


def gpu_memory(gpu_ids: list[str]) -> dict[str, float]:
    """``{"free_gib", "total_gib", "gpus"}``, the first two summed over ``gpu_ids``, from ``nvidia-smi``; ``{}``
    without it."""
    if not gpu_ids or shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits",
             "-i", ",".join(gpu_ids)], capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    free = total = 0.0
    for line in out.strip().splitlines():
        f, t = (float(x) for x in line.split(","))
        free, total = free + f, total + t
    return {"free_gib": free / 1024, "total_gib": total / 1024, "gpus": float(len(gpu_ids))}


def _cluster_nodes() -> int:
    import ray

    if not ray.is_initialized():
        return 1
    return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))


def _free_port() -> int:
    from slime.ray.placement import free_port

    return free_port()


def _run_dir(output_dir: str | None, index: int) -> Path:
    """``<output-dir>/sglang/engine-<index>`` when the run has an output folder, else a temporary folder."""
    if output_dir:
        return Path(output_dir) / "sglang" / f"engine-{index}"
    return Path(tempfile.mkdtemp(prefix=f"slime-sglang-engine-{index}-"))
