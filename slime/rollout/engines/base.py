"""The rollout-engine interface, shaped after SGLang's HTTP server API.

A rollout engine is one inference server, possibly spanning several GPUs
(``--rollout-num-gpus-per-engine``); slime runs each engine inside a Ray actor and talks
to all of them through :class:`slime.rollout.engine_group.RolloutEngineGroup`.  Engines are
selected with ``--rollout-backend`` (registry: :mod:`slime.rollout.engines`):

- ``sglang`` (the production engine, next on the roadmap, not in this version): each
  method maps onto one SGLang endpoint
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
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Literal

import torch

# GPU memory regions, by SGLang's tag strings (``sglang.srt.constants``).
GPU_MEMORY_TYPE_WEIGHTS = "weights"
"""The model weights."""
GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
"""The KV cache pool (and, in SGLang, the radix cache over it)."""
GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
"""Captured CUDA graphs and their memory pool (a separate tag in newer SGLang versions)."""
GPU_MEMORY_TYPES = (GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH)
"""Every tag of this interface; ``tags=None`` means all of them."""


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
        expected_prompt_len: the prompt length in tokens that the data pipeline computed
            locally (images expanded). An engine whose own tokenisation disagrees raises
            :class:`PromptMismatchError` instead of silently training on other tokens.
        rid: request id, for logs.
    """

    text: str
    image_data: list[str]
    sampling_params: SamplingParams
    expected_prompt_len: int | None = None
    rid: str | None = None


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
        prompt_tokens: number of prompt tokens the engine saw (images expanded).
    """

    text: str
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int


class PromptMismatchError(RuntimeError):
    """The engine tokenised a prompt to a different length than the data pipeline did."""


class RolloutEngine(abc.ABC):
    """One inference server. Instances live inside Ray actors (see ``engine_group``).

    Implementations must be safe to call from one thread at a time; the engine group
    never calls two methods of one engine concurrently.
    """

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request; the output list is in request order.

        Raises:
            PromptMismatchError: a request's ``expected_prompt_len`` disagrees with the
                engine's tokenisation.
        """

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

    def flush_cache(self) -> None:
        """Drop cached prefixes (the KV/radix cache), e.g. after a weight update."""

    def pause_generation(self) -> None:
        """Stop admitting requests (SGLang ``/pause_generation``), e.g. around a weight update."""

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`."""

    def health(self) -> bool:
        """Whether the engine can serve requests."""
        return True

    def shutdown(self) -> None:
        """Release every resource (server processes, device memory)."""
