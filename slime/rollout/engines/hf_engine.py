"""Rollout engine on an in-process transformers model, on CPU or one GPU: the default without a GPU and the
fallback without SGLang.

It reproduces the SGLang 0.5 behaviour the trainer relies on: sampling and log-probs (:mod:`.hf_sampling`);
stopping, checked after every token in this order: ``max_new_tokens`` -> ``"length"`` (even on an EOS), an EOS or
``stop_token_ids`` id -> ``"stop"``, a ``stop`` string in the decoded tail -> ``"stop"`` (``output_ids`` keep the
stop token); the text, ``decode(output_ids, skip_special_tokens=True)`` with the matched stop cut off unless
``no_stop_trim``.  Sources, batching and randomness: ``docs/design/rollout_engines.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from slime.data.image import decode_image
from slime.data.processor import load_processor, mm_token_type_ids
from slime.rollout.engines.base import (
    GPU_MEMORY_TYPE_WEIGHTS,
    EngineResources,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    memory_tags,
)
from slime.rollout.engines.config import EngineSpec
from slime.rollout.engines.hf_sampling import check_sampling_params, sample_next_tokens
from slime.routing_replay import RouteShape, capture_hf_routes, compact_routes
from slime.rollout.engines.hf_weights import CheckpointWeights
from slime.rollout.seeds import SEED_BITS, uniform


@dataclasses.dataclass
class _Prompt:
    """A tokenised request: prompt ids (length P) and, with images, the processor's pixel tensors."""

    request: GenerateRequest
    input_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    seed: int | None = None
    """The request's sampling seed (its ``sampling_seed``, else one from the engine's generator)."""


class TransformersEngine(RolloutEngine):
    """A :class:`RolloutEngine` around ``AutoModelForImageTextToText`` (``Qwen3_5MoeForConditionalGeneration``).

    Args:
        hf_checkpoint: local checkpoint folder (weights, tokenizer, processor files).
        device, dtype: of the model, e.g. ``"cpu"`` and float32, ``"cuda:0"`` and bfloat16.
        min_pixels, max_pixels: narrower image bounds for :func:`slime.data.processor.load_processor`.
        seed: seeds the engine's generator, which gives a seed to every request without ``sampling_seed``.
        max_batch_size: requests per forward batch (>= 1).
        attn_implementation: transformers' attention backend (``"sdpa"``, ``"eager"``, ...).

    Raises:
        ValueError: ``max_batch_size < 1``.
        HFFolderError / ConfigError: from ``load_processor``.
    """

    def __init__(
        self,
        hf_checkpoint: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        seed: int = 0,
        max_batch_size: int = 32,
        attn_implementation: str = "sdpa",
    ):
        from transformers import AutoModelForImageTextToText

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size}; use at least 1")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.processor = load_processor(hf_checkpoint, min_pixels=min_pixels, max_pixels=max_pixels)
        self.tokenizer = self.processor.tokenizer
        # Loaded on CPU, then moved: device_map would need accelerate, which CPU installs lack.
        self.model = AutoModelForImageTextToText.from_pretrained(
            hf_checkpoint, dtype=dtype, attn_implementation=attn_implementation
        )
        self.model.to(self.device).eval()
        self.eos_token_ids = _eos_token_ids(self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)  # seeds for requests that bring none
        self._weights = CheckpointWeights(self.model)
        self._paused = False
        self._released: set[str] = set()  # memory tags released and not yet resumed
        self._shut_down = False

    @classmethod
    def from_spec(cls, spec: EngineSpec, resources: EngineResources) -> "TransformersEngine":
        """Engine ``resources.index`` of a run: ``--hf-checkpoint``, the data pipeline's pixel bounds, seed
        ``--rollout-seed + index`` (for requests without one), bfloat16 on the engine's GPU, float32 on CPU.

        Raises:
            ValueError: the engine spans more than one GPU (``--rollout-num-gpus-per-engine`` > 1).
        """
        if resources.num_gpus > 1:
            raise ValueError(
                f"--rollout-num-gpus-per-engine {resources.num_gpus}: the transformers engine runs on one GPU; use "
                "--rollout-num-gpus-per-engine 1 (one engine per GPU) or --rollout-backend sglang for tensor "
                "parallelism"
            )
        return cls(
            spec.hf_checkpoint,
            device="cuda" if resources.use_gpu else "cpu",
            dtype=torch.bfloat16 if resources.use_gpu else torch.float32,
            min_pixels=spec.image_min_pixels,
            max_pixels=spec.image_max_pixels,
            seed=spec.rollout_seed + resources.index,
        )

    @property
    def capacity(self) -> int:
        """``max_batch_size``: one call is one forward batch."""
        return self.max_batch_size

    # ---------------------------------------------------------------- generation

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request (sampling and stopping: module docstring).

        Raises:
            RuntimeError: the engine is paused, released or shut down, or a fused parameter is half-received.
            ValueError: invalid sampling parameters, or an image the processor cannot take.
        """
        self._check_can_generate()
        prompts = [self._tokenize(request, i) for i, request in enumerate(requests)]
        unseeded = [p for p in prompts if p.request.sampling_params.sampling_seed is None]
        own_seeds = torch.randint(0, 2**SEED_BITS - 1, (len(unseeded),), generator=self.generator).tolist()
        for prompt, seed in zip(unseeded, own_seeds):
            prompt.seed = seed
        outputs = []
        for start in range(0, len(prompts), self.max_batch_size):
            outputs += self._generate_batch(prompts[start : start + self.max_batch_size])
        return outputs

    def _check_not_shut_down(self) -> None:
        if self._shut_down:
            raise RuntimeError("the transformers engine was shut down; build a new engine")

    def _check_can_generate(self) -> None:
        self._check_not_shut_down()
        if self._paused:
            raise RuntimeError("generation is paused (pause_generation); call continue_generation() first")
        if self._released:
            raise RuntimeError(
                f"the engine's memory is released ({sorted(self._released)}); call resume_memory_occupation() first"
            )
        incomplete = self._weights.incomplete_parameters()
        if incomplete:
            raise RuntimeError(
                f"a weight update is incomplete: {len(incomplete)} fused parameter(s) are waiting for the rest of "
                f"their checkpoint tensors, e.g. {incomplete[0]}; push the remaining tensors before generating"
            )

    def _tokenize(self, request: GenerateRequest, index: int) -> _Prompt:
        """Decode the request's images, run the processor and check the sampling params."""
        name = f"request {index}" + (f" (rid {request.rid!r})" if request.rid is not None else "")
        check_sampling_params(request.sampling_params, name)
        images = [
            decode_image(data, row=request.rid if request.rid is not None else index, field=f"image_data[{i}]")
            for i, data in enumerate(request.image_data)
        ]
        try:
            processed = self.processor(request.text, images)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        seed = request.sampling_params.sampling_seed
        return _Prompt(request, processed.input_ids, processed.pixel_values, processed.image_grid_thw, seed)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[_Prompt]) -> list[GenerateOutput]:
        """One left-padded batch: prefill, then decode steps until every row is done (routes captured where asked)."""
        batch = len(prompts)
        params = [p.request.sampling_params for p in prompts]
        stop_strs = {row: s.stop for row, s in enumerate(params) if s.stop}
        shape = self._route_shape() if any(p.request.return_routed_experts for p in prompts) else None
        with capture_hf_routes(self.model) if shape is not None else contextlib.nullcontext() as calls:
            tokens, log_probs, n_tokens, by_length, matched_str = self._sample(prompts, params, stop_strs)
        routes = [None] * batch if calls is None else self._routes(calls, prompts, n_tokens.tolist(), shape)

        all_tokens, all_log_probs = tokens.tolist(), log_probs.tolist()
        outputs = []
        for row, (n, length) in enumerate(zip(n_tokens.tolist(), by_length.tolist())):
            ids = all_tokens[row][:n]
            text = self._response_text(ids, length, matched_str.get(row), params[row].no_stop_trim)
            reason = "length" if length else "stop"
            wanted = prompts[row].request.return_routed_experts
            outputs.append(GenerateOutput(text, ids, all_log_probs[row][:n], reason, len(prompts[row].input_ids),
                                          routed_experts=routes[row] if wanted else None))
        return outputs

    def _sample(self, prompts: list[_Prompt], params: list[SamplingParams], stop_strs: dict[int, list[str]]):
        """Prefill and decode one batch: ``(tokens [B, S], log_probs [B, S], n_tokens [B], by_length [B], matched stop
        string per row)``, ``S`` the steps run; row ``b`` is valid in its first ``n_tokens[b]`` entries."""
        from transformers import DynamicCache

        batch, device = len(prompts), self.device
        temperature = torch.tensor([s.temperature for s in params], dtype=torch.float32, device=device)
        top_p = torch.tensor([s.top_p for s in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.top_k for s in params], dtype=torch.long, device=device)
        max_new = torch.tensor([s.max_new_tokens for s in params], dtype=torch.long, device=device)
        stop_table = self._stop_token_table(params)
        inputs = self._prefill_inputs(prompts)
        attention_mask, position_ids = inputs["attention_mask"], inputs["position_ids"]
        cache = DynamicCache(config=self.model.config)
        logits = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        token_steps, log_prob_steps, matched_str = [], [], {}
        n_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        by_length = torch.zeros(batch, dtype=torch.bool, device=device)
        seeds = [p.seed for p in prompts]
        for step in range(int(max_new.max())):
            uniforms = torch.tensor([uniform(seed, step) for seed in seeds], dtype=torch.float64)
            tokens, log_probs = sample_next_tokens(logits.float(), temperature, top_p, top_k, uniforms)
            token_steps.append(tokens)
            log_prob_steps.append(log_probs)
            alive = ~done
            n_tokens += alive
            hit_length = alive & (n_tokens >= max_new)
            hit_stop = alive & ~hit_length & (tokens.unsqueeze(-1) == stop_table).any(-1)
            for row, strings in stop_strs.items():
                if alive[row] and not hit_length[row] and not hit_stop[row]:
                    response = torch.stack(token_steps, dim=1)[row, : n_tokens[row]]
                    matched = self._find_stop_string(response, strings)
                    if matched is not None:
                        matched_str[row], hit_stop[row] = matched, True
            done |= hit_length | hit_stop
            by_length |= hit_length
            if done.all():
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[..., -1:] + 1
            logits = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        return torch.stack(token_steps, dim=1), torch.stack(log_prob_steps, dim=1), n_tokens, by_length, matched_str

    def _route_shape(self) -> RouteShape | None:
        """None for a dense model (its requests get no routes); RouteError above 256 experts per layer."""
        return RouteShape.from_hf_config(self.model.config.to_dict(), "the transformers engine's model")

    @staticmethod
    def _routes(calls: list[list[torch.Tensor]], prompts: list[_Prompt], lengths: list[int],
                shape: RouteShape) -> list[np.ndarray]:
        """Per row, uint8 ``[P + n - 1, layers, top_k]`` from the routers' choices (:func:`capture_hf_routes`):
        the prefill's (left padded to the batch's width) at the prompt's positions, then one per decode step
        that fed a token of this row (``n - 1`` of them)."""
        batch, width = len(prompts), max(len(p.input_ids) for p in prompts)
        per_call = [torch.stack([layer[f] for layer in calls], 1) for f in range(len(calls[0]))]  # [N_f, L, k]
        prefill = per_call[0].view(batch, width, *per_call[0].shape[1:])
        out = []
        for row, (prompt, n) in enumerate(zip(prompts, lengths)):
            decoded = [per_call[1 + t][row: row + 1] for t in range(n - 1)]
            parts = [prefill[row, width - len(prompt.input_ids):], *decoded]
            out.append(compact_routes(torch.cat(parts).numpy(), shape, f"request {prompt.request.rid}"))
        return out

    def _prefill_inputs(self, prompts: list[_Prompt]) -> dict[str, torch.Tensor | None]:
        """Model inputs of the prefill: int64 ``input_ids`` / ``attention_mask`` ``[B, L]`` (left padded),
        ``position_ids`` ``[3, B, L]``, and the images' ``pixel_values`` / ``image_grid_thw`` in batch order."""
        batch, width = len(prompts), max(len(p.input_ids) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt.input_ids) :] = torch.tensor(prompt.input_ids)
            attention_mask[row, width - len(prompt.input_ids) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        with_images = [p for p in prompts if p.pixel_values is not None]
        pixel_values = torch.cat([p.pixel_values for p in with_images]).to(self.device) if with_images else None
        image_grid_thw = torch.cat([p.image_grid_thw for p in with_images]).to(self.device) if with_images else None
        return dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=self._prompt_position_ids(input_ids, attention_mask, image_grid_thw),
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        )

    def _stop_token_table(self, params: list[SamplingParams]) -> torch.Tensor:
        """int64 ``[B, S]``: each row's stop ids (EOS ids and ``stop_token_ids``), padded with -1."""
        stop_ids = [sorted(self.eos_token_ids | set(s.stop_token_ids or ())) for s in params]
        table = torch.full((len(params), max(map(len, stop_ids))), -1, dtype=torch.long)
        for row, ids in enumerate(stop_ids):
            table[row, : len(ids)] = torch.tensor(ids)
        return table.to(self.device)

    def _prompt_position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """int64 ``[3, B, L]``: the M-RoPE (t, h, w) positions of each prompt's own tokens (0 on padding),
        from the model's ``get_rope_index``, i.e. what the model computes for the prompt alone."""
        token_types = mm_token_type_ids(input_ids, self.model.config.image_token_id)
        position_ids, _ = self.model.model.get_rope_index(
            input_ids, token_types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
        )
        return position_ids

    def _find_stop_string(self, response_ids: torch.Tensor, stop: list[str]) -> str | None:
        """The first stop string in the decoded tail, or None.  The tail is ``4 * len(longest) + 1`` tokens: a token
        carries at least one UTF-8 byte, a character at most 4, and the check runs after every token."""
        tail = response_ids[-(4 * max(map(len, stop)) + 1) :].tolist()
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return next((s for s in stop if s in text), None)

    def _response_text(self, ids: list[int], by_length: bool, stop_str: str | None, no_stop_trim: bool) -> str:
        """Decode a response and trim the matched stop as SGLang's detokenizer does."""
        if not by_length and stop_str is None and not no_stop_trim:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_str is not None:
            pos = text.find(stop_str)
            if pos >= 0:
                text = text[: pos + len(stop_str)] if no_stop_trim else text[:pos]
        return text

    # ---------------------------------------------------------------- weights and memory

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True
    ) -> None:
        """Load one bucket of checkpoint-named tensors (:class:`CheckpointWeights`; there is no cache to flush).

        Raises:
            RuntimeError: the engine was shut down.
            KeyError: not a checkpoint tensor of this model.
            ValueError: another shape than the checkpoint's.
        """
        self._check_not_shut_down()
        self._weights.load(named_tensors)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free device memory by SGLang tag (None: all); generation raises until every released tag is resumed.
        ``"weights"``: on CUDA the model moves to CPU (kept, so weight updates land there); ``"kv_cache"``: the
        allocator's cached blocks go back to the driver (no cache lives between calls); ``"cuda_graph"``: none captured.

        Raises:
            RuntimeError: the engine was shut down.
            ValueError: an unknown tag (named); nothing is released then.
        """
        self._check_not_shut_down()
        tags = memory_tags(tags)
        if self.device.type == "cuda":
            if GPU_MEMORY_TYPE_WEIGHTS in tags and GPU_MEMORY_TYPE_WEIGHTS not in self._released:
                self.model.to("cpu")
            # "kv_cache" (and the weights just moved): hand cached allocator blocks back to the driver.
            torch.cuda.empty_cache()
        self._released.update(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`release_memory_occupation` for ``tags`` (None: all); a tag that is not released is skipped.

        Raises:
            RuntimeError: the engine was shut down.
            ValueError: an unknown tag (named); nothing is resumed then.
        """
        self._check_not_shut_down()
        tags = memory_tags(tags)
        if self.device.type == "cuda" and GPU_MEMORY_TYPE_WEIGHTS in tags and GPU_MEMORY_TYPE_WEIGHTS in self._released:
            self.model.to(self.device)
        # "kv_cache": the next generate() call allocates its own cache; "cuda_graph": none captured.
        self._released.difference_update(tags)

    def flush_cache(self) -> None:
        """No-op: no cache lives across :meth:`generate` calls."""

    def pause_generation(self) -> None:
        """Refuse :meth:`generate` until :meth:`continue_generation` (calls never overlap: nothing is in flight)."""
        self._paused = True

    def continue_generation(self) -> None:
        """Allow :meth:`generate` again after :meth:`pause_generation`."""
        self._paused = False

    def health(self) -> bool:
        """True until :meth:`shutdown`."""
        return not self._shut_down

    def shutdown(self) -> None:
        """Drop the model and free its device memory; every later call except :meth:`health` raises."""
        if self._shut_down:
            return
        del self.model, self._weights
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._shut_down = True


def _eos_token_ids(tokenizer_eos: int | None, generation_eos: int | list[int] | None) -> set[int]:
    """Union of the tokenizer's EOS id and the checkpoint's ``generation_config.eos_token_id`` (int or list)."""
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(generation_eos)
    if not ids:
        raise ValueError("the checkpoint defines no EOS token (tokenizer eos_token or generation_config.eos_token_id)")
    return ids
