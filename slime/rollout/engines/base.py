"""The rollout-engine interface, shaped after SGLang's HTTP server API.

A rollout engine is one inference server, possibly spanning several GPUs
(``--rollout-num-gpus-per-engine``); slime runs each engine inside a Ray actor and talks
to all of them through :class:`slime.ray.engine_group.RolloutEngineGroup`.  Engines are
selected with ``--rollout-backend`` (registry: :mod:`slime.rollout.engines`):

- ``sglang`` (the production engine, :mod:`slime.rollout.engines.sglang`): each engine is one
  SGLang server process on the engine's GPUs, and each method maps onto one of its endpoints
  (``/generate``, ``/update_weights_from_tensor``, ``/init_weights_update_group`` +
  ``/update_weights_from_distributed``, ``/release_memory_occupation``,
  ``/resume_memory_occupation``, ``/flush_cache``, ``/pause_generation``,
  ``/continue_generation``, ``/health``).
- ``transformers``: an in-process Hugging Face model; the embedded default on machines
  without a GPU, and usable on one GPU with small models.

The request/response records mirror SGLang's ``/generate`` payload so that the same
rollout code drives both engines: prompts travel as text plus base64 images
(``image_data``), sampling parameters use SGLang's names, and the output carries the
generated token ids, their log-probs and a ``finish_reason``.

Memory tags: ``/release_memory_occupation`` and ``/resume_memory_occupation`` take
``{"tags": [...]}`` naming regions of the engine's GPU memory (SGLang's
``sglang.srt.constants.GPU_MEMORY_TYPE_*``; ``None`` or ``[]`` means every region).
Colocated runs free everything before training and bring the regions back one at a time
around the weight sync (:mod:`slime.ray.colocate`).

Lifecycle, as :class:`slime.ray.engine_group.RolloutEngineGroup` drives it:

1. ``from_config(cfg, resources)`` builds the engine inside its Ray actor.  ``resources``
   (:class:`EngineResources`) lists every placement-group bundle the engine spans
   (``--rollout-num-gpus-per-engine`` of them): node, GPU ids, CPUs.  The actor sits on the
   first bundle; the others are reserved for the engine's own processes (an SGLang server's
   tensor-parallel ranks) and nothing else of the run is placed on them.  The constructor
   should start the server and return; readiness is reported by :meth:`RolloutEngine.health`.
2. :meth:`RolloutEngine.health` is polled until it is True, for at most
   ``--rollout-engine-start-timeout`` seconds; an engine that raises, or is not healthy in
   time, fails the start-up with an error naming it (index, node, bundles, exception and
   :meth:`RolloutEngine.log_tail`).
3. The step's requests form one queue; an engine with room in its window (requests in
   flight: its :attr:`RolloutEngine.capacity` when it is the only engine, else at most half
   an even share of the step, :func:`slime.rollout.scheduler.balance_windows`) gets the
   next ones, in calls of at most :attr:`RolloutEngine.max_requests_per_call`, and up to
   :attr:`RolloutEngine.max_concurrent_calls` calls at once.
4. An engine that dies while serving (its :meth:`RolloutEngine.generate` raises
   :class:`EngineUnavailableError`, its actor dies, or its :meth:`RolloutEngine.health` turns False)
   is taken out of the rotation; its requests go to the other engines and it is restarted
   (:meth:`RolloutEngine.restart`), then serves again after the next weight sync (mid-rollout when no
   other engine is left to serve, :meth:`slime.ray.engine_group.RolloutEngineGroup.set_resync`).
5. :meth:`RolloutEngine.shutdown` stops everything the engine started; it runs in the
   driver's ``finally``, also after errors and when the run joined an external Ray cluster.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from slime.arguments import SlimeConfig

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
        max_new_tokens: hard cap on generated tokens; a response that reaches it ends with
            ``finish_reason == "length"``.
        temperature: softmax temperature, >= 0; 0 is greedy decoding (argmax; ``top_p`` and
            ``top_k`` are ignored, log-probs under ``T = 1``). Log-probs are reported under
            ``logits / temperature``, as SGLang does.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; -1 disables.
        stop: extra stop strings (the EOS token always stops).
        stop_token_ids: extra stop token ids.
        no_stop_trim: keep the matched stop string in the text (SGLang semantics).
        sampling_seed: this request's seed, an int in ``[0, 2**63)`` (SGLang's name), or None
            for the engine's own stream.  With a seed, the response depends only on the seed,
            the prompt and the weights, never on the engine, the batch or earlier requests
            (:mod:`slime.rollout.seeds`); ignored when ``temperature == 0``.
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
        text: the chat-templated prompt, with one vision span per image.
        image_data: base64 PNG images in placeholder order (already resized by the data
            pipeline, so every engine derives the same number of image tokens).
        sampling_params: how to sample.
        rid: request id, for logs.
        return_routed_experts: also return the experts an MoE model routed every position to
            (:attr:`GenerateOutput.routed_experts`; SGLang's field, which needs its server flag
            ``--enable-return-routed-experts``).  An engine that does not capture them returns None.

    Engines do not check the prompt against the data pipeline's tokens: they report the
    length they saw (:attr:`GenerateOutput.prompt_tokens`) and the rollout manager compares
    it, once for every engine.
    """

    text: str
    image_data: list[str]
    sampling_params: SamplingParams
    rid: str | None = None
    return_routed_experts: bool = False


FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class GenerateOutput:
    """One completion (the fields of SGLang's ``/generate`` response that slime uses).

    Attributes:
        text: decoded response text.
        output_ids: generated token ids (R), including the stop token when generation
            stopped on one.
        output_log_probs: log-probs of ``output_ids`` under the sampling distribution
            (``logits / temperature``), natural log, length R (SGLang
            ``meta_info.output_token_logprobs``).
        finish_reason: ``"stop"`` (EOS or a stop token/string), ``"length"``
            (``max_new_tokens`` reached) or ``"abort"``.
        prompt_tokens: number of prompt tokens the engine saw (images expanded; SGLang
            ``meta_info.prompt_tokens``), checked by the rollout manager against the data
            pipeline's count.
        engine_index: which engine served the request; set by the engine group, not by the
            engine.
        rid: the request id the engine answered for, where it reports one (SGLang's
            ``meta_info.id``); the engine group checks it against the request's ``rid``.
        routed_experts: with :attr:`GenerateRequest.return_routed_experts`, uint8
            ``[prompt_tokens + R - 1, layers, top_k]``: the experts of each MoE layer at every position the
            engine ran a forward for (:mod:`slime.data.routes`); None otherwise.
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
    """One placement-group bundle of an engine, as Ray reports it from inside the bundle.

    Attributes:
        bundle_index: index of the bundle in the engines' placement group.
        node_ip: IP address of the bundle's node.
        node_id: Ray node id (hex) of that node.
        gpu_ids: ``ray.get_gpu_ids()`` in the bundle, as strings: the node's device ids as
            ``CUDA_VISIBLE_DEVICES`` spells them; empty for CPU bundles.
        num_cpus: logical CPUs the bundle reserves.
    """

    bundle_index: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]
    num_cpus: float


@dataclasses.dataclass(frozen=True)
class EngineResources:
    """Everything one engine may use: the bundles it spans (``--rollout-num-gpus-per-engine``).

    The engine's Ray actor runs on ``bundles[0]``.  On GPUs the actor is started with Ray's
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` and sets ``CUDA_VISIBLE_DEVICES`` to
    :attr:`local_cuda_visible_devices` itself, so that it and the processes it starts see
    every GPU of the engine on its node (an SGLang server then takes ``base_gpu_id=0``,
    ``tp_size=len(local_gpu_ids)``).  Bundles on other nodes (an engine larger than a node)
    are listed for the engine to start its remote ranks there.

    Attributes:
        index: engine index, ``0 <= index < number of engines``; also its seed offset.
        bundles: the bundles in device order (sorted by node, then GPU id).
        use_gpu: whether the bundles hold GPUs (else CPUs only).
        colocated: whether trainer ranks share these bundles (``--colocate``).
        cpu_threads: torch intra-op threads for this engine on a machine without GPUs (its
            share of the cores, in proportion to its bundles); None on GPUs.
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
    """One inference server. Instances live inside Ray actors (see ``engine_group``).

    Threads: the engine group calls one method at a time, with two exceptions.
    :meth:`health`, :meth:`log_tail` and :meth:`shutdown` may arrive from another thread while
    a method runs (a health poll, a shutdown after Ctrl-C during generation); and up to
    :attr:`max_concurrent_calls` :meth:`generate` calls may run at once when an engine sets it
    above 1 (never together with a weight, memory or cache call).  Weight updates may come from
    several trainer ranks in one sync (each sends the tensors it is the source of), one call after
    another in any order.
    """

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
    def from_config(cls, cfg: SlimeConfig, resources: EngineResources) -> RolloutEngine:
        """Build engine ``resources.index`` of a run inside its Ray actor (the engine factory).

        Args:
            cfg: the run's flags.
            resources: the bundles the engine spans; the engine uses all of them.

        Raises:
            ValueError / ConfigError: the engine cannot use these resources or flags; the
                message names the flag.
        """

    @property
    def capacity(self) -> int:
        """The most requests the engine works on at once, over all its :meth:`generate` calls (>= 1).

        The engine group never has more in flight at the engine.  An engine that batches per
        call (transformers) gives its batch size; a continuous-batching server (SGLang) the
        requests it keeps in flight (upstream slime's ``--sglang-server-concurrency``).
        Default 1.
        """
        return 1

    @property
    def max_requests_per_call(self) -> int:
        """The most requests in one :meth:`generate` call (>= 1); default :attr:`capacity` (one
        call is one batch).  A continuous-batching server with :attr:`max_concurrent_calls` > 1
        sets it smaller (SGLang: ``--sglang-requests-per-call``), so that a call's requests come back
        and free the group's window without waiting for the whole step."""
        return self.capacity

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request (at most :attr:`max_requests_per_call`); the output list is in
        request order, one output per request, each with the engine's
        :attr:`GenerateOutput.prompt_tokens`."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """Load one bucket of weights, by Hugging Face parameter name.

        Names are those of the HF checkpoint (``model.language_model.layers.0...``,
        ``model.visual.blocks.0...``, ``lm_head.weight``); the vision tower keeps its HF
        names. Tensors arrive on CPU (Ray object store) or, for colocated GPU engines,
        as CUDA tensors the engine may read in place.

        Raises:
            KeyError: a name the engine's model does not have.
            ValueError: a shape that does not match the engine's parameter.
        """

    @abc.abstractmethod
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the device memory of the regions ``tags`` for a colocated trainer
        (SGLang ``POST /release_memory_occupation {"tags": tags}``).

        Args:
            tags: :data:`GPU_MEMORY_TYPE_WEIGHTS`, :data:`GPU_MEMORY_TYPE_KV_CACHE`,
                :data:`GPU_MEMORY_TYPE_CUDA_GRAPH`; ``None`` (or ``[]``) releases all of them.

        The engine must not generate until every released region is resumed.  After the
        weights are resumed they must be pushed again (SGLang without a weight backup keeps
        no copy), which :class:`slime.ray.colocate.ColocatedMemory` always does.

        Raises:
            ValueError: an unknown tag (the message names it).
        """

    @abc.abstractmethod
    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Re-allocate the regions ``tags`` that :meth:`release_memory_occupation` freed
        (SGLang ``POST /resume_memory_occupation {"tags": tags}``; ``None`` or ``[]``: all).

        Callers resume only released regions: SGLang raises for a tag that is not released.

        Raises:
            ValueError: an unknown tag (the message names it).
        """

    # -- weight-sync transports other than the object store (see slime.weight_sync.base) ---------

    def update_weights_from_ipc(self, serialized_per_tp_rank: list[str]) -> None:
        """Load one flattened bucket from CUDA IPC handles, one per TP rank of the engine (transport
        ``cuda_ipc``; SGLang ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"``).

        Args:
            serialized_per_tp_rank: for TP rank ``i``, the base64 payload of
                :func:`slime.weight_sync.flattened.serialize_ipc_bucket` made on that rank's GPU.

        Raises:
            NotImplementedError: the engine does not take ``cuda_ipc`` (not in its :attr:`weight_transports`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights by CUDA IPC")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str) -> None:
        """Join the NCCL group ``group_name`` of a weight source (transport ``nccl``; SGLang
        ``/init_weights_update_group``): the engine's TP rank ``i`` becomes rank ``rank_offset + i`` of
        ``world_size``, rank 0 being the trainer rank that broadcasts.  Blocks until the group is formed.

        Raises:
            NotImplementedError: the engine does not take ``nccl``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights over NCCL")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str) -> None:
        """Receive one flattened bucket broadcast from rank 0 of ``group_name`` (transport ``nccl``; SGLang
        ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``): the tensors
        ``names`` (HF checkpoint names) of ``dtypes`` (``"bfloat16"``, ...) and ``shapes``, concatenated
        as bytes in that order.  Returns once they are loaded.

        Raises:
            NotImplementedError: the engine does not take ``nccl``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weights over NCCL")

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the NCCL group ``group_name`` (before a transport reconnects); default: nothing to leave."""

    # -- lifecycle ---------------------------------------------------------------------------

    def restart(self) -> None:
        """Stop what is left of the engine's server and start a new one with the start-up weights
        (``--hf-checkpoint``); returns once it is started (readiness: :meth:`health`).  The engine
        group calls it after the engine died, and pushes the current weights in at the next sync.

        Raises:
            NotImplementedError: the engine cannot restart (the group then fails the run instead).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot restart")

    def memory_info(self) -> dict[str, float]:
        """GPU memory figures of the engine's GPUs for the colocation metrics: ``{"free_gib": ...,
        "total_gib": ...}`` (GiB, summed over its GPUs) and ``"gpus"`` (how many); empty where unknown
        (CPU engines)."""
        return {}

    def flush_cache(self) -> None:
        """Drop cached prefixes (the KV/radix cache), e.g. after a weight update."""

    def pause_generation(self) -> None:
        """Stop admitting requests (SGLang ``/pause_generation``), e.g. around a weight update."""

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`."""

    def health(self) -> bool:
        """Whether the engine can serve requests (SGLang ``GET /health``); polled during start-up
        until True, so it must return quickly, never block until the server is up."""
        return True

    def log_tail(self) -> str:
        """The last lines of the engine's own log (e.g. its server's), quoted when the engine
        fails to start; empty when there is none."""
        return ""

    def shutdown(self) -> None:
        """Release every resource: stop every process the engine started and free device memory.

        Called once at the end of every run, including failed ones, possibly while another
        method still runs (see the class docstring); a second call does nothing.  Processes the
        engine's actor started and that outlive this call are killed by the actor afterwards.
        """
