"""The rollout-engine interface, shaped after SGLang's HTTP server API.

One engine is one inference server, possibly over several GPUs (``--rollout-num-gpus-per-engine``), built inside
its own Ray actor and driven by :class:`slime.ray.engine_group.RolloutEngineGroup`; ``--rollout-backend`` picks
the class (:mod:`slime.rollout.engines`).  The records mirror SGLang's ``/generate`` payload (text plus base64
images, SGLang's sampling names; token ids, log-probs, ``finish_reason``), and the memory calls take SGLang's
tags (:data:`GPU_MEMORY_TYPES`).  The lifecycle the group drives (start-up, health polling, windows, restarts,
shutdown): ``docs/design/rollout_engines.md``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from slime.rollout.engines.config import EngineSpec

# GPU memory regions, by SGLang's tag strings (``sglang.srt.constants``).
GPU_MEMORY_TYPE_WEIGHTS = "weights"
"""The model weights."""
GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
"""The KV cache pool (and, in SGLang, the radix cache over it)."""
GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
"""Captured CUDA graphs and their memory pool (a separate tag in newer SGLang versions)."""
GPU_MEMORY_TYPES = (GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH)
"""Every tag of this interface; ``tags=None`` means all of them."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve: its server died, or cannot be reached.  The call that raises it produced
    nothing, so the engine group may send the same requests to another engine (no duplicate, no loss)."""


def memory_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The tags a memory call acts on: ``None`` or ``[]`` means :data:`GPU_MEMORY_TYPES` (SGLang semantics).

    Raises:
        ValueError: naming every unknown tag and the known ones.
    """
    if not tags:
        return GPU_MEMORY_TYPES
    unknown = [t for t in tags if t not in GPU_MEMORY_TYPES]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; known tags: {list(GPU_MEMORY_TYPES)} (None means all)")
    return tuple(dict.fromkeys(tags))


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters, with SGLang's ``sampling_params`` names.

    Attributes:
        max_new_tokens: cap on generated tokens (reaching it: ``finish_reason == "length"``).
        temperature: >= 0; 0 is greedy (``top_p`` / ``top_k`` ignored, log-probs at ``T = 1``).  Log-probs are
            reported under ``logits / temperature``, as SGLang does.
        top_p: nucleus mass in (0, 1].  top_k: keep the k most likely tokens; -1 disables.
        stop, stop_token_ids: extra stop strings and ids (EOS always stops).
        no_stop_trim: keep the matched stop string in the text.
        sampling_seed: int in ``[0, 2**63)``, or None for the engine's own stream; with a seed the response depends
            only on seed, prompt and weights (:mod:`slime.rollout.seeds`).  Ignored when greedy.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = True
    sampling_seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` dict of an SGLang ``/generate`` request (``None`` fields dropped)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass
class GenerateRequest:
    """One prompt to complete (SGLang ``/generate`` with ``return_logprob=True``).

    Attributes:
        text: the chat-templated prompt, one vision span per image.
        image_data: base64 PNG images in placeholder order, already resized by the data pipeline.
        sampling_params: how to sample.  rid: request id, for logs.
        return_routed_experts: also return :attr:`GenerateOutput.routed_experts` (None from an engine that does
            not capture them).
    """

    text: str
    image_data: list[str]
    sampling_params: SamplingParams
    rid: str | None = None
    return_routed_experts: bool = False


FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class GenerateOutput:
    """One completion (the fields of SGLang's ``/generate`` answer that slime uses).

    Attributes:
        text: decoded response text.
        output_ids: generated token ids (R), the stop token included when one ended the response.
        output_log_probs: natural-log probabilities of ``output_ids`` under ``logits / temperature``, length R
            (SGLang ``meta_info.output_token_logprobs``).
        finish_reason: ``"stop"`` (EOS, stop token or string), ``"length"`` or ``"abort"``.
        prompt_tokens: prompt tokens the engine saw, images expanded (the rollout manager checks it).
        engine_index: the serving engine, set by the engine group.
        rid: the request id the engine answered for, where it reports one (the group checks it).
        routed_experts: when asked, uint8 ``[prompt_tokens + R - 1, layers, top_k]``: each MoE layer's experts at
            every position the engine ran a forward for (:mod:`slime.routing_replay`); None otherwise.
    """

    text: str
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    engine_index: int | None = None
    rid: str | None = None
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class BundleResources:
    """One placement-group bundle of an engine as Ray reports it inside the bundle: ``bundle_index`` in the engines'
    placement group, its node's ``node_ip`` and Ray ``node_id`` (hex), ``gpu_ids`` (``ray.get_gpu_ids()`` as
    ``CUDA_VISIBLE_DEVICES`` spells them; empty on CPU) and ``num_cpus`` (logical CPUs reserved)."""

    bundle_index: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]
    num_cpus: float


@dataclasses.dataclass(frozen=True)
class EngineResources:
    """The bundles one engine spans (``--rollout-num-gpus-per-engine``); its actor runs on ``bundles[0]`` and, on
    GPUs, sets ``CUDA_VISIBLE_DEVICES`` to :attr:`local_cuda_visible_devices` (Ray leaves it unset), so that it and
    its processes see every GPU of the engine on its node.

    Attributes:
        index: engine index (``0 .. engines - 1``), also its seed offset.
        bundles: in device order (node, then GPU id).
        use_gpu: the bundles hold GPUs.  colocated: trainer ranks share them (``--colocate``).
        cpu_threads: torch intra-op threads without GPUs (the engine's share of the cores); None on GPUs.
    """

    index: int
    bundles: tuple[BundleResources, ...]
    use_gpu: bool
    colocated: bool = False
    cpu_threads: int | None = None

    @property
    def node_ip(self) -> str:
        """IP address of the node of the engine's actor (its first bundle)."""
        return self.bundles[0].node_ip

    @property
    def node_ips(self) -> list[str]:
        """Every node the engine spans, first bundle's node first."""
        return list(dict.fromkeys(b.node_ip for b in self.bundles))

    @property
    def bundle_indices(self) -> list[int]:
        return [b.bundle_index for b in self.bundles]

    @property
    def gpu_ids(self) -> list[str]:
        """GPU ids of every bundle, in bundle order (ids are per node)."""
        return [gpu for b in self.bundles for gpu in b.gpu_ids]

    @property
    def local_gpu_ids(self) -> list[str]:
        """GPU ids of the bundles on the actor's node, in bundle order."""
        return [gpu for b in self.bundles if b.node_id == self.bundles[0].node_id for gpu in b.gpu_ids]

    @property
    def local_cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` for the actor and the processes it starts: :attr:`local_gpu_ids`, comma-joined."""
        return ",".join(self.local_gpu_ids)

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_ids)

    @property
    def num_cpus(self) -> float:
        """Logical CPUs of all bundles together."""
        return sum(b.num_cpus for b in self.bundles)

    def describe(self) -> str:
        """E.g. ``engine 1 (node 10.0.0.2, bundles [2, 3], GPUs 2,3)``, for logs and errors."""
        if self.use_gpu:
            devices = f"GPU{'s' if self.num_gpus != 1 else ''} {','.join(self.gpu_ids)}"
        else:
            devices = f"{self.num_cpus:g} CPU{'s' if self.num_cpus != 1 else ''}"
        return f"engine {self.index} (node {', '.join(self.node_ips)}, bundles {self.bundle_indices}, {devices})"


class RolloutEngine(abc.ABC):
    """One inference server inside a Ray actor.  The group calls one method at a time, except that :meth:`health`,
    :meth:`log_tail` and :meth:`shutdown` may come from another thread meanwhile, and up to
    :attr:`max_concurrent_calls` :meth:`generate` calls may run at once (never with a weight, memory or cache call).
    Weight buckets of one sync may come from several trainer ranks, in any order."""

    weight_transports: ClassVar[tuple[str, ...]] = ("object_store",)
    """The weight-sync transports this engine accepts (:mod:`slime.weight_sync`), best first.  Every engine
    takes the object store (CPU tensors into :meth:`update_weights_from_tensor`); the SGLang engine adds
    ``"cuda_ipc"`` (colocated, :meth:`update_weights_from_ipc`) and ``"nccl"`` (disaggregated,
    :meth:`init_weights_update_group` + :meth:`update_weights_from_distributed`), see :mod:`slime.weight_sync.base`."""

    parity_check: ClassVar[bool] = False
    """Whether runs with this engine compare its log-probs with the trainer's before step 0 and after the
    first sync (:mod:`slime.rollout.parity`; ``--skip-engine-parity-check`` turns it off).  True for an
    engine with its own model code (SGLang); the transformers engine runs the trainer's own HF model."""

    max_concurrent_calls: ClassVar[int] = 1
    """:meth:`generate` calls the engine's actor runs at once, each in its own thread (read from
    the class when the actor is created).  1 for an engine that batches per call (transformers);
    more for a thread-safe client of a continuous-batching server (SGLang), so that a request
    that finishes frees its slot for the next one at once instead of waiting for its call."""

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: EngineSpec, resources: EngineResources) -> RolloutEngine:
        """Build engine ``resources.index`` of a run inside its Ray actor, on all of ``resources``, from what every
        engine of the run is handed (:class:`slime.rollout.engines.config.EngineSpec`).

        Raises:
            ValueError / ConfigError: the engine cannot use these resources or flags (the message names the flag).
        """

    @property
    def capacity(self) -> int:
        """The most requests in flight at the engine over all its calls (>= 1; default 1): a batching engine's
        batch size, a continuous-batching server's concurrency."""
        return 1

    @property
    def max_requests_per_call(self) -> int:
        """The most requests in one :meth:`generate` call (>= 1; default :attr:`capacity`)."""
        return self.capacity

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request (at most :attr:`max_requests_per_call`): one output each, in request order."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """Load one bucket by Hugging Face checkpoint name; tensors arrive on CPU, or on CUDA for a colocated engine to
        read in place.

        Raises:
            KeyError: a name the engine's model does not have.
            ValueError: a shape that differs from the engine's parameter.
        """

    @abc.abstractmethod
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the device memory of regions ``tags`` (:data:`GPU_MEMORY_TYPES`; None or ``[]``: all) for a colocated
        trainer.  No generation until they are resumed; released weights must be pushed again.

        Raises:
            ValueError: an unknown tag (named).
        """

    @abc.abstractmethod
    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Re-allocate the released regions ``tags`` (None or ``[]``: all); callers resume released regions only.

        Raises:
            ValueError: an unknown tag (named).
        """

    # -- weight-sync transports other than the object store (see slime.weight_sync.base) ---------

    def update_weights_from_ipc(self, serialized_per_tp_rank: list[str]) -> None:
        """Transport ``cuda_ipc``: load one flattened bucket, one base64 payload per TP rank of the engine
        (:func:`slime.weight_sync.flattened.serialize_ipc_bucket`, made on that rank's GPU).

        Raises:
            NotImplementedError: the engine does not take ``cuda_ipc``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights by CUDA IPC")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str) -> None:
        """Transport ``nccl``: join group ``group_name``, TP rank ``i`` as rank ``rank_offset + i`` of ``world_size``
        (rank 0 broadcasts); blocks until the group is formed.

        Raises:
            NotImplementedError: the engine does not take ``nccl``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights over NCCL")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str) -> None:
        """Transport ``nccl``: receive one flattened bucket from rank 0 of ``group_name``, the tensors ``names`` of
        ``dtypes`` (``"bfloat16"``, ...) and ``shapes`` as bytes in that order; returns once they are loaded.

        Raises:
            NotImplementedError: the engine does not take ``nccl``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights over NCCL")

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the NCCL group ``group_name`` (before a transport reconnects); default: nothing to leave."""

    # -- lifecycle ---------------------------------------------------------------------------

    def restart(self) -> None:
        """Stop what is left of the server and start a new one from ``--hf-checkpoint``; returns once started
        (readiness: :meth:`health`).  The group pushes the current weights at the next sync.

        Raises:
            NotImplementedError: the engine cannot restart (the group then fails the run).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot restart")

    def memory_info(self) -> dict[str, float]:
        """``{"free_gib", "total_gib", "gpus"}`` of the engine's GPUs (GiB, summed) for the colocation metrics; ``{}``
        where unknown."""
        return {}

    def flush_cache(self) -> None:
        """Drop cached prefixes (the KV/radix cache), e.g. after a weight update."""

    def pause_generation(self) -> None:
        """Stop admitting requests (SGLang ``/pause_generation``), e.g. around a weight update."""

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`."""

    def abort_requests(self) -> None:
        """Make the :meth:`generate` calls in flight return now, what is cut off with ``finish_reason "abort"``,
        and keep serving (a dynamic-sampling step that has its groups).  Default: nothing, the calls finish."""

    def health(self) -> bool:
        """Whether the engine can serve (SGLang ``GET /health``); polled during start-up, so it never blocks."""
        return True

    def log_tail(self) -> str:
        """The last lines of the engine's own log, quoted when it fails to start ("" without one)."""
        return ""

    def shutdown(self) -> None:
        """Stop every process the engine started and free its device memory; idempotent, may run while another method
        runs (the actor kills processes that outlive it)."""
