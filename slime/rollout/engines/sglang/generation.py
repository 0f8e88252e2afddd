"""One engine call on SGLang's ``/generate`` (0.5.17, ``tokenizer_manager.py``): bodies, answers, refusals.

A request goes as text plus base64 ``image_data`` (never pre-tokenised ``input_ids``, which SGLang would expand a
second time), several as SGLang's batch form; SGLang's ``rid`` is the request's plus :data:`RID_SEPARATOR` and a
per-attempt suffix.  SGLang refuses a whole batch for one bad prompt without naming it, so a refused batch is sent
again one request per call (:func:`generate`).  The functions take ``send``, the engine's ``/generate`` call, and
raise what it raises.  Why batches: ``docs/design/engine_group.md``.
"""

from __future__ import annotations

import base64
import binascii
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from slime.routing_replay import RouteError, RouteShape, compact_routes
from slime.rollout.engines.base import EngineUnavailableError, GenerateOutput, GenerateRequest
from slime.rollout.engines.sglang.client import SGLangRequestError

logger = logging.getLogger(__name__)

RID_SEPARATOR = "#attempt-"
"""Between the request's ``rid`` and the per-attempt suffix of SGLang's ``rid``."""

Send = Callable[[dict], Any]
"""One ``/generate`` call: the body -> SGLang's answer (a dict, or a list of them for a batch)."""


def generate(requests: list[GenerateRequest], send: Send, close: Callable[[], None], url: str,
             routes: RouteShape | None = None) -> list[GenerateOutput]:
    """Complete ``requests`` (at most the engine's ``max_requests_per_call``) in one ``/generate`` call; a refused batch
    in one call per request, all at once.  ``close`` closes the calling thread's connection, ``url`` names the server in
    the log, ``routes`` is the model's route shape when the server captures routes (None: no request gets any).

    Returns:
        One output per request, in request order.

    Raises:
        EngineUnavailableError: the server is gone (the group retries the requests elsewhere).
        SGLangRequestError: a request was refused (its ``rid`` and SGLang's reason; for a batch, the first refused one
            sent alone, and how many were), an answer is malformed, or a batch got another number of outputs.
    """
    if not requests:
        return []
    if len(requests) == 1:
        return [_generate_single(requests[0], 0, send, routes)]
    try:
        bodies = send(generate_batch_payload(requests))
    except SGLangRequestError as e:
        return _generate_one_by_one(requests, e, send, close, url, routes)
    if not isinstance(bodies, list) or len(bodies) != len(requests):
        got = f"{len(bodies)} outputs" if isinstance(bodies, list) else type(bodies).__name__
        raise SGLangRequestError(f"/generate answered a batch of {len(requests)} requests with {got}",
                                 endpoint="/generate")
    return [parse_generate_response(body, r.rid, _wanted(r, routes)) for body, r in zip(bodies, requests)]


def _wanted(request: GenerateRequest, routes: RouteShape | None) -> RouteShape | None:
    """The route shape to decode ``request``'s answer with: None unless it asked for routes."""
    return routes if request.return_routed_experts else None


def _generate_single(request: GenerateRequest, index: int, send: Send,
                     routes: RouteShape | None = None) -> GenerateOutput:
    """``request`` in a call of its own (``index``: its place in the engine's call, naming a request without rid).

    Raises:
        SGLangRequestError: refused (``rid`` and SGLang's reason; ``status`` kept) or answered malformed.
    """
    try:
        body = send(generate_payload(request))
    except SGLangRequestError as e:
        raise SGLangRequestError(f"SGLang refused request {_request_name(request, index)}: {e}",
                                 endpoint="/generate", status=e.status) from e
    return parse_generate_response(body, request.rid, _wanted(request, routes))


def _generate_one_by_one(requests: list[GenerateRequest], refusal: SGLangRequestError, send: Send,
                         close: Callable[[], None], url: str, routes: RouteShape | None) -> list[GenerateOutput]:
    """After SGLang refused the batch ``requests``: each request in a call of its own, all in flight at once (the group
    counts them in flight here already, and the refused one is found in one generation's time); each thread closes its
    own connection.

    Raises:
        EngineUnavailableError: a call found the server gone (first, so that the group can retry the batch).
        SGLangRequestError: the first request, in request order, that failed alone, with how many did.
    """
    logger.warning("SGLang at %s refused a batched /generate of %d requests (%s); sending them again one "
                   "request per call to find the refused one. The refusal: %s", url, len(requests),
                   _request_names(requests), refusal)

    def one(index: int) -> GenerateOutput | BaseException:
        try:
            return _generate_single(requests[index], index, send, routes)
        except Exception as e:  # noqa: BLE001 - every outcome is looked at below, in request order
            return e
        finally:
            close()  # this thread's connection

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


def parse_generate_response(body: dict, rid: str | None = None, routes: RouteShape | None = None) -> GenerateOutput:
    """A :class:`GenerateOutput` from SGLang's answer for one request: ``output_ids``, the log-probs of
    ``meta_info.output_token_logprobs``, ``meta_info.finish_reason.type``, ``prompt_tokens``, the request id of
    ``meta_info.id`` (None for another form), and with ``routes`` ``meta_info.routed_experts``
    (:func:`decode_routed_experts`; None when absent).

    Raises:
        SGLangRequestError: a field is missing, the log-probs are not one per output token, the finish reason is
            unknown, or the routes are malformed (naming the request).
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
    routed = None
    if routes is not None and meta.get("routed_experts") is not None:
        try:
            routed = decode_routed_experts(meta["routed_experts"], prompt_tokens + len(output_ids) - 1, routes, where)
        except RouteError as e:
            raise SGLangRequestError(str(e), endpoint="/generate") from e
    return GenerateOutput(text=text, output_ids=output_ids, output_log_probs=[float(entry[0]) for entry in logprobs],
                          finish_reason=reason, prompt_tokens=prompt_tokens,
                          rid=answered.rpartition(RID_SEPARATOR)[0] if answered and RID_SEPARATOR in answered else None,
                          routed_experts=routed)


def decode_routed_experts(data: str, positions: int, routes: RouteShape, where: str = "routed_experts") -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` (base64 of the little-endian int32 ``[prompt_tokens + R - 1, layers,
    top_k]`` of every position it ran: ``state_capturer/routed_experts.py``, ``detokenizer_manager.py``) as uint8
    ``[positions, layers, top_k]``.

    Raises:
        RouteError: not base64, another byte count than ``positions`` int32 rows, or an expert id out of range
            (``where`` names the answer).
    """
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise RouteError(f"{where}: meta_info.routed_experts is not base64 ({e})") from None
    row = 4 * routes.num_layers * routes.top_k
    if len(raw) % row or len(raw) // row != positions:
        raise RouteError(
            f"{where}: meta_info.routed_experts holds {len(raw)} bytes, expected {positions} positions (prompt + "
            f"response - 1) x {routes.num_layers} layers x top-{routes.top_k} int32 = {positions * row} bytes"
        )
    ids = np.frombuffer(raw, dtype="<i4").reshape(positions, routes.num_layers, routes.top_k)
    return compact_routes(ids, routes, where)


def generate_payload(request: GenerateRequest) -> dict:
    """The ``/generate`` body of one request: text, base64 images, SGLang sampling params (the seed among them),
    log-probs on, a per-attempt ``rid``."""
    payload = {
        "text": request.text,
        "sampling_params": request.sampling_params.to_sglang(),
        "return_logprob": True,
    }
    if request.image_data:
        payload["image_data"] = list(request.image_data)
    if request.rid is not None:  # unique per attempt (SGLang refuses a rid in flight); the output names the request
        payload["rid"] = f"{request.rid}{RID_SEPARATOR}{uuid.uuid4().hex[:12]}"
    if request.return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def generate_batch_payload(requests: list[GenerateRequest]) -> dict:
    """SGLang's batch form of :func:`generate_payload` (``GenerateReqInput``, every field a list in request order):
    ``image_data`` a list of per-request lists (left out when no request has images), a fresh ``rid`` where a request
    has none, one ``return_logprob``, and ``return_routed_experts`` on when any request asks.  The answer is a list of
    single answers in the same order.

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
    if any(r.return_routed_experts for r in requests):
        payload["return_routed_experts"] = True
    return payload


def _request_name(request: GenerateRequest, index: int) -> str:
    """``rid '<rid>'``, or ``#<index> of the call (no rid)`` for a request without one (``index``: its place in
    the engine's ``generate`` call)."""
    return f"rid {request.rid!r}" if request.rid is not None else f"#{index} of the call (no rid)"


def _request_names(requests: list[GenerateRequest], indices: list[int] | None = None, shown: int = 3) -> str:
    """The first ``shown`` requests' names (:func:`_request_name`; ``indices``: their places, default 0, 1, ...)."""
    indices = list(range(len(requests))) if indices is None else indices
    names = [_request_name(r, i) for r, i in zip(requests[:shown], indices)]
    return ", ".join(names) + (f", ... ({len(requests)} in all)" if len(requests) > shown else "")
