"""Rollout engine on an in-process transformers model: the embedded default on machines without
a GPU and the fallback where SGLang is not installed.  Runs on CPU or one GPU (``device``, ``dtype``).

It reproduces the SGLang behaviour the trainer relies on (SGLang 0.5, ``python/sglang/srt``):

- **Sampling** (``layers/sampler.py``, pytorch backend): ``p = softmax(logits / T)``; top-k keeps
  the k most likely tokens and top-p the sorted tokens whose probability mass *before* them is
  ``<= top_p``, both judged on the same unrenormalised sorted ``p``; one token is drawn from what
  is kept.  ``temperature == 0`` is greedy (SGLang turns it into ``top_k = 1`` at ``T = 1``).
- **Log-probs** (same file, ``torch.log(probs)``): ``log_softmax(logits / T)`` of the chosen
  token, taken *before* top-k / top-p filtering, in float32 (``T = 1`` for greedy rows).
- **Stopping** (``managers/schedule_batch.py``, ``Req.check_finished``), after every token, in
  this order: ``max_new_tokens`` reached -> ``"length"`` (even when that token is an EOS); the
  token is an EOS id (the tokenizer's ``eos_token_id`` or the checkpoint's
  ``generation_config.eos_token_id``) or in ``stop_token_ids`` -> ``"stop"``; the decoded tail of
  the response contains a ``stop`` string -> ``"stop"``.  ``output_ids`` keep the stop token (and
  the tokens of a stop string).
- **Text** (``managers/detokenizer_manager.py``, ``trim_matched_stop``):
  ``decode(output_ids, skip_special_tokens=True)``; with ``no_stop_trim=False`` a matched stop
  token is left out and the text is cut before a matched stop string (with ``no_stop_trim=True``,
  cut after it).

Batching: requests go through the model in request order, ``max_batch_size`` at a time, left
padded, with a KV cache (``DynamicCache``; for Qwen3.5 it holds the Gated DeltaNet conv and
recurrent states next to the attention keys/values).  Padding does not leak into results:
attention masks it, and transformers zeroes padded hidden states before every Gated DeltaNet
layer (``apply_mask_to_padding_states``), so the recurrent state of a left-padded prompt starts
from zero at its first token.  Positions are the M-RoPE (t, h, w) rows of the model's
``get_rope_index`` over each prompt's own tokens; every decode step adds one to each row (the last
prompt token is text, whose three rows are equal).

Randomness: per request, never per engine or per batch.  Token ``t`` of a request with
``sampling_params.sampling_seed = s`` is drawn by inverse-CDF sampling over the kept tokens in
sorted order (most likely first, ties by token id) with the uniform number
:func:`slime.rollout.seeds.uniform` ``(s, t)``; so a response depends only on its seed, prompt and
weights, not on which engine or batch serves it or on what the engine did before.  Requests
without a seed get one from the engine's own generator (CPU ``torch.Generator`` seeded once by
``seed``, advanced by every such request): the same engine seed and the same sequence of calls
then give the same samples.  The process-wide RNG is never touched.

Weights arrive under their Hugging Face *checkpoint* names (see :class:`_CheckpointWeights`).
"""

from __future__ import annotations

import copy
import dataclasses

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
from slime.rollout.seeds import SEED_BITS, uniform


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row with SGLang's sampling rules (see the module docstring).

    A sampled row sorts ``p = softmax(logits / T)`` in decreasing order (stable: ties by token
    id), keeps the prefix that top-k and top-p allow, and returns the first kept token whose
    cumulative kept mass exceeds ``u * (kept mass)``: exact sampling from the renormalised kept
    distribution, with all the randomness in ``u``.

    Args:
        logits: float32 ``[B, V]`` raw next-token logits.
        temperature: float32 ``[B]``, ``>= 0``; 0 means greedy (top-k / top-p ignored).
        top_p: float32 ``[B]`` in ``(0, 1]``.
        top_k: int64 ``[B]``; ``-1`` (or ``>= V``) keeps every token.
        uniforms: float64 ``[B]`` in ``[0, 1)``, one random number per row (unused for greedy rows).

    Returns:
        ``(tokens, log_probs)``: int64 ``[B]`` and float32 ``[B]``, the natural-log probability
        of each token under ``log_softmax(logits / T)`` (``T = 1`` for greedy rows), unfiltered.
    """
    vocab = logits.shape[-1]
    greedy = temperature == 0
    log_probs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1), dim=-1)
    tokens = logits.argmax(dim=-1)
    if not greedy.all():
        sorted_probs, order = log_probs.exp().sort(dim=-1, descending=True, stable=True)
        top_k = torch.where(top_k < 0, vocab, top_k)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        rank = torch.arange(vocab, device=logits.device)
        # Both conditions, and p > 0, hold on a prefix of the sorted tokens that has the top token.
        keep = (rank < top_k.unsqueeze(-1)) & (mass_before <= top_p.unsqueeze(-1)) & (sorted_probs > 0)
        cdf = torch.where(keep, sorted_probs, 0.0).double().cumsum(dim=-1)
        threshold = uniforms.to(cdf.device, torch.float64) * cdf[:, -1]
        choice = torch.searchsorted(cdf, threshold.unsqueeze(-1), right=True).squeeze(-1)
        choice = torch.minimum(choice, keep.sum(dim=-1) - 1)  # u * mass rounding up to the mass
        sampled = order.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


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
        hf_checkpoint: local Hugging Face checkpoint folder (weights, tokenizer, processor configs).
        device: torch device of the model, e.g. ``"cpu"`` or ``"cuda:0"``.
        dtype: parameter dtype, e.g. ``torch.float32`` on CPU, ``torch.bfloat16`` on GPU.
        min_pixels, max_pixels: narrower image pixel bounds for :func:`slime.data.processor.load_processor`.
        seed: seed of the engine's generator, which gives a sampling seed to every request that
            has none (``sampling_params.sampling_seed is None``).
        max_batch_size: requests per forward batch (>= 1).
        attn_implementation: transformers attention backend (``"sdpa"``, ``"eager"``, ...).

    Raises:
        ValueError: ``max_batch_size < 1``.
        FileNotFoundError / ConfigError: from ``load_processor`` (missing files, widened pixel bounds).
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
        self._weights = _CheckpointWeights(self.model)
        self._paused = False
        self._released: set[str] = set()  # memory tags released and not yet resumed
        self._shut_down = False

    @classmethod
    def from_config(cls, cfg, resources: EngineResources) -> "TransformersEngine":
        """Build engine ``resources.index`` of a run from its :class:`slime.arguments.SlimeConfig`
        (what the driver's engine factory calls inside each engine's Ray actor).

        ``--hf-checkpoint``, ``--image-min-pixels`` / ``--image-max-pixels`` (so that the engine's
        prompts match the data pipeline's), engine seed ``--rollout-seed + resources.index`` (used
        only for requests without a ``sampling_seed``; the rollout manager gives every request one,
        so a request's draws do not depend on the engine it lands on); bfloat16 on the engine's GPU
        (the actor's ``CUDA_VISIBLE_DEVICES`` is that GPU), float32 on CPU, where the actor's torch
        threads already cover all of the engine's CPU bundles.

        Raises:
            ValueError: the engine spans more than one GPU (``--rollout-num-gpus-per-engine`` > 1):
                this engine runs on one device.
        """
        if resources.num_gpus > 1:
            raise ValueError(
                f"--rollout-num-gpus-per-engine {resources.num_gpus}: the transformers engine runs on one GPU; use "
                "--rollout-num-gpus-per-engine 1 (one engine per GPU) or --rollout-backend sglang for tensor "
                "parallelism"
            )
        return cls(
            cfg.checkpoint.hf_checkpoint,
            device="cuda" if resources.use_gpu else "cpu",
            dtype=torch.bfloat16 if resources.use_gpu else torch.float32,
            min_pixels=cfg.data.image_min_pixels,
            max_pixels=cfg.data.image_max_pixels,
            seed=cfg.rollout.rollout_seed + resources.index,
        )

    @property
    def capacity(self) -> int:
        """``max_batch_size``: one call is one forward batch (:attr:`max_requests_per_call` is the same),
        and calls run one at a time (``max_concurrent_calls = 1``)."""
        return self.max_batch_size

    # ---------------------------------------------------------------- generation

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete every request (see the module docstring for the sampling and stopping rules).

        Raises:
            RuntimeError: the engine is paused, released, shut down, or a weight update left a
                fused parameter half-received.
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
        _check_sampling_params(request.sampling_params, name)
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
        """One left-padded batch: prefill, then one decode step per token until every row has finished."""
        from transformers import DynamicCache

        batch, device = len(prompts), self.device
        params = [p.request.sampling_params for p in prompts]
        temperature = torch.tensor([s.temperature for s in params], dtype=torch.float32, device=device)
        top_p = torch.tensor([s.top_p for s in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.top_k for s in params], dtype=torch.long, device=device)
        max_new = torch.tensor([s.max_new_tokens for s in params], dtype=torch.long, device=device)
        stop_table = self._stop_token_table(params)
        stop_strs = {row: s.stop for row, s in enumerate(params) if s.stop}

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

        all_tokens = torch.stack(token_steps, dim=1).tolist()
        all_log_probs = torch.stack(log_prob_steps, dim=1).tolist()
        outputs = []
        for row, (n, length) in enumerate(zip(n_tokens.tolist(), by_length.tolist())):
            ids = all_tokens[row][:n]
            text = self._response_text(ids, length, matched_str.get(row), params[row].no_stop_trim)
            reason = "length" if length else "stop"
            outputs.append(GenerateOutput(text, ids, all_log_probs[row][:n], reason, len(prompts[row].input_ids)))
        return outputs

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
        """The first stop string found in the decoded tail of the response, or None.

        The tail is ``4 * len(longest stop string) + 1`` tokens: every token carries at least
        one UTF-8 byte and a character has at most 4, and the check runs after every token, so
        a stop string first appears within it.
        """
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
        """Load one bucket of checkpoint-named tensors (see :class:`_CheckpointWeights`).

        ``flush_cache`` has nothing to do here: this engine keeps no cache between calls.

        Raises:
            RuntimeError: the engine was shut down.
            KeyError: a name that is not a checkpoint tensor of this model.
            ValueError: a tensor whose shape differs from the checkpoint's.
        """
        self._check_not_shut_down()
        self._weights.load(named_tensors)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free device memory for a colocated trainer, by SGLang tag (``None``: all); generation
        raises until every released tag is resumed.

        - ``"weights"``: on CUDA the model moves to CPU; on CPU nothing moves.  Unlike SGLang
          without a weight backup, the weights survive, so pushing them again after the resume
          (as :class:`slime.ray.colocate.ColocatedMemory` does) is correct but not needed.
          Weight updates are accepted meanwhile and land in the CPU copy.
        - ``"kv_cache"``: this engine keeps no KV cache between :meth:`generate` calls (each call
          builds and drops its own ``DynamicCache``), so nothing is held; on CUDA the blocks the
          last call left in PyTorch's caching allocator go back to the driver, where the trainer
          (another process) can use them.
        - ``"cuda_graph"``: this engine captures no CUDA graphs; nothing to free.

        Releasing an already released tag does nothing.

        Raises:
            RuntimeError: the engine was shut down.
            ValueError: an unknown tag (named in the message); nothing is released then.
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
        """Undo :meth:`release_memory_occupation` for ``tags`` (``None``: all): ``"weights"`` moves
        the model back to ``device`` (a no-op on CPU); ``"kv_cache"`` and ``"cuda_graph"`` hold no
        memory here.  A tag that is not released is skipped (SGLang would raise; the driver never
        does this).

        Raises:
            RuntimeError: the engine was shut down.
            ValueError: an unknown tag (named in the message); nothing is resumed then.
        """
        self._check_not_shut_down()
        tags = memory_tags(tags)
        if self.device.type == "cuda" and GPU_MEMORY_TYPE_WEIGHTS in tags and GPU_MEMORY_TYPE_WEIGHTS in self._released:
            self.model.to(self.device)
        # "kv_cache": the next generate() call allocates its own cache; "cuda_graph": none captured.
        self._released.difference_update(tags)

    def flush_cache(self) -> None:
        """No-op: the KV cache lives only inside one :meth:`generate` call, so nothing is cached across calls."""

    def pause_generation(self) -> None:
        """Refuse :meth:`generate` until :meth:`continue_generation`.

        The engine runs one call at a time (the engine group never overlaps calls), so nothing is
        in flight to pause; a later ``generate`` raises instead of blocking, because blocking
        would wait forever for a ``continue_generation`` that cannot arrive meanwhile.
        """
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


def _check_sampling_params(params: SamplingParams, name: str) -> None:
    """Raise ValueError naming the request and the field when a sampling parameter is out of range."""
    if params.max_new_tokens < 1:
        raise ValueError(f"{name}: max_new_tokens = {params.max_new_tokens}; use at least 1")
    if params.temperature < 0:
        raise ValueError(f"{name}: temperature = {params.temperature}; use > 0 to sample, or 0 for greedy decoding")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"{name}: top_p = {params.top_p} is outside (0, 1]; 1.0 disables nucleus sampling")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"{name}: top_k = {params.top_k}; use a positive k, or -1 to disable top-k")
    seed = params.sampling_seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**SEED_BITS):
        raise ValueError(f"{name}: sampling_seed = {seed!r}; use an int in [0, 2**{SEED_BITS}), or None")
    if params.stop and not all(isinstance(s, str) and s for s in params.stop):
        raise ValueError(f"{name}: stop = {params.stop!r}; every stop string must be a non-empty string")


class _CheckpointWeights:
    """Writes tensors named as in the model's checkpoint files into the model's in-memory layout.

    transformers 5 converts checkpoint tensors when it loads a model and records the conversions
    it used on ``model._weight_conversions`` (``transformers/conversion_mapping.py``).  For
    Qwen3.5-MoE the per-expert ``...mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` /
    ``down_proj`` (``[I, H]``, ``[I, H]``, ``[H, I]``) become ``...mlp.experts.gate_up_proj``
    (``[E, 2I, H]``, gate rows first) and ``...mlp.experts.down_proj`` (``[E, H, I]``); every
    other name is kept.  This class runs the load direction with transformers' own pieces:
    ``rename_source_key`` maps a checkpoint name to its parameter and ``WeightConverter.convert``
    fuses a complete group.  Which checkpoint names (and shapes) exist is derived from the model
    once, by running ``revert_weight_conversion`` (what ``save_pretrained`` and the trainer use
    to produce these names) on a meta-device copy of the state dict.

    A bucket may end in the middle of a fused group (e.g. half the experts of a layer): the
    received tensors are buffered until the group is complete, then fused and copied in.  A
    tensor sent twice before its group completes replaces the earlier one.  So buckets from
    several trainer ranks (each sending the tensors it is the source of) may arrive in any order.
    """

    def __init__(self, model: torch.nn.Module):
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )

        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            raise RuntimeError("the model carries no _weight_conversions; load it with from_pretrained")
        conversions = copy.deepcopy(conversions)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._model = model
        targets = model.state_dict(keep_vars=True)
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in targets.items()}
        self._shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, meta).items()}
        self._route: dict[str, tuple[str, str | None]] = {}
        self._members: dict[str, list[str]] = {}
        for name in sorted(self._shapes, key=dot_natural_key):
            target, pattern = rename_source_key(name, renamings, converters)
            if target not in targets:
                raise RuntimeError(
                    f"transformers maps checkpoint name {name!r} to {target!r}, which the model does not have; "
                    "its conversion mapping for this model is not invertible"
                )
            self._route[name] = (target, pattern)
            if pattern is not None:
                self._members.setdefault(target, []).append(name)
        self._converters = {pattern: c for c in converters for pattern in c.source_patterns}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def names(self) -> list[str]:
        """Every checkpoint name, in natural order."""
        return list(self._route)

    def incomplete_parameters(self) -> list[str]:
        """Fused parameters with some, not all, of their checkpoint tensors received."""
        return sorted(self._pending)

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket into the model (any device and float dtype; cast to the parameter's).

        The whole bucket is checked before anything is written, so a bad bucket changes nothing.

        Raises:
            KeyError: a name that is not a checkpoint tensor of this model.
            ValueError: a tensor whose shape differs from the checkpoint's.
        """
        for name, tensor in named_tensors:
            if name not in self._route:
                raise KeyError(
                    f"{name!r} is not a checkpoint tensor of this model (names look like {self.names()[0]!r}); "
                    "send Hugging Face checkpoint names, e.g. from transformers' revert_weight_conversion"
                )
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(
                    f"{name!r} has shape {tuple(tensor.shape)} but the checkpoint's is {self._shapes[name]}; "
                    "check that trainer and engine use the same model config"
                )
        targets = self._model.state_dict(keep_vars=True)  # looked up per call: moving the model replaces buffers
        for name, tensor in named_tensors:
            target, pattern = self._route[name]
            if pattern is None:
                targets[target].copy_(tensor)
                continue
            group = self._pending.setdefault(target, {})
            group[name] = tensor
            if len(group) == len(self._members[target]):
                targets[target].copy_(self._fuse(target, self._pending.pop(target)))

    def _fuse(self, target: str, group: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run transformers' converter of ``target`` on its complete group (members in natural order)."""
        converter = copy.deepcopy(self._converters[self._route[self._members[target][0]][1]])
        for name in self._members[target]:
            converter.add_tensor(target, name, self._route[name][1], group[name])
        (fused,) = converter.convert(target, model=self._model, config=self._model.config).values()
        return fused[0] if isinstance(fused, list) else fused
