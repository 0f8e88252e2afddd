"""Shared pieces of the SGLang GPU tests and benchmarks (``tests/test_sglang_gpu*.py``, ``scripts/bench/sglang_*.py``).

- :data:`LAUNCHER_FLAGS`, :func:`server_flags`, :func:`sglang_argv`: SGLang at its defaults with the launcher's
  flags (what users get: FA3 attention, CUDA graphs, flashinfer sampling), or with ``eager=True``
  :data:`EAGER_FLAGS` (triton kernels, no CUDA graph: the GPU tests' configuration before issue 24, kept for the
  benchmarks' continuity figures);
- :class:`SharedGpuPlacement`: engines on GPUs named by hand (several engines may share one GPU), for
  :class:`slime.ray.engine_group.RolloutEngineGroup` without a placement group;
- :func:`start_engine`: one :class:`~slime.rollout.engines.sglang.engine.SGLangEngine` in this process;
- :func:`hf_log_probs`: a Hugging Face model's log-probs of given responses along the FSDP trainer's code path,
  optionally with the engine's routes replayed and one rounding step of noise (the parity gate's trainer side);
- :func:`route_agreement`: the share of positions whose top-k experts two route tables agree on, per layer;
- :func:`figure`: one JSON line of figures into ``$SLIME_GPU_FIGURES`` (when set) and on stdout;
- :func:`generate_in_actor`: requests sent from inside an engine's actor in calls of N, without the engine group.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from slime.rollout.engines.base import BundleResources, EngineResources
from slime.rollout.engines.sglang.engine import SGLangEngine
from slime.rollout.engines.sglang.launch import LOCALHOST, ServerSpec

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
LAUNCHER_FLAGS = ("--max-running-requests", "512", "--disable-custom-all-reduce")
"""The launcher's SGLang flags on one GPU (examples/geo3k_vlm/run_geo3k_qwen35.sh) besides the memory fraction;
SGLang picks everything else (FA3 attention, CUDA graphs, flashinfer sampling, its MoE runner)."""
EAGER_FLAGS = (
    "--attention-backend", "triton", "--mm-attention-backend", "triton_attn", "--sampling-backend", "pytorch",
    "--moe-runner-backend", "triton", "--disable-cuda-graph", "--skip-server-warmup",
)  # fmt: skip
"""Triton kernels and no CUDA graph: what a wheelhouse without FA3 needs, and the configuration of the benchmarks'
figures before issue 24 (``sglang_rollout_bench.py --server-config eager``)."""
START_TIMEOUT_S = 900.0
"""A server's start-up on a fresh machine (142 s seen for the scaled model at SGLang's defaults, CUDA graphs
captured, kernels compiling)."""


def server_flags(mem_fraction: float, *extra: str, eager: bool = False) -> tuple[str, ...]:
    """SGLang server flags: the launcher's (:data:`LAUNCHER_FLAGS`) or, with ``eager``, :data:`EAGER_FLAGS`; the
    memory fraction, then ``extra``."""
    if eager:
        return (*EAGER_FLAGS, "--mem-fraction-static", str(mem_fraction), *extra)
    return ("--mem-fraction-static", str(mem_fraction), *LAUNCHER_FLAGS, *extra)


def sglang_argv(mem_fraction: float, *extra: str, eager: bool = False) -> list[str]:
    """:func:`server_flags` as ``--sglang-*`` flags of slime."""
    argv = []
    for token in server_flags(mem_fraction, *extra, eager=eager):
        argv.append("--sglang-" + token[2:] if token.startswith("--") else token)
    return argv


def figure(**values) -> dict:
    """Print ``values`` as one JSON line and append it to ``$SLIME_GPU_FIGURES`` when set."""
    line = json.dumps(values)
    print("FIGURE", line, flush=True)
    path = os.environ.get("SLIME_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return values


class SharedGpuPlacement:
    """Engines on GPUs of this node chosen by hand: engine ``i`` on ``gpu_ids[i]`` (ids may repeat).

    Duck-types the two things :class:`~slime.ray.engine_group.RolloutEngineGroup` reads from a
    :class:`~slime.ray.placement.Placement`: ``engine_resources`` and ``engine_options(i)``.  Actors take no
    Ray GPU (``num_gpus=0``) and set ``CUDA_VISIBLE_DEVICES`` from their resources themselves.
    """

    def __init__(self, gpu_ids: list[list[str]], colocated: bool = False):
        import ray

        node_ip = ray.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        self.engine_resources = [
            EngineResources(i, tuple(BundleResources(100 * i + k, node_ip, node_id, (g,), 1.0) for k, g in enumerate(ids)),
                            use_gpu=True, colocated=colocated)
            for i, ids in enumerate(gpu_ids)
        ]

    def engine_options(self, index: int) -> dict:
        from slime.ray.placement import NOSET_CUDA_VISIBLE_DEVICES

        return {"num_cpus": 0, "num_gpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}}


def start_engine(model_path: str, run_dir: str | os.PathLike, *, mem_fraction: float = 0.25, colocated: bool = True,
                 env: dict[str, str] | None = None, capacity: int = 128, extra: tuple[str, ...] = (),
                 eager: bool = False, return_routed_experts: bool = False) -> SGLangEngine:
    """One SGLang server on ``CUDA_VISIBLE_DEVICES``'s first GPU, through the engine, with :func:`server_flags`
    (and ``--enable-return-routed-experts`` with ``return_routed_experts``: requests may then ask for the routes);
    returns once it started (:func:`wait_healthy` waits until it serves)."""
    from slime.ray.placement import free_port

    spec = ServerSpec(model_path=str(model_path), tp_size=1, host=LOCALHOST, port=free_port(), seed=0,
                      colocated=colocated, passthrough=server_flags(mem_fraction, *extra, eager=eager),
                      return_routed_experts=return_routed_experts)
    return SGLangEngine(spec, run_dir, capacity=capacity, gpu_ids=["0"], env=env)


def wait_healthy(*engines: SGLangEngine, timeout_s: float = START_TIMEOUT_S) -> float:
    """Poll until every engine is healthy; returns the seconds it took.

    Raises:
        AssertionError: not healthy in time (with each log tail).
    """
    started = time.monotonic()
    pending = list(engines)
    while pending:
        pending = [e for e in pending if not e.health()]
        if pending and time.monotonic() - started > timeout_s:
            raise AssertionError("SGLang not healthy in time:\n" + "\n---\n".join(e.log_tail() for e in pending))
        if pending:
            time.sleep(1.0)
    return time.monotonic() - started


def hf_log_probs(model, samples, temperature: float, *, replay_routes: bool = False, rounding_noise: bool = False,
                 routes_out: list | None = None) -> list[list[float]]:
    """Per-token log-probs (float32, as lists) of each sample's response under the Hugging Face model ``model``, one
    sample per forward, along the FSDP trainer's path (:func:`slime.backends.fsdp.backend.build_model_inputs`,
    ``response_log_probs`` at ``logits / temperature``).

    Args:
        replay_routes: every MoE layer takes the sample's ``rollout_routed_experts`` (uint8 ``[P + R - 1, layers,
            top_k]``) at those positions and its own choice at the last one (:func:`slime.routing_replay.token_routes`,
            :func:`slime.routing_replay.force_hf_routes`: the FSDP trainer's replay).
        rounding_noise: one rounding step of noise on the token embeddings, the ``n``-th forward seeded ``n``
            (:func:`slime.backends.rounding.rounding_step_noise` around all forwards, as the trainer's floor pass).
        routes_out: when a list, each sample's own routes (int64 ``[P + R, layers, top_k]``) are appended to it.

    Raises:
        ValueError: ``replay_routes`` and a sample without routes (naming its index).
    """
    import contextlib

    from slime.backends.fsdp.backend import build_model_inputs, response_log_probs
    from slime.backends.rounding import rounding_step_noise
    from slime.routing_replay import RouteShape, token_routes
    from slime.routing_replay import capture_hf_routes, force_hf_routes

    device = next(model.parameters()).device
    shape = RouteShape.from_hf_config(model.config.to_dict(), "the reference's config") if replay_routes else None
    out = []
    with torch.no_grad(), rounding_step_noise(model.get_input_embeddings() if rounding_noise else None):
        for sample in samples:
            inputs = build_model_inputs([sample], model.config, device)
            replay = contextlib.nullcontext()
            if replay_routes:
                if sample.rollout_routed_experts is None:
                    raise ValueError(f"sample {sample.index} has no routed experts to replay")
                width = inputs.model_kwargs["input_ids"].shape[1]
                routes = token_routes([np.asarray(sample.rollout_routed_experts)], [0], width, shape)
                replay = force_hf_routes(model, torch.from_numpy(routes).to(device))
            capture = capture_hf_routes(model) if routes_out is not None else contextlib.nullcontext()
            with replay, capture as calls:
                log_probs, _ = response_log_probs(model, inputs, temperature)
            if routes_out is not None:
                routes_out.append(torch.stack([layer[-1] for layer in calls], 1))
            out.append(log_probs[0, : sample.response_length].float().tolist())
    return out


def route_agreement(routes: list, reference: list) -> list[float]:
    """Per layer, the share of positions where ``routes[i]`` and ``reference[i]`` (integer ``[positions, layers,
    top_k]`` each, any order of the top-k) name the same experts, over the positions both cover, all samples."""
    same, total = None, 0
    for a, b in zip(routes, reference, strict=True):
        a, b = torch.as_tensor(np.asarray(a)).long(), torch.as_tensor(np.asarray(b)).long()
        n = min(a.shape[0], b.shape[0])
        equal = (a[:n].sort(-1).values == b[:n].sort(-1).values).all(-1).sum(0)
        same = equal if same is None else same + equal
        total += n
    return [round(float(x) / total, 4) for x in same] if total else []


def load_checkpoint_tensors(model_path: str | Path, device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """Every tensor of the checkpoint's safetensors files by checkpoint name, on ``device`` in ``dtype``, but an MTP
    layer's (``mtp.*``: no trainer holds one, so none is ever synced)."""
    from safetensors.torch import load_file

    from slime.checkpoints.mtp import MTP_PREFIX

    tensors = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        tensors.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(str(path)).items()
                        if not k.startswith(MTP_PREFIX)})
    return tensors


def generate_in_actor(actor, requests, requests_per_call: int = 1) -> dict:
    """In an engine's actor (``actor.__ray_call__.remote(generate_in_actor, requests, n)``): the requests in
    consecutive calls of ``requests_per_call`` straight into the engine's ``generate`` (the last call may hold
    fewer), all calls in flight at once from a thread pool, as many as the engine's ``capacity`` allows
    (``capacity // requests_per_call`` calls, at least one; the engine group keeps at most ``capacity`` requests
    in flight at an engine the same way): the same calls as the group's, without its Ray call per call and its
    scheduling, to tell the group's cost from the engine's.  ``requests_per_call=1`` is one HTTP call per request.

    Returns:
        ``tokens`` (output tokens of all requests), wall ``seconds``, ``tokens_per_s``, ``calls`` and
        ``calls_at_once`` (the pool's size).

    Raises:
        ValueError: ``requests_per_call`` below 1, or an engine call answered with another number of outputs
            or another request's output (``rid``).
    """
    from concurrent.futures import ThreadPoolExecutor

    if requests_per_call < 1:
        raise ValueError(f"requests_per_call must be >= 1, got {requests_per_call}")
    calls = [requests[k:k + requests_per_call] for k in range(0, len(requests), requests_per_call)]
    at_once = max(1, min(len(calls), actor.engine.capacity // requests_per_call))

    def call(batch):
        outputs = actor.engine.generate(batch)
        if len(outputs) != len(batch) or [o.rid for o in outputs] != [r.rid for r in batch]:
            raise ValueError(f"a call of {len(batch)} requests ({[r.rid for r in batch][:3]}...) was answered with "
                             f"{len(outputs)} outputs ({[o.rid for o in outputs][:3]}...)")
        return outputs

    with ThreadPoolExecutor(at_once) as pool:
        t0 = time.perf_counter()
        outputs = [out for batch in pool.map(call, calls) for out in batch]
        seconds = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "calls": len(calls),
            "calls_at_once": at_once}
