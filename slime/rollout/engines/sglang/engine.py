"""The SGLang rollout engine: one SGLang server process per engine, driven over its HTTP API.

:class:`SGLangEngine` lives in the engine's Ray actor (:class:`slime.ray.engine_actor.EngineActor`)
on the engine's first bundle, with ``CUDA_VISIBLE_DEVICES`` set to all of the engine's GPUs on that
node.  It starts the server (:mod:`.launch`: command line, environment, log), talks to it through
:class:`~.client.SGLangClient` with a per-engine secret that never leaves the actor and the server,
and maps every :class:`~slime.rollout.engines.base.RolloutEngine` method onto one endpoint:

- :meth:`SGLangEngine.generate`: one ``/generate`` call per engine-group call, in SGLang's batch form
  when it holds several requests (every field a list; ``max_requests_per_call`` =
  ``--sglang-requests-per-call``, default 32), up to :attr:`capacity` requests at once
  (``--sglang-server-concurrency``; the engine group never has more in flight, which is the
  backpressure: the rest wait in the group's queue), the prompt as text plus ``image_data`` (base64
  images; never pre-tokenised ``input_ids``, which SGLang would expand a second time),
  ``sampling_params`` from the rollout flags, ``return_logprob=True``.  Why batches: SGLang's
  tokenizer manager pre-processes a batch's prompts one after the other and hands each to the
  scheduler as soon as it is ready, while many single-request calls that arrive together are
  pre-processed side by side (the image processor runs in its event loop) and reach the scheduler
  together, late: on the H200, 64 image prompts sent singly reached it 2 s after the first three
  (``docs/results/h200_sglang.md``, run 6).  The output
  takes ``output_ids``, the log-probs of ``meta_info.output_token_logprobs``,
  ``meta_info.finish_reason.type`` and ``meta_info.prompt_tokens`` (:func:`parse_generate_response`).
  SGLang's ``rid`` is the request's id plus a per-attempt suffix (unique while in flight, also when a
  request is retried); the output carries the request id back (``meta_info.id``), which the engine
  group compares with the request's.  SGLang 0.5.17 refuses a whole batch when it refuses one of its
  prompts (e.g. one longer than ``--context-length``: HTTP 400 ``{"error": {"message": ...}}``, naming
  neither the request nor its index), so a refused batch is sent again one request per call (logged as a
  warning): the error then names the refused request's ``rid`` and SGLang's reason, and a batch whose
  requests all complete alone returns their outputs.
- weights: ``/update_weights_from_tensor`` (object store: the bucket by value; CUDA IPC: one handle
  per TP rank, ``load_format="flattened_bucket"``), ``/init_weights_update_group`` +
  ``/update_weights_from_distributed`` (NCCL).
- memory: ``/release_memory_occupation`` and ``/resume_memory_occupation`` with the tags the server
  has (``cuda_graph`` is dropped on releases without it, as the server plugin reports, and with
  ``--disable-cuda-graph``); a tag already released (or not released) is not sent again.
- ``/pause_generation`` (``abort``, SGLang 0.5.17's default, or ``retract``), ``/continue_generation``,
  ``/flush_cache``; ``/health`` (never generates: see :mod:`.launch`) plus "is the process alive".

Start-up: the constructor starts the server and returns; :meth:`health` is polled by the group.  A
server that exits makes :meth:`health` raise with the exit code and the tail of its log.  Once
healthy, the engine reads the plugin's reports (:mod:`.server_plugin`) and refuses to serve when
a scheduler process lacks them or an affected SGLang runs without the multimodal-RoPE fix (unless
``SLIME_SGLANG_MROPE_FIX=0`` asked for that).
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
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import torch

from slime.rollout.engines.base import (
    GPU_MEMORY_TYPE_CUDA_GRAPH,
    EngineResources,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    memory_tags,
)
from slime.rollout.engines.sglang.client import SGLangClient, SGLangRequestError, SGLangUnavailable
from slime.rollout.engines.sglang.config import (
    MAX_SERVER_CONCURRENCY,
    default_requests_per_call,
    requests_per_call,
    server_concurrency,
    slime_owned_args,
)
from slime.rollout.engines.sglang.launch import (
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
RID_SEPARATOR = "#attempt-"
"""Between the request's ``rid`` and the per-attempt suffix of SGLang's ``rid``."""
FLUSH_RETRY_S = 60.0
"""How long ``/flush_cache`` is retried while the server still has requests (it answers 400 then)."""


class ServerReportError(RuntimeError):
    """The server runs without what slime needs in it (the plugin's reports say what is missing)."""


def parse_generate_response(body: dict, rid: str | None = None) -> GenerateOutput:
    """A :class:`GenerateOutput` from SGLang's ``/generate`` answer for one request.

    ``body`` is ``{"text": str, "output_ids": [int], "meta_info": {"finish_reason": {"type": ...},
    "prompt_tokens": int, "output_token_logprobs": [[logprob, token_id, text|None], ...], "id": rid, ...}}``
    (``tokenizer_manager.py`` of SGLang 0.5.17).  ``rid`` of the output: the request id of ``meta_info.id``
    (:func:`generate_payload`'s form), None for another form.

    Raises:
        SGLangRequestError: a field is missing, the log-probs do not cover the output tokens one to
            one, or the finish reason is unknown (the message names the request).
    """
    where = f"/generate answer{f' for rid {rid}' if rid else ''}"
    try:
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
        finish = meta["finish_reason"]
        reason = finish["type"] if isinstance(finish, dict) else finish
        logprobs = meta["output_token_logprobs"]
        prompt_tokens = int(meta["prompt_tokens"])
        text = body.get("text") or ""
    except (KeyError, TypeError, ValueError) as e:
        raise SGLangRequestError(f"{where} lacks {e} (return_logprob must be set)", endpoint="/generate") from e
    if reason not in ("stop", "length", "abort"):
        raise SGLangRequestError(f"{where}: unknown finish_reason {finish!r}", endpoint="/generate")
    ids = [int(entry[1]) for entry in logprobs]
    if ids != output_ids:
        raise SGLangRequestError(
            f"{where}: {len(logprobs)} log-probs for {len(output_ids)} output tokens, or other token ids "
            f"({ids[:5]} vs {output_ids[:5]})", endpoint="/generate",
        )  # fmt: skip
    if reason == "abort":
        logger.warning("SGLang aborted request %s: %s", rid, finish.get("message") if isinstance(finish, dict) else "")
    answered = meta.get("id")
    return GenerateOutput(text=text, output_ids=output_ids, output_log_probs=[float(entry[0]) for entry in logprobs],
                          finish_reason=reason, prompt_tokens=prompt_tokens,
                          rid=answered.rpartition(RID_SEPARATOR)[0] if answered and RID_SEPARATOR in answered else None)


def generate_payload(request: GenerateRequest) -> dict:
    """The ``/generate`` body of one request: text, base64 images, SGLang sampling params, log-probs on.

    Per-request sampling seeds (``SamplingParams.sampling_seed``, SGLang's ``sampling_seed``) travel
    inside ``sampling_params`` once the sampling params carry them (``SamplingParams.to_sglang``).
    """
    payload = {
        "text": request.text,
        "sampling_params": request.sampling_params.to_sglang(),
        "return_logprob": True,
    }
    if request.image_data:
        payload["image_data"] = list(request.image_data)
    if request.rid is not None:  # unique per attempt (SGLang refuses a rid in flight); the output names the request
        payload["rid"] = f"{request.rid}{RID_SEPARATOR}{uuid.uuid4().hex[:12]}"
    return payload


def generate_batch_payload(requests: list[GenerateRequest]) -> dict:
    """The ``/generate`` body of several requests in one call: SGLang's batch form of :func:`generate_payload`
    (``GenerateReqInput`` with every field a list, one entry per request, in request order).

    ``image_data`` is a list of per-request image lists (``[]`` for a prompt without images; left out when
    no request has one), ``rid`` a list (a fresh id where the request has none: SGLang wants one per
    entry), ``return_logprob`` one value for all.  The answer is a list of single-request answers in the
    same order (``tokenizer_manager.py``, ``_handle_batch_request``).

    Raises:
        ValueError: ``requests`` is empty.
    """
    if not requests:
        raise ValueError("a batched /generate call needs at least one request")
    singles = [generate_payload(r) for r in requests]
    payload = {
        "text": [p["text"] for p in singles],
        "sampling_params": [p["sampling_params"] for p in singles],
        "return_logprob": True,
        "rid": [p.get("rid") or uuid.uuid4().hex for p in singles],
    }
    if any("image_data" in p for p in singles):
        payload["image_data"] = [p.get("image_data", []) for p in singles]
    return payload


class SGLangEngine(RolloutEngine):
    """One SGLang server (see the module docstring).

    Args:
        spec: what the server is started with (:class:`~.launch.ServerSpec`).
        run_dir: folder for the server's log (``server.log``), plugin folder and reports.
        capacity: requests in flight at once (``--sglang-server-concurrency``), <= :data:`MAX_CONCURRENT_CALLS`.
        requests_per_call: the most requests in one ``/generate`` call (``--sglang-requests-per-call``),
            1..``capacity``; default :func:`~.config.default_requests_per_call`.
        gpu_ids: the engine's GPUs as ``nvidia-smi`` numbers them (for :meth:`memory_info`).
        secret: the key the first server requires (default: a new random one, never shown); a restarted
            server gets a new random one (:meth:`restart`).
        env: variables set for the server on top of this process's environment (e.g.
            ``{"SLIME_SGLANG_MROPE_FIX": "0"}`` to measure the bug).

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
        self._start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, resources: EngineResources) -> SGLangEngine:
        """Engine ``resources.index`` of a run: its server on the engine's GPUs (see :mod:`.launch`).

        Raises:
            ValueError: the engine has no GPUs, or spans several nodes.
        """
        cls.check_resources(resources)
        owned, passthrough = slime_owned_args(cfg.sglang)
        del owned
        spec = ServerSpec(
            model_path=cfg.checkpoint.hf_checkpoint,
            tp_size=len(resources.local_gpu_ids) or 1,
            host=server_host(resources.node_ip, _cluster_nodes()),
            port=_free_port(),
            seed=cfg.rollout.rollout_seed + resources.index,
            colocated=resources.colocated,
            passthrough=tuple(passthrough),
        )
        return cls(spec, _run_dir(cfg, resources.index), capacity=server_concurrency(cfg.sglang),
                   requests_per_call=requests_per_call(cfg.sglang), gpu_ids=resources.local_gpu_ids)

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
        """Whether the server is up and checked (see the module docstring).

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
        """Complete the requests with one ``/generate`` call: :func:`generate_payload` for one request,
        :func:`generate_batch_payload` for several (at most :attr:`max_requests_per_call`).

        A refused batch (an HTTP error answer, :class:`SGLangRequestError`; not a lost server or a refused
        key) is sent again one request per call, all at once (:meth:`_generate_one_by_one`): SGLang 0.5.17
        fails the whole call when one of its prompts is refused (``_handle_batch_request`` pre-processes them
        in order and the first ``ValueError`` ends the call with 400 ``{"error": {"message": ...}}``, naming
        neither the request nor its index), so this is how the refused request is named.  If every request
        then completes (the batch itself was refused), their outputs are returned.

        Returns:
            One output per request, in request order.

        Raises:
            EngineUnavailableError: the server is gone (the group retries the requests elsewhere).
            SGLangRequestError: the server refused a request (the message names its ``rid`` and SGLang's
                reason; for a batch: the first refused one in request order, sent alone, and how many of the
                batch were refused), answered malformed, or answered a batch with another number of outputs.
        """
        if not requests:
            return []
        if len(requests) == 1:
            return [self._generate_single(requests[0], 0)]
        try:
            bodies = self._call(self.client.generate, generate_batch_payload(requests))
        except SGLangRequestError as e:
            return self._generate_one_by_one(requests, e)
        if not isinstance(bodies, list) or len(bodies) != len(requests):
            got = f"{len(bodies)} outputs" if isinstance(bodies, list) else type(bodies).__name__
            raise SGLangRequestError(f"/generate answered a batch of {len(requests)} requests with {got}",
                                     endpoint="/generate")
        return [parse_generate_response(body, r.rid) for body, r in zip(bodies, requests)]

    def _generate_single(self, request: GenerateRequest, index: int) -> GenerateOutput:
        """``request`` in a ``/generate`` call of its own; a refusal names the request (``index``: its place
        in this engine's call, for a request without ``rid``).

        Raises:
            SGLangRequestError: refused (``rid`` and SGLang's reason in the message; ``status`` kept) or
                answered malformed.
        """
        try:
            body = self._call(self.client.generate, generate_payload(request))
        except SGLangRequestError as e:
            raise SGLangRequestError(f"SGLang refused request {_request_name(request, index)}: {e}",
                                     endpoint="/generate", status=e.status) from e
        return parse_generate_response(body, request.rid)

    def _generate_one_by_one(self, requests: list[GenerateRequest],
                             refusal: SGLangRequestError) -> list[GenerateOutput]:
        """After SGLang refused the batch ``requests`` with ``refusal``: each request in a call of its own.

        All calls are in flight at once, from a pool of ``len(requests)`` threads: the engine group counts
        the batch's requests as in flight at this engine already, so the server gets no more at once than
        the batch gave it (the backpressure holds), and the refused request is found in one generation's
        time (one after the other, a refused 32nd request would wait for 31 generations).  Each thread closes
        its own keep-alive connection (the client's connections are per thread) before it ends.

        Raises:
            EngineUnavailableError: a call found the server gone (first, so that the group can retry the
                batch elsewhere).
            SGLangRequestError: the first request in request order that was refused (or answered malformed)
                when sent alone, with how many were.
        """
        logger.warning("SGLang at %s refused a batched /generate of %d requests (%s); sending them again one "
                       "request per call to find the refused one. The refusal: %s", self.spec.url, len(requests),
                       _request_names(requests), refusal)

        def one(index: int) -> GenerateOutput | BaseException:
            try:
                return self._generate_single(requests[index], index)
            except Exception as e:  # noqa: BLE001 - every outcome is looked at below, in request order
                return e
            finally:
                self.client.close()  # this thread's connection

        with ThreadPoolExecutor(len(requests), thread_name_prefix="sglang-one-by-one") as pool:
            outcomes = list(pool.map(one, range(len(requests))))
        failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if not failures:
            logger.warning("all %d requests of the refused batch completed when sent one per call: SGLang refused "
                           "the batch, not a request of it (%s)", len(requests), refusal)
            return outcomes
        gone = [o for _, o in failures if isinstance(o, EngineUnavailableError)]
        if gone:
            raise gone[0]
        first = failures[0][1]
        if not isinstance(first, SGLangRequestError):
            raise first
        refused = [i for i, o in failures if isinstance(o, SGLangRequestError)]
        same_reason = str(refusal).split(": ", 1)[-1] in str(first)  # the address before the first ": "
        batch_reason = "" if same_reason else f"; the batch was refused with: {refusal}"
        raise SGLangRequestError(
            f"{first} ({len(refused)} of a batch of {len(requests)} requests failed when sent alone: "
            f"{_request_names([requests[i] for i in refused], refused)}{batch_reason})",
            endpoint="/generate", status=first.status,
        ) from first

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

    def memory_info(self) -> dict[str, float]:
        """Free and total memory of the engine's GPUs (``nvidia-smi``), GiB; empty when it cannot tell."""
        return gpu_memory(self.gpu_ids)

    # ------------------------------------------------------------------ lifecycle

    def restart(self) -> None:
        """Stop the old server (whatever is left of it) and start a new one on a new port, with a new secret.

        The new secret leaves nothing the old server (or a process that read its key, e.g. from a dump) could
        use; the new client carries it, and a recording (``client.record``) goes on, redacting it."""
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


def _request_name(request: GenerateRequest, index: int) -> str:
    """``rid '<rid>'``, or ``#<index> of the call (no rid)`` for a request without one (``index``: its place in
    the engine's ``generate`` call)."""
    return f"rid {request.rid!r}" if request.rid is not None else f"#{index} of the call (no rid)"


def _request_names(requests: list[GenerateRequest], indices: list[int] | None = None, shown: int = 3) -> str:
    """The first ``shown`` requests' names (:func:`_request_name`; ``indices``: their places, default 0, 1, ...)."""
    indices = list(range(len(requests))) if indices is None else indices
    names = [_request_name(r, i) for r, i in zip(requests[:shown], indices)]
    return ", ".join(names) + (f", ... ({len(requests)} in all)" if len(requests) > shown else "")


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


def _run_dir(cfg, index: int) -> Path:
    """``<output-dir>/sglang/engine-<index>`` when the run has an output folder, else a temporary folder."""
    output_dir = getattr(cfg.logging, "output_dir", None)
    if output_dir:
        return Path(output_dir) / "sglang" / f"engine-{index}"
    return Path(tempfile.mkdtemp(prefix=f"slime-sglang-engine-{index}-"))
