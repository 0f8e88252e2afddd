"""A fake SGLang 0.5.17 HTTP server for the CPU tests of the SGLang engine.

Started by :class:`scripts.harness.fake_sglang.FakeSGLangEngine` exactly where the engine starts a real server
(same command-line flags, the secret on the first line of stdin, the same environment), it speaks the
0.5.17 native API as read from SGLang's source (``sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``, ``managers/tokenizer_manager.py``, ``utils/auth.py``):

- **auth** as ``decide_request_auth`` with ``api_key == admin_api_key``: ``/health*`` and ``/metrics``
  open; every other endpoint needs ``Authorization: Bearer <key>`` or gets 401 ``{"error": "Unauthorized"}``;
- ``GET /health``: 503 while "starting" (``--fake-startup-s``), then 200; ``/get_weight_version`` 404
  (0.5.17 moved it to ``/model_info``);
- ``POST /generate``: ``text`` + ``image_data`` (base64 list) + ``sampling_params`` + ``return_logprob``,
  or SGLang's batch form (every field a list; answered with a list; the requests run side by side);
  ``input_ids`` together with ``image_data`` is refused (real SGLang expands the image tokens a second time
  and crashes); answers ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...},
  "prompt_tokens", "completion_tokens", "output_token_logprobs": [[logprob, id, null], ...], ...}}``;
- ``/pause_generation`` (``mode`` default ``abort``: requests in flight end with ``finish_reason.type
  "abort"``; new ones wait), ``/continue_generation``, ``/flush_cache`` (400 while requests run);
- ``/release_memory_occupation`` / ``/resume_memory_occupation`` with ``tags`` (resuming a tag that is not
  released fails, as SGLang's ``offload_tags.remove``); after the weights are released and resumed the
  model emits only token 0 until weights are pushed again (what the H200 showed without a weight backup);
- ``/update_weights_from_tensor``: one base64 payload per TP rank, unpickled with an allow-list of
  module prefixes as SGLang's ``SafeUnpickler`` (``torch.``, ``builtins.``, ``types.``, ``collections.``,
  ...); ``load_format="flattened_bucket"`` rebuilds tensors as ``buffer[start_idx:end_idx].view(dtype)
  .reshape(shape)``.

Two models (``--fake-model``):

- ``echo`` (default): no weights needed; a response is ``1 + (number of words of the prompt) % 5`` tokens
  (capped by ``max_new_tokens``; exactly ``max_new_tokens`` with SGLang's ``ignore_eos``), token ``k`` is
  ``10 + k``, the text ``"<first word>: t10 t11 ..."`` (the first word identifies the request), token
  ``k``'s log-prob ``-(k + 1) / 10 - shift`` where ``shift`` is the sum of every pushed tensor's elements (so
  a weight update shows), ``prompt_tokens`` the number of whitespace-separated words plus 4 per image;
- ``hf``: slime's transformers engine on ``--model-path`` (CPU, float32): real tokens and log-probs that the
  trainer reproduces, and pushed weights really load.  ``--fake-image-logprob-shift X`` adds ``X`` to every
  log-prob of a request with images (a stand-in for SGLang's multimodal-RoPE bug);
  ``--fake-image-prompt-tokens-shift N`` reports ``N`` more prompt tokens per image than it saw (a stand-in for
  an engine whose processor makes another number of image tokens; its routes get as many leading rows of expert 0).
  With SGLang's ``--enable-return-routed-experts``, a request with ``return_routed_experts`` gets its model's
  routes (the transformers engine's capture) as ``meta_info.routed_experts``: base64 of int32
  ``[prompt_tokens + R - 1, layers, top_k]``, as SGLang 0.5.17's detokenizer encodes them.

Processes: like SGLang, whose scheduler (one per TP rank) and detokenizer processes run in the server's
session, the fake starts ``--fake-scheduler-processes`` children (default ``--tp-size``) in its session and
process group before it listens.  Each only sleeps (up to an hour, a bound for a test that leaks it), and none
watches its parent: only a stop that reaches the whole group (the engine's, or ``exit_with_parent`` 's thread
and session guard, which the fake starts as the real server does) ends them.
``/server_info`` lists their pids (``scheduler_pids``); one that gets ``SIGTERM`` writes
``scheduler-<pid>.exit`` in the server's working folder before it exits.

Faults and timing: ``--fake-delay-s`` per request, ``--fake-exit-after N`` (the process exits with code 1
when the N-th ``/generate`` request arrives: a crash mid-rollout).  Refusals as 0.5.17 answers them:
``--context-length N`` (SGLang's flag; echo model) refuses a prompt of ``N`` or more tokens, or one whose
``max_new_tokens`` would not fit, with SGLang's message and 400 ``{"error": {"message": ...}}``; a batch with
such a prompt is refused as a whole with that message (``_handle_batch_request`` pre-processes the prompts in
order; the first refusal fails the call, which names neither the request nor its index).
``--fake-refuse-batches N`` refuses the first ``N`` batched calls (400) whatever they hold: a refusal of the
batch as such, whose requests are fine alone.  ``/server_info`` counts ``generate_calls`` (requests that ran),
``generate_http_calls`` (``/generate`` calls, refused ones included) and ``running`` (requests running now).  Plugin: the server finds slime's SGLang
plugin through ``importlib.metadata`` entry points (the ``*.dist-info`` on ``PYTHONPATH``) and, as the real
plugin would in a main and ``--tp-size`` scheduler processes, writes its reports (``--fake-version`` is the
SGLang version reported).  ``--replay FILE``: answer from a recording (JSON lines ``{"method", "endpoint",
"request", "status", "response"}``, as :class:`slime.rollout.engines.sglang.client.SGLangClient` records
them) whenever a request matches one, by endpoint and body (SGLang's per-attempt ``rid`` aside; the answer takes
the new one).
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import io
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ALLOWED_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "types.", "torch.", "torch._utils.",
                    "torch.storage.", "sglang.srt.weight_sync.tensor_bucket.")
"""Module prefixes SGLang 0.5.17's ``SafeUnpickler`` accepts (the subset a weight payload may use)."""
DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("types", "CodeType"),
          ("types", "FunctionType")}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in DENIED or not any((module + ".").startswith(p) for p in ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--fake-model", choices=("echo", "hf"), default="echo")
    p.add_argument("--fake-version", default="0.5.17")
    p.add_argument("--fake-startup-s", type=float, default=0.0)
    p.add_argument("--fake-delay-s", type=float, default=0.0)
    p.add_argument("--fake-exit-after", type=int, default=0)
    p.add_argument("--fake-refuse-batches", type=int, default=0)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--fake-image-logprob-shift", type=float, default=0.0)
    p.add_argument("--fake-image-prompt-tokens-shift", type=int, default=0)
    p.add_argument("--replay", default=None)
    p.add_argument("--fake-scheduler-processes", type=int, default=None)
    args, unknown = p.parse_known_args(argv)
    args.unknown = unknown
    return args


class FakeServer:
    def __init__(self, args, secret: str):
        self.args, self.secret = args, secret
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.paused = False
        self.abort_epoch = 0
        self.running = 0
        self.max_running = 0
        self.generate_calls = 0  # requests that ran
        self.generate_http_calls = 0  # /generate calls (a batch is one), refused ones included
        self.refused_batches = 0
        self.released: set[str] = set()
        self.weights_lost = False  # weights released and resumed, not pushed since
        self.tensors: dict = {}
        self.updates = 0
        self.engine = None
        if args.fake_model == "hf":
            from slime.rollout.engines.hf_engine import TransformersEngine

            self.engine = TransformersEngine(args.model_path, seed=args.random_seed, max_batch_size=1)
        self.scheduler_pids: list[int] = []
        self.replay = []
        if args.replay:
            with open(args.replay) as f:
                self.replay = [json.loads(line) for line in f if line.strip()]

    # ------------------------------------------------------------------ endpoints

    def handle(self, method: str, path: str, headers, body):
        if path.startswith("/health"):
            if time.monotonic() - self.started < self.args.fake_startup_s:
                return 503, None
            return 200, None
        if path.startswith("/metrics"):
            return 200, ""
        if self.secret and headers.get("Authorization", "") != f"Bearer {self.secret}":
            return 401, {"error": "Unauthorized"}
        for record in self.replay:  # SGLang's rid differs per attempt: not part of the match
            if record["endpoint"] == path and record["method"] == method and _without_rid(record.get("request")) == \
                    _without_rid(body):
                response = record["response"]
                if isinstance(body, dict) and body.get("rid") and isinstance(response, dict) and "meta_info" in response:
                    response = {**response, "meta_info": {**response["meta_info"], "id": body["rid"]}}
                return record["status"], response
        handler = getattr(self, "ep_" + path.strip("/").replace("/", "_"), None)
        if handler is None:
            return 404, {"detail": "Not Found"}
        try:
            return handler(body or {})
        except FakeError as e:
            return e.status, {"error": {"message": str(e)}}

    def ep_get_weight_version(self, body):
        return 404, {"detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                               "Please use '/model_info' instead."}

    def ep_model_info(self, body):
        return 200, {"model_path": self.args.model_path, "weight_version": f"updates-{self.updates}",
                     "is_generation": True, "has_image_understanding": True}

    def ep_server_info(self, body):
        return 200, {"version": self.args.fake_version, "tp_size": self.args.tp_size, "api_key": self.secret,
                     "port": self.args.port, "host": self.args.host, "unknown_args": self.args.unknown,
                     "running": self.running, "max_running": self.max_running, "generate_calls": self.generate_calls,
                     "generate_http_calls": self.generate_http_calls, "scheduler_pids": self.scheduler_pids}

    def ep_generate(self, body):
        with self.lock:
            self.generate_http_calls += 1
        if isinstance(body.get("text"), list):  # the batch's requests run side by side, as in a real server
            from concurrent.futures import ThreadPoolExecutor

            ones = self._split_batch(body)
            with self.lock:
                refuse = self.refused_batches < self.args.fake_refuse_batches
                self.refused_batches += refuse
            if refuse:
                raise FakeError(f"fake: batched /generate refused ({self.refused_batches} of "
                                f"--fake-refuse-batches {self.args.fake_refuse_batches})")
            for one in ones:  # in order, as SGLang pre-processes a batch: the first refusal fails the call
                self._validate(one)
            with ThreadPoolExecutor(len(ones)) as pool:
                return 200, [answer for _, answer in pool.map(self._generate_one, ones)]
        self._validate(body)
        return self._generate_one(body)

    def _validate(self, body):
        """SGLang's ``TokenizerManager._validate_one_request`` against ``--context-length`` (echo model only:
        its prompt tokens are known before it runs), with SGLang's messages; raised as a ``ValueError`` there,
        which the ``/generate`` endpoint answers with 400 ``{"error": {"message": ...}}`` (for a batch: the
        whole call, the rest of it aborted)."""
        context = self.args.context_length
        if context is None or self.engine is not None or not isinstance(body.get("text"), str):
            return
        prompt_tokens = len(body["text"].split()) + 4 * len(body.get("image_data") or [])
        if prompt_tokens >= context:
            raise FakeError(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                            f"({context} tokens).")
        max_new = (body.get("sampling_params") or {}).get("max_new_tokens")
        if max_new is not None and max_new + prompt_tokens > context:
            raise FakeError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new + prompt_tokens} tokens: {prompt_tokens} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit.")

    @staticmethod
    def _split_batch(body):
        """SGLang's batch form (``GenerateReqInput.normalize_batch_and_arguments``): every per-request field a
        list of the batch's length (``sampling_params`` and ``return_logprob`` may be one value for all); the
        answer is the list of single answers, in order (a bad entry fails the whole call, as there)."""
        texts = body["text"]
        n = len(texts)
        if n == 0:
            raise FakeError("text is an empty list")
        images = body.get("image_data")
        if images is not None and (not isinstance(images, list) or len(images) != n):
            raise FakeError("The length of image_data should be equal to the batch size.")
        rids = body.get("rid")
        if rids is not None and (not isinstance(rids, list) or len(rids) != n):
            raise FakeError("The specified rids length mismatch with the batch_size for batch processing.")
        params = body.get("sampling_params")
        if isinstance(params, list) and len(params) != n:
            raise FakeError("The length of sampling_params should be equal to the batch size.")
        return [{**{k: v for k, v in body.items() if k not in ("text", "image_data", "rid", "sampling_params")},
                 "text": texts[i], "image_data": images[i] if images else None, "rid": rids[i] if rids else None,
                 "sampling_params": params[i] if isinstance(params, list) else params} for i in range(n)]

    def _generate_one(self, body):
        if body.get("input_ids") is not None and body.get("image_data"):
            raise FakeError("input_ids with image_data: the image placeholders would be expanded twice", 500)
        if not isinstance(body.get("text"), str):
            raise FakeError("text is required (a string)")
        params = body.get("sampling_params") or {}
        with self.lock:
            self.generate_calls += 1
            calls = self.generate_calls
        if self.args.fake_exit_after and calls >= self.args.fake_exit_after:
            os._exit(1)
        with self.cond:
            while self.paused:
                self.cond.wait()
            if self.released:
                raise FakeError(f"memory released ({sorted(self.released)}); resume it first", 500)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            epoch = self.abort_epoch
        try:
            if self.args.fake_delay_s:
                time.sleep(self.args.fake_delay_s)
            if self.engine is not None:
                out = self._hf_generate(body, params)
            else:
                out = self._echo_generate(body, params)
            with self.lock:
                if self.abort_epoch != epoch:  # paused with mode=abort while it ran
                    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue",
                                                         "status_code": None, "err_type": None}
            return 200, out
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()

    def _echo_generate(self, body, params):
        words = body["text"].split()
        images = body.get("image_data") or []
        max_new = int(params.get("max_new_tokens", 128))
        n = max_new if params.get("ignore_eos") else min(max_new, 1 + len(words) % 5)  # its "EOS" ignored
        shift = sum(float(t.double().sum()) for t in self.tensors.values())
        ids = [0] * n if self.weights_lost else [10 + k for k in range(n)]
        logprobs = [-(k + 1) / 10 - shift for k in range(n)]
        finish = {"type": "length", "length": max_new} if n == max_new else {"type": "stop", "matched": 2}
        text = f"{words[0] if words else ''}: " + " ".join(f"t{i}" for i in ids)
        return self._answer(text, ids, logprobs, finish, len(words) + 4 * len(images), body.get("rid"))

    def _hf_generate(self, body, params):
        from slime.rollout.engines.base import GenerateRequest, SamplingParams

        known = {k: params[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "stop",
                                        "stop_token_ids", "no_stop_trim") if k in params}
        routes = bool(self.args.enable_return_routed_experts and body.get("return_routed_experts"))
        request = GenerateRequest(body["text"], list(body.get("image_data") or []), SamplingParams(**known),
                                  return_routed_experts=routes)
        with self.lock:  # one forward at a time
            out = self.engine.generate([request])[0]
        shift = self.args.fake_image_logprob_shift if request.image_data else 0.0
        logprobs = [min(0.0, lp + shift) for lp in out.output_log_probs]
        finish = {"type": out.finish_reason}
        extra = self.args.fake_image_prompt_tokens_shift * len(request.image_data)
        answer = self._answer(out.text, out.output_ids, logprobs, finish, out.prompt_tokens + extra, body.get("rid"))
        if routes:
            import numpy as np

            ids = out.routed_experts.astype(np.int32)
            ids = np.concatenate([np.zeros((extra, *ids.shape[1:]), np.int32), ids]) if extra >= 0 else ids[-extra:]
            answer["meta_info"]["routed_experts"] = base64.b64encode(np.ascontiguousarray(ids).tobytes()).decode()
        return answer

    @staticmethod
    def _answer(text, ids, logprobs, finish, prompt_tokens, rid=None):
        return {"text": text, "output_ids": ids, "meta_info": {
            "id": rid or f"fake-{time.monotonic_ns()}", "finish_reason": finish, "prompt_tokens": prompt_tokens,
            "weight_version": "default", "num_retractions": 0, "completion_tokens": len(ids), "cached_tokens": 0,
            "reasoning_tokens": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
            "output_token_logprobs_length": len(ids)}}

    def ep_pause_generation(self, body):
        mode = body.get("mode", "abort")
        with self.cond:
            self.paused = True
            if mode == "abort":
                self.abort_epoch += 1
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def ep_continue_generation(self, body):
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def ep_flush_cache(self, body):
        with self.lock:
            if self.running:
                return 400, "Flush cache failed.\n"
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"

    def ep_release_memory_occupation(self, body):
        tags = body.get("tags") or ["kv_cache", "weights", "cuda_graph"]
        with self.lock:
            if self.running:
                raise FakeError("release_memory_occupation should be called only when server is idle.")
            self.released.update(tags)
        return 200, None

    def ep_resume_memory_occupation(self, body):
        tags = body.get("tags") or ["kv_cache", "weights", "cuda_graph"]
        with self.lock:
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise FakeError(f"KeyError: {missing[0]!r}")
            self.released.difference_update(tags)
            if "weights" in tags:
                self.weights_lost = True
        return 200, None

    def ep_update_weights_from_tensor(self, body):
        import torch

        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != self.args.tp_size:
            raise FakeError(f"serialized_named_tensors: one payload per TP rank ({self.args.tp_size}), got "
                            f"{len(payloads) if isinstance(payloads, list) else payloads!r}")
        named = None
        for payload in payloads:
            try:
                data = RestrictedUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
            except Exception as e:  # noqa: BLE001 - reported like SGLang's failed update
                return 400, {"success": False, "message": f"Failed to deserialize: {e}"}
            if body.get("load_format") == "flattened_bucket":
                flat = data["flattened_tensor"]
                named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).clone())
                         for m in data["metadata"]]
            else:
                named = [(n, t.clone()) for n, t in data]
        if self.engine is not None:
            self.engine.update_weights_from_tensor([(n, t.to(torch.float32)) for n, t in named])
        with self.lock:
            self.tensors.update(dict(named))
            self.updates += 1
            self.weights_lost = False
        return 200, {"success": True, "message": "Success"}

    def ep_tensors(self, body):
        """Fake-only: the pushed tensors (name -> [sum, numel]), for the tests to compare."""
        return 200, {n: [float(t.double().sum()), t.numel()] for n, t in self.tensors.items()}


def _without_rid(body):
    return {k: v for k, v in body.items() if k != "rid"} if isinstance(body, dict) else body


class FakeError(Exception):
    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def make_handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def _serve(self, method):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                status, data = 400, {"error": {"message": "invalid JSON"}}
            else:
                status, data = server.handle(method, self.path.split("?")[0], self.headers, body)
            payload = b"" if data is None and status != 200 else (
                data.encode() if isinstance(data, str) else json.dumps(data).encode())
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

    return Handler


def write_plugin_reports(args) -> None:
    """What slime's plugin reports from a main and ``--tp-size`` scheduler processes, once the fake found the
    plugin's entry point where SGLang would (``importlib.metadata``, group ``sglang.srt.plugins``)."""
    from slime.rollout.engines.sglang.server_plugin import ENTRY_POINT, ENTRY_POINT_GROUP, MROPE_FIX_ENV, REPORT_DIR_ENV
    from slime.rollout.engines.sglang.versions import needs_mrope_fix

    found = [ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    folder = os.environ.get(REPORT_DIR_ENV)
    if ENTRY_POINT not in found or not folder:
        print(f"fake sglang: slime's plugin not found (entry points {found}, report dir {folder})", flush=True)
        return
    state = "not needed"
    if needs_mrope_fix(args.fake_version):
        state = "disabled" if os.environ.get(MROPE_FIX_ENV) == "0" else "applied"
    for k in range(1 + args.tp_size):
        report = {"pid": os.getpid() * 10 + k, "main": k == 0, "sglang": args.fake_version,
                  "mrope_fix": "main process" if k == 0 and state != "not needed" else state,
                  "memory_tags": ["kv_cache", "weights", "cuda_graph"]}
        with open(os.path.join(folder, f"{report['pid']}.json"), "w") as f:
            json.dump(report, f)


SCHEDULER_LIFETIME_S = 3600
SCHEDULER_CODE = """
import os, signal, sys, time
def stopped(signum, frame):
    with open(f"scheduler-{{os.getpid()}}.exit", "w") as f:
        f.write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
time.sleep({lifetime_s})
"""
"""A scheduler stand-in: sleeps; on ``SIGTERM`` writes ``scheduler-<pid>.exit`` (``SIGTERM``) in its working folder
(the server's log folder) and exits, so that a test can tell an orderly stop that reached it from a kill."""


def start_scheduler_processes(args) -> list[int]:
    """Start the stand-ins for SGLang's scheduler processes (module docstring): in this process's session and
    group, no file descriptor but the log inherited, not watching this process.  Returns their pids."""
    count = args.tp_size if args.fake_scheduler_processes is None else args.fake_scheduler_processes
    code = SCHEDULER_CODE.format(lifetime_s=SCHEDULER_LIFETIME_S)
    children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(count)]
    return [child.pid for child in children]


class _Listener(ThreadingHTTPServer):
    """A thread per request, and uvicorn's listen backlog (2048; ``socketserver``'s default of 5 resets
    connections when a rollout opens dozens at once, which the real server never does)."""

    daemon_threads = True
    request_queue_size = 2048


def main(argv):
    from slime.rollout.engines.sglang.server_main import exit_with_parent

    secret = sys.stdin.readline().strip()
    exit_with_parent()  # as the real server does
    args = parse_args(argv)
    print(f"fake sglang {args.fake_version}: server_args=ServerArgs(model_path={args.model_path!r}, "
          f"api_key='<redacted>', port={args.port})", flush=True)
    server = FakeServer(args, secret)
    server.scheduler_pids = start_scheduler_processes(args)
    write_plugin_reports(args)
    httpd = _Listener((args.host, args.port), make_handler(server))
    print(f"fake sglang listening on {args.host}:{args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
