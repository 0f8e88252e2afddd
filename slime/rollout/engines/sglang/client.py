"""HTTP client of one SGLang server (the 0.5.17 native API, ``sglang/srt/entrypoints/http_server.py``).

Standard library only (``http.client``), one keep-alive connection per thread, so that the engine can run many
``/generate`` calls at once; every request carries ``Authorization: Bearer <secret>``.  Errors:
:class:`SGLangUnavailable` (no answer: the server is dead or not up yet; the request produced nothing, so another
engine may take it), :class:`SGLangAuthError` (401/403) and :class:`SGLangRequestError` (any other refusal; not
retried).  The endpoints' payloads and 0.5.17's quirks: ``docs/design/sglang_engine.md``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.parse
from typing import Any

from slime.rollout.engines.base import EngineUnavailableError


class SGLangError(RuntimeError):
    """Base of the client's errors; ``endpoint`` and ``status`` (None without an HTTP answer) say where.
    Picklable (Ray carries it from the engine actor to the driver)."""

    def __init__(self, message: str, *, endpoint: str = "", status: int | None = None):
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class SGLangUnavailable(SGLangError, EngineUnavailableError):
    """No HTTP answer: connection refused, reset or timed out."""


class SGLangAuthError(SGLangError):
    """The server refused the key (401 Unauthorized / 403 Forbidden)."""


class SGLangRequestError(SGLangError):
    """The server answered with an error status or ``"success": false``."""


class SGLangClient:
    """Calls one server at ``base_url`` (``http://host:port``) with ``api_key`` (None: no ``Authorization`` header).

    ``timeout_s``: socket timeout of control calls, seconds (``/generate`` and weight updates wait without limit: a dead
    server resets the connection, and the group's health checks catch a hung one).  ``record``: append every exchange to
    this JSON-lines file, the key redacted (e.g. for ``scripts/harness/fake_sglang_server.py --replay``).
    """

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 60.0,
                 record: str | os.PathLike | None = None):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"SGLang server address must be http://host:port, got {base_url!r}")
        self.base_url = base_url
        self.host, self.port = parsed.hostname, parsed.port
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self._secret = api_key
        self.record = record
        self._record_lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"SGLangClient({self.base_url})"

    # ------------------------------------------------------------------ transport

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, endpoint: str, payload: Any = None, *, timeout: float | None = None,
                check: bool = True) -> tuple[int, Any]:
        """One HTTP call; returns ``(status, decoded JSON or text)``.

        Raises:
            SGLangUnavailable, SGLangAuthError, SGLangRequestError (the last only with ``check``).
        """
        body = None if payload is None else json.dumps(payload).encode()
        for attempt in (0, 1):
            conn = self._connection(timeout)
            reused = conn.sock is not None
            try:
                conn.request(method, endpoint, body=body, headers=self._headers)
                response = conn.getresponse()
                raw = response.read()
                break
            except (ConnectionError, socket.timeout, OSError, http.client.HTTPException) as e:
                self._drop_connection()
                lost = isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if attempt == 0 and reused and lost:
                    continue  # an idle keep-alive connection the server had closed: once more on a new one
                raise SGLangUnavailable(f"{self.base_url}{endpoint}: {type(e).__name__}: {e}", endpoint=endpoint) from e
        if response.getheader("Connection", "").lower() == "close":
            self._drop_connection()
        text = raw.decode(errors="replace")
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = text
        status = response.status
        if self.record is not None:
            self._record(method, endpoint, payload, status, data)
        if status in (401, 403):
            raise SGLangAuthError(
                f"{self.base_url}{endpoint}: refused ({status} {_message(data)}); the request lacks the run's "
                "key or carries another one", endpoint=endpoint, status=status,
            )  # fmt: skip
        failed = status >= 400 or (isinstance(data, dict) and data.get("success") is False)
        if check and failed:
            raise SGLangRequestError(f"{self.base_url}{endpoint}: {status} {_message(data)}", endpoint=endpoint,
                                     status=status)
        return status, data

    def _record(self, method: str, endpoint: str, payload: Any, status: int, data: Any) -> None:
        line = json.dumps({"method": method, "endpoint": endpoint, "request": payload, "status": status,
                           "response": data})
        if self._secret:
            line = line.replace(self._secret, "<redacted>")
        with self._record_lock, open(self.record, "a") as f:
            f.write(line + "\n")

    def get(self, endpoint: str, **kwargs) -> Any:
        return self.request("GET", endpoint, **kwargs)[1]

    def post(self, endpoint: str, payload: Any = None, **kwargs) -> Any:
        return self.request("POST", endpoint, {} if payload is None else payload, **kwargs)[1]

    def close(self) -> None:
        self._drop_connection()

    # ------------------------------------------------------------------ endpoints

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """``GET /health`` answered 200 (False for 503, a refused connection or a timeout)."""
        try:
            status, _ = self.request("GET", "/health", timeout=timeout_s, check=False)
        except SGLangUnavailable:
            return False
        return status == 200

    def model_info(self) -> dict:
        return self.get("/model_info", timeout=self.timeout_s)

    def server_info(self) -> dict:
        return self.get("/server_info", timeout=self.timeout_s)

    def generate(self, payload: dict) -> dict:
        return self.post("/generate", payload, timeout=None)

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self.post("/pause_generation", {"mode": mode}, timeout=self.timeout_s)

    def continue_generation(self) -> None:
        self.post("/continue_generation", {}, timeout=self.timeout_s)

    def flush_cache(self) -> None:
        self.post("/flush_cache", None, timeout=self.timeout_s)

    def release_memory_occupation(self, tags: list[str]) -> None:
        self.post("/release_memory_occupation", {"tags": list(tags)}, timeout=None)

    def resume_memory_occupation(self, tags: list[str]) -> None:
        self.post("/resume_memory_occupation", {"tags": list(tags)}, timeout=None)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None,
                                   flush_cache: bool = False) -> None:
        self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
        }, timeout=None)  # fmt: skip

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> None:
        self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }, timeout=None)  # fmt: skip

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, load_format: str | None = "flattened_bucket",
                                        flush_cache: bool = False) -> None:
        self.post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": load_format, "flush_cache": flush_cache,
        }, timeout=None)  # fmt: skip

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.post("/destroy_weights_update_group", {"group_name": group_name}, timeout=self.timeout_s)


def _message(data: Any) -> str:
    """The error text of an SGLang error body (``{"error": {"message"}}``, ``{"error"}``, ``{"message"}``,
    ``{"detail"}``)."""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
